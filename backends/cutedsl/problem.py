"""The problem record of the CuTe DSL kernel family: what a compiled kernel serves.

With a :class:`kda.backends.cutedsl.schedule.Schedule` (how it serves it) a :class:`Problem`
is the compile key. Pure Python (no CuTe DSL import), so the backend computes cache keys and
resource needs on a machine without the DSL. The runtime-only values of
:class:`kda.config.KdaConfig` (``scale``, ``norm_eps``, ``lower_bound``) are not part of it:
the kernels take them as runtime fp32 scalars, so changing them never recompiles.
"""

from __future__ import annotations

import dataclasses

import torch

from kda.config import KdaConfig

#: Tokens per request the kernels serve (the gate MMA has 8 token columns).
MAX_T = 8
#: Row alignments (bytes) the kernels are built for (:func:`kda.backend.row_bytes`).
ROW_BYTES = (16, 8, 4, 2)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Everything of a step a compiled kernel is specialized on. Frozen and validated.

    Attributes:
      H: heads. T: tokens per request (1..8). L: conv window length (>= T+2).
      layout: "SD" (window-first) or "DS" (dim-first) conv cache.
      bounded: bounded gate (lower_bound * sigmoid(A x)) instead of softplus.
      gate_mode: 0 (one accumulator chain) or 1 (four chains).
      has_bias: a conv bias is passed. record: record mode.
      cs_bf16 / cw_bf16 / nw_bf16: conv_state / conv_weight / norm_weight are bf16 (else fp32).
      beta_activated: beta is fp32, already passed through the sigmoid (used as it is);
        else bf16 logits.
      row_bytes: 16, 8, 4 or 2: the widest access every row of x, f_a, output_gate and out
        allows (:func:`kda.backend.row_bytes`, computed by the launcher for each call), the
        alignment the kernel's pointers to them assume.
      state_bf16: the state pool is bf16: each page is widened to fp32 on load and every state
        written is rounded once to nearest even (the kernels move it in the fp32 build's
        column layout, so all arithmetic is the fp32 build's); else fp32.

    Raises:
      ValueError: a field outside its range (each named).
    """

    H: int
    T: int
    L: int
    layout: str
    bounded: bool
    gate_mode: int
    has_bias: bool
    record: bool
    cs_bf16: bool
    cw_bf16: bool
    nw_bf16: bool
    beta_activated: bool = False
    row_bytes: int = 16
    state_bf16: bool = False

    def __post_init__(self):
        why = []
        if self.H < 1:
            why.append(f"H: expected >= 1, got {self.H}")
        if not 1 <= self.T <= MAX_T:
            why.append(f"T: expected 1..{MAX_T}, got {self.T}")
        if self.L < self.T + 2:
            why.append(f"L: expected >= T + 2 = {self.T + 2}, got {self.L}")
        if self.layout not in ("SD", "DS"):
            why.append(f"layout: expected 'SD' or 'DS', got {self.layout!r}")
        if self.gate_mode not in (0, 1):
            why.append(f"gate_mode: expected 0 or 1, got {self.gate_mode}")
        if self.row_bytes not in ROW_BYTES:
            why.append(f"row_bytes: expected one of {ROW_BYTES}, got {self.row_bytes}")
        if why:
            raise ValueError("Problem: " + "; ".join(why))

    @classmethod
    def from_config(cls, cfg: KdaConfig, row_bytes: int = 16) -> "Problem":
        """The compile-time part of ``cfg`` (scale, norm_eps and lower_bound's value excluded),
        for rows of ``row_bytes`` alignment."""
        return cls(H=cfg.num_heads, T=cfg.T, L=cfg.window, layout=cfg.conv_layout,
                   bounded=cfg.lower_bound is not None, gate_mode=cfg.gate_mode,
                   has_bias=cfg.has_conv_bias, record=cfg.record,
                   cs_bf16=cfg.conv_state_dtype == torch.bfloat16,
                   cw_bf16=cfg.conv_weight_dtype == torch.bfloat16,
                   nw_bf16=cfg.norm_weight_dtype == torch.bfloat16,
                   beta_activated=cfg.beta_activated, row_bytes=row_bytes,
                   state_bf16=cfg.state_dtype == torch.bfloat16)

    def tag(self) -> str:
        """A file-name friendly identifier, e.g. ``H32_T1_L3_SD_sp_g0_cs16_cw32_nw32``."""
        parts = [f"H{self.H}", f"T{self.T}", f"L{self.L}", self.layout,
                 "bd" if self.bounded else "sp", f"g{self.gate_mode}"]
        if self.has_bias:
            parts.append("bias")
        if self.record:
            parts.append("rec")
        parts.append("cs16" if self.cs_bf16 else "cs32")
        parts.append("cw16" if self.cw_bf16 else "cw32")
        parts.append("nw16" if self.nw_bf16 else "nw32")
        if self.beta_activated:
            parts.append("ba32")
        if self.row_bytes != 16:
            parts.append(f"rows{self.row_bytes}")
        if self.state_bf16:
            parts.append("st16")
        return "_".join(parts)
