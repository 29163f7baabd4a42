"""The arithmetic of one item that every kernel of the family (``wide``, ``split``, ``stream``)
shares, defined once so that their bit-identity in it is structural: the conv + SiLU of a
channel (:func:`conv_silu`), the fixed-order sums and scalings of the q / k norms and of the
gated RMSNorm (:func:`quarter_sum`, :func:`inv_norm`, :func:`q_hat`, :func:`gated_rmsnorm`),
and the delta rule on state rows held in registers (:func:`token`).

A thread holds ``n`` rows of 16 key columns, ``S[m, 4c + e]`` = key column ``4*(l8 + 8c) + e``
of its row ``m`` (chunk ``c`` of lane ``l8``): the 8 lanes of a row are consecutive, so one
warp instruction moves 4 rows x 128 contiguous bytes. Per token (FP32; ``docs/contract.md``
section 2, "Recurrence"):

    S *= alpha (per key column);  u = beta * (v - S.k-hat);  S += u k-hat;  o = S.q-hat

with each row sum as two partials per lane (even / odd components, chunks in order), then the
row's 8 lanes (:func:`kda.backends.cutedsl.ptx.row_sum8`), and ``o`` rounded to bf16.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from kda.backends.cutedsl import ptx as N

D = 128


@cute.jit
def source_slot(ids, accepted, T: cutlass.Constexpr):
    """The item's source slot and window offset from its request's T slot ids ``ids`` (Int32
    values) and accepted count ``accepted`` (read at T > 1 only): ``off = clamp(accepted, 1,
    T) - 1``, ``src = ids[off]``; at T = 1 ``src = ids[0]``, ``off = 0``
    (``docs/contract.md`` section 2, "Liveness"). Returns (src, off)."""
    src = ids[0]
    off = Int32(0)
    if cutlass.const_expr(T > 1):
        a = cutlass.max(cutlass.min(accepted, Int32(T)), Int32(1))
        off = a - 1
        for t in cutlass.range_constexpr(1, T):
            # (on the clamped count itself: the compiler then compares the raw count, and
            # drops the clamp where the offset is not used)
            if a == t + 1:
                src = ids[t]
    return src, off


def is_live(src, cslot, slots, valid=None):
    """Whether an item is live: ``0 < src < slots`` and ``0 < conv slot < slots`` (and
    ``valid``, where given; ``docs/contract.md`` section 2, "Liveness")."""
    live = src > 0 if valid is None else valid & (src > 0)
    return live & (src < slots) & (cslot > 0) & (cslot < slots)


def conv_silu(seq, w, bias, T: int):
    """Conv + SiLU of one channel for the T tokens (FP32; ``docs/contract.md`` section 2,
    "Conv"): ``acc = bias; acc = fma(s[t+e], w[e], acc)`` for e = 0..3 over ``seq`` = [w0, w1,
    w2, x_0 .. x_{T-1}] (fp32 values), ``y_t = bf16(silu(acc))``. Returns the T values y_t."""
    ys = []
    for t in range(T):
        acc = bias
        for e in range(4):
            acc = N.ffma(seq[t + e], w[e], acc)
        ys.append(N.bf16_round(N.fmul(acc, N.sigmoid(acc))))
    return ys


def quarter_sum(part):
    """``((part(0) + part(1)) + part(2)) + part(3)``: a 128-thread sum from its four warps'
    sums, in warp order (``part(i)`` is evaluated in that order too)."""
    return N.fadd(N.fadd(N.fadd(part(0), part(1)), part(2)), part(3))


def inv_norm(ss):
    """``rsqrt(ss + 1e-6)``: the q / k L2 norm's inverse from the sum of squares ``ss`` (eps on
    the sum, no clamp; ``docs/contract.md`` section 2, "q, k, v")."""
    return N.rsqrt(N.fadd(ss, Float32(1e-6)))


def q_hat(q, iq, scale):
    """``(q * iq) * scale``."""
    return N.fmul(N.fmul(q, iq), scale)


def gated_rmsnorm(ob, ssum, eps, nw, og):
    """``((ob * rsqrt(ssum / 128 + eps)) * nw) * og`` in fp32 (``ssum``: the sum of ob^2 over
    the head's 128 values, ``og``: sigmoid(output gate)); the caller rounds it to bf16
    (``docs/contract.md`` section 2, "Output")."""
    rstd = N.rsqrt(N.fadd(N.fmul(ssum, Float32(1.0 / D)), eps))
    return N.fmul(N.fmul(N.fmul(ob, rstd), nw), og)


def chunk(row, l8, c):
    """The 4 key columns 4*(l8 + 8c) .. +3 of a 128-column row."""
    return cute.local_tile(row, (4,), (l8 + 8 * c,))


def load4(row, l8, c):
    """The 4 fp32 of :func:`chunk` in registers (one 16-byte load)."""
    v = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
    cute.autovec_copy(chunk(row, l8, c), v)
    return v


def store4(v, dst, bf16: bool):
    """The 4 fp32 of ``v`` into the state chunk ``dst``: 16 bytes, or (``bf16``) 8 bytes of
    values rounded once to nearest even."""
    if bf16:
        raw = cute.make_rmem_tensor(cute.make_layout((4,)), BFloat16)
        for e in range(4):
            raw[e] = BFloat16(v[e])
        cute.autovec_copy(raw, dst)
    else:
        cute.autovec_copy(v, dst)


def reg_chunk(S, m, c):
    """Chunk ``c`` of register row ``m`` of :func:`state_regs`: its 4 key columns
    ``4*(l8 + 8c)`` .. +3, the registers of :func:`chunk` of that row."""
    return cute.local_tile(S[m, None], (4,), (c,))


def state_regs(n: int):
    """Registers for ``n`` rows of a thread: ``S[m, 4c + e]``, fp32."""
    return cute.make_rmem_tensor(cute.make_layout((n, 16), stride=(16, 1)), Float32)


def _sweep(S, n, l8, x, y, update):
    """One pass over the rows, in place: ``S[m, j] = update(m, S[m, j], x[col j])``, then the
    two partial dot products of each updated row with ``y`` (even / odd components, chunks in
    order)."""
    dot = [[Float32(0.0), Float32(0.0)] for _ in range(n)]
    for c in range(4):
        x4 = load4(x, l8, c)
        y4 = load4(y, l8, c)
        for m in range(n):
            for e in range(4):
                s_ = update(m, S[m, 4 * c + e], x4[e])
                S[m, 4 * c + e] = s_
                if c == 0 and e < 2:
                    dot[m][e % 2] = N.fmul(s_, y4[e])
                else:
                    dot[m][e % 2] = N.ffma(s_, y4[e], dot[m][e % 2])
    return dot


@cute.jit
def token(S, a, k, q, beta, v_of, l8, emit, lane0_only=True):
    """One token of the delta rule on the thread's rows ``S`` (:func:`state_regs`), in place.

    Args:
      S: the rows, ``[n, 16]`` fp32 registers.
      a, k, q: the token's decay alpha, k-hat and q-hat, ``[128]`` fp32 (shared memory).
      beta: the token's beta (fp32 scalar).
      v_of: ``v_of(m)``, the value v of row ``m`` (fp32 scalar).
      l8: the thread's lane within its rows (0..7).
      emit: ``emit(m, u, ob)`` for each row in order: the row's ``u`` (the record mode's
        value) and ``o`` rounded to bf16 (fp32 holding a bf16 value).
      lane0_only: ``emit`` only on lane 0 of each row (``l8 == 0``); else on every lane (the
        row sums are butterflies: each of a row's 8 lanes holds them), for an ``emit`` of
        predicated stores.
    """
    n = cute.size(S, mode=[0])
    # S *= alpha, with S.k-hat; then S += u k-hat, with S.q-hat
    acc = _sweep(S, n, l8, a, k, lambda m, s, a_e: N.fmul(s, a_e))
    u = []
    for m in cutlass.range_constexpr(n):
        u.append(N.fmul(beta, N.fsub(v_of(m), N.row_sum8(acc[m]))))
    o = _sweep(S, n, l8, k, q, lambda m, s, k_e: N.ffma(u[m], k_e, s))
    for m in cutlass.range_constexpr(n):
        ob = N.bf16_round(N.row_sum8(o[m]))
        if cutlass.const_expr(lane0_only):
            if l8 == 0:
                emit(m, u[m], ob)
        else:
            emit(m, u[m], ob)
