"""kda: the fused KDA (Kimi Delta Attention) decode step for inference servers.

Public API:

* :func:`kda_decode` — one step, configuration derived from the tensors each call.
* :class:`KdaDecode` — built once for a :class:`KdaConfig`, called every step.
* :class:`KdaConfig`, :class:`KdaArgs` — static configuration and per-step tensors.
* :mod:`kda.registry` — backends: ``status()``, ``resolve()``, names in ``CHOICES``;
  ``python3 -m kda`` prints a table of which run here.
* :mod:`kda.reference` — the PyTorch reference that defines the numerics.
* :mod:`kda.testing` — random inputs for a configuration (``make_case``), comparison helpers.
* ``$KDA_BACKEND`` picks the backend; servers built on absl get ``--kda_backend`` by
  importing :mod:`kda.flags`.
"""

import os as _os
import sys as _sys
import types as _types


def _backends_beside() -> None:
    """In a source checkout (or a Bazel runfiles tree) the backend packages live beside this
    one, in ``backends/``; an installed distribution puts them inside it (``kda/backends``,
    see pyproject.toml). Here the former is made importable as ``kda.backends``."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    beside = _os.path.join(_os.path.dirname(here), "backends")
    if "kda.backends" in _sys.modules or _os.path.isdir(_os.path.join(here, "backends")) \
            or not _os.path.isdir(beside):
        return
    pkg = _types.ModuleType("kda.backends", "The backends, one package each (backends/).")
    pkg.__path__ = [beside]
    pkg.__package__ = "kda.backends"
    _sys.modules["kda.backends"] = pkg
    globals()["backends"] = pkg


_backends_beside()

from kda import registry  # noqa: E402
from kda.config import GATE_RANK, HEAD_DIM, KdaArgs, KdaConfig  # noqa: E402
from kda.errors import KdaArgumentError, KdaBackendError  # noqa: E402
from kda.op import KdaDecode, kda_decode  # noqa: E402
from kda.registry import CHOICES  # noqa: E402

__all__ = ["kda_decode", "KdaDecode", "KdaConfig", "KdaArgs", "KdaArgumentError",
           "KdaBackendError", "CHOICES", "HEAD_DIM", "GATE_RANK", "registry"]
__version__ = "0.1.0"
