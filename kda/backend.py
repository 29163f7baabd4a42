"""What every backend implements: availability, per-config support, and a built step function.

A backend lives in ``backends/<name>/`` and exposes one object ``BACKEND`` (or, for a package
holding two kernels, ``BACKENDS``) of a :class:`Backend` subclass. The registry
(:mod:`kda.registry`) imports them lazily, so a backend whose dependencies are missing costs
nothing and reports why through :meth:`Backend.availability`.
"""

from __future__ import annotations

import abc
from typing import Callable, List, Optional, Tuple

import torch

from kda.config import KdaArgs, KdaConfig

#: A built step: reads the validated args and writes out / state / conv_state / records.
StepFn = Callable[[KdaArgs], None]


class Backend(abc.ABC):
    """One implementation of the fused decode step.

    Subclasses set :attr:`name` and :attr:`description` and implement :meth:`probe`,
    :meth:`build` and, where they restrict configurations, :meth:`unsupported`.
    """

    #: Registry name, e.g. "triton".
    name: str = ""
    #: One line for the README's backend table and for logs.
    description: str = ""
    #: Devices this backend runs on ("cpu", "cuda").
    device_types: tuple = ("cuda",)

    @abc.abstractmethod
    def probe(self) -> Optional[str]:
        """None when the backend can run in this process, else the reason it cannot.

        Called once (by :meth:`availability`, which caches it and turns an exception into a
        reason), so it may import heavy modules and query devices.
        """

    def availability(self) -> Optional[str]:
        """:meth:`probe`'s answer, computed once; never raises."""
        cached = self.__dict__.get("_availability_cache")
        if cached is None:
            try:
                why = self.probe()
            except Exception as e:  # noqa: BLE001 - availability must not raise
                why = f"{self.name} availability check failed: {type(e).__name__}: {e}"
            cached = self.__dict__["_availability_cache"] = (why,)
        return cached[0]

    def unsupported(self, cfg: KdaConfig, device: torch.device) -> List[str]:
        """Reasons this backend cannot serve ``cfg`` on ``device``; empty when it can."""
        reasons = []
        if device.type not in self.device_types:
            reasons.append(f"{self.name} runs on {'/'.join(self.device_types)}, "
                           f"tensors are on {device.type}")
        return reasons

    @abc.abstractmethod
    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        """Return the step function for ``cfg`` (compiling or loading it once).

        Called only after :meth:`availability` is None and :meth:`unsupported` is empty.
        The returned function must not synchronize with the host, read device-side values on
        the host, or allocate per call beyond what the caching allocator serves (CUDA graphs).
        """


def gpu_reason(accept: Callable[[Tuple[int, int]], bool], need: str) -> Optional[str]:
    """None when torch sees a CUDA device whose compute capability ``accept`` takes, else why not.

    Args:
      accept: predicate on a (major, minor) capability, e.g. ``lambda cc: cc >= (9, 0)``.
      need: what the backend needs, for the message (e.g. "an sm_90 GPU (H100 / H200)").
    """
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not any(accept(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())):
        return f"needs {need}"
    return None
