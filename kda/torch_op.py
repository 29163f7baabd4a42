"""The decode step as a ``torch.library`` custom op, for ``torch.compile(fullgraph=True)``.

``torch.ops.kda.decode`` declares the buffers it mutates (``conv_state``, ``state``, ``out``,
``v_record``, ``kg_record``) and has a fake implementation, so a model that calls it compiles
into one graph; the op itself runs the selected backend eagerly. Like
``KdaDecode(validate="first")`` it validates every argument fully the first time it sees
their dtypes, shapes, strides and devices (and scalars, backend choice), and afterwards
compares that metadata only (aliasing between buffers is not re-checked while it is
unchanged). The dispatcher adds a per-call cost that the direct eager path
(:class:`kda.KdaDecode`) does not pay; ``tools/bench/host_overhead.py`` measures both.
The static configuration, the state pool's dtype (fp32 or bf16) included, comes from the
tensors, as in :func:`kda.kda_decode`. ``import kda`` registers it; :func:`kda.kda_decode`
and :class:`kda.KdaDecode` are traced as this op under ``torch.compile``.

    out = kda.torch_op.decode(x, conv_weight, ..., norm_weight, out=out)
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from kda import registry
from kda.backend import StepFn
from kda.config import HEAD_DIM, KdaArgs
from kda.dispatch import metadata_key, validated_step
from kda.errors import KdaArgumentError
from kda.validate import check_device, check_scalar_types

# The op is defined with torch.library's low-level API and an alias-annotated schema
# (mutated buffers marked "!") rather than torch.library.custom_op: the latter's eager
# dispatch binds the Python signature on every call (about 120 us for these 22 arguments on
# the project's CPU machine); torch.compile reads the mutations from the schema either way.
# The tensors come in KdaArgs order, then the scalars.
_LIB = torch.library.Library("kda", "DEF")
_LIB.define(
    "decode(Tensor x, Tensor conv_weight, Tensor? conv_bias, Tensor(a!) conv_state, Tensor f_a, "
    "Tensor f_b, Tensor beta, Tensor A_log, Tensor dt_bias, Tensor(b!) state, "
    "Tensor state_indices, Tensor output_gate, Tensor norm_weight, "
    "Tensor? num_accepted_tokens, Tensor(c!)? v_record, Tensor(d!)? kg_record, Tensor(e!) out, "
    "float scale, float norm_eps, float? lower_bound, int gate_mode, bool beta_activated, "
    "bool early_reads, str backend) -> ()")
_NT = len(KdaArgs._fields)

#: (argument metadata, scalars, requested backend) -> validated step function: the op
#: validates fully the first time it sees an argument metadata (as KdaDecode(validate="first")).
_STEPS: Dict[tuple, StepFn] = {}


def _decode(*operands) -> None:
    """The op's implementation: the :class:`KdaArgs` tensors, then scale, norm_eps,
    lower_bound, gate_mode, beta_activated, early_reads, backend ("" = the default choice)."""
    args = KdaArgs(*operands[:_NT])
    scale, norm_eps, lower_bound, gate_mode, beta_activated, early_reads, backend = operands[_NT:]
    explicit = None if backend == "" else backend
    key = (metadata_key(args), scale, norm_eps, lower_bound, gate_mode, beta_activated, early_reads,
           registry.requested_name(explicit))
    step = _STEPS.get(key)
    if step is None:
        step, args = validated_step(args, scale=scale, norm_eps=norm_eps,
                                    lower_bound=lower_bound, gate_mode=gate_mode,
                                    beta_activated=beta_activated, early_reads=early_reads,
                                    backend=explicit)
        _STEPS[key] = step
    if args.state_indices.shape[0]:
        step(args)


def check_devices(args: KdaArgs) -> None:
    """Every tensor argument is on ``x``'s device (metadata only: fake tensors carry their
    devices).

    Raises:
      KdaArgumentError: named after the first tensor on another device.
    """
    for name, t in zip(KdaArgs._fields, args):
        if isinstance(t, torch.Tensor):
            check_device(name, t, args.x.device)


def _decode_fake(*operands) -> None:
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
    args = KdaArgs(*operands[:_NT])
    if isinstance(args.x, FakeTensor):
        return None     # tracing: decode() checked the devices, the op validates when run
    check_devices(args)
    return None


_LIB.impl("decode", _decode, "CompositeExplicitAutograd")
torch.library.register_fake("kda::decode", _decode_fake, lib=_LIB)


def decode(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
           state_indices, output_gate, norm_weight, *, num_accepted_tokens=None, v_record=None,
           kg_record=None, out: torch.Tensor, scale: Optional[float] = None,
           norm_eps: float = 1e-5, lower_bound: Optional[float] = None, gate_mode: int = 0,
           beta_activated: bool = False, early_reads: bool = False,
           backend: Optional[str] = None) -> torch.Tensor:
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
    args = KdaArgs(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
                   state_indices, output_gate, norm_weight, num_accepted_tokens, v_record,
                   kg_record, out)
    return call(args, scale=scale, norm_eps=norm_eps, lower_bound=lower_bound,
                gate_mode=gate_mode, beta_activated=beta_activated, early_reads=early_reads,
                backend=backend)


def call(args: KdaArgs, *, scale=None, norm_eps=1e-5, lower_bound=None, gate_mode=0,
         beta_activated=False, early_reads=False, backend: Optional[str] = None) -> torch.Tensor:
    """:func:`decode` on a :class:`KdaArgs` record (``args.out`` required); returns it."""
    if not isinstance(args.out, torch.Tensor):
        raise KdaArgumentError("out", "required by the custom op: expected a bfloat16 tensor "
                                      f"[R*T, H*128] to write into, got {type(args.out).__name__}")
    # before the op's conversions
    check_scalar_types(scale, norm_eps, lower_bound, gate_mode, beta_activated, early_reads)
    if torch.compiler.is_compiling():
        # Tracing (fake tensors carry their devices): the fake kernel cannot raise our error
        # (fake propagation wraps it in a TorchRuntimeError) and a meta tensor beside real
        # ones would reach inductor, which fails on it; checked here instead.
        check_devices(args)
    torch.ops.kda.decode(*args, HEAD_DIM ** -0.5 if scale is None else float(scale),
                         float(norm_eps), lower_bound, int(gate_mode), bool(beta_activated),
                         bool(early_reads),
                         backend or "")
    return args.out
