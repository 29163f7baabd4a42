"""kda: the fused KDA (Kimi Delta Attention) decode step for inference servers.

Public API:

* :func:`kda_decode` — one step, configuration derived from the tensors each call.
* :class:`KdaDecode` — built once for a :class:`KdaConfig`, called every step.
* :class:`KdaConfig`, :class:`KdaArgs` — static configuration and per-step tensors.
* :mod:`kda.registry` — backends: ``status()``, ``resolve()``, names in ``CHOICES``.
* :mod:`kda.reference` — the PyTorch reference that defines the numerics.
* ``--kda_backend`` (absl flag, :mod:`kda.flags`) and ``$KDA_BACKEND`` pick the backend.
"""

from kda import flags as _flags  # noqa: F401  (defines --kda_backend)
from kda.config import GATE_RANK, HEAD_DIM, KdaArgs, KdaConfig
from kda.op import KdaDecode, kda_decode
from kda.registry import CHOICES, KdaBackendError
from kda.validate import KdaArgumentError

__all__ = ["kda_decode", "KdaDecode", "KdaConfig", "KdaArgs", "KdaArgumentError",
           "KdaBackendError", "CHOICES", "HEAD_DIM", "GATE_RANK"]
__version__ = "0.1.0"
