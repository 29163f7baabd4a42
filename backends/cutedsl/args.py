"""The runtime arguments of every CuTe DSL kernel of the family, defined once.

:data:`OPERANDS` are the step's tensors in :class:`kda.config.KdaArgs`' field order and names
(the launcher passes the record's tensors as they come), each with its dtype and the
alignment the kernels assume; :data:`SCALARS` the scalars after them. From these come
:class:`KernelArgs` (what every kernel takes; CuTe DSL passes a ``NamedTuple`` of pointers and
scalars as its flattened fields), the one host entry :meth:`Launch.launch` (whose flat
parameter list, which CuTe DSL's C export needs, is checked against them), the compile-time
stand-ins (:func:`compile_args`), the launcher's argument slots (:func:`arg_names`,
:data:`HOST_SCALARS`) and the tensor views the kernels index (:func:`make_views`).
"""

import inspect
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from kda.backends.cutedsl.problem import Problem
from kda.config import KdaArgs

D = 128

#: name (a :class:`kda.config.KdaArgs` field) -> (dtype, assumed alignment in bytes). dtype:
#: "bf16", "f32", "i32", or the :class:`Problem` field that decides between bf16 and fp32
#: ("cw_bf16", "cs_bf16", "nw_bf16", "state_bf16"; "beta": fp32 with ``beta_activated``, else
#: bf16). Alignment: bytes, "rows" (:attr:`Problem.row_bytes`) or "beta" (4 with
#: ``beta_activated``, else 2).
OPERANDS = {
    "x": ("bf16", "rows"), "conv_weight": ("cw_bf16", 4), "conv_bias": ("f32", 4),
    "conv_state": ("cs_bf16", 16), "f_a": ("bf16", "rows"), "f_b": ("bf16", 4),
    "beta": ("beta", "beta"), "A_log": ("f32", 4), "dt_bias": ("f32", 4),
    "state": ("state_bf16", 16), "state_indices": ("i32", 4), "output_gate": ("bf16", "rows"),
    "norm_weight": ("nw_bf16", 4), "num_accepted_tokens": ("i32", 4), "v_record": ("f32", 4),
    "kg_record": ("bf16", 2), "out": ("bf16", "rows"),
}
assert tuple(OPERANDS) == KdaArgs._fields, "OPERANDS follows KdaArgs"

#: The scalars after the pointers: R requests; the state pool's slots; the row pitches
#: (elements) of x, f_a, beta, output_gate and out; the slot strides (elements) of the state
#: pool and the conv cache; scale, norm_eps and lower_bound (fp32); ctas, the streamed
#: kernels' grid (:func:`kda.backends.cutedsl.scheduler.ctas`).
SCALARS = (("R", Int32), ("slots", Int32), ("x_rs", Int32), ("fa_rs", Int32),
           ("beta_rs", Int32), ("og_rs", Int32), ("out_rs", Int32), ("state_ss", Int64),
           ("cs_ss", Int64), ("scale", Float32), ("eps", Float32), ("lb", Float32),
           ("ctas", Int32))

#: The scalars the launcher reads off a call's :class:`kda.config.KdaArgs`, by name (the
#: others: the config's runtime scalars, set once, and ``ctas``, from the scheduler).
HOST_SCALARS = {
    "R": lambda a: a.state_indices.shape[0], "slots": lambda a: a.state.shape[0],
    "x_rs": lambda a: a.x.stride(0), "fa_rs": lambda a: a.f_a.stride(0),
    "beta_rs": lambda a: a.beta.stride(0), "og_rs": lambda a: a.output_gate.stride(0),
    "out_rs": lambda a: a.out.stride(0), "state_ss": lambda a: a.state.stride(0),
    "cs_ss": lambda a: a.conv_state.stride(0),
}

#: What every kernel's device function takes.
KernelArgs = NamedTuple("KernelArgs", [(n, cute.Pointer) for n in OPERANDS] + list(SCALARS))
#: The kernels' global tensors, one per operand (:func:`make_views`).
Views = NamedTuple("Views", [(n, cute.Tensor) for n in OPERANDS])


def arg_names() -> list:
    """The launcher's argument slots, in order: :class:`KernelArgs`' fields, the CUDA stream
    last."""
    return list(KernelArgs._fields) + ["stream"]


def operand_dtype(name: str, pb: Problem):
    """The element type of operand ``name`` for ``pb``."""
    key = OPERANDS[name][0]
    if key == "beta":
        key = "f32" if pb.beta_activated else "bf16"
    elif key not in ("bf16", "f32", "i32"):
        key = "bf16" if getattr(pb, key) else "f32"
    return {"bf16": BFloat16, "f32": Float32, "i32": Int32}[key]


def operand_align(name: str, pb: Problem) -> int:
    """The alignment (bytes) the kernels assume for operand ``name`` of ``pb``."""
    align = OPERANDS[name][1]
    if align == "rows":
        return pb.row_bytes
    if align == "beta":
        return 4 if pb.beta_activated else 2
    return align


def compile_args(pb: Problem) -> list:
    """Stand-ins for ``cute.compile``, in :func:`arg_names` order: null pointers with the
    alignments the kernel assumes (the row tensors' from ``pb.row_bytes``: a launch passes
    them only on rows that have it), scalars of their types, a stream."""
    from cutlass.cute.runtime import make_ptr

    ptrs = [make_ptr(operand_dtype(n, pb), 0, cute.AddressSpace.gmem,
                     assumed_align=min(operand_align(n, pb), 16)) for n in OPERANDS]
    scalars = [typ(1.0) if typ is Float32 else typ(1) for _, typ in SCALARS]
    return [*ptrs, *scalars, cuda.CUstream(0)]


class Launch:
    """The host entry of a kernel class, which defines ``_launch(a, stream)``."""

    @cute.jit
    def launch(self, x: cute.Pointer, conv_weight: cute.Pointer, conv_bias: cute.Pointer,
               conv_state: cute.Pointer, f_a: cute.Pointer, f_b: cute.Pointer,
               beta: cute.Pointer, A_log: cute.Pointer, dt_bias: cute.Pointer,
               state: cute.Pointer, state_indices: cute.Pointer, output_gate: cute.Pointer,
               norm_weight: cute.Pointer, num_accepted_tokens: cute.Pointer,
               v_record: cute.Pointer, kg_record: cute.Pointer, out: cute.Pointer, R: Int32,
               slots: Int32, x_rs: Int32, fa_rs: Int32, beta_rs: Int32, og_rs: Int32,
               out_rs: Int32, state_ss: Int64, cs_ss: Int64, scale: Float32, eps: Float32,
               lb: Float32, ctas: Int32, stream: cuda.CUstream):
        """Host entry (what gets compiled): the kernel on ``stream``. Its parameters are
        :func:`arg_names`, flat (the compile cache's C export takes no record; checked
        below), gathered into the :class:`KernelArgs` the kernels take."""
        a = locals()
        self._launch(KernelArgs(*[a[n] for n in KernelArgs._fields]), stream)


assert list(inspect.signature(Launch.launch).parameters)[1:] == arg_names(), \
    "Launch.launch takes the arguments of OPERANDS and SCALARS, in order"


def make_views(pb: Problem, a: KernelArgs) -> Views:
    """The kernels' global tensors over the argument pointers of ``a``, for ``pb``: every
    kernel of the family indexes its arguments through these layouts."""
    R, slots = a.R, a.slots
    T, H, dim = pb.T, pb.H, pb.H * D
    L = pb.L
    N_ = R * T
    v = {}
    if pb.row_bytes > 2:
        # every row pitch is a multiple of the rows' alignment (kda.backend.row_bytes)
        x_rs, fa_rs, og_rs, out_rs = (cute.assume(s, divby=pb.row_bytes // 2)
                                      for s in (a.x_rs, a.fa_rs, a.og_rs, a.out_rs))
    else:
        x_rs, fa_rs, og_rs, out_rs = a.x_rs, a.fa_rs, a.og_rs, a.out_rs
    v["x"] = cute.make_tensor(a.x, cute.make_layout((N_, 3 * dim), stride=(x_rs, 1)))
    v["conv_weight"] = cute.make_tensor(a.conv_weight, cute.make_layout(
        (3, 4, dim), stride=(4 * dim, dim, 1)))
    v["conv_bias"] = cute.make_tensor(a.conv_bias, cute.make_layout((3 * dim,)))
    if pb.layout == "SD":
        v["conv_state"] = cute.make_tensor(a.conv_state, cute.make_layout(
            (slots, 3 * dim, L), stride=(a.cs_ss, 1, 3 * dim)))
    else:
        v["conv_state"] = cute.make_tensor(a.conv_state, cute.make_layout(
            (slots, 3 * dim, L), stride=(a.cs_ss, L, 1)))
    v["f_a"] = cute.make_tensor(a.f_a, cute.make_layout((N_, D), stride=(fa_rs, 1)))
    v["f_b"] = cute.make_tensor(a.f_b, cute.make_layout((dim, D), stride=(D, 1)))
    v["beta"] = cute.make_tensor(a.beta, cute.make_layout((N_, H), stride=(a.beta_rs, 1)))
    v["A_log"] = cute.make_tensor(a.A_log, cute.make_layout((H,)))
    v["dt_bias"] = cute.make_tensor(a.dt_bias, cute.make_layout((dim,)))
    # (the slot stride is a multiple of 16 bytes)
    v["state"] = cute.make_tensor(a.state, cute.make_layout(
        (slots, H, D, D), stride=(cute.assume(a.state_ss, divby=8 if pb.state_bf16 else 4),
                                  D * D, D, 1)))
    v["state_indices"] = cute.make_tensor(a.state_indices, cute.make_layout((R, T),
                                                                           stride=(T, 1)))
    v["output_gate"] = cute.make_tensor(a.output_gate, cute.make_layout((N_, dim),
                                                                       stride=(og_rs, 1)))
    v["norm_weight"] = cute.make_tensor(a.norm_weight, cute.make_layout((D,)))
    v["num_accepted_tokens"] = cute.make_tensor(a.num_accepted_tokens, cute.make_layout((R,)))
    # record rows: 64-bit slot offsets (slots * H * T * 256 can pass 2**31)
    v["v_record"] = cute.make_tensor(a.v_record, cute.make_layout(
        (slots, H, T, D), stride=(Int64(H * T * D), T * D, D, 1)))
    v["kg_record"] = cute.make_tensor(a.kg_record, cute.make_layout(
        (slots, H, T, 2 * D), stride=(Int64(H * T * 2 * D), T * 2 * D, 2 * D, 1)))
    v["out"] = cute.make_tensor(a.out, cute.make_layout((N_, dim), stride=(out_rs, 1)))
    return Views(**v)
