"""The ``--kda_backend`` absl flag, for servers built on absl: importing this module defines it
(once per process) and makes the registry read it.

``import kda`` does not import this module (nor absl): a server that wants the flag imports
``kda.flags``; others use the ``KDA_BACKEND`` environment variable or the ``backend=``
argument. The flag, when given, wins over the variable (see :mod:`kda.registry`).
"""

from __future__ import annotations

from typing import Optional

from absl import flags

from kda.registry import CHOICES, set_flag_source

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


set_flag_source(flag_value)
