"""How ``auto`` orders the backends for a configuration and a batch size: a table from
measurements.

On a CUDA device the order comes from :data:`MEASURED`, the ranking (:func:`rank`) by median
step time of the GPU backends in the runs :data:`SOURCE` (NVIDIA H200, their H=32 cells,
softplus gate, SD conv layout, all requests live, CUDA graphs of rotating slot sets in a pool
much larger than L2) for each state pool dtype, measured T and batch size R. A call uses its state dtype's
table, the row of the nearest measured T and,
within it, of the measured R nearest (on a log scale; ties: the smaller R) to its own work in
the table's units, ``R * H / 32`` (the kernels scale with the R*H items, and the table was
measured at H=32). Backends a row does not rank follow in the fixed order
:data:`GPU_FALLBACK`; the registry skips whichever is unavailable or cannot serve the
configuration. ``tests/kda/test_auto.py`` recomputes every row from :data:`SOURCE`, so the
table cannot drift from its measurement.

So under ``auto`` the kernel that runs can depend on the batch size. ``cutedsl`` and
``cutedsl_wide`` are bit-identical, the others agree with the reference within the
contract's tolerances but not bit for bit with each other, so a request's results can differ
in the last bits between batch sizes. Pin a backend (``backend=``, ``--kda_backend``,
``$KDA_BACKEND``) where that matters.

On the CPU only the reference runs at a useful speed (the Triton interpreter is for tests),
so ``auto`` picks it.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from kda.backend import Backend, StepFn
from kda.config import KdaArgs, KdaConfig
from kda.errors import KdaBackendError

#: The measurements the tables come from, per state pool dtype: the reference run's JSON files.
SOURCE = {
    "fp32": ("docs/results/2026-12-03-h200/bench-h200-fp32.json",),
    "bf16": ("docs/results/2026-12-03-h200/bench-h200-bf16.json",),
}
#: state dtype -> T -> R -> our backends, fastest first (median step time at H=32).
MEASURED: Dict[str, Dict[int, Dict[int, Tuple[str, ...]]]] = {
    "fp32": {
        1: {1: ("cutedsl", "cutedsl_wide", "triton", "cuda"),
            8: ("cutedsl", "cutedsl_wide", "cuda", "triton"),
            32: ("cutedsl", "cuda", "cutedsl_wide", "triton"),
            128: ("cutedsl", "cuda", "cutedsl_wide", "triton"),
            512: ("cutedsl", "cuda", "cutedsl_wide", "triton")},
        4: {1: ("cutedsl", "cutedsl_wide", "cuda", "triton"),
            8: ("cutedsl", "cutedsl_wide", "cuda", "triton"),
            32: ("cutedsl", "cuda", "cutedsl_wide", "triton"),
            128: ("cutedsl", "cutedsl_wide", "cuda", "triton"),
            512: ("cutedsl", "cutedsl_wide", "cuda", "triton")},
    },
    "bf16": {
        1: {1: ("cutedsl", "cutedsl_wide", "triton", "cuda"),
            8: ("cutedsl", "cutedsl_wide", "triton", "cuda"),
            32: ("cutedsl", "triton", "cutedsl_wide", "cuda"),
            128: ("cutedsl", "triton", "cuda", "cutedsl_wide"),
            512: ("cutedsl", "triton", "cuda", "cutedsl_wide")},
        4: {1: ("cutedsl", "cutedsl_wide", "cuda", "triton"),
            8: ("cutedsl", "cutedsl_wide", "cuda", "triton"),
            32: ("cutedsl", "cutedsl_wide", "triton", "cuda"),
            128: ("cutedsl", "cuda", "cutedsl_wide", "triton"),
            512: ("cutedsl", "cuda", "cutedsl_wide", "triton")},
    },
}


def rank(times: Dict[str, float]) -> Tuple[str, ...]:
    """Backend names of one measured cell, fastest first (``times``: name -> step time), with
    ``cutedsl`` moved into ``cutedsl_wide``'s place where that was faster: ``cutedsl`` runs the
    wide kernel itself wherever its policy measured it faster, by items and head count
    (``tests/kda/test_auto.py`` checks that it does so in every such cell of :data:`SOURCE`),
    while a table measured at one H that named ``cutedsl_wide`` would give it to every H."""
    order = sorted(times, key=times.get)
    if {"cutedsl", "cutedsl_wide"} <= set(order):
        i, j = order.index("cutedsl_wide"), order.index("cutedsl")
        if i < j:
            order.insert(i, order.pop(j))
    return tuple(order)


#: Heads of the measurement: a call's batch counts as ``R * H / TABLE_HEADS`` requests.
TABLE_HEADS = 32
#: Fixed fallback order on a CUDA device for backends the table does not rank.
GPU_FALLBACK = ("cuda", "cutedsl", "cutedsl_wide", "triton", "reference")
#: Order on the CPU.
CPU_ORDER = ("reference",)


def _nearest(values, x: float, log: bool) -> int:
    key = (lambda v: (abs(math.log(v) - math.log(x)), v)) if log else (lambda v: (abs(v - x), v))
    return min(values, key=key)


def state_key(cfg: KdaConfig) -> str:
    """The table of ``cfg``'s state pool dtype: "fp32" or "bf16"."""
    return "bf16" if cfg.state_dtype == torch.bfloat16 else "fp32"


def _row(cfg: KdaConfig) -> Dict[int, Tuple[str, ...]]:
    table = MEASURED[state_key(cfg)]
    return table[_nearest(table, cfg.T, log=False)]


def table_batch(cfg: KdaConfig, batch: int) -> int:
    """The measured R whose ranking a call with ``batch`` requests of ``cfg`` uses."""
    work = max(int(batch), 1) * cfg.num_heads / TABLE_HEADS
    return _nearest(_row(cfg), work, log=True)


def auto_order(cfg: KdaConfig, device: torch.device, batch: Optional[int] = None) -> List[str]:
    """Backend names to try, best first, for ``cfg`` on ``device`` at ``batch`` requests.

    Args:
      cfg: the configuration (its T picks the row: the nearest measured T; with its H the
        batch is scaled to the table's H, see :func:`table_batch`).
      device: a CPU device gets :data:`CPU_ORDER`.
      batch: the number of requests R (>= 1); None = the table's largest measured R.

    Returns:
      Every backend name once (on a CUDA device), the ranked ones first.
    """
    if device.type != "cuda":
        return list(CPU_ORDER)
    return table_order(cfg, max(_row(cfg)) if batch is None else table_batch(cfg, batch))


def table_order(cfg: KdaConfig, table_r: int) -> List[str]:
    """Every GPU backend name once, best first, at the measured R ``table_r`` (table units,
    one of :func:`batch_sizes`) of ``cfg``'s row."""
    order = list(_row(cfg)[table_r])
    return order + [n for n in GPU_FALLBACK if n not in order]


def plan(cfg: KdaConfig, device: torch.device) -> Dict[Optional[int], List[str]]:
    """Every order ``auto`` may need for ``cfg`` on ``device``: on a CUDA device measured R
    (table units) -> :func:`table_order`; on the CPU ``{None: CPU_ORDER}``."""
    if device.type != "cuda":
        return {None: list(CPU_ORDER)}
    return {r: table_order(cfg, r) for r in batch_sizes(cfg)}


def _last_batch(cfg: KdaConfig, table_r: int) -> int:
    """The largest batch size whose :func:`table_batch` is at most ``table_r``."""
    lo, hi = 1, 1 << 30
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if table_batch(cfg, mid) <= table_r:
            lo = mid
        else:
            hi = mid - 1
    return lo


def batch_sizes(cfg: KdaConfig) -> List[int]:
    """The measured batch sizes of ``cfg``'s row (ascending), in the table's units."""
    return sorted(_row(cfg))


class BatchAuto(Backend):
    """``auto`` when its first choice differs between batch sizes: the step it builds holds
    the step of the backend chosen for every measured R and runs, per call, the one chosen
    for the call's batch (:func:`table_batch`). The choice reads only the host-side shape
    ``state_indices.shape[0]``, so a CUDA graph captured at one batch size replays the kernel
    chosen for it; every chosen backend is built (compiled) when ``auto`` is built, never
    during a call, through the same step cache as explicit choices (``build``, :func:`kda.registry.step_fn`).
    A candidate whose build fails is logged and skipped: that R falls back to the next
    candidate of its order.

    Args:
      cfg: the configuration the candidates were checked for.
      candidates: measured R -> the backends that can serve ``cfg`` here, best first.
      build: builds (or returns the cached) step of a candidate
        (:func:`kda.registry.step_fn`).

    Raises (build):
      KdaBackendError: no candidate of some measured R builds (chained to the last error).
    """

    name = "auto"
    device_types = ("cuda",)

    def __init__(self, cfg: KdaConfig, candidates: Dict[int, List[Backend]],
                 build: Callable[[Backend, KdaConfig, torch.device], StepFn]):
        self.cfg = cfg
        self._build = build
        self.candidates = {r: list(c) for r, c in sorted(candidates.items())}
        segments = []   # [first choice, last batch size it serves (None: every larger)]
        rows = list(self.candidates)
        for i, r in enumerate(rows):
            last = _last_batch(cfg, r) if i + 1 < len(rows) else None
            if segments and segments[-1][0] == self.candidates[r][0].name:
                segments[-1][1] = last
            else:
                segments.append([self.candidates[r][0].name, last])
        self.description = "by batch size: " + ", ".join(
            f"{n} for R <= {last}" if last is not None else f"{n} above"
            for n, last in segments)
        #: distinguishes plans in the step cache (kda.op), which is keyed by it
        self.cache_key = ("auto",) + tuple((r, tuple(b.name for b in c))
                                           for r, c in self.candidates.items())

    def probe(self) -> Optional[str]:
        return None

    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        steps: Dict[str, StepFn] = {}
        failed: Dict[str, BaseException] = {}
        chosen: Dict[int, str] = {}
        for r, cands in self.candidates.items():
            for b in cands:
                if b.name in failed:
                    continue
                if b.name not in steps:
                    try:
                        steps[b.name] = self._build(b, cfg, device)
                    except Exception as e:  # noqa: BLE001 - any build failure: next candidate
                        failed[b.name] = e
                        logging.getLogger("kda").warning("KDA auto: backend %s failed to build for %s on %s "
                                        "(%s: %s); batches ~%d use the next candidate", b.name,
                                        cfg.short(), device, type(e).__name__, e, r)
                        continue
                chosen[r] = b.name
                break
            else:
                last = next(reversed(failed.values()), None)
                raise KdaBackendError(
                    f"auto: no KDA backend builds for {cfg.short()} on {device} at table batch "
                    f"{r}: " + "; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in failed.items())
                ) from last
        by_batch: Dict[int, StepFn] = {}

        def backend_for(batch: int) -> str:
            return chosen[table_batch(cfg, batch)]

        def step(args: KdaArgs) -> None:
            R = args.state_indices.shape[0]
            fn = by_batch.get(R)
            if fn is None:
                fn = by_batch[R] = steps[backend_for(R)]
            fn(args)

        step.backend_for = backend_for   # for KdaDecode.backend_for, tools and tests
        step.steps = steps
        return step
