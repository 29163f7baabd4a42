"""The public entry points: :func:`kda_decode` (per call) and :class:`KdaDecode` (built once).

Both run one fused KDA decode step (contract: ``docs/contract.md``) for every (request,
head) item: short causal conv + SiLU over the cached window, q/k L2 norm, the low-rank
forget gate and its decay, the delta-rule update of the 128x128 fp32 state, and the gated
RMSNorm, with paged state, null slots and speculative verify.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kda import registry, torch_op
from kda.config import HEAD_DIM, KdaArgs, KdaConfig, dtype_name
from kda.dispatch import alloc_out, metadata_key, validated_step
from kda.errors import KdaArgumentError, KdaBackendError
from kda.validate import (FIELD_ARG, check_is_tensor, check_writable, config_from_args,
                          validate_args)


def tracing(x: torch.Tensor) -> bool:
    """Whether a call with ``x`` is being traced rather than run: under ``torch.compile``
    (dynamo), with a fake ``x`` (``FakeTensorMode``), or under a dispatch mode such as
    ``make_fx``'s proxy mode. Such a call goes through the custom op, whose fake
    implementation traces it (the eager path would read fake tensors' addresses). On every
    call's host path: three checks of well under a microsecond together."""
    return (torch.compiler.is_compiling() or isinstance(x, FakeTensor)
            or _get_current_dispatch_mode() is not None)


def _host(v):
    """A scalar argument as the Python number it stands for, under torch.compile: dynamo
    turns numpy scalars (accepted eagerly) into arrays, which the op's schema refuses; a 0-d
    one is unwrapped, anything else is passed on for the op's own type check."""
    if v is not None and not isinstance(v, (bool, int, float, str, torch.Tensor)) \
            and getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
        return v.item()
    return v


def kda_decode(
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
    output_gate: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    v_record: Optional[torch.Tensor] = None,
    kg_record: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    norm_eps: float = 1e-5,
    lower_bound: Optional[float] = None,
    gate_mode: int = 0,
    beta_activated: bool = False,
    early_reads: bool = False,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """One fused KDA decode step for R requests x H heads; returns ``out``.

    Shapes: H heads (from ``A_log``), D = 128, dim = H*D, R requests, T tokens per request
    (1, or ``state_indices.shape[1]`` for speculative verify), N = R*T rows, L the conv window.

    Args:
      x: [N, 3*dim] bf16, q|k|v projections before the conv; row n = r*T + t.
      conv_weight: [3, 4, dim] fp32 (bf16 accepted); tap 3 multiplies the current token.
      conv_bias: [3*dim] fp32 or None.
      conv_state: [slots, 3*dim, L] bf16 (fp32 accepted), window-first (strides [s, 1, 3*dim])
        or dim-first (strides [s, L, 1]); rewritten in place for live items.
      f_a: [N, 128] bf16, low-rank gate activations.
      f_b: [dim, 128] bf16, gate up-projection rows of these heads.
      beta: [N, H] bf16 logits (sigmoid applied here), or with ``beta_activated`` [N, H] fp32
        already passed through the sigmoid (used as it is, not rounded).
      A_log: [H] fp32. dt_bias: [dim] fp32.
      state: [slots, H, 128(v), 128(k)] fp32 or bf16, V-major; updated in place (not in
        record mode). A bf16 pool is widened to fp32 on load, all math is fp32, and each state
        written is rounded once to bf16 (nearest even); the dtype sets ``state_dtype`` of the
        configuration (float16 is an error naming ``state``). Every backend serves both.
      state_indices: [R] int32 (T=1) or [R, T] int32 (verify): slot per request / draft position.
        Ids <= 0 or >= slots are null. The item is dead (zeros out, nothing else written) when
        its source slot (T=1: the id; T>1: position a-1, a = accepted count) or its conv slot
        (position 0) is null; a null id at another draft position only skips that token's
        state write (docs/contract.md section 6, "Liveness" and "T>1 state writes").
      output_gate: [N, dim] bf16 logits of the output gate.
      norm_weight: [128] fp32 (bf16 accepted), gated RMSNorm weight shared by all heads.
      num_accepted_tokens: [R] int32, required for T > 1; clamped to 1..T on the device.
      scale: q scale, default 128**-0.5. norm_eps: RMSNorm eps (the L2-norm eps is 1e-6).
      lower_bound: None for the softplus gate, or a float in [-5, 0) for the bounded gate.
      gate_mode: 0 or 1, accumulation order of the gate projection (see the contract).
      beta_activated: False: ``beta`` is bf16 raw logits; True: fp32, already activated by the
        engine (vLLM's Kimi-Linear layer computes ``sigmoid(beta)`` itself). Never inferred
        from beta's dtype: a dtype that does not match is an error naming ``beta``.
      early_reads: False (default), or True to let the streamed CuTe DSL kernel read
        ``state_indices``, ``num_accepted_tokens`` and their first windows and pages before
        waiting for the kernel launched before them (PDL), when that kernel writes none of
        them (:attr:`kda.config.KdaConfig.early_reads`; the contract, section 6, "Launch
        order").
      v_record: [slots, H, T, 128] fp32 and kg_record: [slots, H, T, 256] bf16, both or
        neither: record mode (state read but not written; u, raw k and raw gate recorded at
        row ``state_indices[r, 0]``).
      out: [N, dim] bf16 to write into (for CUDA graphs); allocated when None.
      backend: a name from :data:`kda.registry.CHOICES`; default from ``--kda_backend``,
        ``$KDA_BACKEND``, else "auto".

    Layouts accepted (``docs/contract.md`` section 6): x, output_gate, f_a, beta, out with last
    stride 1 and any row stride >= the row length, at any element alignment (column slices of
    an engine's packed projection, whatever its row pitch, are read in place; rows that are
    not 16-byte aligned take a narrower load path in the GPU kernels); each slot's state page
    contiguous (any slot stride, a multiple of 16 bytes); conv_state in either layout with any slot
    stride (multiple of 8); everything else contiguous. Written buffers may not share memory
    with any other argument.

    Returns:
      ``out`` [N, dim] bf16.

    Raises:
      KdaArgumentError (a ValueError): an invalid argument; the message names it, what was
        expected and what was given. Nothing has been written.
      KdaBackendError: unknown backend name, or the chosen backend cannot serve the call.

    Under ``torch.compile``, and with fake or proxy tensors (``FakeTensorMode``, ``make_fx``,
    ``torch.export``: :func:`tracing`), the call is traced as the custom op
    ``torch.ops.kda.decode`` (:mod:`kda.torch_op`, same validation, run eagerly inside the
    graph): tracing the backend's own code would let the compiler drop the bf16 round trips
    that are the contract's rounding points.

    Formulas: the contract, section 2 (after fla-core's ``naive_recurrent_kda`` and
    ``naive_kda_gate`` / ``naive_kda_lowerbound_gate``, with the rounding points of section 3).
    """
    args = KdaArgs(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
                   state_indices, output_gate, norm_weight, num_accepted_tokens, v_record,
                   kg_record, out)
    check_is_tensor("x", x)
    if tracing(x):
        if backend is not None and not isinstance(backend, str):
            registry.check_choice(backend, "argument")     # not a name: raises as resolve()
        if out is None and isinstance(A_log, torch.Tensor) and A_log.dim() == 1:
            args = args._replace(out=alloc_out(x, A_log.shape[0] * HEAD_DIM))
        check_writable(args, traced=True)
        return torch_op.call(args, scale=_host(scale), norm_eps=_host(norm_eps),
                             lower_bound=_host(lower_bound), gate_mode=_host(gate_mode),
                             beta_activated=_host(beta_activated),
                             early_reads=_host(early_reads), backend=backend)
    step, args = validated_step(args, scale=scale, norm_eps=norm_eps, lower_bound=lower_bound,
                                gate_mode=gate_mode, beta_activated=beta_activated,
                                early_reads=early_reads, backend=backend)
    if state_indices.shape[0]:
        step(args)
    return args.out


#: How many distinct argument metadata (e.g. batch sizes) a KdaDecode remembers as validated.
VALIDATED_KEYS = 64


class KdaDecode:
    """A decode step built once for a static configuration and called every step.

    Construction resolves the backend and compiles (or loads) its kernel for ``cfg``; a call
    then costs only the launch. Arguments are fully validated on the first call with each
    argument metadata (dtype, shape, strides and device of every argument; the last
    :data:`VALIDATED_KEYS` distinct ones are remembered, so a batch size that comes back is not
    validated again) (``validate="first"``, the default: a host-side lookup), or on every
    call (``validate="always"``: also re-checks alignment and aliasing between buffers, which
    the default does not re-check while the metadata stays the same: a new ``out`` that
    overlaps an input, with unchanged shapes, is not caught by the default).

    Example::

        step = KdaDecode(KdaConfig(num_heads=32), device="cuda")
        out = step(x, conv_weight, None, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
                   state_indices, output_gate, norm_weight, out=out_buf)

    Args:
      cfg: the static configuration (see :class:`kda.config.KdaConfig`; its
        ``beta_activated`` says whether ``beta`` comes as bf16 logits or as fp32 already
        passed through the sigmoid).
      device: the device the tensors will be on (default: current CUDA device, else CPU).
      backend: a backend name or "auto" (default: flag / env / auto, as for :func:`kda_decode`).
      validate: "first" or "always".

    Raises:
      KdaArgumentError: invalid ``cfg`` or ``validate``; at call time, as :func:`kda_decode`.
      KdaBackendError: as :func:`kda_decode`, at construction.
    """

    def __init__(self, cfg: KdaConfig, *, device=None, backend: Optional[str] = None,
                 validate: str = "first"):
        if not isinstance(cfg, KdaConfig):
            raise KdaArgumentError("cfg", f"expected a kda.KdaConfig, got {type(cfg).__name__}")
        if validate not in ("first", "always"):
            raise KdaArgumentError("validate", f"expected 'first' or 'always', got {validate!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise KdaArgumentError("device", f"expected a torch device or its name ('cuda', "
                                             f"'cuda:1', 'cpu'), got {device!r} ({e})") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise KdaBackendError(f"device {device}: torch sees no CUDA device here")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.cfg = cfg
        self.device = device
        self.backend = registry.resolve(cfg, device, backend)
        self._step = registry.step_fn(self.backend, cfg, device)
        self._always = validate == "always"
        self._validated: set = set()     # metadata keys validated (at most VALIDATED_KEYS)

    @property
    def backend_name(self) -> str:
        """The name of the backend this object runs ("auto" when ``auto``'s choice depends
        on the batch size: see :meth:`backend_for`)."""
        return self.backend.name

    def backend_for(self, batch: int) -> str:
        """The name of the backend a call with ``batch`` requests runs.

        Raises:
          KdaArgumentError: ``batch`` is not an int >= 1.
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise KdaArgumentError("batch", f"expected an int >= 1, got {type(batch).__name__} "
                                            f"{batch!r}")
        pick = getattr(self._step, "backend_for", None)
        return pick(batch) if pick is not None else self.backend.name

    def __call__(self, x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias,
                 state, state_indices, output_gate, norm_weight, *, num_accepted_tokens=None,
                 v_record=None, kg_record=None, out=None) -> torch.Tensor:
        """Run one step; arguments as :func:`kda_decode` (scalars and the form of ``beta``
        come from the config).

        Under ``torch.compile`` (or fake / proxy tensors: :func:`tracing`) the call is traced
        as the custom op ``torch.ops.kda.decode``
        with this object's backend and scalars, after checking that the tensors' device and
        configuration are this object's (as :func:`kda_decode` does, and for the same
        reason). The op validates as ``validate="first"`` does, whatever this object's
        ``validate``.
        """
        check_is_tensor("x", x)
        args = KdaArgs(x, conv_weight, conv_bias, conv_state, f_a, f_b, beta, A_log, dt_bias,
                       state, state_indices, output_gate, norm_weight, num_accepted_tokens,
                       v_record, kg_record, out)
        if out is None:
            args = args._replace(out=alloc_out(x, self.cfg.dim))
        if tracing(x):
            return self._compiled_call(args)
        # dtype, shape, strides and device of every argument: metadata not validated before
        # (a new batch size, another cache layout or window, a bias appearing, a tensor on
        # another device) is validated; a non-tensor always is (and fails there with a clear
        # message). Aliasing between arguments is checked only on those validations.
        key = metadata_key(args)
        if self._always or key not in self._validated:
            self._check_device(x)
            validate_args(self.cfg, args, config_name="this KdaDecode's KdaConfig")
            if len(self._validated) >= VALIDATED_KEYS:
                self._validated.clear()
            self._validated.add(key)
        if state_indices.shape[0]:
            self._step(args)
        return args.out

    def _check_device(self, x: torch.Tensor) -> None:
        if x.device != self.device:
            raise KdaArgumentError("x", f"expected device {self.device} (this KdaDecode's), got {x.device}")

    def _compiled_call(self, args: KdaArgs) -> torch.Tensor:
        """:meth:`__call__` under torch.compile: the tensors' static configuration (metadata
        only, resolved while tracing) must be this object's; then the custom op runs the step
        (validating the tensors when the graph runs)."""
        c = self.cfg
        self._check_device(args.x)
        got = config_from_args(args, scale=c.scale, norm_eps=c.norm_eps,
                               lower_bound=c.lower_bound, gate_mode=c.gate_mode,
                               beta_activated=c.beta_activated, early_reads=c.early_reads)
        for field in ("num_heads", "T", "window", "conv_layout", "has_conv_bias", "record",
                      "conv_state_dtype", "conv_weight_dtype", "norm_weight_dtype",
                      "state_dtype"):
            if getattr(got, field) != getattr(c, field):
                arg = FIELD_ARG[field]
                if field == "record" and args.v_record is None and args.kg_record is not None:
                    arg = "kg_record"
                want, have = (dtype_name(v) if isinstance(v, torch.dtype) else v
                              for v in (getattr(c, field), getattr(got, field)))
                raise KdaArgumentError(arg, f"expected {field} = {want} (this KdaDecode's "
                                            f"configuration), got {have}")
        check_writable(args, traced=True)
        return torch_op.call(args, scale=c.scale, norm_eps=c.norm_eps, lower_bound=c.lower_bound,
                             gate_mode=c.gate_mode, beta_activated=c.beta_activated,
                             early_reads=c.early_reads,
                             backend=self.backend.name)
