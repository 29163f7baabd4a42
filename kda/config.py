"""Static configuration of one fused KDA decode step, and the argument bundle backends receive.

A :class:`KdaConfig` holds everything that selects a kernel variant (head count, tokens per
request, conv window length and layout, gate kind, gate accumulation order, conv bias, record
mode, cache and state dtypes, the form of beta). It is hashable, so backends key their compiled kernels
on it. Everything that changes per step (batch size, slot ids, accepted counts, the tensors
themselves) lives in :class:`KdaArgs`.

The contract these follow is ``docs/contract.md``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from typing import NamedTuple, Optional

import torch

from kda.errors import KdaArgumentError

#: Head dimension D (K = V = D). Fixed by the contract.
HEAD_DIM = 128
#: Rank of the low-rank forget-gate projection (f_a width). Fixed by the contract.
GATE_RANK = 128
#: Conv taps W. Fixed by the contract.
CONV_TAPS = 4
#: Eps added to the sum of squares in the q/k L2 norm (contract section 2; not configurable).
L2_NORM_EPS = 1e-6

#: Conv-cache layouts: "SD" is window-first (strides [L*3dim, 1, 3dim], vLLM's default);
#: "DS" is dim-first (strides [3dim*L, L, 1]).
CONV_LAYOUTS = ("SD", "DS")


@dataclasses.dataclass(frozen=True)
class KdaConfig:
    """The static configuration of a decode step; one compiled kernel serves one config.

    Attributes:
      num_heads: H, KDA heads on this GPU (any H >= 1).
      T: tokens per request (1 = plain decode, >1 = speculative verify).
      window: L, the conv window length held in the cache, >= T + 2; None (the default)
        means T + 2, the shortest window that serves T (3 at T=1). Resolved at construction:
        ``dataclasses.replace(cfg, T=...)`` keeps the old window unless ``window=None`` is
        passed too.
      conv_layout: "SD" (window-first) or "DS" (dim-first), see :data:`CONV_LAYOUTS`.
      lower_bound: None for the softplus gate (Kimi-Linear), or a float in [-5, 0) for the
        bounded gate ``lower_bound * sigmoid(A * x)`` (Kimi-K3 style).
      gate_mode: accumulation order of the f_b gate projection: 0 = one chain over j in
        16-wide steps, 1 = four chains over 32-wide slices combined ((c0+c1)+c2)+c3.
      has_conv_bias: whether a conv bias [3*dim] fp32 is passed.
      record: speculative verify with checkpoint records (state read, not written; u, k and
        the raw gate written to v_record / kg_record).
      scale: q scale, default D**-0.5.
      norm_eps: eps of the gated RMSNorm, default 1e-5.
      conv_state_dtype: bf16 (default) or fp32.
      state_dtype: dtype of the recurrent state pool: fp32 (default) or bf16. A bf16 page is
        widened to fp32 on load, all math stays fp32, and every state written is rounded to
        bf16 once (round to nearest even). fp16 is rejected.
      conv_weight_dtype: fp32 (default) or bf16.
      norm_weight_dtype: fp32 (default) or bf16.
      beta_activated: False (default): ``beta`` is bf16 raw logits and the op applies the
        sigmoid; True: ``beta`` is fp32 already passed through the sigmoid by the engine,
        used as it is. Never inferred from beta's dtype.
      early_reads: False (default): every kernel waits for its programmatic-launch (PDL)
        predecessor before it reads anything that kernel may write. True: ``cutedsl``'s
        persistent streamed kernel on fp32 pages reads ``state_indices``,
        ``num_accepted_tokens``, its first conv windows and its first state pages before that
        wait (the activations still after it), which takes its first items' load latency off
        the step (``kda.backends.cutedsl.policy.reads_early``). Allowed only where the kernel
        launched just before the step on its stream writes none of ``state``,
        ``conv_state``, ``state_indices`` and ``num_accepted_tokens`` (in a model's forward
        pass that kernel is a projection; two steps on one pool back to back on a stream must
        leave this False): the contract, section 6, "Launch order". The other kernels and
        backends ignore it.

    Construction checks every field and stores the numbers as Python ``int`` / ``float`` /
    ``bool`` (numpy scalars are accepted).

    Raises:
      KdaArgumentError: named after the offending field: a count that is not an int, H < 1,
        T < 1, a window shorter than T + 2, an unknown layout, lower_bound outside [-5, 0)
        (or not < 0 in fp32), gate_mode not 0 / 1, a scale or norm_eps that is not a finite
        number > 0 that is normal in fp32 (the kernels' precision), a flag that is not a
        bool, a dtype other than bf16 / fp32 (``state_dtype``: float16 with its own message).
    """

    num_heads: int
    T: int = 1
    window: Optional[int] = None
    conv_layout: str = "SD"
    lower_bound: Optional[float] = None
    gate_mode: int = 0
    has_conv_bias: bool = False
    record: bool = False
    scale: float = HEAD_DIM ** -0.5
    norm_eps: float = 1e-5
    conv_state_dtype: torch.dtype = torch.bfloat16
    conv_weight_dtype: torch.dtype = torch.float32
    norm_weight_dtype: torch.dtype = torch.float32
    beta_activated: bool = False
    state_dtype: torch.dtype = torch.float32
    early_reads: bool = False

    def __post_init__(self):
        for name in ("num_heads", "T", "window", "gate_mode"):
            val = getattr(self, name)
            if name == "window" and val is None:
                continue
            if isinstance(val, bool) or not isinstance(val, numbers.Integral):
                raise KdaArgumentError(name, f"expected an int, got {type(val).__name__} {val!r}")
        if self.num_heads < 1:
            raise KdaArgumentError("num_heads", f"expected H >= 1 heads, got {self.num_heads}")
        if self.T < 1:
            raise KdaArgumentError("T", f"expected T >= 1 tokens per request, got {self.T}")
        window = self.T + 2 if self.window is None else int(self.window)
        if window < self.T + 2:
            raise KdaArgumentError("window", f"window too short for T={self.T}: expected L >= "
                                             f"T + 2 = {self.T + 2} positions (default T + 2), "
                                             f"got L = {window}")
        if self.conv_layout not in CONV_LAYOUTS:
            raise KdaArgumentError("conv_layout", f"expected one of {CONV_LAYOUTS}, got "
                                                  f"{self.conv_layout!r}")
        lb = self.lower_bound
        if lb is not None:
            if isinstance(lb, bool) or not isinstance(lb, numbers.Real):
                raise KdaArgumentError("lower_bound", f"expected None or a float in [-5, 0), got "
                                                      f"{type(lb).__name__} {lb!r}")
            if not (finite(lb) and -5.0 <= lb < 0.0 and as_fp32(lb) < 0.0):
                raise KdaArgumentError("lower_bound", f"expected None or a float in [-5, 0) (also "
                                                      f"as fp32, the kernels' precision), got {lb!r}")
        if self.gate_mode not in (0, 1):
            raise KdaArgumentError("gate_mode", f"expected 0 or 1, got {self.gate_mode!r}")
        for name in ("scale", "norm_eps"):
            val = getattr(self, name)
            if (isinstance(val, bool) or not isinstance(val, numbers.Real)
                    or not (finite(val) and val > 0)):
                raise KdaArgumentError(name, f"expected a finite float > 0, got "
                                             f"{type(val).__name__} {val!r}")
            f32 = as_fp32(val)
            if not (math.isfinite(f32) and f32 >= FP32_MIN_NORMAL):
                raise KdaArgumentError(name, f"expected a float > 0 that is finite and normal in "
                                             f"fp32 (the kernels' precision: [{FP32_MIN_NORMAL:.4g}, "
                                             f"3.403e+38]), got {val!r} (fp32: {f32!r})")
        for name in ("has_conv_bias", "record", "beta_activated", "early_reads"):
            val = getattr(self, name)
            if not is_bool(val):
                raise KdaArgumentError(name, f"expected a bool, got {type(val).__name__} {val!r}")
        for name in ("conv_state_dtype", "conv_weight_dtype", "norm_weight_dtype"):
            dt = getattr(self, name)
            if dt not in (torch.bfloat16, torch.float32):
                raise KdaArgumentError(name, f"expected dtype bfloat16 or float32, got "
                                             f"{dtype_name(dt)}")
        if self.state_dtype not in (torch.float32, torch.bfloat16):
            why = " (float16 state pools are not supported)" \
                if self.state_dtype == torch.float16 else ""
            raise KdaArgumentError("state_dtype", f"expected dtype float32 or bfloat16{why}, got "
                                                  f"{dtype_name(self.state_dtype)}")
        normal = dict(num_heads=int(self.num_heads), T=int(self.T), window=window,
                      lower_bound=None if lb is None else float(lb),
                      gate_mode=int(self.gate_mode), has_conv_bias=bool(self.has_conv_bias),
                      record=bool(self.record), beta_activated=bool(self.beta_activated),
                      early_reads=bool(self.early_reads), scale=float(self.scale),
                      norm_eps=float(self.norm_eps))
        for name, val in normal.items():
            object.__setattr__(self, name, val)

    @property
    def dim(self) -> int:
        """H * D: channels of one of q, k, v."""
        return self.num_heads * HEAD_DIM

    @property
    def gate(self) -> str:
        """"softplus" or "bounded"."""
        return "softplus" if self.lower_bound is None else "bounded"

    def short(self) -> str:
        """A compact human-readable tag, e.g. ``H32-T1-L3-SD-softplus-g0``."""
        parts = [f"H{self.num_heads}", f"T{self.T}", f"L{self.window}", self.conv_layout,
                 self.gate if self.lower_bound is None else f"lb{self.lower_bound:g}",
                 f"g{self.gate_mode}"]
        if self.has_conv_bias:
            parts.append("bias")
        if self.record:
            parts.append("record")
        if self.conv_state_dtype != torch.bfloat16:
            parts.append("cs32")
        if self.beta_activated:
            parts.append("beta32")
        if self.state_dtype == torch.bfloat16:
            parts.append("st16")
        if self.early_reads:
            parts.append("early")
        return "-".join(parts)


#: The smallest normal fp32 number: scale and norm_eps below it would be flushed to zero by
#: kernels that do so (norm_eps = 0 turns an all-zero o into NaN).
FP32_MIN_NORMAL = 2.0 ** -126


def dtype_name(dt) -> str:
    """How every message of the package spells a dtype: torch's name without ``torch.``
    ("float32", "bfloat16"); anything that is not a dtype as its repr."""
    return str(dt).replace("torch.", "") if isinstance(dt, torch.dtype) else repr(dt)


def finite(v) -> bool:
    """``math.isfinite(v)``, False for an int too large for a float (not an OverflowError)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def is_bool(v) -> bool:
    """A bool, or numpy's bool_ (a 0-d value of dtype kind "b"; not an array of them)."""
    return isinstance(v, bool) or (getattr(getattr(v, "dtype", None), "kind", "") == "b"
                                   and getattr(v, "ndim", None) == 0)


def as_fp32(v: float) -> float:
    """``v`` rounded to fp32 (inf beyond its range), as the kernels and the reference use it."""
    try:
        return struct.unpack("<f", struct.pack("<f", float(v)))[0]
    except OverflowError:
        return math.copysign(math.inf, float(v))


class KdaArgs(NamedTuple):
    """The tensors of one step, in the order of :func:`kda.kda_decode`'s parameters: the one
    record carried from the public entry points (which build it) through validation and the
    custom op to each backend's launcher.

    Shapes use R requests, T tokens per request, N = R*T token rows, dim = H*128, L the window.
    A backend's step function reads these and writes ``out``, ``state``, ``conv_state`` and
    (record mode) ``v_record`` / ``kg_record`` in place; it must honour the strides below and
    must not read device-side values (slot ids, accepted counts) on the host.

    Layout guarantees given by validation:
      x [N, 3*dim] bf16, output_gate [N, dim] bf16, f_a [N, 128] bf16, out [N, dim] bf16:
        last stride 1, any row stride >= the row length, any element alignment (the GPU
        kernels pick their row loads by :func:`kda.backend.row_bytes`).
      beta [N, H]: bf16 (float32 with ``KdaConfig.beta_activated``), last stride 1, any row
        stride >= H.
      state [slots, H, 128, 128] fp32 or bf16 (``KdaConfig.state_dtype``): inner three dims
        contiguous, slot stride a multiple of 16 bytes (4 fp32 / 8 bf16 elements), 16-byte
        aligned.
      conv_state [slots, 3*dim, L] (bf16 or fp32): "SD" strides [s, 1, 3*dim], "DS" strides
        [s, L, 1], slot stride s any multiple of 8 elements, 16-byte aligned.
      conv_weight [3, 4, dim], conv_bias [3*dim] (or None), f_b [dim, 128], A_log [H],
        dt_bias [dim], norm_weight [128], state_indices [R] (T=1) or [R, T] (T>1),
        num_accepted_tokens [R] (T>1, else None), v_record [slots, H, T, 128] fp32 and
        kg_record [slots, H, T, 256] bf16 (record mode, else None): contiguous.
    """

    x: torch.Tensor
    conv_weight: torch.Tensor
    conv_bias: Optional[torch.Tensor]
    conv_state: torch.Tensor
    f_a: torch.Tensor
    f_b: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    state: torch.Tensor
    state_indices: torch.Tensor
    output_gate: torch.Tensor
    norm_weight: torch.Tensor
    num_accepted_tokens: Optional[torch.Tensor] = None
    v_record: Optional[torch.Tensor] = None
    kg_record: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None

    @property
    def num_requests(self) -> int:
        """R, the batch's request count (``state_indices.shape[0]``; host metadata only)."""
        return self.state_indices.shape[0]


#: The fields of :class:`KdaArgs` a step may write in place (record mode: the records, not
#: the state).
WRITTEN = ("out", "state", "conv_state", "v_record", "kg_record")
