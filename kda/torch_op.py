"""The decode step as a ``torch.library`` custom op, for ``torch.compile(fullgraph=True)``.

``torch.ops.kda.decode`` declares the buffers it mutates (``conv_state``, ``state``, ``out``,
``v_record``, ``kg_record``) and has a fake implementation, so a model that calls it compiles
into one graph; the op itself runs the selected backend eagerly. Like
``KdaDecode(validate="first")`` it validates every argument fully the first time it sees
their dtypes, shapes, strides and devices (and scalars, backend choice), and afterwards
compares that metadata only (aliasing between buffers is not re-checked while it is
unchanged). The dispatcher adds a per-call cost that the direct eager path
(:class:`kda.KdaDecode`) does not pay; ``tools/bench/host_overhead.py`` measures both.

    import kda.torch_op  # registers torch.ops.kda.decode
    out = kda.torch_op.decode(x, conv_weight, ..., norm_weight, out=out)
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from kda import registry
from kda.backend import StepFn
from kda.config import KdaArgs
from kda.op import metadata_key, validated_step
from kda.validate import KdaArgumentError, check_device, check_scalar_types

# The op is defined with torch.library's low-level API and an alias-annotated schema
# (mutated buffers marked "!") rather than torch.library.custom_op: the latter's eager
# dispatch binds the Python signature on every call (about 120 us for these 22 arguments on
# the project's CPU machine); torch.compile reads the mutations from the schema either way.
_LIB = torch.library.Library("kda", "DEF")
_LIB.define(
    "decode(Tensor x, Tensor conv_weight, Tensor? conv_bias, Tensor(a!) conv_state, Tensor f_a, "
    "Tensor f_b, Tensor beta, Tensor A_log, Tensor dt_bias, Tensor(b!) state, "
    "Tensor state_indices, Tensor? num_accepted_tokens, Tensor output_gate, Tensor norm_weight, "
    "Tensor(c!) out, Tensor(d!)? v_record, Tensor(e!)? kg_record, float scale, float norm_eps, "
    "float? lower_bound, int gate_mode, str backend) -> ()")

#: (argument metadata, scalars, requested backend) -> validated step function: the op
#: validates fully the first time it sees an argument metadata (as KdaDecode(validate="first")).
_STEPS: Dict[tuple, StepFn] = {}


def _decode(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
            state_indices, num_accepted_tokens, output_gate, norm_weight, out, v_record,
            kg_record, scale, norm_eps, lower_bound, gate_mode, backend) -> None:
    args = KdaArgs(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
                   state_indices, num_accepted_tokens, output_gate, norm_weight, out, v_record,
                   kg_record)
    explicit = None if backend == "" else backend
    key = (metadata_key(args), scale, norm_eps, lower_bound, gate_mode,
           registry.requested_name(explicit))
    step = _STEPS.get(key)
    if step is None:
        step, args = validated_step(
            x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
            state_indices, output_gate, norm_weight, num_accepted_tokens=num_accepted_tokens,
            scale=scale, norm_eps=norm_eps, lower_bound=lower_bound, gate_mode=gate_mode,
            v_record=v_record, kg_record=kg_record, out=out, backend=explicit)
        _STEPS[key] = step
    if state_indices.shape[0]:
        step(args)


_ARG_NAMES = KdaArgs._fields


def _check_devices(tensors) -> None:
    """Every tensor among the op's 17 tensor arguments (:class:`KdaArgs` order, ``x`` first)
    is on ``x``'s device (metadata only: fake tensors carry their devices)."""
    x = tensors[0]
    for name, t in zip(_ARG_NAMES, tensors):
        if isinstance(t, torch.Tensor):
            check_device(name, t, x.device)


def _decode_fake(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
                 state_indices, num_accepted_tokens, output_gate, norm_weight, out, v_record,
                 kg_record, scale, norm_eps, lower_bound, gate_mode, backend) -> None:
    """The op under fake tensors (torch.compile's tracing) or on the meta device: nothing to
    compute (the op returns nothing and mutates only its declared buffers).

    A real call with some arguments on the meta device also lands here (the dispatcher picks
    the meta kernel when any argument is on it), where it would do nothing and leave ``out``
    and the caches as they were: such a call gets :func:`kda.kda_decode`'s device error
    instead. All arguments on the meta device pass; under fake tensors (tracing) nothing is
    checked here (:func:`decode` checks the devices while tracing, the op validates the rest
    when the compiled graph runs).

    Raises:
      KdaArgumentError: a tensor argument on another device than ``x``.
    """
    if isinstance(x, FakeTensor):
        return None     # tracing: decode() checked the devices, the op validates when run
    _check_devices((x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
                    state_indices, num_accepted_tokens, output_gate, norm_weight, out, v_record,
                    kg_record))
    return None


_LIB.impl("decode", _decode, "CompositeExplicitAutograd")
torch.library.register_fake("kda::decode", _decode_fake, lib=_LIB)


def decode(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
           state_indices, output_gate, norm_weight, *, out: torch.Tensor,
           num_accepted_tokens=None, scale: Optional[float] = None, norm_eps: float = 1e-5,
           lower_bound: Optional[float] = None, gate_mode: int = 0, v_record=None,
           kg_record=None, backend: Optional[str] = None) -> torch.Tensor:
    """:func:`kda.kda_decode` through ``torch.ops.kda.decode``; returns ``out``.

    Same arguments and errors as :func:`kda.kda_decode`, except that ``out`` is required (a
    custom op may not return a tensor aliasing its inputs, so the op writes into ``out``) and
    that the dispatcher checks the argument types first.

    Raises:
      KdaArgumentError: ``out`` is not a tensor (checked before anything runs: without it the
        caches would advance and the step's output be lost), or any error of
        :func:`kda.kda_decode` (a tensor on the meta device beside real ones included).
      RuntimeError: from torch's dispatcher, before anything runs, when a tensor argument
        is not a tensor (e.g. a list) or a scalar has the wrong type, naming the argument
        ("kda::decode() Expected a value of type 'Tensor' for argument 'x' ...").
    """
    if not isinstance(out, torch.Tensor):
        raise KdaArgumentError("out", "required by the custom op: expected a bfloat16 tensor "
                                      f"[R*T, H*128] to write into, got {type(out).__name__}")
    check_scalar_types(scale, norm_eps, lower_bound, gate_mode)   # before the op's conversions
    if torch.compiler.is_compiling():
        # Tracing (fake tensors carry their devices): the fake kernel cannot raise our error
        # (fake propagation wraps it in a TorchRuntimeError) and a meta tensor beside real
        # ones would reach inductor, which fails on it; checked here instead.
        _check_devices((x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias,
                        state, state_indices, num_accepted_tokens, output_gate, norm_weight, out,
                        v_record, kg_record))
    torch.ops.kda.decode(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias,
                         state, state_indices, num_accepted_tokens, output_gate, norm_weight, out,
                         v_record, kg_record, 128 ** -0.5 if scale is None else float(scale),
                         float(norm_eps), lower_bound, int(gate_mode), backend or "")
    return out
