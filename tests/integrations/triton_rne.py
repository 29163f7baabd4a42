"""Round-to-nearest-even fp32 -> bf16 casts in Triton's CPU interpreter, for the engine tests.

Triton's interpreter casts fp32 to bf16 by truncation, where Triton on a GPU rounds to
nearest even; an engine's own Triton kernels run in the interpreter then round their bf16
results toward zero. Under :func:`rne_casts` that one cast rounds to nearest even, as on a GPU.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton.language as tl


@contextlib.contextmanager
def rne_casts():
    """Patch the interpreter's fp32 -> bf16 cast to round to nearest even; restore on exit."""
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    truncating = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            a = np.ascontiguousarray(src.data, dtype=np.float32)
            b = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(b.reshape(a.shape), dst_type.scalar)
        return truncating(self, src, dst_type)

    builder.cast_impl = cast_impl
    try:
        yield
    finally:
        builder.cast_impl = truncating
