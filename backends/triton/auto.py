"""The Triton backend's step function: per call, the build :mod:`~kda.backends.triton.policy`
chooses for the batch size, launched through its kernel's host wrapper."""

from __future__ import annotations

from typing import Dict

import torch

from kda.backends.triton import kda_decode, kda_decode_chunked, policy
from kda.backends.triton.common import interpreter_enabled, sm_count
from kda.config import KdaArgs, KdaConfig


class AutoStep:
    """The step function for one :class:`KdaConfig` (callable): ``step(args)`` launches the
    build :func:`kda.backends.triton.policy.choose` names for ``R * H`` items on this
    device's SM count, once, on the current stream, and writes in place.

    The per-item builds share one :class:`kda_decode.ItemStep` (its V-split buffers); each
    chunked build gets its :class:`kda_decode_chunked.ChunkedStep` on first use. The choice
    reads shapes only (nothing from the device), so a CUDA graph captures one build per batch
    size.

    Args (constructor):
      cfg: the static configuration (validated).
      device: the CUDA device, or the CPU under ``TRITON_INTERPRET=1`` (then 4 SMs are
        assumed, so that small batches reach every build).
    """

    def __init__(self, cfg: KdaConfig, device):
        self.cfg = cfg
        self.device = torch.device(device)
        self.num_sms = sm_count(self.device, interpreter_enabled())
        self.item = kda_decode.ItemStep(cfg, self.device)
        self._chunked: Dict[str, kda_decode_chunked.ChunkedStep] = {}

    def build_for(self, n_items: int) -> str:
        """The name of the build a batch of ``n_items`` items (R * H) runs."""
        return policy.choose(self.cfg.T, n_items, self.num_sms)

    def __call__(self, args: KdaArgs) -> None:
        R = args.state_indices.shape[0]
        if R == 0:
            return
        name = self.build_for(R * self.cfg.num_heads)
        if name in kda_decode.BUILDS:
            self.item(args, kda_decode.BUILDS[name])
            return
        step = self._chunked.get(name)
        if step is None:
            step = self._chunked[name] = kda_decode_chunked.ChunkedStep(
                self.cfg, self.device, kda_decode_chunked.BUILDS[name])
        step(args)


__all__ = ["AutoStep"]
