"""The ``--kda_backend`` absl flag, defined once for any program that imports :mod:`kda`.

Servers built on absl get the flag for free; others use the ``KDA_BACKEND`` environment
variable or the ``backend=`` argument. The flag wins over the variable (see
:mod:`kda.registry`).
"""

from __future__ import annotations

from typing import Optional

from absl import flags

from kda.registry import CHOICES

FLAGS = flags.FLAGS

if "kda_backend" not in FLAGS:
    flags.DEFINE_enum(
        "kda_backend", None, list(CHOICES),
        "Backend of the fused KDA decode step (default: $KDA_BACKEND, else auto).")


def flag_value() -> Optional[str]:
    """The flag's value when it was given on a parsed command line, else None."""
    if not FLAGS.is_parsed():
        return None
    return FLAGS["kda_backend"].value
