"""The one-CTA-per-item kernel's shared-memory size and occupancy hint, and the compile
cache's directory. Pure Python (no CuTe DSL import).
"""

from __future__ import annotations

from kda.backend import cache_dir

D = 128


class SmemPlan:
    """The shared-memory regions of one wide CTA for T tokens, in bytes (all 16-B aligned):
    what the host needs without CuTe DSL (the carveout hint, the occupancy check). The kernel's
    storage struct (:func:`kda.backends.cutedsl.common.storage_fields`) has these regions in
    this order, as tensors; :class:`kda.backends.cutedsl.wide.KdaWide` checks that it fits
    :attr:`total`.

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
