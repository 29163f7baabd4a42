"""How ``auto`` orders the backends for a configuration and a batch size: a table from
measurements.

On a CUDA device the order comes from :data:`MEASURED`, derived from
``docs/results/2026-11-29-h200-0145d86/bench-h200.json`` (NVIDIA H200, H=32, softplus gate, SD
conv layout, all requests live, 8 GiB pool, CUDA graphs of 8 steps): for each measured T and
batch size R in {1, 8, 32, 128, 512}, the GPU backends ranked by median step time. A call
uses the row of the nearest measured T and, within it, of the measured R nearest to its own
batch size on a log scale (ties: the smaller R). In that run the one-CTA-per-item
``cutedsl_wide`` was fastest at R <= 8 and the persistent ``cuda`` kernel at R >= 32, at
every T (at R=512 T=1 by 5.5%: 609.5 against 644.9 us). Backends a row does not rank follow
in the fixed order :data:`GPU_FALLBACK`; the registry skips whichever is unavailable or
cannot serve the configuration. ``tests/kda/test_auto.py`` recomputes every row from the
JSON, so the table cannot drift from its measurement.

So under ``auto`` the kernel that runs can depend on the batch size; backends agree with the
reference within the contract's tolerances but not bit for bit with each other, so a request's
results can differ in the last bits between batch sizes. Pin a backend (``backend=``,
``--kda_backend``, ``$KDA_BACKEND``) where that matters.

On the CPU only the reference runs at a useful speed (the Triton interpreter is for tests),
so ``auto`` picks it.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from kda.backend import Backend, StepFn
from kda.config import KdaArgs, KdaConfig

#: The measurement the table comes from.
SOURCE = "docs/results/2026-11-29-h200-0145d86/bench-h200.json"
_WIDE_FIRST = ("cutedsl_wide", "cutedsl", "cuda", "triton")
#: T -> R -> our backends, fastest first (median step time at H=32).
MEASURED: Dict[int, Dict[int, Tuple[str, ...]]] = {
    1: {1: ("cutedsl_wide", "cutedsl", "triton", "cuda"),
        8: ("cutedsl_wide", "cuda", "cutedsl", "triton"),
        32: ("cuda", "cutedsl", "cutedsl_wide", "triton"),
        128: ("cuda", "cutedsl_wide", "cutedsl", "triton"),
        512: ("cuda", "cutedsl", "triton", "cutedsl_wide")},
    2: {1: _WIDE_FIRST,
        8: ("cutedsl_wide", "cuda", "cutedsl", "triton"),
        32: ("cuda", "cutedsl_wide", "cutedsl", "triton"),
        128: ("cuda", "cutedsl_wide", "cutedsl", "triton"),
        512: ("cuda", "cutedsl_wide", "triton", "cutedsl")},
    5: {1: _WIDE_FIRST,
        8: ("cutedsl_wide", "cuda", "cutedsl", "triton"),
        32: ("cuda", "cutedsl_wide", "cutedsl", "triton"),
        128: ("cuda", "cutedsl_wide", "cutedsl", "triton"),
        512: ("cuda", "cutedsl_wide", "cutedsl", "triton")},
}
#: Fixed fallback order on a CUDA device for backends the table does not rank.
GPU_FALLBACK = ("cuda", "cutedsl", "cutedsl_wide", "triton", "reference")
#: Order on the CPU.
CPU_ORDER = ("reference",)


def _nearest(values, x: float, log: bool) -> int:
    key = (lambda v: (abs(math.log(v) - math.log(x)), v)) if log else (lambda v: (abs(v - x), v))
    return min(values, key=key)


def auto_order(cfg: KdaConfig, device: torch.device, batch: Optional[int] = None) -> List[str]:
    """Backend names to try, best first, for ``cfg`` on ``device`` at ``batch`` requests.

    Args:
      cfg: the configuration (its T picks the row: the nearest measured T).
      device: a CPU device gets :data:`CPU_ORDER`.
      batch: the number of requests R (>= 1); None = the table's largest measured R.

    Returns:
      Every backend name once (on a CUDA device), the ranked ones first.
    """
    if device.type != "cuda":
        return list(CPU_ORDER)
    rows = MEASURED[_nearest(MEASURED, cfg.T, log=False)]
    r = max(rows) if batch is None else _nearest(rows, max(int(batch), 1), log=True)
    order = list(rows[r])
    return order + [n for n in GPU_FALLBACK if n not in order]


def batch_sizes(cfg: KdaConfig) -> List[int]:
    """The measured batch sizes of ``cfg``'s row (ascending): :func:`auto_order` changes only
    at the geometric midpoints between them."""
    return sorted(MEASURED[_nearest(MEASURED, cfg.T, log=False)])


class BatchAuto(Backend):
    """``auto`` when its choice differs between batch sizes: the step it builds holds the
    step of every backend chosen for some measured R and runs, per call, the one chosen for
    the measured R nearest to the call's (as :func:`auto_order`). The choice reads only the
    host-side shape ``state_indices.shape[0]``, so a CUDA graph captured at one batch size
    replays the kernel chosen for it; every candidate is built (compiled) when ``auto`` is
    built, never during a call.

    Args:
      picks: measured R -> the backend (already checked to serve the configuration).
    """

    name = "auto"
    device_types = ("cuda",)

    def __init__(self, picks: Dict[int, Backend]):
        self.picks = dict(sorted(picks.items()))
        self.description = "by batch size: " + ", ".join(
            f"R~{r}: {b.name}" for r, b in self.picks.items())

    def probe(self) -> Optional[str]:
        return None

    def backend_for(self, batch: int) -> str:
        """The backend name a call with ``batch`` requests runs."""
        return self.picks[_nearest(self.picks, max(int(batch), 1), log=True)].name

    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        built: Dict[str, StepFn] = {}
        for b in self.picks.values():
            if b.name not in built:
                built[b.name] = b.build(cfg, device)
        by_batch: Dict[int, StepFn] = {}

        def step(args: KdaArgs) -> None:
            R = args.state_indices.shape[0]
            fn = by_batch.get(R)
            if fn is None:
                fn = by_batch[R] = built[self.backend_for(R)]
            fn(args)

        step.backend_for = self.backend_for   # for tools and tests
        step.steps = built
        return step
