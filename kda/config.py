"""Static configuration of one fused KDA decode step, and the argument bundle backends receive.

A :class:`KdaConfig` holds everything that selects a kernel variant (head count, tokens per
request, conv window length and layout, gate kind, gate accumulation order, conv bias, record
mode, cache dtypes). It is hashable, so backends key their compiled kernels on it. Everything
that changes per step (batch size, slot ids, accepted counts, the tensors themselves) lives in
:class:`KdaArgs`.

The contract these follow is ``docs/contract.md`` (a copy of the team's
``kda-decode-contract.md`` with the project's decisions where it is silent).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

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
      conv_weight_dtype: fp32 (default) or bf16.
      norm_weight_dtype: fp32 (default) or bf16.

    Construction checks nothing; :class:`kda.KdaDecode` validates the configuration (errors are
    named after the call argument each field comes from, see ``kda.validate.FIELD_ARG``).
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

    def __post_init__(self):
        # window=None -> T + 2 (left None when T is not an int: validate_config names T first)
        if self.window is None and isinstance(self.T, int) and not isinstance(self.T, bool):
            object.__setattr__(self, "window", self.T + 2)

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
        return "-".join(parts)


class KdaArgs(NamedTuple):
    """The per-step tensors, already validated against a :class:`KdaConfig`.

    Shapes use R requests, T tokens per request, N = R*T token rows, dim = H*128, L the window.
    A backend's step function reads these and writes ``out``, ``state``, ``conv_state`` and
    (record mode) ``v_record`` / ``kg_record`` in place; it must honour the strides below and
    must not read device-side values (slot ids, accepted counts) on the host.

    Layout guarantees given by validation:
      x [N, 3*dim] bf16, output_gate [N, dim] bf16, f_a [N, 128] bf16, out [N, dim] bf16:
        last stride 1, row stride any multiple of 8 elements, data 16-byte aligned.
      beta [N, H] bf16: last stride 1, any row stride.
      state [slots, H, 128, 128] fp32: inner three dims contiguous, slot stride a multiple
        of 4 elements, 16-byte aligned.
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
    num_accepted_tokens: Optional[torch.Tensor]
    output_gate: torch.Tensor
    norm_weight: torch.Tensor
    out: torch.Tensor
    v_record: Optional[torch.Tensor]
    kg_record: Optional[torch.Tensor]

    @property
    def num_requests(self) -> int:
        """R, the batch's request count (``state_indices.shape[0]``; host metadata only)."""
        return self.state_indices.shape[0]
