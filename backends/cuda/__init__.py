"""CUDA C++ backend (sm_90a) of the fused KDA decode step; see backend.py and kda_decode.cu."""

from kda.backends.cuda.backend import BACKEND

__all__ = ["BACKEND"]
