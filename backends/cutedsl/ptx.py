"""Thin PTX wrappers used by the CuTe DSL KDA kernels (imported only once CuTe DSL is loaded).

The wide kernel's memory accesses go through these helpers (except the recurrence's operand
loads, CuTe copies of :mod:`kda.backends.cutedsl.item`) so that the access width (16-byte
vectors for the state page and the staged rows), the cache path (``.cg`` for data another
grid may have written, ``.nc`` for read-only operands) and predication are explicit.
Each helper emits one ``llvm.inline_asm``; memory operations carry a memory clobber and are
marked as having side effects, so LLVM neither reorders them across barriers nor drops them.
Pure helpers (tensor-core MMA, conversions) are side-effect free so LLVM may schedule them.

Operand conventions: shared-memory addresses are 32-bit ``Int32`` values (``.shared`` window),
global addresses are ``cute.Pointer`` values in the gmem address space (converted to 64-bit
integers), predicates are ``Int32`` 0/1 values (or DSL Booleans).
"""

from __future__ import annotations

from typing import Sequence

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64
from cutlass._mlir import ir
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


_PRED = "{ .reg .pred p; setp.ne.b32 p, $%d, 0; %s }"


def _pred(text: str, idx: int) -> str:
    return _PRED % (idx, text)


# ---------------------------------------------------------------------------------- shared
def sld_f32(addr):
    """One fp32 from shared memory."""
    return asm("ld.shared.f32 $0, [$1];", [Float32], [addr], memory=True)


def sld_v4(addr):
    """Four fp32 from one 16-byte shared load."""
    return asm("ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", [Float32] * 4, [addr], memory=True)


def sld_bf16x4(addr):
    """Four bf16 from one 8-byte shared load, widened to fp32 (exactly)."""
    return asm("{ .reg .b32 w0, w1; ld.shared.v2.b32 {w0, w1}, [$4]; shl.b32 $0, w0, 16; "
               "and.b32 $1, w0, 0xffff0000; shl.b32 $2, w1, 16; and.b32 $3, w1, 0xffff0000; }",
               [Float32] * 4, [addr], memory=True)


def sld_b32(addr):
    """One 32-bit word from shared memory (Int32)."""
    return asm("ld.shared.b32 $0, [$1];", [Int32], [addr], memory=True)


def sld_u16(addr):
    """A raw 16-bit element, zero-extended."""
    return asm("ld.shared.u16 $0, [$1];", [Int32], [addr], memory=True)


def sst_f32(addr, v, pred=None):
    """Store one fp32 to shared memory (where ``pred``, if given)."""
    if pred is None:
        return asm("st.shared.f32 [$0], $1;", [], [addr, v], memory=True)
    return asm(_pred("@p st.shared.f32 [$0], $1;", 2), [], [addr, v, pred], memory=True)


def sst_b32(addr, v, pred=None):
    """Store one 32-bit word to shared memory (where ``pred``, if given)."""
    if pred is None:
        return asm("st.shared.b32 [$0], $1;", [], [addr, v], memory=True)
    return asm(_pred("@p st.shared.b32 [$0], $1;", 2), [], [addr, v, pred], memory=True)


def cp_async16(saddr, gptr, pred):
    """16-byte global -> shared copy through L2 only (cp.async.cg), issued where ``pred``."""
    asm(_pred("@p cp.async.cg.shared.global [$0], [$1], 16;", 2), [], [saddr, gptr, pred],
        memory=True)


def cp_async_ca(saddr, gptr, nbytes: int, pred):
    """``nbytes`` (4 or 8, an immediate) global -> shared copy (cp.async.ca: .cg takes 16 bytes
    only), issued where ``pred``; committed and waited for as the 16-byte copies are."""
    asm(_pred("@p cp.async.ca.shared.global [$0], [$1], %d;" % nbytes, 2), [],
        [saddr, gptr, pred], memory=True)


def sst_v2_b32(addr, a, b, pred):
    """One 8-byte shared store of two 32-bit words where ``pred``."""
    asm(_pred("@p st.shared.v2.b32 [$0], {$1, $2};", 3), [], [addr, a, b, pred], memory=True)


def cp_async16_multi(sbase, gbase, offsets, pred):
    """Several 16-byte cp.async.cg from ``gbase + goff`` to ``sbase + soff`` (immediates)."""
    body = " ".join("@p cp.async.cg.shared.global [$0+%d], [$1+%d], 16;" % (so, go)
                    for so, go in offsets)
    asm(_pred(body, 2), [], [sbase, gbase, pred], memory=True)


def cp_async8_multi(sbase, gbase, offsets, pred):
    """Several 8-byte cp.async.ca (.cg takes 16 bytes only) from ``gbase + goff`` to
    ``sbase + soff`` (immediates)."""
    body = " ".join("@p cp.async.ca.shared.global [$0+%d], [$1+%d], 8;" % (so, go)
                    for so, go in offsets)
    asm(_pred(body, 2), [], [sbase, gbase, pred], memory=True)


def cp_async_commit():
    """Close the current cp.async group."""
    asm("cp.async.commit_group;", [], [], memory=True)


def cp_async_wait_group(n: int):
    """Wait until at most ``n`` of this thread's most recently committed cp.async groups are
    still pending (``n`` is an immediate)."""
    asm("cp.async.wait_group %d;" % n, [], [], memory=True)


def cp_async_wait_all():
    """Wait for every cp.async of this thread (then a barrier publishes them)."""
    asm("cp.async.wait_all;", [], [], memory=True)


# ---------------------------------------------------------------------------------- global
def gld_nc_b32(gptr):
    """Read-only (non-coherent path) 32-bit load."""
    return asm("ld.global.nc.b32 $0, [$1];", [Int32], [gptr], memory=True)


def gld_nc_b32_or0(gptr, pred):
    """Read-only 32-bit load where ``pred``, else 0."""
    return asm(_pred("mov.b32 $0, 0; @p ld.global.nc.b32 $0, [$1];", 2), [Int32], [gptr, pred],
               memory=True, early=True)


def gld_nc_u16(gptr):
    """Read-only 16-bit load, zero-extended to an Int32."""
    return asm("ld.global.nc.u16 $0, [$1];", [Int32], [gptr], memory=True)


def gld_nc_u16_or0(gptr, pred):
    """Read-only 16-bit load where ``pred``, else 0."""
    return asm(_pred("mov.b32 $0, 0; @p ld.global.nc.u16 $0, [$1];", 2), [Int32], [gptr, pred],
               memory=True, early=True)


def gld_nc_u16x2_or0(gptr, pred):
    """The 32-bit word of the two 16-bit elements at ``gptr`` (only 2-byte aligned: two
    read-only 16-bit loads, the first in the low half) where ``pred``, else 0."""
    return asm("{ .reg .pred p; .reg .b16 l, h; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; "
               "@p ld.global.nc.b16 l, [$1]; @p ld.global.nc.b16 h, [$1+2]; "
               "@p mov.b32 $0, {l, h}; }", [Int32], [gptr, pred], memory=True, early=True)


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


def gld_nc_f32(gptr):
    """Read-only fp32 load."""
    return asm("ld.global.nc.f32 $0, [$1];", [Float32], [gptr], memory=True)


def gld_nc_f32_or0(gptr, pred):
    """Read-only fp32 load where ``pred``, else 0."""
    return asm(_pred("mov.b32 $0, 0; @p ld.global.nc.f32 $0, [$1];", 2), [Float32], [gptr, pred],
               memory=True, early=True)


def gld_cg_u16_or0(gptr, pred):
    """16-bit load through L2 (data this or another grid writes), 0 where not ``pred``."""
    return asm(_pred("mov.b32 $0, 0; @p ld.global.cg.u16 $0, [$1];", 2), [Int32], [gptr, pred],
               memory=True, early=True)


def gld_cg_b32_or0(gptr, pred):
    """32-bit load through L2 where ``pred``, else 0."""
    return asm(_pred("mov.b32 $0, 0; @p ld.global.cg.b32 $0, [$1];", 2), [Int32], [gptr, pred],
               memory=True, early=True)


def gst_b16(gptr, v, pred):
    """Store the low 16 bits of ``v``."""
    asm("{ .reg .pred p; .reg .b16 h; setp.ne.b32 p, $2, 0; cvt.u16.u32 h, $1; "
        "@p st.global.b16 [$0], h; }", [], [gptr, v, pred], memory=True)


def gst_b32(gptr, v, pred):
    """Store a 32-bit word where ``pred``."""
    asm(_pred("@p st.global.b32 [$0], $1;", 2), [], [gptr, v, pred], memory=True)


def gst_f32(gptr, v, pred):
    """Store one fp32 where ``pred``."""
    asm(_pred("@p st.global.f32 [$0], $1;", 2), [], [gptr, v, pred], memory=True)


def gst_v4_f32(gptr, a, b, c, d, pred):
    """One 16-byte global store of four fp32."""
    asm(_pred("@p st.global.v4.f32 [$0], {$1, $2, $3, $4};", 5), [], [gptr, a, b, c, d, pred],
        memory=True)


def gst_v4_f32_off(gptr, off, a, b, c, d, pred):
    """16-byte global store of four fp32 at ``gptr + off`` bytes (immediate offset)."""
    asm(_pred("@p st.global.v4.f32 [$0+%d], {$1, $2, $3, $4};" % off, 5), [],
        [gptr, a, b, c, d, pred], memory=True)


def gst_bf16x4_off(gptr, off, a, b, c, d, pred):
    """8-byte global store at ``gptr + off`` bytes (immediate offset) of four fp32, each rounded
    to bf16 (nearest even), ``a`` at the lowest address."""
    asm(_pred("{ .reg .b32 w0, w1; cvt.rn.bf16x2.f32 w0, $2, $1; cvt.rn.bf16x2.f32 w1, $4, $3; "
              "@p st.global.v2.b32 [$0+%d], {w0, w1}; }" % off, 5), [],
        [gptr, a, b, c, d, pred], memory=True)


def gst_v4_zero(gptr, pred):
    """16-byte store of zeros where ``pred``."""
    asm(_pred("@p st.global.v4.b32 [$0], {0, 0, 0, 0};", 1), [], [gptr, pred], memory=True)


# ------------------------------------------------------------------------------------ math
def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A(16x16 bf16, row) * B(16x8 bf16, col) + C (fp32), mma.sync m16n8k16."""
    return asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
               [Float32] * 4, [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3])


def bf16_bits_to_f32(bits):
    """fp32 value of the bf16 whose raw bits are the low 16 bits of ``bits``."""
    return asm("shl.b32 $0, $1, 16;", [Float32], [bits])


def f32_bits(x):
    """The raw bits of an fp32 (Int32)."""
    return asm("mov.b32 $0, $1;", [Int32], [x])


def f32_from_bits(bits):
    """The fp32 whose raw bits are ``bits``."""
    return asm("mov.b32 $0, $1;", [Float32], [bits])


def bf16_round(x):
    """bf16(x) (round to nearest even) as an fp32 value."""
    return asm("{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.f32.bf16 $0, h; }", [Float32], [x])


def bf16_bits(x):
    """Raw bits of bf16(x) (round to nearest even) in the low half of an Int32."""
    return asm("{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.u32.u16 $0, h; }", [Int32], [x])


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


def lg2(x):
    """log2 x (lg2.approx.ftz)."""
    return asm("lg2.approx.ftz.f32 $0, $1;", [Float32], [x])


def rcp(x):
    """1/x (rcp.approx.ftz)."""
    return asm("rcp.approx.ftz.f32 $0, $1;", [Float32], [x])


def rsqrt(x):
    """1/sqrt(x) (rsqrt.approx.ftz)."""
    return asm("rsqrt.approx.ftz.f32 $0, $1;", [Float32], [x])


_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


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


def sel_i32(pred, a, b):
    """pred ? a : b for Int32 values."""
    return asm("{ .reg .pred p; setp.ne.b32 p, $1, 0; selp.b32 $0, $2, $3, p; }", [Int32],
               [pred, a, b])


def clamp_i32(x, lo: int, hi: int):
    """min(max(x, lo), hi) for an Int32 and static bounds."""
    return asm("{ max.s32 $0, $1, %d; min.s32 $0, $0, %d; }" % (lo, hi), [Int32], [x])


def live_flag(src, cslot, slots, valid):
    """1 if ``valid`` and 0 < src < slots and 0 < cslot < slots, else 0 (Int32)."""
    return asm("{ .reg .pred q; setp.ne.b32 q, $4, 0; setp.gt.and.s32 q, $1, 0, q; "
               "setp.lt.and.s32 q, $1, $3, q; setp.gt.and.s32 q, $2, 0, q; "
               "setp.lt.and.s32 q, $2, $3, q; selp.b32 $0, 1, 0, q; }",
               [Int32], [src, cslot, slots, valid])


def bar_sync():
    """CTA-wide barrier (bar.sync 0)."""
    asm("bar.sync 0;", [], [], memory=True)


def fence_gpu():
    """GPU-scope acquire-release fence (makes this thread's writes visible GPU-wide)."""
    asm("fence.acq_rel.gpu;", [], [], memory=True)


def griddep_wait():
    """Wait until the predecessor grid completed and its memory is visible (PDL)."""
    asm("griddepcontrol.wait;", [], [], memory=True)


def griddep_launch():
    """Allow the dependent grid to launch (PDL trigger)."""
    asm("griddepcontrol.launch_dependents;", [], [], memory=True)
