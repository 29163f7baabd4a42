"""CuTe DSL backends of the fused KDA decode step: ``cutedsl`` (the kernel by load) and
``cutedsl_wide`` (one CTA per item).

Importing this package is cheap and works without CuTe DSL or a GPU: the DSL is imported
only when a backend's availability is checked or a step is built.
"""

from kda.backends.cutedsl.backend import KdaBackend, KdaWideBackend, compile_seconds

BACKENDS = (KdaBackend(), KdaWideBackend())

__all__ = ["BACKENDS", "compile_seconds"]
