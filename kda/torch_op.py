"""The decode step as a ``torch.library`` custom op, for ``torch.compile(fullgraph=True)``.

``torch.ops.kda.decode`` declares the buffers it mutates (``conv_state``, ``state``, ``out``,
``v_record``, ``kg_record``) and has a fake implementation, so a model that calls it compiles
into one graph; the op itself runs the selected backend eagerly. The dispatcher adds a
per-call cost that the direct eager path (:class:`kda.KdaDecode` / :func:`kda.kda_decode`)
does not pay; ``tools/bench`` measures both.

    import kda.torch_op  # registers torch.ops.kda.decode
    out = kda.torch_op.decode(x, conv_weight, ..., norm_weight, out=out)
"""

from __future__ import annotations

from typing import Optional

import torch

from kda.op import kda_decode
from kda.validate import KdaArgumentError

_MUTATED = ("conv_state", "state", "out", "v_record", "kg_record")


@torch.library.custom_op("kda::decode", mutates_args=_MUTATED)
def _decode(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    f_a: torch.Tensor,
    f_b: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: Optional[torch.Tensor],
    output_gate: torch.Tensor,
    norm_weight: torch.Tensor,
    out: torch.Tensor,
    v_record: Optional[torch.Tensor],
    kg_record: Optional[torch.Tensor],
    scale: float,
    norm_eps: float,
    lower_bound: Optional[float],
    gate_mode: int,
    backend: str,
) -> None:
    kda_decode(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
               state_indices, output_gate, norm_weight, num_accepted_tokens=num_accepted_tokens,
               scale=scale, norm_eps=norm_eps, lower_bound=lower_bound, gate_mode=gate_mode,
               v_record=v_record, kg_record=kg_record, out=out,
               backend=None if backend == "" else backend)


@_decode.register_fake
def _decode_fake(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
                 state_indices, num_accepted_tokens, output_gate, norm_weight, out, v_record,
                 kg_record, scale, norm_eps, lower_bound, gate_mode, backend) -> None:
    return None


def decode(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
           state_indices, output_gate, norm_weight, *, out: torch.Tensor,
           num_accepted_tokens=None, scale: Optional[float] = None, norm_eps: float = 1e-5,
           lower_bound: Optional[float] = None, gate_mode: int = 0, v_record=None,
           kg_record=None, backend: Optional[str] = None) -> torch.Tensor:
    """:func:`kda.kda_decode` through ``torch.ops.kda.decode``; returns ``out``.

    Same arguments and errors as :func:`kda.kda_decode`, except that ``out`` is required (a
    custom op may not return a tensor aliasing its inputs, so the op writes into ``out``).

    Raises:
      KdaArgumentError: ``out`` is not a tensor (checked before anything runs: without it the
        caches would advance and the step's output be lost), or any error of
        :func:`kda.kda_decode`.
    """
    if not isinstance(out, torch.Tensor):
        raise KdaArgumentError("out", "required by the custom op: expected a bfloat16 tensor "
                                      f"[R*T, H*128] to write into, got {type(out).__name__}")
    torch.ops.kda.decode(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias,
                         state, state_indices, num_accepted_tokens, output_gate, norm_weight, out,
                         v_record, kg_record, 128 ** -0.5 if scale is None else float(scale),
                         float(norm_eps), lower_bound, int(gate_mode), backend or "")
    return out
