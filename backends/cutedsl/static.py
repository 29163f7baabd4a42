"""Static (compile-time) description of a CuTe DSL KDA kernel, and its shared-memory plan.

Pure Python (no CuTe DSL import), so the backend can compute cache keys and resource needs on
a machine without the DSL. The runtime-only values of :class:`kda.config.KdaConfig`
(``scale``, ``norm_eps``, ``lower_bound``) are *not* part of :class:`KernelStatic`: they are
passed to the kernel as runtime fp32 scalars, so changing them never recompiles.
"""

from __future__ import annotations

import dataclasses

import torch

from kda.backend import cache_dir
from kda.config import KdaConfig

D = 128


@dataclasses.dataclass(frozen=True)
class KernelStatic:
    """Everything a compiled kernel is specialized on.

    Attributes:
      H: heads. T: tokens per request (1..8). L: conv window length (>= T+2).
      layout: "SD" (window-first) or "DS" (dim-first) conv cache.
      bounded: bounded gate (lower_bound * sigmoid(A x)) instead of softplus.
      gate_mode: 0 (one accumulator chain) or 1 (four chains).
      has_bias: a conv bias is passed. record: record mode.
      cs_bf16 / cw_bf16 / nw_bf16: conv_state / conv_weight / norm_weight are bf16 (else fp32).
      beta_activated: beta is fp32, already passed through the sigmoid (used as it is);
        else bf16 logits.
      page_last: the (first) item's state page is committed as its own cp.async group after
        the operand group, so that the item's phase A (conv, norms) runs while the page
        lands; False = page and operands one group, waited for together before phase A. The
        backend passes its choice, ``kda.backends.cutedsl.policy.page_last``; the split
        kernel ignores it.
      state_bf16: the state pool is bf16: each page is widened to fp32 on load and every state
        written is rounded once to nearest even (the kernels move it with 8-byte accesses in
        the fp32 build's column layout, so all arithmetic is the fp32 build's); else fp32.
      early_reads: the streamed kernel reads slot ids, windows and pages before
        ``griddepcontrol.wait`` (:attr:`kda.config.KdaConfig.early_reads`; the backend passes
        it where it measured faster, ``stream`` on fp32 pages, and False to the others; the
        streamed builds serve it either way).
      row_bytes: 16, 8, 4 or 2: the widest access every row of x, f_a, output_gate and out
        allows (:func:`kda.backend.row_bytes`, computed by the launcher for each call), the
        alignment the kernel's pointers to them assume. The wide kernel stages those rows with
        16-byte copies at 16, else with narrower copies or element loads (:mod:`common`); the
        split kernel reads them element by element either way.

    Every kernel is launched with programmatic dependent launch and, unless ``early_reads``,
    reads nothing a predecessor may write (slot ids, windows, pages, activations) before
    ``griddepcontrol.wait``. The wide kernel triggers its dependents after each CTA's last
    write; the split kernel reads the model weights before its wait and triggers right after
    it (a dependent reads this kernel's outputs only after its own wait, which waits for
    this grid's completion and memory).
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
    page_last: bool = True
    beta_activated: bool = False
    row_bytes: int = 16
    state_bf16: bool = False
    early_reads: bool = False

    @classmethod
    def from_config(cls, cfg: KdaConfig, page_last: bool = True, row_bytes: int = 16,
                    early_reads: bool = False) -> "KernelStatic":
        """The static part of ``cfg`` (scale, norm_eps and lower_bound's value excluded), for
        rows of ``row_bytes`` alignment; ``early_reads`` as given (the caller decides whether
        the kernel honours ``cfg.early_reads``)."""
        return cls(H=cfg.num_heads, T=cfg.T, L=cfg.window, layout=cfg.conv_layout,
                   bounded=cfg.lower_bound is not None, gate_mode=cfg.gate_mode,
                   has_bias=cfg.has_conv_bias, record=cfg.record,
                   cs_bf16=cfg.conv_state_dtype == torch.bfloat16,
                   cw_bf16=cfg.conv_weight_dtype == torch.bfloat16,
                   nw_bf16=cfg.norm_weight_dtype == torch.bfloat16, page_last=page_last,
                   beta_activated=cfg.beta_activated, row_bytes=row_bytes,
                   state_bf16=cfg.state_dtype == torch.bfloat16, early_reads=early_reads)

    def tag(self) -> str:
        """A file-name friendly identifier, e.g. ``H32_T1_L3_SD_sp_g0``."""
        parts = [f"H{self.H}", f"T{self.T}", f"L{self.L}", self.layout,
                 "bd" if self.bounded else "sp", f"g{self.gate_mode}"]
        if self.has_bias:
            parts.append("bias")
        if self.record:
            parts.append("rec")
        parts.append("cs16" if self.cs_bf16 else "cs32")
        parts.append("cw16" if self.cw_bf16 else "cw32")
        parts.append("nw16" if self.nw_bf16 else "nw32")
        if not self.page_last:
            parts.append("pj")
        if self.beta_activated:
            parts.append("ba32")
        if self.row_bytes != 16:
            parts.append(f"rows{self.row_bytes}")
        if self.state_bf16:
            parts.append("st16")
        if self.early_reads:
            parts.append("er")
        return "_".join(parts)


class SmemPlan:
    """Byte offsets of the shared-memory regions of one CTA for T tokens (all 16-B aligned).

    Staging:
      ST  state page [16 chunk][256 thread][4] fp32 (64 KiB; a bf16 page uses its first half as
          [16 chunk][256 thread][4] bf16)
      SX  x rows [T][3 (q,k,v)][128] bf16
      SOG output-gate rows [T][128] bf16
      SW  conv-window history [3 pos][3 part][128] (cache dtype; SD layout only)
    Per-item compute buffers:
      CQ, CK, CV, CA, CO  q-hat, k-hat, v, alpha, o: [T][128] fp32 each
      CB  beta [8] fp32; SL raw slot ids [2 parity][16] int32 (T slots + accepted count)
      CRQ, CRK, CRO  per-warp partial sums [9][4] fp32 (q^2, k^2, ob^2)
    """

    def __init__(self, T: int):
        self.T = T
        off = 0

        def take(n):
            """Reserve n bytes (16-byte aligned); return the offset."""
            nonlocal off
            o = off
            off += (n + 15) // 16 * 16
            return o

        self.ST = take(65536)
        self.SX = take(768 * T)
        self.SOG = take(256 * T)
        self.SW = take(3 * 3 * D * 4)
        self.CQ = take(512 * T)
        self.CK = take(512 * T)
        self.CV = take(512 * T)
        self.CA = take(512 * T)
        self.CO = take(512 * T)
        self.CB = take(32)
        self.SL = take(128)
        self.CRQ = take(144)
        self.CRK = take(144)
        self.CRO = take(144)
        self.total = (off + 127) // 128 * 128


#: Hopper: 228 KiB of shared memory per SM at most, 1 KiB of it reserved per CTA.
SMEM_PER_SM_MAX = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024


def carveout_percent(smem_per_cta: int, ctas_per_sm: int = 2) -> int:
    """Smallest shared-memory carveout (percent of the maximum) that fits ``ctas_per_sm`` CTAs.

    The driver rounds the hint up to a supported configuration; everything not carved out
    stays L1 cache (which the kernels use for register spills and the per-head operands).
    """
    need = ctas_per_sm * (smem_per_cta + SMEM_RESERVED_PER_CTA + 1024)   # + alignment slack
    return min(100, -(-100 * need // SMEM_PER_SM_MAX))


def default_cache_dir() -> str:
    """``$KDA_CACHE_DIR/cutedsl``, else ``~/.cache/kda/cutedsl`` (:func:`kda.backend.cache_dir`)."""
    return str(cache_dir("cutedsl"))
