"""Thin PTX wrappers used by the CuTe DSL KDA kernels (imported only once CuTe DSL is loaded):
what the kernels need spelled out and CuTe DSL does not give them.

* the contract's explicit roundings: ``mul.rn`` / ``add.rn`` / ``sub.rn`` / ``fma.rn``
  (:func:`fmul`, :func:`fadd`, :func:`fsub`, :func:`ffma`: no compiler-chosen contraction
  can make two kernels of the family differ), bf16 rounding (:func:`bf16_round`), the
  approximate ``ex2`` / ``rcp`` / ``rsqrt`` and the functions built on them (:func:`fexp`,
  :func:`sigmoid`, :func:`softplus`);
* the fixed-order warp sums (:func:`warp_sum`, :func:`row_sum8`);
* L2 cache hints (a bulk copy marked evict-last, ``applypriority``, ``prefetch``).

Each helper emits one ``llvm.inline_asm``; memory operations carry a memory clobber and are
marked as having side effects, so LLVM neither reorders them across barriers nor drops them.
Pure helpers are side-effect free so LLVM may schedule them. Global addresses are
``cute.Pointer`` values in the gmem address space (converted to 64-bit integers).
"""

from __future__ import annotations

from typing import Sequence

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm


def _operand(v):
    """(ir.Value, constraint) for one asm input."""
    if isinstance(v, bool):
        v = Int32(int(v))
    elif isinstance(v, int):
        v = Int32(v)
    elif isinstance(v, float):
        v = Float32(v)
    if isinstance(v, cute.Pointer):
        return Int64(v.toint()).ir_value(), "l"
    if isinstance(v, Boolean):
        return Int32(v).ir_value(), "r"
    if isinstance(v, Float32):
        return v.ir_value(), "f"
    if isinstance(v, Int64):
        return v.ir_value(), "l"
    if isinstance(v, cutlass.Numeric) and v.width == 32:
        return Int32(v).ir_value(), "r"
    raise TypeError(f"unsupported inline-asm operand {type(v).__name__}")


def _out_constraint(t, early: bool) -> str:
    c = "=&" if early else "="
    if t is Float32:
        return c + "f"
    if t is Int64:
        return c + "l"
    return c + "r"


def asm(ptx: str, outs: Sequence[type] = (), ins: Sequence = (), memory: bool = False,
        early: bool = False):
    """Emit ``ptx`` as inline assembly; outputs are $0.., inputs follow.

    Args:
      ptx: the PTX text with ``$N`` operand references.
      outs: DSL types of the outputs (Float32, Int32 or Int64).
      ins: input values (DSL numerics, Python numbers, Booleans, gmem Pointers).
      memory: the asm reads or writes memory (adds a memory clobber and side effects).
      early: outputs are written before every input is read (early-clobber constraints,
        so no output shares a register with an input).

    Returns:
      None, one value, or a tuple of values (one per output).
    """
    vals, cons = [], [_out_constraint(t, early) for t in outs]
    for v in ins:
        iv, c = _operand(v)
        vals.append(iv)
        cons.append(c)
    constraint = ",".join(cons + (["~{memory}"] if memory else []))
    if not outs:
        res_type = None
    elif len(outs) == 1:
        res_type = outs[0].mlir_type
    else:
        res_type = llvm.StructType.get_literal([t.mlir_type for t in outs])
    res = llvm.inline_asm(res_type, vals, ptx, constraint,
                          has_side_effects=memory or not outs,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    if not outs:
        return None
    if len(outs) == 1:
        return outs[0](res)
    return tuple(t(llvm.extractvalue(t.mlir_type, res, [i])) for i, t in enumerate(outs))


# ------------------------------------------------------------------------- L2 cache hints
def bulk_g2s_evict_last(sptr, gptr, nbytes: int, mbar):
    """``cp.async.bulk`` of ``nbytes`` from ``gptr`` to the shared pointer ``sptr`` on the
    mbarrier ``mbar``, its lines marked L2 evict-last (CuTe's bulk-copy atom emits no cache
    hint)."""
    asm("{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
        "[$0], [$1], $2, [$3], pol; }", [],
        [Int32(sptr.toint()), gptr, Int32(nbytes), Int32(mbar.toint())], memory=True)


def l2_evict_normal_256(gptr):
    """Return the L2 lines of the 256 bytes at ``gptr`` (two or three 128-byte lines) to the
    normal eviction priority (``applypriority``)."""
    asm("{ .reg .b64 a, e; .reg .pred p; and.b64 a, $0, -128; add.s64 e, $0, 255; "
        "and.b64 e, e, -128; applypriority.global.L2::evict_normal [a], 128; "
        "add.s64 a, a, 128; applypriority.global.L2::evict_normal [a], 128; "
        "add.s64 a, a, 128; setp.le.u64 p, a, e; @p applypriority.global.L2::evict_normal [a], 128; }",
        [], [gptr], memory=True)


def prefetch_l2_evict_last(gptr):
    """Bring the line of ``gptr`` into L2 marked evict-last."""
    asm("prefetch.global.L2::evict_last [$0];", [], [gptr])


def l2_evict_normal_line(gptr):
    """Return the L2 line of ``gptr`` to the normal eviction priority."""
    asm("{ .reg .b64 a; and.b64 a, $0, -128; applypriority.global.L2::evict_normal [a], 128; }",
        [], [gptr], memory=True)


def prefetch_l2(gptr):
    """Bring the line of ``gptr`` into L2 (no register, no scoreboard: a later load hits L2)."""
    asm("prefetch.global.L2 [$0];", [], [gptr])


# ------------------------------------------------------------------------------------ math
def f32_bits(x):
    """The raw bits of an fp32 (Int32)."""
    return asm("mov.b32 $0, $1;", [Int32], [x])


def bf16_round(x):
    """bf16(x) (round to nearest even) as an fp32 value."""
    return asm("{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.f32.bf16 $0, h; }", [Float32], [x])


def fmul(a, b):
    """a*b rounded once (never contracted into an FMA)."""
    return asm("mul.rn.f32 $0, $1, $2;", [Float32], [a, b])


def fadd(a, b):
    """a+b rounded once (never contracted)."""
    return asm("add.rn.f32 $0, $1, $2;", [Float32], [a, b])


def fsub(a, b):
    """a-b rounded once."""
    return asm("sub.rn.f32 $0, $1, $2;", [Float32], [a, b])


def ffma(a, b, c):
    """fma(a, b, c), one rounding."""
    return asm("fma.rn.f32 $0, $1, $2, $3;", [Float32], [a, b, c])


def ex2(x):
    """2^x (ex2.approx.ftz)."""
    return asm("ex2.approx.ftz.f32 $0, $1;", [Float32], [x])


def rcp(x):
    """1/x (rcp.approx.ftz)."""
    return asm("rcp.approx.ftz.f32 $0, $1;", [Float32], [x])


def rsqrt(x):
    """1/sqrt(x) (rsqrt.approx.ftz)."""
    return asm("rsqrt.approx.ftz.f32 $0, $1;", [Float32], [x])


_LOG2E = 1.4426950408889634


def fexp(x):
    """exp(x) = 2^(x*log2 e) (approximate)."""
    return ex2(fmul(x, Float32(_LOG2E)))


def sigmoid(x):
    """1 / (1 + exp(-x)) (approximate)."""
    return rcp(fadd(Float32(1.0), fexp(fsub(Float32(0.0), x))))


def softplus(x):
    """x for x > 20, else log1p(exp(x)) (the contract's threshold).

    exp is the approximate ex2 path; log1p is the precise libdevice-style expansion (a
    lg2.approx of 1 + e loses all relative accuracy when e is tiny, i.e. for x < -10).
    """
    sp = cute.math.log1p(fexp(x))
    return asm("{ .reg .pred p; setp.gt.f32 p, $1, 0f41A00000; selp.f32 $0, $1, $2, p; }",
               [Float32], [x, sp])


def shfl_xor(x, m):
    """The value of lane ``lane ^ m`` (full-warp butterfly shuffle)."""
    return asm("shfl.sync.bfly.b32 $0, $1, $2, 31, -1;", [Float32], [x, Int32(m)])


def warp_sum(x):
    """Butterfly sum over the 32 lanes (fixed order; every lane gets the same bits)."""
    for m in (16, 8, 4, 2, 1):
        x = fadd(x, shfl_xor(x, m))
    return x


def row_sum8(acc):
    """A state row's dot product from its 8 lanes' two partials each: p0 + p1, then the row's
    8 consecutive lanes (xor 1, 2, 4), so all 8 hold the same bits."""
    x = fadd(acc[0], acc[1])
    x = fadd(x, shfl_xor(x, 1))
    x = fadd(x, shfl_xor(x, 2))
    return fadd(x, shfl_xor(x, 4))


