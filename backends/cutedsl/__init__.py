"""CuTe DSL backends of the fused KDA decode step: ``cutedsl`` (streamed) and ``cutedsl_wide``.

Importing this package is cheap and works without CuTe DSL or a GPU: the DSL is imported
only when a backend's availability is checked or a step is built.
"""

from kda.backends.cutedsl.backend import KdaStreamBackend, KdaWideBackend, compile_seconds

BACKENDS = (KdaStreamBackend(), KdaWideBackend())

__all__ = ["BACKENDS", "compile_seconds"]
