"""The ``cuda`` backend: the streamed fused decode kernel in CUDA C++ (sm_90a).

The kernel (``kda_decode.cu``) is compiled on first use by :mod:`kda.backends.cuda.build` and
cached on disk (``$KDA_CACHE_DIR``, see build.py); ``python3 -m kda.backends.cuda.build``
compiles it ahead of time. Each step is one launch with programmatic dependent launch on the
persistent grid; the per-T choices (the static share of the item schedule, the f_b staging
build) come from :mod:`kda.backends.cuda.policy`.
"""

from __future__ import annotations

import shutil
from typing import List, Optional

import torch

from kda.backend import Backend, StepFn, StreamBuffers, gpu_reason, kernel_config_reasons
from kda.backends.cuda.policy import policy
from kda.config import KdaArgs, KdaConfig

#: Tokens per request the kernel is built for (one build per T).
MAX_T = 8


class CudaBackend(Backend):
    """The ``cuda`` backend: the CUDA C++ extension (``kda_decode.cu``) for sm_90 GPUs.

    Available when torch sees an sm_90 GPU and the extension is built or nvcc can build it
    (:mod:`kda.backends.cuda.build`). Serves T <= :data:`MAX_T` (8, the kernel's instantiations)
    and every other axis of the contract (fp32 and bf16 state pools, both layouts, gates,
    gate_mode, bias, records, any head count and window).
    """

    name = "cuda"
    description = ("CUDA C++ streamed kernel for sm_90a: persistent CTAs, cp.async-prefetched "
                   "state pages, mma.sync gate projection, PDL")
    device_types = ("cuda",)

    def probe(self) -> Optional[str]:
        why = gpu_reason(lambda cc: cc == (9, 0),
                         "an sm_90 GPU (H100 / H200); the kernel is built for sm_90a")
        if why is None:
            from torch.utils import cpp_extension

            from kda.backends.cuda import build

            built = build._built_library(build.cache_dir(), build.module_name()) is not None
            if not built and shutil.which("nvcc") is None and cpp_extension.CUDA_HOME is None:
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
        """The step function for ``cfg`` on ``device``: ``step(args)`` launches the kernel on
        the current CUDA stream with ``args`` (a :class:`kda.config.KdaArgs`, validated) and
        returns nothing; it writes ``out``, ``state``, ``conv_state`` and the records in place
        and never synchronizes.

        The step keeps the item schedule's counter pair (two int32, zero between launches) per
        CUDA stream (:class:`kda.backend.StreamBuffers`): launches on different streams never
        share one; graphs captured on one stream share that stream's pair, so two of them must
        not be replayed at the same time.

        Raises:
          KeyError: ``cfg.T`` has no kernel build (T > MAX_T; :meth:`unsupported` says so).
        """
        from kda.backends.cuda import build

        ext = build.load()
        pol = policy(cfg.T, cfg.state_dtype == torch.bfloat16)
        lb = None if cfg.lower_bound is None else float(cfg.lower_bound)
        conf = (cfg.num_heads, cfg.T, float(cfg.scale), float(cfg.norm_eps), lb, cfg.gate_mode,
                cfg.record, cfg.beta_activated)
        counters = StreamBuffers(torch.device(device), torch.int32, True,
                                 "the item schedule's counters", min_elems=2)
        launch = ext.step

        def step(a: KdaArgs) -> None:
            launch(*a, *conf, counters.get(2), pol.static_fraction, pol.fb_smem)

        step.counters = counters   # for tests
        return step


BACKEND = CudaBackend()
