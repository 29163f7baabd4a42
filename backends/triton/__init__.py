"""The Triton backend of the fused KDA decode step: one Triton launch per step.

Importing this package needs neither Triton nor a GPU (the kernel modules are imported when a
step function is built). ``BACKEND`` is registered in :mod:`kda.registry` as ``"triton"``.
"""

from kda.backends.triton.backend import BACKEND

__all__ = ["BACKEND"]
