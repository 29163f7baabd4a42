"""The ``cuda`` backend: the streamed fused decode kernel in CUDA C++ (sm_90a).

The kernel (``kda_decode.cu``) is compiled on first use by :mod:`kda.backends.cuda.build` and
cached on disk; ``python3 -m kda.backends.cuda.build`` compiles it ahead of time.

Environment:
  KDA_CUDA_PDL=0   launch without programmatic dependent launch (default: on).
  KDA_CUDA_PREFETCH=d   L2-prefetch item n+d's state page during item n (d in 2..8; 0 = off,
                   the default PREFETCH_DISTANCE; see the design note of kda_decode.cu). Only
                   under the static schedule (KDA_CUDA_SCHEDULE=static); ignored otherwise.
  KDA_CUDA_ITEMS_PER_CTA=k   at most k items per CTA: ceil(R*H / k) CTAs, never fewer than
                   the resident ones (0 = persistent grid; default by T: ITEMS_PER_CTA). With
                   the dynamic schedule the CTAs that start late still walk their static
                   ranges after the counter has run out, which lengthens the tail.
  KDA_CUDA_SCHEDULE=dynamic|static   how CTAs get their items (default by T: SCHEDULE):
                   dynamic = each CTA takes its next item from an atomic counter pair that
                   the built step keeps per CUDA stream (kda.backend.StreamBuffers: launches
                   on different streams never share one; graphs captured on one stream share
                   that stream's pair, so do not replay two of them at the same time; a
                   stream first used during capture takes a pair zeroed by an eager step);
                   static = contiguous ranges fixed at launch.
  KDA_CUDA_STATIC_FRACTION=f   with the dynamic schedule: each CTA first walks a contiguous
                   range of floor(f * items / CTAs) items, then takes items from the counter
                   (f in [0, 1]; default by T: STATIC_FRACTION).
  KDA_CUDA_FB_SMEM=1|0   at T=1, stage each head's f_b rows (32 KiB) in shared memory once
                   per head instead of loading the gate MMA's fragments from L2 for every
                   item (default: FB_SMEM; no effect at T > 1, which has no such build).
  KDA_CUDA_EARLY_PARAMS=1|0   request the first item's head parameters (model weights) before
                   the kernel's griddepcontrol.wait (default: EARLY_PARAMS).
  KDA_CUDA_EARLY_TRIGGER=1|0   let a PDL successor be scheduled right after the wait instead
                   of at each CTA's end (default: EARLY_TRIGGER).
  KDA_CUDA_TRACE=1   build and load the debugging variant that writes per-CTA timestamps
                   (build.py; read by tools/bench/cuda_trace.py).
  (The KDA_CUDA_* variables are read when a step is built: kda_decode / KdaDecode keep built
  steps for the process, so a later change needs a new process or a new build().)
  KDA_CACHE_DIR    where the compiled extension is kept (see build.py).
"""

from __future__ import annotations

import os
import shutil
from typing import List, Optional

import torch

from kda.backend import (Backend, StepFn, StreamBuffers, flag_from_env, fraction_from_env,
                         gpu_reason, items_per_cta_from_env, kernel_config_reasons,
                         prefetch_distance_from_env)
from kda.config import KdaArgs, KdaConfig

#: Tokens per request the kernel is instantiated for.
MAX_T = 8

#: Default L2-prefetch distance in items (``KDA_CUDA_PREFETCH`` overrides; 0 = off). Off:
#: on the H200 (c3bcd08) distance 2 / 3 took R=128 T=1 from 0.788 to 0.655 / 0.603 of the
#: floor (the prefetched pages are evicted from L2 by the other SMs' traffic before use).
PREFETCH_DISTANCE = 0

#: Default items per CTA by T (``KDA_CUDA_ITEMS_PER_CTA`` overrides; 0 = persistent grid;
#: T not listed: 0). Persistent everywhere: on the H200 (H=32, fraction of the floor at
#: R=128 / R=512) 8 items per CTA looked better at T >= 2 in one sweep (95e0754: T=2 0.798 /
#: 0.829 against 0.780 / 0.822) and not in the next (5f303cd: T=2 0.802 / 0.832 against
#: 0.796 / 0.838, T=5 0.805 / 0.812 against 0.804 / 0.830); 1, 2 and 4 items per CTA were
#: slower at T=1 (95e0754: R=128 0.640 / 0.700 / 0.736 against 0.770).
ITEMS_PER_CTA: dict = {}

#: Default item schedule by T (``KDA_CUDA_SCHEDULE`` overrides; T not listed: "dynamic"; see
#: ``KdaParams.sched`` in kda_decode.h). On the H200 (1b62e9a, H=32, step times of one sweep,
#: dynamic against static at R = 32 / 128 / 256 / 512): T=1 0.6-0.9% slower (173.2 against
#: 172.1 us at R=128: the next item's slot row waits for the atomic, and consecutive items
#: rarely share a head), T=2 3.6-3.9% faster from R=128 (244.0 against 252.7 us), T=5 2.7-4.0%
#: faster (480.9 against 500.2 us at R=128; 1.9% at R=32). Since the eighth session dynamic at
#: T=1 too, after static ranges (STATIC_FRACTION).
SCHEDULE: dict = {}

SCHEDULES = ("dynamic", "static")

#: Default static fraction of the dynamic schedule by T (``KDA_CUDA_STATIC_FRACTION``
#: overrides; T not listed: 0, every item after a CTA's first from the counter). On the H200
#: (8155583, H=32, step times at R = 32 / 128 / 512, two repeats) T=1 with f = 0.8: 46.6 / 156.7
#: / 595.5 us against 46.4 / 162.1 / 607.8 with the static ranges (the SMs run at different
#: speeds, so equal static ranges end far apart, 525-608 us at R=512; the counter evens that
#: out) and with the head-
#: major locality (f_b staged per head) kept for most items; f = 0.9 within 0.3% of it, f = 0.6
#: 0.4-1.3% slower.
#: T=5: f = 0.8 1.3% slower than f = 0 at R=128 (475.6 against 469.5 us).
STATIC_FRACTION: dict = {1: 0.8}

#: Default of ``KDA_CUDA_FB_SMEM`` (the T=1 kernel with f_b staged in shared memory). On: on
#: the H200 (e1356bb, H=32, two interleaved pairs of sweep entries, step times at R = 32 / 128
#: / 256 / 512, T=1) 45.8 / 164.4 / 313.5 / 613.3 us against 48.9 / 171.8 / 330.1 / 649.0
#: (6.4 / 4.3 / 5.0 / 5.5% faster; the repeats agreed within 0.3%).
FB_SMEM = True

#: Defaults of ``KDA_CUDA_EARLY_PARAMS`` and ``KDA_CUDA_EARLY_TRIGGER`` (see kda_decode.h).
EARLY_PARAMS = False
EARLY_TRIGGER = False


def schedule_from_env(default: str) -> str:
    """``$KDA_CUDA_SCHEDULE`` (``dynamic`` or ``static``), else ``default``.

    Raises:
      ValueError: the variable holds anything else.
    """
    v = os.environ.get("KDA_CUDA_SCHEDULE", "").strip().lower() or default
    if v not in SCHEDULES:
        raise ValueError(f"KDA_CUDA_SCHEDULE must be one of {SCHEDULES}, got {v!r}")
    return v


def static_fraction_from_env(default: float) -> float:
    """``$KDA_CUDA_STATIC_FRACTION`` (a number in [0, 1]), else ``default``.

    Raises:
      ValueError: the variable holds anything else.
    """
    return fraction_from_env("KDA_CUDA_STATIC_FRACTION", default)


class CudaBackend(Backend):
    """The ``cuda`` backend: the CUDA C++ extension (``kda_decode.cu``) for sm_90 GPUs.

    Available when torch sees an sm_90 GPU and the extension is built or nvcc can build it
    (:mod:`kda.backends.cuda.build`). Serves T <= :data:`MAX_T` (8, the kernel's instantiations);
    every other axis of the contract (both layouts, gates, gate_mode, bias, records, any
    head count and window).
    """

    name = "cuda"
    description = ("CUDA C++ streamed kernel for sm_90a: persistent CTAs, cp.async-prefetched "
                   "state pages, mma.sync gate projection, PDL")
    device_types = ("cuda",)

    def probe(self) -> Optional[str]:
        why = gpu_reason(lambda cc: cc == (9, 0),
                         "an sm_90 GPU (H100 / H200); the kernel is built for sm_90a")
        if why is None:
            from kda.backends.cuda import build

            built = build._built_library(build.cache_dir(), build.module_name()) is not None
            if not built and shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
                why = "the extension is not built and nvcc is not on PATH"
        return why

    def unsupported(self, cfg: KdaConfig, device: torch.device) -> List[str]:
        reasons = super().unsupported(cfg, device)
        if device.type == "cuda" and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability(device)
            if cap != (9, 0):
                reasons.append(f"kernel is built for sm_90a, device is sm_{cap[0]}{cap[1]}")
        reasons += kernel_config_reasons(cfg, MAX_T)
        return reasons

    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        from kda.backends.cuda import build

        ext = build.load()
        H, T, record = cfg.num_heads, cfg.T, cfg.record
        scale, eps, lb, gm = float(cfg.scale), float(cfg.norm_eps), cfg.lower_bound, cfg.gate_mode
        lb = None if lb is None else float(lb)
        pdl = os.environ.get("KDA_CUDA_PDL", "1") != "0"
        pfd = prefetch_distance_from_env("KDA_CUDA_PREFETCH", PREFETCH_DISTANCE)
        ipc = items_per_cta_from_env("KDA_CUDA_ITEMS_PER_CTA", ITEMS_PER_CTA.get(T, 0))
        dynamic = schedule_from_env(SCHEDULE.get(T, "dynamic")) == "dynamic"
        static_fraction = static_fraction_from_env(STATIC_FRACTION.get(T, 0.0))
        if not dynamic:
            static_fraction = 0.0
        fb_smem = T == 1 and flag_from_env("KDA_CUDA_FB_SMEM", FB_SMEM)
        early_params = flag_from_env("KDA_CUDA_EARLY_PARAMS", EARLY_PARAMS)
        early_trigger = flag_from_env("KDA_CUDA_EARLY_TRIGGER", EARLY_TRIGGER)
        # the dynamic schedule's counter pairs, one per CUDA stream (zero before their first
        # launch, left at zero by every launch; never made during capture, see StreamBuffers)
        counters = (StreamBuffers(torch.device(device), torch.int32, True,
                                  "the dynamic schedule's counters", min_elems=2)
                    if dynamic else None)

        def sched() -> Optional[torch.Tensor]:
            return None if counters is None else counters.get(2)

        launch = ext.step

        def step(a: KdaArgs) -> None:
            launch(a.x, a.conv_weight, a.conv_bias, a.conv_state, a.f_a, a.f_b, a.beta, a.A_log,
                   a.dt_bias, a.state, a.state_indices, a.num_accepted_tokens, a.output_gate,
                   a.norm_weight, a.out, a.v_record, a.kg_record, H, T, scale, eps, lb, gm,
                   record, pdl, pfd, ipc, sched(), fb_smem, early_params, early_trigger,
                   step.trace, static_fraction)

        step.fb_smem = fb_smem     # for tests
        # KDA_CUDA_TRACE=1 builds: an int64 CUDA tensor the next launches write per-CTA
        # timestamps into (tools/bench/cuda_trace.py); None = none
        step.trace = None
        step.counters = counters   # the StreamBuffers, for tests (None: static)
        step.static_fraction = static_fraction
        return step


BACKEND = CudaBackend()
