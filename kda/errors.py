"""The two errors the op raises: a bad argument, or a backend that cannot serve the call."""

from __future__ import annotations


class KdaArgumentError(ValueError):
    """A decode-step argument (or configuration field) is invalid: ``KdaArgumentError(arg,
    message)``; ``arg`` names the argument, ``str()`` reads "arg: message". Raised before
    anything is written.

    (No ``__init__`` of its own: torch.compile's dynamo raises such an exception from traced
    code as it is, while one whose ``__init__`` calls ``super().__init__`` ended, under torch
    2.11, in an internal AssertionError instead; with ``fullgraph=True`` a raise while tracing
    is dynamo's "Observed exception" error, which quotes this one under torch 2.13.)
    """

    @property
    def arg(self) -> str:
        return self.args[0] if self.args else ""

    @property
    def message(self) -> str:
        return self.args[1] if len(self.args) == 2 else ""

    def __str__(self) -> str:
        return f"{self.args[0]}: {self.args[1]}" if len(self.args) == 2 else super().__str__()


class KdaBackendError(RuntimeError):
    """The requested backend does not exist, is not available, or cannot serve the call."""
