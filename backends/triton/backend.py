"""Registry entry for the Triton backend.

Modules: :mod:`~kda.backends.triton.common` (device helpers shared by both kernels),
:mod:`~kda.backends.triton.kda_decode` (the per-item kernel and its builds),
:mod:`~kda.backends.triton.kda_decode_chunked` (the chunked kernel and its builds),
:mod:`~kda.backends.triton.policy` (which build runs a batch), :mod:`~kda.backends.triton.auto`
(the step function), :mod:`~kda.backends.triton.offline` (compilation without a GPU). This
module imports none of them until a step function is built.
"""

from __future__ import annotations

import os
from typing import List, Optional

import torch

from kda.backend import Backend, StepFn
from kda.config import KdaConfig

#: Largest T the kernel serves (the contract's; the gate tile pads tokens to 16 rows and the
#: RMSNorm epilogue tile to 8).
MAX_T = 8


def interpreter_enabled() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``; "true", "yes" and "on"
    count too). The one place that reads ``TRITON_INTERPRET``; it imports no Triton."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


#: Triton releases whose CPU interpreter cannot run the kernels: 3.9's gives a bool mask formed
#: with a scalar (``tensor & live``, a scalar mask) int32 data and refuses it ("mask has
#: unsupported dtype"); 3.6-3.8 run them (the ``dev`` extra pins 3.6.0). The compiled GPU
#: kernels are unaffected.
INTERPRETER_REFUSED = ((3, 9),)


def interpreter_refusal(version: str) -> Optional[str]:
    """Why Triton ``version``'s CPU interpreter cannot run the kernels, or None."""
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return None
    if major_minor in INTERPRETER_REFUSED:
        return (f"Triton {version}'s CPU interpreter (TRITON_INTERPRET=1) rejects the kernels' "
                "masks (\"mask has unsupported dtype\"); the interpreter runs them with Triton "
                "3.6-3.8 (pip install \"triton<3.9\"; the dev extra pins 3.6.0)")
    return None


class TritonBackend(Backend):
    """The whole decode step in one Triton kernel launch, the build chosen per call by
    :mod:`kda.backends.triton.policy`.

    On a CUDA device (compute capability >= 8.0: bf16 tensor-core dots) it runs compiled;
    with ``TRITON_INTERPRET=1`` it runs on CPU tensors in Triton's interpreter (tests only).
    """

    name = "triton"
    description = "Triton, one fused launch per step (CUDA; CPU via TRITON_INTERPRET=1)"

    @property
    def device_types(self) -> tuple:  # type: ignore[override]
        return ("cpu",) if interpreter_enabled() else ("cuda",)

    def probe(self) -> Optional[str]:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any failure means unavailable
            return f"triton not importable: {type(e).__name__}: {e}"
        if interpreter_enabled():
            return interpreter_refusal(triton.__version__)
        try:
            if not torch.cuda.is_available():
                return "no CUDA device (set TRITON_INTERPRET=1 to run Triton's CPU interpreter)"
        except Exception as e:  # noqa: BLE001
            return f"CUDA unusable: {type(e).__name__}: {e}"
        return None

    def unsupported(self, cfg: KdaConfig, device: torch.device) -> List[str]:
        reasons = super().unsupported(cfg, device)
        if cfg.T > MAX_T:
            reasons.append(f"triton serves T <= {MAX_T}, got T={cfg.T}")
        if device.type == "cuda" and not interpreter_enabled():
            try:
                major, minor = torch.cuda.get_device_capability(device)
                if major < 8:
                    reasons.append(f"triton needs compute capability >= 8.0 (bf16 MMA), "
                                   f"got {major}.{minor}")
            except Exception as e:  # noqa: BLE001
                reasons.append(f"cannot query {device}: {type(e).__name__}: {e}")
        return reasons

    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        from kda.backends.triton.auto import AutoStep
        return AutoStep(cfg, device)


BACKEND = TritonBackend()
