"""The PyTorch reference as a backend (CPU and GPU): the numerics every other backend matches."""

from kda.backends.reference.backend import BACKEND

__all__ = ["BACKEND"]
