"""The forget gate of the CuTe DSL family's tensor-core kernels (``split``, ``stream``): the
low-rank projection of one 16-feature tile on ``mma.sync`` and the decay, in one order for
both, so that their decays are the same bits.

Contract (``docs/contract.md``, the gate): per token t and feature f, ``rg = bf16(sum_k
f_b[h*128 + f, k] * f_a[t, k])`` (gate_mode 0: one fp32 chain over the 128 k in order; 1:
four chains of 32, summed ((c0 + c1) + c2) + c3), ``x = rg + dt_bias[h*128 + f]``, ``g =
lower_bound * sigmoid(exp(A_log[h]) * x)`` (bounded gate) or ``-exp(A_log[h]) * softplus(x)``
(softplus gate), ``alpha = exp(g)``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import warp

from kda.backends.cutedsl import ptx as N
from kda.backends.cutedsl.problem import Problem


def gate_mma(lane):
    """The gate's warp MMA (bf16 x bf16 -> fp32, 16x8x16) and lane ``lane``'s slice of it."""
    mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
    return mma, mma.get_slice(lane)


def smem_fragment(mma, lane, rows: cute.Tensor, operand: str):
    """The lane's A (``operand`` "A": 16 f_b rows) or B ("B": 8 f_a token rows) fragment of
    ``rows`` in shared memory ([rows, 128] bf16, 16-byte aligned rows), loaded with
    ``ldmatrix``: the registers :meth:`make_fragment_A` / ``_B`` of ``thr.partition_A`` /
    ``_B`` would hold, in 4 (A) or 2 (B) matrices per instruction instead of one 4-byte
    load per register pair."""
    if cutlass.const_expr(operand == "A"):
        rF = mma.make_fragment_A(mma.get_slice(lane).partition_A(rows))
        tiled = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), BFloat16), mma)
    else:
        rF = mma.make_fragment_B(mma.get_slice(lane).partition_B(rows))
        tiled = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 2), BFloat16), mma)
    thr_copy = tiled.get_slice(lane)
    cute.copy(tiled, thr_copy.partition_S(rows), thr_copy.retile(rF))
    return rF


@cute.jit
def gate_tile(pb: cutlass.Constexpr, mma, thr, rA: cute.Tensor, rB: cute.Tensor,
              emit: cutlass.Constexpr, columns: cutlass.Constexpr = 0):
    """One 16-feature tile: A = ``rA`` (the fragment of 16 f_b rows), B = ``rB`` (the f_a
    fragment of up to 8 rows: an item's tokens, or at T = 1 up to 8 items of one head, one
    per column); for each of this lane's accumulator values ``i`` whose column ``t`` is below
    ``columns`` (0: T), ``emit(i, f16, t, rg)`` with ``f16`` the feature within the tile and
    ``rg`` the bf16-rounded projection (as fp32). Each column's result is its own dot
    products: the other columns' rows do not enter it."""
    chains = 1 if pb.gate_mode == 0 else 4
    acc = [mma.make_fragment_C(mma.partition_shape_C((16, 8))) for _ in range(chains)]
    for q in cutlass.range_constexpr(chains):
        acc[q].fill(0.0)
    for s in cutlass.range_constexpr(cute.size(rA, mode=[2])):
        q = 0 if pb.gate_mode == 0 else s // 2
        cute.gemm(mma, acc[q], rA[None, None, s], rB[None, None, s], acc[q])
    cC = thr.partition_C(cute.make_identity_tensor((16, 8)))
    for i in cutlass.range_constexpr(cute.size(acc[0])):
        f16, t = cC[i]
        if t < (columns if columns else pb.T):
            cval = acc[0][i]
            if cutlass.const_expr(pb.gate_mode == 1):
                cval = N.fadd(N.fadd(N.fadd(acc[0][i], acc[1][i]), acc[2][i]), acc[3][i])
            emit(i, f16, t, N.bf16_round(cval))


def decay(pb: Problem, A, lb, xg):
    """alpha = exp(g) of gate input ``xg`` (fp32), ``A`` = exp(A_log[h]), ``lb`` the lower
    bound (bounded gate only)."""
    if pb.bounded:
        gk = N.fmul(lb, N.sigmoid(N.fmul(A, xg)))
    else:
        gk = N.fmul(N.fsub(Float32(0.0), A), N.softplus(xg))
    return N.fexp(gk)
