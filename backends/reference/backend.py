"""Registry entry for the PyTorch reference (:mod:`kda.reference`)."""

from __future__ import annotations

from typing import Optional

import torch

from kda.backend import Backend, StepFn
from kda.config import KdaArgs, KdaConfig
from kda.reference import reference_step


class ReferenceBackend(Backend):
    """The contract in PyTorch, vectorized over items; runs wherever torch runs."""

    name = "reference"
    description = "PyTorch reference (defines the numerics; CPU and GPU; slow)"
    device_types = ("cpu", "cuda")

    def probe(self) -> Optional[str]:
        return None

    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        def step(args: KdaArgs) -> None:
            reference_step(cfg, args)
        return step


BACKEND = ReferenceBackend()
