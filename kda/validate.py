"""Argument validation for the decode step: every error names the argument, what was expected
and what was given, and is raised before anything is written.

Only host-side metadata is read (dtype, shape, strides, device, data pointer alignment);
device-side values (slot ids, accepted counts) are never read here: their out-of-range
behaviour is defined by the contract (dead items, clamped counts) instead.
"""

from __future__ import annotations

import numbers
import operator
from typing import Optional, Sequence

import torch

from kda.config import GATE_RANK, HEAD_DIM, WRITTEN, KdaArgs, KdaConfig, dtype_name, is_bool
from kda.errors import KdaArgumentError

D = HEAD_DIM


def check_is_tensor(name: str, t) -> None:
    """Raises KdaArgumentError unless argument ``name`` is a torch.Tensor."""
    if not isinstance(t, torch.Tensor):
        raise KdaArgumentError(name, f"expected a torch.Tensor, got {type(t).__name__}")


def _check_tensor(name: str, t, dtypes: Sequence[torch.dtype], shape: Sequence[int],
                  device: torch.device, dtype_why: str = "", shape_why: str = "") -> torch.Tensor:
    """``t`` is a tensor of one of ``dtypes``, of ``shape``, on ``device``; ``dtype_why`` and
    ``shape_why`` say where the expected dtype and shape come from, in the message (in
    parentheses after the expectation; empty: nothing said)."""
    check_is_tensor(name, t)
    if t.dtype not in dtypes:
        raise KdaArgumentError(name, f"expected dtype {' or '.join(dtype_name(d) for d in dtypes)}"
                                     f"{_why(dtype_why)}, got {dtype_name(t.dtype)}")
    if tuple(t.shape) != tuple(shape):
        raise KdaArgumentError(name, f"expected shape {list(shape)}{_why(shape_why)}, got "
                                     f"{list(t.shape)}")
    check_device(name, t, device)
    return t


def _why(text: str) -> str:
    return f" ({text})" if text else ""


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Argument ``name`` (a tensor) is on ``device``, the device of x.

    Raises:
      KdaArgumentError: it is not.
    """
    if t.device != device:
        raise KdaArgumentError(name, f"expected device {device} (the device of x), got {t.device}")


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise KdaArgumentError(name, f"expected a contiguous tensor, got strides {list(t.stride())} "
                                     f"for shape {list(t.shape)}")


def _check_aligned(name: str, t: torch.Tensor) -> None:
    """Data 16-byte aligned (the kernels copy it with 16-byte or bulk copies)."""
    if t.numel() and t.data_ptr() % 16:
        raise KdaArgumentError(name, "expected 16-byte aligned data, got an address "
                                     f"{t.data_ptr() % 16} bytes past alignment")


def _check_rows(name: str, t: torch.Tensor) -> None:
    """Last stride 1 and a row stride >= the row length. Any row stride and element alignment
    beyond that: the GPU kernels choose their row loads by the alignment of the rows
    (:func:`kda.backend.row_bytes`), so column slices of an engine's packed projection are
    taken as they are."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise KdaArgumentError(name, f"expected the last dimension contiguous (stride 1), "
                                     f"got strides {list(t.stride())}")
    if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise KdaArgumentError(name, f"expected a row stride >= {t.shape[1]}, got {t.stride(0)}")


def conv_layout_of(conv_state: torch.Tensor) -> Optional[str]:
    """"SD" (window-first), "DS" (dim-first) or None for any other stride pattern."""
    if conv_state.dim() != 3:
        return None
    _, C, L = conv_state.shape
    s = conv_state.stride()
    if (s[1] == 1 or C == 1) and (s[2] == C or L == 1):
        return "SD"
    if (s[2] == 1 or L == 1) and (s[1] == L or C == 1):
        return "DS"
    return None


def check_scalar_types(scale, norm_eps, lower_bound, gate_mode, beta_activated=False,
                       early_reads=False) -> None:
    """The call's scalars are host numbers of the right kind: ``scale`` (None allowed),
    ``norm_eps`` and ``lower_bound`` (None allowed) real numbers, ``gate_mode`` an int (not a
    bool), ``beta_activated`` and ``early_reads`` bools. Values are checked by
    :class:`kda.config.KdaConfig`.

    Raises:
      KdaArgumentError: named after the offending scalar.
    """
    for name, val, optional in (("scale", scale, True), ("norm_eps", norm_eps, False),
                                ("lower_bound", lower_bound, True)):
        if val is None and optional:
            continue
        # numbers.Real: Python and numpy scalars alike (a 0-d tensor would be a device value)
        if isinstance(val, bool) or not isinstance(val, numbers.Real):
            raise KdaArgumentError(name, f"expected a float{' or None' if optional else ''}, got "
                                         f"{type(val).__name__} {val!r}")
    if isinstance(gate_mode, bool) or not isinstance(gate_mode, numbers.Integral):
        raise KdaArgumentError("gate_mode", f"expected the int 0 or 1, got {type(gate_mode).__name__} "
                                            f"{gate_mode!r}")
    for name, val in (("beta_activated", beta_activated), ("early_reads", early_reads)):
        if not is_bool(val):
            raise KdaArgumentError(name, f"expected a bool, got {type(val).__name__} {val!r}")


def config_from_args(args: KdaArgs, *, scale=None, norm_eps=1e-5, lower_bound=None,
                     gate_mode=0, beta_activated=False, early_reads=False) -> KdaConfig:
    """Derive the static :class:`KdaConfig` of a call from its tensors (metadata only) and
    scalars.

    Raises:
      KdaArgumentError: named after the call argument a field comes from (``A_log`` for the
        head count, ``state_indices`` for T, ``conv_state`` for the window, layout and dtype,
        ``conv_weight`` / ``norm_weight`` / ``state`` for their dtypes, ``v_record`` for record mode; the
        scalars under their own names).
    """
    A_log, state_indices, conv_state = args.A_log, args.state_indices, args.conv_state
    if not isinstance(A_log, torch.Tensor) or A_log.dim() != 1 or A_log.shape[0] < 1:
        raise KdaArgumentError("A_log", "expected a 1-D tensor [H] with H >= 1, got "
                               + (f"shape {list(A_log.shape)}" if isinstance(A_log, torch.Tensor)
                                  else type(A_log).__name__))
    H = A_log.shape[0]
    heads = _head_counts(args)
    if len(heads) == 2 and len(set(heads.values())) == 1 and H not in heads.values():
        n = heads["x"]
        raise KdaArgumentError("A_log", f"expected shape [{n}] (one value per head: x and state "
                                        f"hold {n} heads), got shape [{H}]")
    if not isinstance(state_indices, torch.Tensor) or state_indices.dim() not in (1, 2):
        raise KdaArgumentError("state_indices", "expected an int32 tensor [R] (T=1) or [R, T], got "
                               + (f"shape {list(state_indices.shape)}"
                                  if isinstance(state_indices, torch.Tensor) else type(state_indices).__name__))
    T = 1 if state_indices.dim() == 1 else state_indices.shape[1]
    if T < 1:
        raise KdaArgumentError("state_indices", f"expected T = state_indices.shape[1] >= 1, got {T}")
    check_conv_state_is_3d(conv_state)
    layout = conv_layout_of(conv_state)
    if layout is None:
        raise KdaArgumentError("conv_state", "expected window-first strides [s, 1, 3*dim] (SD) or "
                                             f"dim-first strides [s, L, 1] (DS), got strides "
                                             f"{list(conv_state.stride())} for shape "
                                             f"{list(conv_state.shape)} (3*dim = shape[1], L = "
                                             "shape[2]: a slice of a cache's channels or window "
                                             "positions has neither layout)")
    if scale is None:
        scale = D ** -0.5
    check_scalar_types(scale, norm_eps, lower_bound, gate_mode, beta_activated, early_reads)
    try:
        return KdaConfig(
            num_heads=H, T=T, window=conv_state.shape[2], conv_layout=layout,
            lower_bound=lower_bound, gate_mode=gate_mode,
            has_conv_bias=args.conv_bias is not None,
            record=args.v_record is not None or args.kg_record is not None,
            scale=scale, norm_eps=norm_eps, conv_state_dtype=conv_state.dtype,
            conv_weight_dtype=getattr(args.conv_weight, "dtype", torch.float32),
            norm_weight_dtype=getattr(args.norm_weight, "dtype", torch.float32),
            beta_activated=beta_activated,
            state_dtype=getattr(args.state, "dtype", torch.float32), early_reads=early_reads)
    except KdaArgumentError as e:
        arg = FIELD_ARG.get(e.arg, e.arg)
        if arg == e.arg:
            raise
        if e.arg.endswith("_dtype"):          # the tensor's dtype: the message says it all
            raise KdaArgumentError(arg, e.message) from None
        raise KdaArgumentError(arg, f"{e.arg} {e.message}" if e.arg != "window" else
                               f"{e.message} (L = conv_state.shape[2]; T = "
                               "state_indices.shape[1], 1 for a 1-D state_indices)") from None


def _head_counts(args: KdaArgs) -> dict:
    """The head counts that x ([N, 3*H*128]) and state ([slots, H, 128, 128]) imply, for those
    of the two whose shape has that form."""
    heads = {}
    x, st = args.x, args.state
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] and x.shape[1] % (3 * D) == 0:
        heads["x"] = x.shape[1] // (3 * D)
    if isinstance(st, torch.Tensor) and st.dim() == 4 and tuple(st.shape[2:]) == (D, D):
        heads["state"] = st.shape[1]
    return heads


#: The call argument each KdaConfig field is derived from: errors about a field name it.
FIELD_ARG = {"num_heads": "A_log", "T": "state_indices", "window": "conv_state",
             "conv_layout": "conv_state", "has_conv_bias": "conv_bias", "record": "v_record",
             "conv_state_dtype": "conv_state", "conv_weight_dtype": "conv_weight",
             "norm_weight_dtype": "norm_weight", "gate_mode": "gate_mode",
             "lower_bound": "lower_bound", "scale": "scale", "norm_eps": "norm_eps",
             "beta_activated": "beta_activated", "state_dtype": "state"}


def check_conv_state_is_3d(conv_state) -> None:
    """Raises KdaArgumentError unless ``conv_state`` is a 3-D tensor [slots, 3*dim, L]."""
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3:
        raise KdaArgumentError("conv_state", "expected a 3-D tensor [slots, 3*dim, L], got "
                               + (f"shape {list(conv_state.shape)}" if isinstance(conv_state, torch.Tensor)
                                  else type(conv_state).__name__))


def check_x_is_2d(x: torch.Tensor) -> None:
    """Raises KdaArgumentError unless the tensor ``x`` is 2-D ([N, 3*dim]); also used before
    ``out`` is allocated from ``x.shape[0]``."""
    if x.dim() != 2:
        raise KdaArgumentError("x", f"expected a 2-D tensor [N, 3*dim], got shape {list(x.shape)}")


def validate_args(cfg: KdaConfig, args: KdaArgs, config_name: Optional[str] = None) -> None:
    """Check every tensor of a call against ``cfg``; raise :class:`KdaArgumentError` on the first
    problem. Reads only metadata (never device values), writes nothing.

    Args:
      cfg: the configuration (already checked by its construction).
      args: the call's tensors.
      config_name: None in the functional form, where ``cfg`` comes from the call's own
        tensors (:func:`config_from_args`; the head count from ``A_log``); in the object form
        what to call the configuration the tensors are held to ("this KdaDecode's KdaConfig"):
        an expectation that one of its fields decides (the head count, the dtypes of the
        caches and weights) names that field in the message.
    """
    H, T, L, dim = cfg.num_heads, cfg.T, cfg.window, cfg.dim

    def decides(field: str) -> str:
        return f"{config_name}.{field} decides" if config_name else ""

    heads_from = f"{config_name}.num_heads" if config_name else "A_log"
    x = args.x
    check_is_tensor("x", x)
    dev = x.device
    if dev.type not in ("cpu", "cuda"):
        raise KdaArgumentError("x", f"expected a cpu or cuda tensor, got device {dev}")
    check_x_is_2d(x)
    if x.shape[1] != 3 * dim:
        if x.shape[1] % (3 * D) == 0:
            raise KdaArgumentError("x", f"expected {3 * dim} channels (3 x H={H} heads x D={D}; H "
                                        f"from {heads_from}), got {x.shape[1]} "
                                        f"(= {x.shape[1] // (3 * D)} heads)")
        raise KdaArgumentError("x", f"expected 3*H*D = {3 * dim} channels with head dim D = {D}, "
                                    f"got {x.shape[1]}")
    si = args.state_indices
    if not isinstance(si, torch.Tensor):
        raise KdaArgumentError("state_indices", f"expected an int32 tensor, got {type(si).__name__}")
    want_dims = "[R]" if T == 1 else f"[R, T={T}]"
    t_from = f"{decides('T')}; " if config_name else ""
    if si.dim() != (1 if T == 1 else 2) or (T > 1 and si.shape[1] != T):
        raise KdaArgumentError("state_indices", f"expected {want_dims} for T = {T} ({t_from}T = 1 "
                                                f"takes a 1-D tensor, verify T > 1 a 2-D one), got "
                                                f"shape {list(si.shape)}")
    R = si.shape[0]
    N = R * T
    if x.shape[0] != N:
        hint = (" (a speculative verify with T > 1 tokens passes state_indices as [R, T])"
                if T == 1 and R and x.shape[0] % R == 0 and x.shape[0] > R else "")
        raise KdaArgumentError("x", f"expected N = R*T = {N} rows (R = {R} from state_indices, T = {T}), "
                                    f"got {x.shape[0]}{hint}")
    _check_tensor("x", x, (torch.bfloat16,), (N, 3 * dim), dev)
    _check_rows("x", x)
    _check_tensor("state_indices", si, (torch.int32,), (R,) if T == 1 else (R, T), dev)
    _check_contiguous("state_indices", si)
    if T > 1:
        if args.num_accepted_tokens is None:
            raise KdaArgumentError("num_accepted_tokens", f"required when T > 1 (T = {T}), got None")
        _check_tensor("num_accepted_tokens", args.num_accepted_tokens, (torch.int32,), (R,), dev)
        _check_contiguous("num_accepted_tokens", args.num_accepted_tokens)
    elif args.num_accepted_tokens is not None:
        raise KdaArgumentError("num_accepted_tokens", "expected None for T = 1 (state_indices is "
                                                      "[R]; pass state_indices [R, T] for verify), "
                                                      "got a tensor of shape "
                                                      f"{list(args.num_accepted_tokens.shape)}")
    _check_tensor("conv_weight", args.conv_weight, (cfg.conv_weight_dtype,), (3, 4, dim), dev,
                  dtype_why=decides("conv_weight_dtype"))
    _check_contiguous("conv_weight", args.conv_weight)
    if cfg.has_conv_bias:
        if args.conv_bias is None:
            raise KdaArgumentError("conv_bias", f"expected a float32 tensor [{3 * dim}] (the "
                                                "configuration has a conv bias), got None")
        _check_tensor("conv_bias", args.conv_bias, (torch.float32,), (3 * dim,), dev)
        _check_contiguous("conv_bias", args.conv_bias)
    elif args.conv_bias is not None:
        raise KdaArgumentError("conv_bias", "the configuration has no conv bias, but one was passed")
    st = args.state
    if not isinstance(st, torch.Tensor) or st.dim() != 4:
        raise KdaArgumentError("state", "expected a 4-D tensor [slots, H, 128, 128], got "
                               + (f"shape {list(st.shape)}" if isinstance(st, torch.Tensor) else type(st).__name__))
    slots = st.shape[0]
    _check_tensor("state", st, (cfg.state_dtype,), (slots, H, D, D), dev,
                  dtype_why=decides("state_dtype"))
    if slots < 1:
        raise KdaArgumentError("state", "expected at least one slot (slot 0 is the null slot), got 0")
    if st.stride()[1:] != (D * D, D, 1):
        raise KdaArgumentError("state", f"expected each slot's [H, 128(v), 128(k)] page contiguous "
                                        f"(V-major, strides [s, {D * D}, {D}, 1]), got strides {list(st.stride())}")
    per16 = 16 // st.element_size()     # elements in 16 bytes: 4 fp32, 8 bf16
    if slots > 1 and (st.stride(0) < H * D * D or st.stride(0) % per16):
        raise KdaArgumentError("state", f"expected a slot stride >= {H * D * D} and a multiple of "
                                        f"{per16} elements (16 bytes), got {st.stride(0)}")
    _check_aligned("state", st)
    cs = args.conv_state
    check_conv_state_is_3d(cs)
    if cs.shape[0] != slots:
        raise KdaArgumentError("conv_state", f"mismatched slot counts: expected {slots} slots (as state), "
                                             f"got {cs.shape[0]}")
    if cs.shape[1] != 3 * dim:
        raise KdaArgumentError("conv_state", f"expected shape [slots, 3*dim = {3 * dim}, L] (the "
                                             "channel axis second in both layouts; a cache stored "
                                             "window-first as [slots, L, 3*dim] is passed as its "
                                             f"transpose(1, 2)), got shape {list(cs.shape)}")
    if cs.shape[2] != L:
        # (the object form's window is the configuration's: a KdaConfig copied with
        # dataclasses.replace(cfg, T=...) keeps the window it had)
        raise KdaArgumentError("conv_state", f"expected L = {L} window positions (KdaConfig.window; "
                                             f"None gives T + 2 = {T + 2}), got shape "
                                             f"{list(cs.shape)}")
    _check_tensor("conv_state", cs, (cfg.conv_state_dtype,), (slots, 3 * dim, L), dev,
                  dtype_why=decides("conv_state_dtype"))
    layout = conv_layout_of(cs)
    if layout != cfg.conv_layout:
        raise KdaArgumentError("conv_state", f"expected the {cfg.conv_layout} layout, got strides "
                                             f"{list(cs.stride())} ({layout or 'neither layout'})")
    inner = 3 * dim * L
    if slots > 1 and (cs.stride(0) < inner or cs.stride(0) % 8):
        raise KdaArgumentError("conv_state", f"expected a slot stride >= {inner} and a multiple of 8 "
                                             f"elements, got {cs.stride(0)}")
    _check_aligned("conv_state", cs)
    _check_tensor("f_a", args.f_a, (torch.bfloat16,), (N, GATE_RANK), dev)
    _check_rows("f_a", args.f_a)
    _check_tensor("f_b", args.f_b, (torch.bfloat16,), (dim, GATE_RANK), dev)
    _check_contiguous("f_b", args.f_b)
    _check_aligned("f_b", args.f_b)
    _check_beta(cfg, args.beta, N, dev)
    _check_tensor("A_log", args.A_log, (torch.float32,), (H,), dev,
                  shape_why=f"one value per head; H = {H} from {heads_from}")
    _check_contiguous("A_log", args.A_log)
    _check_tensor("dt_bias", args.dt_bias, (torch.float32,), (dim,), dev)
    _check_contiguous("dt_bias", args.dt_bias)
    _check_tensor("output_gate", args.output_gate, (torch.bfloat16,), (N, dim), dev)
    _check_rows("output_gate", args.output_gate)
    _check_tensor("norm_weight", args.norm_weight, (cfg.norm_weight_dtype,), (D,), dev,
                  dtype_why=decides("norm_weight_dtype"))
    _check_contiguous("norm_weight", args.norm_weight)
    _check_tensor("out", args.out, (torch.bfloat16,), (N, dim), dev)
    _check_rows("out", args.out)
    if cfg.record:
        for name, dt, width in (("v_record", torch.float32, D), ("kg_record", torch.bfloat16, 2 * D)):
            t = getattr(args, name)
            if t is None:
                raise KdaArgumentError(name, "required in record mode, got None")
            _check_tensor(name, t, (dt,), (slots, H, T, width), dev)
            _check_contiguous(name, t)
    else:
        for name in ("v_record", "kg_record"):
            if getattr(args, name) is not None:
                raise KdaArgumentError(name, f"given, but {config_name}.record is False (record "
                                             "mode: KdaConfig(record=True), with both v_record "
                                             "and kg_record)" if config_name else
                                       "given without record mode; pass both v_record and "
                                       "kg_record to enable it")
    check_writable(args)
    _check_no_overlap(args)


_written = operator.attrgetter(*WRITTEN)


def write_mode(args: KdaArgs) -> tuple:
    """What decides whether PyTorch lets the written buffers be updated in place now: grad mode,
    inference mode, and each one's ``requires_grad`` and ``is_inference()`` (part of the object
    form's validation key: a later call in another mode, or with such a buffer, is checked)."""
    if torch.is_inference_mode_enabled():
        return ()           # (grad mode is off inside it) nothing is refused: engines' case
    grad = torch.is_grad_enabled()
    return (grad,) + tuple((grad and t.requires_grad, t.is_inference())
                           if isinstance(t, torch.Tensor) else None
                           for t in _written(args))


def check_writable(args: KdaArgs, traced: bool = False) -> None:
    """The buffers the step writes in place (``out``, ``conv_state``, and ``state``, or in
    record mode, which the records' presence decides, ``v_record`` and ``kg_record``): refused,
    as PyTorch refuses an in-place update, for a tensor that requires grad while grad mode is
    on (the write would bypass autograd) and for an inference tensor outside inference mode.

    ``traced``: before the custom op is traced (autograd's handling of a mutated input that
    requires grad failed there after the op had written): every buffer the op's schema
    declares written (``state`` in record mode too), and no inference-mode check (dynamo
    cannot read the mode).
    """
    grad = torch.is_grad_enabled()
    inference = not traced and not torch.is_inference_mode_enabled()
    record = args.v_record is not None or args.kg_record is not None
    for name in WRITTEN:
        if name == "state" and record and not traced:
            continue
        t = getattr(args, name)
        if not isinstance(t, torch.Tensor):
            continue
        if grad and t.requires_grad:
            raise KdaArgumentError(name, "expected a tensor that does not require grad, or a call "
                                         "under torch.no_grad() / torch.inference_mode(): the "
                                         "step writes it in place, which autograd cannot record; "
                                         "got requires_grad=True with grad mode on")
        if inference and t.is_inference():
            raise KdaArgumentError(name, "expected a normal tensor, or a call under "
                                         "torch.inference_mode(): the step writes it in place, "
                                         "which PyTorch forbids for an inference tensor outside "
                                         "inference mode; got an inference tensor (made under "
                                         "torch.inference_mode())")


def _check_beta(cfg: KdaConfig, beta, N: int, dev: torch.device) -> None:
    """beta [N, H]: bf16 raw logits, or fp32 already activated with ``beta_activated``; the
    dtype must match the flag (it is never inferred from the dtype)."""
    check_is_tensor("beta", beta)
    want = torch.float32 if cfg.beta_activated else torch.bfloat16
    if beta.dtype != want:
        form = ("beta_activated=True: the engine's sigmoid(beta), used as it is" if cfg.beta_activated
                else "raw logits, the op applies the sigmoid; pass beta_activated=True for an "
                     "already activated float32 beta")
        raise KdaArgumentError("beta", f"expected dtype {dtype_name(want)} ({form}), got "
                                       f"{dtype_name(beta.dtype)}")
    _check_tensor("beta", beta, (want,), (N, cfg.num_heads), dev)
    _check_rows("beta", beta)


def _span(t: torch.Tensor):
    """[lo, hi) byte addresses a tensor can touch (non-negative strides)."""
    lo = t.data_ptr()
    return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _row_period(t: torch.Tensor):
    """(period, bytes per row) when dim 0 repeats every ``period`` bytes and one row's elements
    fit inside that period (rows of a fused projection, slots of a paged cache); else None."""
    if t.dim() < 2 or t.shape[0] < 2:
        return None
    period = t.stride(0) * t.element_size()
    row = (sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:])) + 1) * t.element_size()
    return (period, row) if 0 < row <= period else None


def may_overlap(a: torch.Tensor, b: torch.Tensor, spans=None) -> bool:
    """Whether a and b can share an element (conservative: True unless provably disjoint).

    Disjoint byte ranges, or -- for two views that step through one buffer with the same row
    period, e.g. ``out`` and ``output_gate`` column slices of one projection output, or a
    slot's conv window and state pages interleaved in one paged cache -- disjoint positions
    within the period. ``spans`` may pass precomputed (:func:`_span`) byte ranges of a and b.
    """
    (alo, ahi), (blo, bhi) = spans or (_span(a), _span(b))
    if ahi <= blo or bhi <= alo:
        return False
    pa, pb = _row_period(a), _row_period(b)
    if pa is None or pb is None or pa[0] != pb[0]:
        return True
    period = pa[0]
    phase = (blo - alo) % period          # b's row start, relative to a's, within a period
    return phase < pa[1] or phase + pb[1] > period


def _check_no_overlap(args: KdaArgs) -> None:
    """The written buffers must not share memory with each other or with any input."""
    spans = {n: (t, _span(t)) for n, t in args._asdict().items() if t is not None and t.numel()}
    for wname in WRITTEN:
        if wname not in spans:
            continue
        w, wspan = spans[wname]
        for name, (t, span) in spans.items():
            if name != wname and may_overlap(w, t, (wspan, span)):
                raise KdaArgumentError(wname, f"overlaps the memory of {name}: written buffers must "
                                              "not alias any other argument")
