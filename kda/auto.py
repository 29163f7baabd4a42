"""How ``auto`` orders the backends for a configuration: a small table from measurements.

On a CUDA device the order comes from :data:`MEASURED`, derived from
``docs/results/2026-11-29-h200-0145d86/bench-h200.json`` (NVIDIA H200, H=32, softplus gate, SD
conv layout, all requests live, 8 GiB pool, CUDA graphs of 8 steps): for each measured T, the
GPU backends ranked by the geometric mean over R in {1, 8, 32, 128, 512} of the median step
time. A configuration with an unmeasured T uses the nearest measured T. Backends the table
does not rank follow in the fixed order :data:`GPU_FALLBACK`; the registry skips whichever
is unavailable or cannot serve the configuration. ``tests/kda/test_auto.py`` recomputes the
ranking from the JSON, so the table cannot drift from its measurement.

On the CPU only the reference runs at a useful speed (the Triton interpreter is for tests),
so ``auto`` picks it.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from kda.config import KdaConfig

#: The measurement the table comes from.
SOURCE = "docs/results/2026-11-29-h200-0145d86/bench-h200.json"
#: T -> our backends, fastest first (geometric mean of the step time over R, H=32).
MEASURED: Dict[int, Tuple[str, ...]] = {
    1: ("cutedsl_wide", "cutedsl", "cuda", "triton"),
    2: ("cutedsl_wide", "cuda", "cutedsl", "triton"),
    5: ("cutedsl_wide", "cutedsl", "cuda", "triton"),
}
#: Fixed fallback order on a CUDA device for backends the table does not rank.
GPU_FALLBACK = ("cuda", "cutedsl", "cutedsl_wide", "triton", "reference")
#: Order on the CPU.
CPU_ORDER = ("reference",)


def auto_order(cfg: KdaConfig, device: torch.device) -> List[str]:
    """Backend names to try, best first, for ``cfg`` on ``device``."""
    if device.type != "cuda":
        return list(CPU_ORDER)
    nearest = min(MEASURED, key=lambda t: (abs(t - cfg.T), t))
    order = list(MEASURED[nearest])
    return order + [n for n in GPU_FALLBACK if n not in order]
