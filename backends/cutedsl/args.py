"""The runtime arguments of every CuTe DSL kernel of the family, as one record.

:class:`KernelArgs` is what each kernel's device function takes (CuTe DSL passes a
``NamedTuple`` of pointers and scalars as its flattened fields), and :class:`Launch` holds the
one host entry every kernel shares: ``launch`` takes the arguments positionally in
:data:`kda.backends.cutedsl.cache.POINTER_ARGS` then :data:`~kda.backends.cutedsl.cache.SCALAR_ARGS`
order (the launcher's packed call), builds the record and hands it to the kernel's
``_launch``.
"""

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64


class KernelArgs(NamedTuple):
    """Pointers to the step's tensors (:class:`kda.config.KdaArgs` order), then the scalars:
    R requests; the state pool's slots; the row pitches (elements) of x, f_a, beta,
    output_gate and out; the slot strides (elements) of the state pool and the conv cache;
    scale, norm_eps and lower_bound (fp32); ctas, the streamed kernel's persistent grid."""
    x: cute.Pointer
    cw: cute.Pointer
    cb: cute.Pointer
    cs: cute.Pointer
    fa: cute.Pointer
    fb: cute.Pointer
    beta: cute.Pointer
    alog: cute.Pointer
    dtb: cute.Pointer
    state: cute.Pointer
    si: cute.Pointer
    og: cute.Pointer
    nw: cute.Pointer
    na: cute.Pointer
    vrec: cute.Pointer
    kgrec: cute.Pointer
    out: cute.Pointer
    R: Int32
    slots: Int32
    x_rs: Int32
    fa_rs: Int32
    beta_rs: Int32
    og_rs: Int32
    out_rs: Int32
    state_ss: Int64
    cs_ss: Int64
    scale: Float32
    eps: Float32
    lb: Float32
    ctas: Int32


class Launch:
    """The host entry of a kernel class, which defines ``_launch(a, stream)``."""

    @cute.jit
    def launch(self, x: cute.Pointer, cw: cute.Pointer, cb: cute.Pointer, cs: cute.Pointer,
               fa: cute.Pointer, fb: cute.Pointer, beta: cute.Pointer, alog: cute.Pointer,
               dtb: cute.Pointer, state: cute.Pointer, si: cute.Pointer, og: cute.Pointer,
               nw: cute.Pointer, na: cute.Pointer, vrec: cute.Pointer, kgrec: cute.Pointer,
               out: cute.Pointer, R: Int32, slots: Int32, x_rs: Int32, fa_rs: Int32,
               beta_rs: Int32, og_rs: Int32, out_rs: Int32, state_ss: Int64, cs_ss: Int64,
               scale: Float32, eps: Float32, lb: Float32, ctas: Int32, stream: cuda.CUstream):
        """Host entry (what gets compiled): the kernel on ``stream``."""
        # by name: a swap of two same-typed values here would pass every type check
        self._launch(KernelArgs(
            x=x, cw=cw, cb=cb, cs=cs, fa=fa, fb=fb, beta=beta, alog=alog, dtb=dtb, state=state,
            si=si, og=og, nw=nw, na=na, vrec=vrec, kgrec=kgrec, out=out, R=R, slots=slots,
            x_rs=x_rs, fa_rs=fa_rs, beta_rs=beta_rs, og_rs=og_rs, out_rs=out_rs,
            state_ss=state_ss, cs_ss=cs_ss, scale=scale, eps=eps, lb=lb, ctas=ctas), stream)
