"""The fused KDA decode step as ONE Triton kernel launch, and its host wrapper.

Contract: ``docs/contract.md`` (section 2 formulas, section 3 rounding points) plus the project's
decisions (liveness, per-token state writes, record rows, window rewrite, 64-bit slot offsets).

Work decomposition
------------------
One *item* is one (request r, head h), numbered ``item = r * H + h``. A *work unit* is one
item, or, with V-row splitting (``NV > 1``), one block of ``BV = 128 / NV`` value rows of an
item: ``work = item * NV + vb``. Every work unit recomputes the cheap per-item part (conv of
the q and k channels, L2 norms, the gate projection, decay, beta) and owns the rows
``vb*BV .. vb*BV+BV-1`` of the 128x128 fp32 state page, of ``u`` and of ``o``.

Per work unit (all of it runs with ``live``-masked loads and stores, no data-dependent branch;
a dead item's loads are masked off, so it costs no bandwidth):

1. slots: T=1 ``src = conv_slot = state_indices[r]``, ``off = 0``; T>1 ``a = clamp(nacc[r], 1, T)``,
   ``src = state_indices[r, a-1]``, ``conv_slot = state_indices[r, 0]``, ``off = a-1``. The item
   is live iff ``0 < src < slots`` and ``0 < conv_slot < slots``; slot offsets are int64.
2. the gate projection ``rg = bf16(f_a @ f_b_h^T)`` with ``tl.dot`` on bf16 operands and fp32
   accumulation, in four 32-wide K slices; the token dimension of f_a is padded to 16 rows with
   masked loads (tl.dot needs M >= 16). gate_mode 0 chains the accumulator through the slices
   (one chain of MMA k16 steps); gate_mode 1 starts every slice from a zero and adds them
   ((c0 + c1) + c2) + c3 (the zero is opaque to the compiler, which would otherwise fold
   ``acc + dot(a, b, 0)`` into ``dot(a, b, acc)``). The T gate rows are parked, as bf16, in
   the item's own out rows and read back per token: that cuts the MMA layout of the dot's
   result off from the state tile (Triton prefers MMA layouts when layouts meet, and the
   64 KiB page would go through shared memory into it). Each out row is overwritten with the
   result later; barriers order every read of a row before its write.
3. the state rows, 16-byte loads along the key dimension (the page is contiguous per slot; a
   row is 512 bytes) with ``evict_first``; then a CTA barrier, so that no thread's state write
   (T>1: a token's write slot may be ``src``) can land before another thread's read.
4. per token t (a runtime loop, T <= 8): the conv + SiLU on [num_warps, 128] tiles (rows q, k, v and
   padding: the state tile's own layout, 4 values per thread) with fma taps over the sequence
   [w0, w1, w2, x_0, ..] (operands reloaded per token from L1/L2 rather than held in
   registers); y rounded to bf16; q/k L2 norm (eps 1e-6 on the sum of squares); decay from
   the gate row; beta; the recurrence on the block's rows; the state write (T=1: to ``src``;
   T>1: to ``state_indices[r, t]`` when that slot is valid; record mode: none, records
   instead); ``o`` rounded to bf16 and parked in out row t (V-split: in the scratch).
5. the gated RMSNorm of all T rows as one [T, 128] tile (each value computed once; in the
   state's row layout every value would be recomputed by the 32 lanes of a warp).
6. the conv window rewrite: ``new[0] = w1, new[1] = w2, new[2+t] = x_t`` for the item's 3x128
   channels. It reloads w1, w2, then a CTA barrier, then stores: every read of the old window
   by any thread of the CTA happens before any write.

Registers: with 8 warps the page is 64 floats per thread; ``maxnreg=128`` (the ``item``
default) lets two CTAs share an SM, so one CTA's page loads overlap the other's math. The
offline compile (:func:`compile_offline`, checked by the backend's tests) reports 128
registers and no spill at T=1, a few spilled values (<= ~128 bytes of stack) for T >= 2;
the kernel is ~2k SASS instructions whatever T (the token loop is not unrolled).

V-row splitting and the window race
-----------------------------------
With ``NV > 1`` blocks per item, every block reads the q/k window history, and the gated
RMSNorm needs all 128 values of ``o``. Blocks of one grid have no ordering, so a block that
rewrote the window could do so before a sibling read it (the read and write ranges overlap),
and no single block sees all of ``o``. The kernel therefore uses a "last arriver" protocol,
which never waits on another block (no spin, no deadlock whatever the scheduling order):
each block writes its bf16-rounded ``o`` rows to a scratch buffer, then (CTA barrier, one
``atomic_add`` with acq_rel semantics at GPU scope on the item's counter) announces that it
has finished reading. The block that observes the counter reach a multiple of NV minus one is
the last one: by then every sibling's window reads and scratch writes happened before their
release, so it alone computes the RMSNorm for all 128 rows (reading ``o`` from scratch in a
fixed order: bit-repeatable), writes the item's ``out`` rows, and rewrites the window; then
it puts the item's counter back to zero, so every launch starts from zero whatever NV the
step's previous launch used (``auto`` picks NV per batch size: without the reset a launch at
NV=2 left live items' counters at 2 mod 4, and a following NV=4 launch took the second block
to arrive for the last one, finishing with half of ``o`` stale). The scratch and counters
belong to the built step function, one pair per CUDA stream it is called on
(:class:`kda.backend.StreamBuffers`: the counters are zeroed before their first launch and
never made during capture), so launches on two streams at once never share them; graphs
captured on one stream share that stream's pair (do not replay two of them at once). Dead
items: each block writes zeros to its own out rows and touches nothing else (no counter).

Variants (see :data:`VARIANTS`, selectable by name through ``build_step(cfg, device,
variant)`` or the environment variable ``KDA_TRITON_VARIANT``):

* ``item``: one program of 8 warps per item (BV = 128). 64 state floats per thread, every
  access a 16-byte vector; the grid is R*H programs, the hardware scheduler keeps ~2 CTAs per
  SM resident and overlaps one CTA's page load with another's compute.
* ``vsplit2`` / ``vsplit4``: 2 or 4 blocks of 4 warps per item (BV = 64 / 32), see above.
  Meant for R*H small next to the SM count (one item's 64 KiB page then streams through 2 or
  4 SMs instead of one); ``vsplit4`` caps registers at 96 (5 programs per SM), which also
  makes it a candidate at large batches (more, smaller programs in flight per SM).
* ``item_nocap`` / ``item_w16`` / ``item_w16_r64`` / ``item_noevict``: no register cap
  (1 CTA/SM); 16 warps (32 state floats per thread) with 128 registers (1 CTA/SM) or 64
  (2 CTAs/SM, a few spilled values); no L2 eviction hints.
* ``persistent``: a grid of ``2 * SMs`` programs looping over work units with ``tl.range``.
  (Triton 3.6's software pipeliner leaves this loop alone -- no async copies in the TTGIR with
  ``num_stages=2`` -- because each item's addresses depend on its slot ids loaded in the same
  iteration; the variant is there to measure the cost of the grid alone.)
* ``chunked`` (and ``chunked_bv16`` / ``chunked_s3`` / ``chunked_nocap``): another kernel,
  :mod:`kda.backends.triton.kda_decode_chunked`: one 4-warp program per item walking the page in
  32-row chunks (a software-pipelined loop: the next chunk is prefetched with async copies),
  <= 88 registers (5 CTAs per SM).
* ``auto`` (the default, :class:`AutoStep`): when R*H is at least the SM count, a build of
  the ``chunked`` kernel chosen by T and batch size (:data:`AUTO_CHUNKED`: 2-warp programs
  on 16-row chunks, 3 stages at T=1; at T >= 2 2 stages from 4 items per SM, the 4-warp
  builds below that (32-row at T=2, 16-row at T >= 3), and 4-warp 16-row programs for
  T >= 3 from 64 items per SM; the measurements are next to the table); below that ``vsplit4`` / ``vsplit2`` when R*H is at most a quarter / half of the SM count,
  else ``item``. Why: on the H200 (2026-11-29, commit 700474b, H=32) ``item`` measured 0.49 /
  0.50 / 0.36 of the copy-bandwidth floor at R=128 T=1 / R=512 T=1 / R=128 T=5 and every
  V-split and 16-warp variant was slower at R >= 8; the ``chunked`` kernel is the
  decomposition of fla-core's recurrence kernel (0.79 at R=128 T=1), see its module. The
  small-batch choice is the earlier prediction; ``docs/results`` has the measurements
  (``python3 -m tools.bench.bench --backends=triton --triton_variants=...``).

Numerics: the same rounding points as the reference (y, rg, o, out in bf16; everything else
fp32). On the GPU the transcendental functions are Triton's fast ones (the contract allows
approximate transcendentals). Under ``TRITON_INTERPRET=1`` (CPU) the kernel selects, through
the ``INTERP`` constexpr, emulations that match the reference's definitions: bf16 loads are
converted to fp32 at once, the fma is emulated in float64 (exact product, one rounding), the
gate projection sums each 16-wide K step exactly (float64) and rounds it to fp32 before
chaining (a tensor-core k16 step, as the reference models it), and bf16 rounding is done with
integer round-to-nearest-even on the fp32 bits (the interpreter's own fp32->bf16 conversion
does not carry into the exponent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, Dict, List, Optional

import torch
import triton
import triton.language as tl

from kda.backend import StreamBuffers
from kda.config import GATE_RANK, HEAD_DIM, L2_NORM_EPS, KdaArgs, KdaConfig

D = HEAD_DIM
assert L2_NORM_EPS == 1e-6  # written as a literal in the kernel (a JIT function reads no globals)
#: Name of the environment variable that selects the variant of :func:`build_step`.
VARIANT_ENV = "KDA_TRITON_VARIANT"


def interpreter_quiet(interp: bool):
    """A context for one launch: under the interpreter (``interp``), numpy's overflow /
    invalid-value warnings are off. The interpreter also computes the masked-off lanes of a
    block, whose values (other=, poisoned buffers) can overflow; those lanes are never
    stored, and the tests compare every written element (NaN never passes), so the warnings
    only alarm. On the GPU: nothing."""
    if not interp:
        return contextlib.nullcontext()
    import numpy as np
    return np.errstate(over="ignore", invalid="ignore")


def interpreter_enabled() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _bf16_round(x, INTERP: tl.constexpr):
    """Round fp32 ``x`` to the nearest bf16 (ties to even) and return it as fp32."""
    if INTERP:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _fma(a, b, c, INTERP: tl.constexpr):
    """fma(a, b, c) in fp32 (one rounding)."""
    if INTERP:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _rowoff(n, stride):
    """``n * stride`` (scalar or 1-D) with the alignment KdaArgs guarantees: every row stride
    of x, f_a, output_gate and out is a multiple of 8 elements (16 bytes)."""
    return tl.multiple_of(n * stride, 8)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _load_f32(ptrs, mask):
    """Load and convert to fp32 right away (the interpreter gets bf16 arithmetic wrong)."""
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _decay(g, A, lower_bound, BOUNDED: tl.constexpr):
    """The decay ``alpha = exp(gk)`` of the gate ``g = rg + dt_bias`` (any shape), with
    ``gk = lower_bound * sigmoid(A * g)`` (bounded gate) or ``-A * softplus(g)``."""
    if BOUNDED:
        gk = lower_bound * _sigmoid(A * g)
    else:
        # softplus(g) = g for g > 20, else log1p(exp(g)); log1p(e) = log(u) * e / (u - 1)
        # with u = 1 + e (exact where u != 1, Goldberg's identity), e itself where u == 1
        eg = tl.exp(tl.minimum(g, 20.0))
        u1 = 1.0 + eg
        log1p_e = tl.where(u1 == 1.0, eg, tl.log(u1) * (eg / (u1 - 1.0)))
        gk = -A * tl.where(g > 20.0, g, log1p_e)
    return tl.exp(gk)


@triton.jit
def _delta_rule(S, alpha, k, q, b, v):
    """One token of the recurrence on a block of value rows (V-major: row = value channel,
    column = key), in the reference's order: ``S *= alpha``; ``u = b (v - S k)``;
    ``S += u kᵀ``; ``o = S q``. ``S`` [rows, 128], ``alpha``, ``k``, ``q`` [128] (key
    dimension), ``b`` a scalar, ``v`` [rows]. Returns (S, u, o)."""
    S = S * alpha[None, :]
    Sk = tl.sum(S * k[None, :], axis=1)
    u = b * (v - Sk)
    S = S + u[:, None] * k[None, :]
    return S, u, tl.sum(S * q[None, :], axis=1)


@triton.jit
def _store_state(dst, S, mask, EVICT: tl.constexpr):
    """Store a state block: streaming (``.cs``, evict-first) with ``EVICT``, else write-back."""
    if EVICT:
        tl.store(dst, S, mask=mask, cache_modifier=".cs")
    else:
        tl.store(dst, S, mask=mask)


@triton.jit
def _gate_projection(fa_ptr, stride_fa, row0, fb_ptr, h, live, rt_zero,
                     T: tl.constexpr, GATE_MODE: tl.constexpr, INTERP: tl.constexpr):
    """rg[t, k] = bf16(sum_j f_a[row0 + t, j] * f_b[h*128 + k, j]) as a [16, 128] fp32 tile.

    Rows t >= T are zero (masked loads pad the token dimension to 16 for tl.dot).
    ``rt_zero`` is a zero the compiler cannot see through (a runtime scalar times 0.0).
    """
    tt = tl.arange(0, 16)
    kk = tl.arange(0, 128)
    rows = row0 + tt.to(tl.int64)
    rmask = (tt < T) & live
    fb_rows = fb_ptr + (h * 128 + kk).to(tl.int64) * 128
    if INTERP:
        # exact sum of each 16-wide K step (float64), rounded once to fp32, chained in fp32
        acc = tl.zeros([16, 128], dtype=tl.float32)
        chain = tl.zeros([16, 128], dtype=tl.float32)
        for c in tl.static_range(8):
            jj = c * 16 + tl.arange(0, 16)
            a = tl.load(fa_ptr + _rowoff(rows, stride_fa)[:, None] + jj[None, :],
                        mask=rmask[:, None], other=0.0).to(tl.float32).to(tl.float64)  # [t, j]
            b = tl.load(fb_rows[None, :] + jj[:, None]).to(tl.float32).to(tl.float64)  # [j, k]
            part = tl.sum(a[:, :, None] * b[None, :, :], axis=1).to(tl.float32)  # [16 t, 128 k]
            if GATE_MODE == 0:
                acc = acc + part
            else:
                if c % 2 == 0:
                    chain = part
                else:
                    acc = acc + (chain + part)
    else:
        # bf16 operands, fp32 accumulation, in 32-wide K slices (each slice is two MMA k16
        # steps). gate_mode 0 passes the accumulator along: one chain over the 8 k16 steps.
        # gate_mode 1 starts each slice from zero and adds the slices ((c0+c1)+c2)+c3; the
        # zero is a runtime value so that Triton does not fold "acc + dot(a, b, 0)" into
        # "dot(a, b, acc)" (which would turn mode 1 into mode 0's single chain).
        acc = tl.zeros([16, 128], dtype=tl.float32)
        zero = tl.zeros([16, 128], dtype=tl.float32) + rt_zero
        for c in tl.static_range(4):
            jj = c * 32 + tl.arange(0, 32)
            a = tl.load(fa_ptr + _rowoff(rows, stride_fa)[:, None] + jj[None, :],
                        mask=rmask[:, None], other=0.0)                      # [16, 32] bf16
            b = tl.load(fb_rows[None, :] + jj[:, None])                      # [32, 128] bf16
            if GATE_MODE == 0:
                acc = tl.dot(a, b, acc, out_dtype=tl.float32)
            else:
                acc = acc + tl.dot(a, b, zero, out_dtype=tl.float32)
    return _bf16_round(acc, INTERP)


@triton.jit
def _write_window(cs_base, x_ptr, stride_x, n0, h, off, do_write,
                  DIM: tl.constexpr, T: tl.constexpr, STRIDE_C: tl.constexpr,
                  STRIDE_L: tl.constexpr):
    """new[0] = w1, new[1] = w2, new[2+t] = x_t for the item's 3x128 channels.

    All old-window reads of this CTA (the caller's and this function's) precede the barrier,
    every write follows it.
    """
    pp = tl.arange(0, 4)[:, None]
    dd = tl.arange(0, 128)[None, :]
    chan = pp * DIM + h * 128 + dd                                  # [4, 128]; row 3 unused
    cmask = (pp < 3) & do_write
    cptr = cs_base + chan * STRIDE_C
    w1 = tl.load(cptr + (off + 1) * STRIDE_L, mask=cmask)
    w2 = tl.load(cptr + (off + 2) * STRIDE_L, mask=cmask)
    tl.debug_barrier()
    tl.store(cptr, w1, mask=cmask)
    tl.store(cptr + STRIDE_L, w2, mask=cmask)
    for t in tl.static_range(T):
        xv = tl.load(x_ptr + _rowoff(n0 + t, stride_x) + chan, mask=cmask)
        tl.store(cptr + (2 + t) * STRIDE_L, xv.to(cs_base.dtype.element_ty), mask=cmask)


@triton.jit
def _finish_rows(ob_ptr, ob_stride, out_ptr, stride_out, og_ptr, stride_og, nw_ptr, n0, h,
                 norm_eps, live, w_ok, T: tl.constexpr, TP: tl.constexpr, INTERP: tl.constexpr,
                 FROM_OTHER_CTAS: tl.constexpr):
    """Gated RMSNorm of the item's T rows: ``out[n0+t, h*128 + v] = bf16(ob * rsqrt(mean(ob^2)
    + eps) * norm_weight[v] * sigmoid(output_gate))``, with ``ob`` (bf16 values) read from
    ``ob_ptr + t*ob_stride + v``; zeros for a dead item.

    One [TP, 128] tile for all tokens: every value computed once per CTA (in the state's row
    layout each value would be recomputed by all 32 lanes of a warp).
    """
    t1 = tl.arange(0, TP)
    tt = t1[:, None]
    vv = tl.arange(0, 128)[None, :]
    rows = tt < T
    if FROM_OTHER_CTAS:     # written by other CTAs of this grid: read through L2, not L1
        ob = tl.load(ob_ptr + _rowoff(t1, ob_stride)[:, None] + vv, mask=rows & live, other=0.0,
                     cache_modifier=".cg").to(tl.float32)
    else:
        ob = _load_f32(ob_ptr + _rowoff(t1, ob_stride)[:, None] + vv, rows & live)
    og = _load_f32(og_ptr + _rowoff(n0 + t1, stride_og)[:, None] + h * 128 + vv, rows & live)
    nw = _load_f32(nw_ptr + vv, True)
    rn = tl.rsqrt(tl.sum(ob * ob, axis=1) * (1.0 / 128.0) + norm_eps)
    res = tl.where(live, _bf16_round(ob * rn[:, None] * nw * _sigmoid(og), INTERP), 0.0)
    tl.debug_barrier()                       # ob may live in the out rows written below
    tl.store(out_ptr + _rowoff(n0 + t1, stride_out)[:, None] + h * 128 + vv,
             res.to(tl.bfloat16), mask=rows & w_ok)


# --------------------------------------------------------------------------------------------
# the kernel
# --------------------------------------------------------------------------------------------

@triton.jit
def _kda_work(w, w_ok,
              x_ptr, stride_x, cw_ptr, cb_ptr, cs_ptr, stride_cs,
              fa_ptr, stride_fa, fb_ptr, beta_ptr, stride_beta, alog_ptr, dtb_ptr,
              st_ptr, stride_st, si_ptr, nacc_ptr, og_ptr, stride_og, nw_ptr,
              out_ptr, stride_out, vrec_ptr, kgrec_ptr, scr_ptr, ctr_ptr,
              num_slots, scale, norm_eps, lower_bound,
              H: tl.constexpr, T: tl.constexpr, L: tl.constexpr, SD: tl.constexpr,
              HAS_BIAS: tl.constexpr, BOUNDED: tl.constexpr, GATE_MODE: tl.constexpr,
              RECORD: tl.constexpr, NV: tl.constexpr, BV: tl.constexpr,
              EVICT: tl.constexpr, INTERP: tl.constexpr, PROWS: tl.constexpr):
    """One work unit: rows vb*BV.. of item ``w // NV`` (see the module docstring)."""
    DIM: tl.constexpr = H * 128
    TP: tl.constexpr = 1 if T == 1 else (2 if T == 2 else (4 if T <= 4 else 8))
    if SD:
        STRIDE_C: tl.constexpr = 1
        STRIDE_L: tl.constexpr = 3 * H * 128
    else:
        STRIDE_C: tl.constexpr = L
        STRIDE_L: tl.constexpr = 1
    item = w // NV
    vb = w % NV
    r = item // H
    h = item % H
    r64 = r.to(tl.int64)
    item64 = item.to(tl.int64)

    # ---- 1. slots and liveness ----------------------------------------------------------
    if T == 1:
        src = tl.load(si_ptr + r64, mask=w_ok, other=0)
        cslot = src
        off = 0
    else:
        a = tl.load(nacc_ptr + r64, mask=w_ok, other=1)
        a = tl.minimum(tl.maximum(a, 1), T)
        src = tl.load(si_ptr + r64 * T + (a - 1), mask=w_ok, other=0)
        cslot = tl.load(si_ptr + r64 * T, mask=w_ok, other=0)
        off = a - 1
    live = (src > 0) & (src < num_slots) & (cslot > 0) & (cslot < num_slots)
    src64 = tl.where(live, src, 0).to(tl.int64)
    cs64 = tl.where(live, cslot, 0).to(tl.int64)
    n0 = r64 * T                                                    # first token row

    dd = tl.arange(0, 128)                                          # q/k channel, key column
    vv = vb * BV + tl.arange(0, BV)                                 # this block's value rows

    # ---- 2. conv tiles -------------------------------------------------------------------
    # The conv runs on [PROWS, 128] tiles, PROWS = num_warps: row p = 0 q, 1 k, 2 v, the rest
    # padding (masked). Such a tile gets the state tile's own layout (4 consecutive channels
    # per thread, a warp per row), 4 registers per thread for all three parts; q and k leave
    # it through a reduction over p in the state's column layout, v in its column layout and
    # then one explicit 128-value conversion to the row layout. (Other shapes made Triton
    # move the whole 64 KiB state through shared memory into the conv tile's layout; the
    # offline-compilation test checks that no 128-row tile is converted.)
    pp = tl.arange(0, PROWS)[:, None]
    pmask = pp < 3
    cmask = pmask & live
    chan = pp * DIM + h * 128 + dd[None, :]                         # channel c = p*dim + h*D + d
    cs_base = cs_ptr + tl.multiple_of(cs64 * stride_cs, 8)
    c_ptr = cs_base + chan * STRIDE_C
    w_ptr = cw_ptr + pp * (4 * DIM) + h * 128 + dd[None, :]         # conv_weight[p, e, h*D + d]

    # ---- 3. gate projection --------------------------------------------------------------
    G = _gate_projection(fa_ptr, stride_fa, n0, fb_ptr, h, live, scale * 0.0, T, GATE_MODE,
                         INTERP)
    # The raw gate rows go through the item's own out rows (each is overwritten with the
    # result later; a barrier separates every read of row t from the write of row t). Read
    # back in a layout of Triton's choosing, they cut the MMA layout of tl.dot's result off
    # from the state tile: Triton prefers MMA layouts for elementwise ops, and S * alpha
    # would otherwise move the 64 KiB page through shared memory into the MMA layout.
    tt = tl.arange(0, 16)
    g_ptr = out_ptr + _rowoff(n0 + tt.to(tl.int64), stride_out)[:, None] + h * 128 + dd[None, :]
    tl.store(g_ptr, G.to(tl.bfloat16), mask=(tt[:, None] < T) & live)
    A = tl.exp(tl.load(alog_ptr + h).to(tl.float32))

    # ---- 4. the state rows (128-bit loads along the key dimension) -------------------------
    st_rows = st_ptr + tl.multiple_of(src64 * stride_st, 4) + h * (128 * 128)
    st_off = vv[:, None] * 128 + dd[None, :]
    if EVICT:
        S = tl.load(st_rows + st_off, mask=live, other=0.0, eviction_policy="evict_first")
    else:
        S = tl.load(st_rows + st_off, mask=live, other=0.0)
    # every thread's reads of the state page precede any state write (a token's write slot
    # may be the source slot), and the gate rows stored above are visible to every thread
    tl.debug_barrier()

    # ---- 5. tokens -----------------------------------------------------------------------
    # A loop, not unrolled: the unrolled T=8 body was ~11k instructions (instruction-cache
    # pressure, seconds of compile time per configuration) for no measurable gain in the SASS.
    for t in range(T):
        n = n0 + t
        # conv over the sequence [w0, w1, w2, x_0, .., x_{T-1}]: element p = t+e is window
        # position off+p (p < 3) or token row p-3; operands are reloaded per token (cache
        # hits) rather than held in registers across tokens
        if HAS_BIAS:
            acc = _load_f32(cb_ptr + chan, pmask)
        else:
            acc = tl.zeros([PROWS, 128], dtype=tl.float32)
        for e in tl.static_range(4):
            p = t + e
            if T == 1:      # p is a compile-time constant
                if e < 3:
                    s_e = _load_f32(c_ptr + (off + e) * STRIDE_L, cmask)
                else:
                    s_e = _load_f32(x_ptr + _rowoff(n0, stride_x) + chan, cmask)
            else:
                s_w = _load_f32(c_ptr + (off + p) * STRIDE_L, cmask & (p < 3))
                s_x = _load_f32(x_ptr + _rowoff(n0 + p - 3, stride_x) + chan, cmask & (p >= 3))
                s_e = tl.where(p < 3, s_w, s_x)
            acc = _fma(s_e, _load_f32(w_ptr + e * DIM, pmask), acc, INTERP)
        Y = _bf16_round(acc / (1.0 + tl.exp(-acc)), INTERP)
        yq = tl.sum(tl.where(pp == 0, Y, 0.0), axis=0)
        yk = tl.sum(tl.where(pp == 1, Y, 0.0), axis=0)
        yv = tl.sum(tl.where(pp == 2, Y, 0.0), axis=0)
        if NV > 1:
            # this block's rows of v (a one-hot contraction: exact)
            yv = tl.sum(tl.where(vv[:, None] == dd[None, :], yv[None, :], 0.0), axis=1)

        qh = yq * tl.rsqrt(tl.sum(yq * yq, axis=0) + 1e-6) * scale
        kh = yk * tl.rsqrt(tl.sum(yk * yk, axis=0) + 1e-6)

        out_row = out_ptr + _rowoff(n, stride_out) + h * 128
        rg = _load_f32(out_row + dd, live)                          # row t of the gate tile
        g = rg + _load_f32(dtb_ptr + h * 128 + dd, True)
        alpha = _decay(g, A, lower_bound, BOUNDED)
        b_t = _sigmoid(tl.load(beta_ptr + n * stride_beta + h, mask=live, other=0.0).to(tl.float32))

        S, u, o = _delta_rule(S, alpha, kh, qh, b_t, yv)   # this block's rows

        if RECORD:
            rec = cs64 * (H * T) + h * T + t                     # record row (conv_slot, h, t)
            tl.store(vrec_ptr + rec * 128 + vv, u, mask=live)
            kg_mask = live & (vb == 0)
            tl.store(kgrec_ptr + rec * 256 + dd, yk.to(tl.bfloat16), mask=kg_mask)
            tl.store(kgrec_ptr + rec * 256 + 128 + dd, rg.to(tl.bfloat16), mask=kg_mask)
        else:
            if T == 1:
                tgt64 = src64
                valid = live
            else:
                tgt = tl.load(si_ptr + n, mask=live, other=0)
                valid = live & (tgt > 0) & (tgt < num_slots)
                tgt64 = tl.where(valid, tgt, 0).to(tl.int64)
            dst = st_ptr + tl.multiple_of(tgt64 * stride_st, 4) + h * (128 * 128) + st_off
            _store_state(dst, S, valid, EVICT)

        ob = _bf16_round(o, INTERP)
        tl.debug_barrier()                   # every thread has read row t's gate (above)
        if NV == 1:
            # o (bf16 values) parks in out row t until the epilogue below
            tl.store(out_row + vv, ob.to(tl.bfloat16), mask=live)
        else:
            tl.store(scr_ptr + (item64 * T + t) * 128 + vv, ob, mask=live)
            tl.store(out_row + vv, tl.zeros([BV], dtype=tl.bfloat16), mask=(live == 0) & w_ok)

    # ---- 6. V-split: the last block of the item finishes it; conv window -----------------
    if NV == 1:
        tl.debug_barrier()                   # all o rows are in place
        _finish_rows(out_ptr + _rowoff(n0, stride_out) + h * 128, stride_out, out_ptr, stride_out,
                     og_ptr, stride_og, nw_ptr, n0, h, norm_eps, live, w_ok, T, TP, INTERP, False)
        _write_window(cs_base, x_ptr, stride_x, n0, h, off, live, DIM, T, STRIDE_C, STRIDE_L)
    else:
        tl.debug_barrier()                   # all threads' scratch writes and window reads ...
        old = tl.atomic_add(ctr_ptr + item64, 1, mask=live, sem="acq_rel", scope="gpu")
        tl.debug_barrier()                   # ... before the release; loads below after acquire
        last = live & ((old & (NV - 1)) == (NV - 1))
        _finish_rows(scr_ptr + item64 * (T * 128), 128, out_ptr, stride_out,
                     og_ptr, stride_og, nw_ptr, n0, h, norm_eps, last, last, T, TP, INTERP, True)
        _write_window(cs_base, x_ptr, stride_x, n0, h, off, last, DIM, T, STRIDE_C, STRIDE_L)
        # every sibling's increment came before the last one's: the counter goes back to zero
        # for the next launch, whatever its NV
        tl.store(ctr_ptr + item64, tl.zeros_like(old), mask=last)


@triton.jit(do_not_specialize=["n_work", "num_slots", "nprog", "iters"])
def _kda_decode_kernel(
        x_ptr, stride_x, cw_ptr, cb_ptr, cs_ptr, stride_cs,
        fa_ptr, stride_fa, fb_ptr, beta_ptr, stride_beta, alog_ptr, dtb_ptr,
        st_ptr, stride_st, si_ptr, nacc_ptr, og_ptr, stride_og, nw_ptr,
        out_ptr, stride_out, vrec_ptr, kgrec_ptr, scr_ptr, ctr_ptr,
        n_work, num_slots, nprog, iters, scale, norm_eps, lower_bound,
        H: tl.constexpr, T: tl.constexpr, L: tl.constexpr, SD: tl.constexpr,
        HAS_BIAS: tl.constexpr, BOUNDED: tl.constexpr, GATE_MODE: tl.constexpr,
        RECORD: tl.constexpr, NV: tl.constexpr, BV: tl.constexpr, EVICT: tl.constexpr,
        PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr, INTERP: tl.constexpr,
        PROWS: tl.constexpr, ITERS_INTERP: tl.constexpr = 0):
    """The fused KDA decode step: every work unit of the batch (see the module docstring).

    Grid: ``n_work = R * H * NV`` programs, or ``nprog`` persistent programs striding over
    the work units. Pointers: the :class:`kda.config.KdaArgs` tensors (unused optional ones
    point at any tensor and are never dereferenced); strides in elements.
    """
    pid = tl.program_id(0)
    if PERSISTENT:
        # a uniform trip count (host-computed) for every program; the tail is masked
        if INTERP:
            # the interpreter turns runtime ints into 1-element arrays that range() rejects
            for i in tl.static_range(ITERS_INTERP):
                w = pid + i * nprog
                _kda_work(w, w < n_work, x_ptr, stride_x, cw_ptr, cb_ptr, cs_ptr, stride_cs,
                          fa_ptr, stride_fa, fb_ptr, beta_ptr, stride_beta, alog_ptr, dtb_ptr,
                          st_ptr, stride_st, si_ptr, nacc_ptr, og_ptr, stride_og, nw_ptr,
                          out_ptr, stride_out, vrec_ptr, kgrec_ptr, scr_ptr, ctr_ptr,
                          num_slots, scale, norm_eps, lower_bound,
                          H, T, L, SD, HAS_BIAS, BOUNDED, GATE_MODE, RECORD, NV, BV, EVICT, INTERP,
                          PROWS)
        else:
            for i in tl.range(0, iters, num_stages=NUM_STAGES):
                w = pid + i * nprog
                _kda_work(w, w < n_work, x_ptr, stride_x, cw_ptr, cb_ptr, cs_ptr, stride_cs,
                          fa_ptr, stride_fa, fb_ptr, beta_ptr, stride_beta, alog_ptr, dtb_ptr,
                          st_ptr, stride_st, si_ptr, nacc_ptr, og_ptr, stride_og, nw_ptr,
                          out_ptr, stride_out, vrec_ptr, kgrec_ptr, scr_ptr, ctr_ptr,
                          num_slots, scale, norm_eps, lower_bound,
                          H, T, L, SD, HAS_BIAS, BOUNDED, GATE_MODE, RECORD, NV, BV, EVICT, INTERP,
                          PROWS)
    else:
        _kda_work(pid, True, x_ptr, stride_x, cw_ptr, cb_ptr, cs_ptr, stride_cs,
                  fa_ptr, stride_fa, fb_ptr, beta_ptr, stride_beta, alog_ptr, dtb_ptr,
                  st_ptr, stride_st, si_ptr, nacc_ptr, og_ptr, stride_og, nw_ptr,
                  out_ptr, stride_out, vrec_ptr, kgrec_ptr, scr_ptr, ctr_ptr,
                  num_slots, scale, norm_eps, lower_bound,
                  H, T, L, SD, HAS_BIAS, BOUNDED, GATE_MODE, RECORD, NV, BV, EVICT, INTERP,
                          PROWS)


# --------------------------------------------------------------------------------------------
# host wrapper
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Variant:
    """A launch configuration of :func:`_kda_decode_kernel`.

    Attributes:
      name: the key in :data:`VARIANTS`.
      nv: V-row blocks per item (1, 2 or 4); 0 = chosen per call from the grid size (auto).
      persistent: a fixed grid of ``ctas_per_sm * SMs`` programs looping over work units.
      ctas_per_sm: persistent programs per SM.
      num_stages: software-pipelining stages of the persistent loop (``tl.range``).
      num_warps: warps per program; 0 = 8 when a program owns all 128 rows, else 4.
      evict: state loads ``evict_first`` and state stores ``.cs`` (streaming), so the pages do
        not push the shared parameters (f_b, conv weights) out of L2.
      maxnreg: register cap per thread passed to ptxas when a program owns all 128 rows (None
        = Triton's choice); 128 with 8 warps lets two programs share an SM.
      split_maxnreg: the same for V-split launches (4 warps); 96 fits 5 programs per SM.
      kernel: "item" (:func:`_kda_decode_kernel`) or "chunked" (the kernel of
        :mod:`kda.backends.triton.kda_decode_chunked`: one 4-warp program per item walking the
        page in chunks of ``bv`` value rows, ``num_stages`` pipelining stages of that loop).
      bv: value rows per chunk of the ``chunked`` kernel.
      hold: ``chunked`` kernel, T > 1: keep q̂, k̂, α of the first 4 tokens in registers
        across the row loop instead of re-reading them per chunk and token.
      kb: ``chunked`` kernel: 1 = the state chunk is a [bv, 128] tile (one row per warp, 32
        lanes); 4 = a [bv, 4, 32] tile (4 rows per warp, 8 lanes per row, the 4 column
        blocks of a row in one thread: fewer shuffles per row sum, see ``_delta_rule_kb``).
      description: one line for benchmark tables.
    """

    name: str
    nv: int = 1
    persistent: bool = False
    ctas_per_sm: int = 2
    num_stages: int = 1
    num_warps: int = 0
    evict: bool = True
    maxnreg: Optional[int] = None
    split_maxnreg: Optional[int] = None
    kernel: str = "item"
    bv: int = 32
    hold: bool = False
    kb: int = 1
    description: str = ""


#: Every named variant; ``auto`` is the default (see the module docstring for why).
VARIANTS: Dict[str, Variant] = {v.name: v for v in (
    Variant("auto", nv=0, maxnreg=128,
            description="vsplit4/vsplit2 when R*H <= SMs/4 / SMs/2, else item"),
    Variant("item", maxnreg=128,
            description="one 8-warp program per item, page in registers, <=128 regs (2 CTAs/SM)"),
    Variant("item_nocap", description="item without the register cap (1 CTA/SM)"),
    Variant("item_w16", num_warps=16, maxnreg=128,
            description="one 16-warp program per item, 32 state floats/thread (1 CTA/SM)"),
    Variant("item_w16_r64", num_warps=16, maxnreg=64,
            description="16 warps, <=64 regs (2 CTAs/SM, a few spills)"),
    Variant("item_noevict", maxnreg=128, evict=False, description="item without L2 eviction hints"),
    Variant("vsplit2", nv=2, description="2 programs per item (64 rows each), last-arriver finish"),
    Variant("vsplit4", nv=4, split_maxnreg=96,
            description="4 programs per item (32 rows each), last-arriver finish, <=96 regs"),
    Variant("persistent", persistent=True, maxnreg=128,
            description="2 programs/SM looping over items"),
    Variant("chunked", kernel="chunked", bv=32, num_stages=2, num_warps=4, maxnreg=88,
            description="one 4-warp program per item, 32-row chunks of the page, 2-stage "
                        "pipelined loop, <=88 regs (5 CTAs/SM; kda_decode_chunked.py)"),
    Variant("chunked_bv16", kernel="chunked", bv=16, num_stages=2, num_warps=4, maxnreg=88,
            description="chunked with 16-row chunks"),
    Variant("chunked_s3", kernel="chunked", bv=32, num_stages=3, num_warps=4, maxnreg=88,
            description="chunked with a 3-stage pipeline"),
    Variant("chunked_nocap", kernel="chunked", bv=32, num_stages=2, num_warps=4,
            description="chunked without the register cap"),
    Variant("chunked_s4", kernel="chunked", bv=32, num_stages=4, num_warps=4, maxnreg=88,
            description="chunked with a 4-stage pipeline"),
    Variant("chunked_bv16_s3", kernel="chunked", bv=16, num_stages=3, num_warps=4, maxnreg=88,
            description="chunked_bv16 with a 3-stage pipeline"),
    Variant("chunked_w2", kernel="chunked", bv=16, num_stages=2, num_warps=2, maxnreg=128,
            description="2-warp programs, 16-row chunks, <=128 regs (8 programs per SM)"),
    Variant("chunked_w2_s3", kernel="chunked", bv=16, num_stages=3, num_warps=2, maxnreg=128,
            description="chunked_w2 with a 3-stage pipeline"),
    Variant("chunked_w2_r104", kernel="chunked", bv=16, num_stages=2, num_warps=2, maxnreg=104,
            description="chunked_w2 at <=104 regs (9 programs per SM)"),
    Variant("chunked_w8_bv64", kernel="chunked", bv=64, num_stages=2, num_warps=8, maxnreg=88,
            description="8-warp programs, 64-row chunks"),
    Variant("chunked_w2_hold", kernel="chunked", bv=16, num_stages=2, num_warps=2, maxnreg=128,
            hold=True, description="chunked_w2 holding q̂, k̂, α of tokens 0-3 in registers"),
)}
# ``<base>_k4``: the same build with the state chunk as a [bv, 4, 32] tile (8 lanes per row)
VARIANTS.update({
    f"{b}_k4": dataclasses.replace(
        VARIANTS[b], name=f"{b}_k4", kb=4,
        description=f"{b} with [{VARIANTS[b].bv}, 4, 32] state tiles (8 lanes per row)")
    for b in ("chunked", "chunked_bv16", "chunked_w2", "chunked_w2_s3")})
DEFAULT_VARIANT = "auto"

#: ``auto``'s chunked builds, first match wins: (largest T or None = any, least items per SM,
#: variant).
#: H200, H=32, fraction of the floor at R = 32 / 128 / 512 (commit 9e0c701, one run,
#: docs/results/2026-11-29-h200-9e0c701): T=1 2-warp 16-row 3-stage 0.659 / 0.772 / 0.831
#: (4-warp 32-row: 2 stages 0.636 / 0.753 / 0.804, 3 stages 0.614 / 0.770 / 0.832); T=2
#: 2-warp 2-stage 0.666 / 0.748 / 0.797 (4-warp 32-row 0.614 / 0.709 / 0.759); T=5 2-warp
#: 0.648 / 0.698 / 0.713, 4-warp 16-row 0.608 / 0.684 / 0.729 (so the latter from 64 items
#: per SM: R=512 at H=32); 8-warp 64-row 0.58-0.63 everywhere. T=3, 4: not measured, as T=5.
#: At R=8 (256 items, 2 per SM) the 2-warp build was slower at T=2 / 5 (d6d6c22: 26.5 / 54.9 us
#: against 25.0 / 46.5 us for the 4-warp builds at b32855c), so T >= 2 uses it from 4 per SM.
AUTO_CHUNKED = (
    (1, 1, "chunked_w2_s3"),
    (2, 4, "chunked_w2"),
    (2, 1, "chunked"),
    (None, 64, "chunked_bv16"),
    (None, 4, "chunked_w2"),
    (None, 1, "chunked_bv16"),
)


def _auto_nv(n_items: int, num_sms: int) -> int:
    """V-row blocks per item for the ``auto`` variant: split only when the grid is small."""
    if 4 * n_items <= num_sms:
        return 4
    if 2 * n_items <= num_sms:
        return 2
    return 1


class TritonStep:
    """The step function for one :class:`KdaConfig` and one :class:`Variant` (callable).

    ``step(args)`` launches :func:`_kda_decode_kernel` once on the current stream. Nothing is
    read back from the device and nothing is allocated per call, except (V-split variants)
    the scratch and counters of a stream the step has not run on before, or growing them when
    a larger batch than ever before arrives on it (:class:`kda.backend.StreamBuffers`).

    Raises (at call time):
      RuntimeError: a V-split launch during CUDA-graph capture on a stream this step has not
        run on, with no spare counters left by an eager step of at least this batch.
    """

    def __init__(self, cfg: KdaConfig, device: torch.device, variant: Variant):
        self.cfg = cfg
        self.device = torch.device(device)
        self.variant = variant
        self.interp = interpreter_enabled()
        if self.device.type == "cuda" and not self.interp:
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 4   # interpreter: small persistent grids exercise the item loop
        self._const = dict(
            H=cfg.num_heads, T=cfg.T, L=cfg.window, SD=cfg.conv_layout == "SD",
            HAS_BIAS=cfg.has_conv_bias, BOUNDED=cfg.lower_bound is not None,
            GATE_MODE=cfg.gate_mode, RECORD=cfg.record, EVICT=variant.evict,
            PERSISTENT=variant.persistent, NUM_STAGES=variant.num_stages, INTERP=self.interp)
        self._scalars = (float(cfg.scale), float(cfg.norm_eps),
                         0.0 if cfg.lower_bound is None else float(cfg.lower_bound))
        # V-split: per CUDA stream, the o rows' scratch and the per-item counters
        self._scratch = StreamBuffers(self.device, torch.float32, False, "the V-split scratch")
        self._counters = StreamBuffers(self.device, torch.int32, True, "the V-split counters",
                                       min_elems=self.num_sms)

    def nv_for(self, n_items: int) -> int:
        """V-row blocks per item used for a batch of ``n_items`` items."""
        return self.variant.nv or _auto_nv(n_items, self.num_sms)

    @property
    def _scr(self) -> Optional[torch.Tensor]:
        """The current stream's V-split scratch (None before its first V-split step)."""
        return self._scratch.current()

    @property
    def _ctr(self) -> Optional[torch.Tensor]:
        """The current stream's per-item counters (None before its first V-split step)."""
        return self._counters.current()

    def _split_buffers(self, n_items: int):
        return self._scratch.get(n_items * self.cfg.T * D), self._counters.get(n_items)

    def __call__(self, args: KdaArgs) -> None:
        cfg = self.cfg
        R = args.state_indices.shape[0]
        if R == 0:
            return
        n_items = R * cfg.num_heads
        nv = self.nv_for(n_items)
        n_work = n_items * nv
        v = self.variant
        num_warps = v.num_warps or (8 if nv == 1 else 4)
        opts = {}
        cap = v.maxnreg if nv == 1 else v.split_maxnreg
        if cap and not self.interp:
            opts["maxnreg"] = cap
        if v.persistent:
            nprog = min(n_work, v.ctas_per_sm * self.num_sms)
        else:
            nprog = n_work
        scr, ctr = self._split_buffers(n_items) if nv > 1 else (args.x, args.x)
        scale, norm_eps, lb = self._scalars
        iters = triton.cdiv(n_work, nprog)
        extra = {"ITERS_INTERP": iters} if (self.interp and v.persistent) else {}
        with interpreter_quiet(self.interp):
            _kda_decode_kernel[(nprog,)](
                *kernel_operands(args), scr, ctr,
                n_work, args.state.shape[0], nprog, iters, scale, norm_eps, lb,
                NV=nv, BV=D // nv, PROWS=num_warps, num_warps=num_warps, num_stages=1,
                **self._const, **extra, **opts)


def kernel_operands(args: KdaArgs) -> tuple:
    """The leading arguments of both Triton kernels (this file's and the chunked one), in
    their order: the call's tensors and row strides, up to the records. An absent optional
    tensor is replaced by one that is never dereferenced (``x``; the slot ids for the
    accepted counts at T = 1)."""
    x = args.x
    cb = args.conv_bias if args.conv_bias is not None else x
    nacc = args.num_accepted_tokens if args.num_accepted_tokens is not None else args.state_indices
    vrec = args.v_record if args.v_record is not None else x
    kgrec = args.kg_record if args.kg_record is not None else x
    return (x, x.stride(0), args.conv_weight, cb, args.conv_state, args.conv_state.stride(0),
            args.f_a, args.f_a.stride(0), args.f_b, args.beta, args.beta.stride(0), args.A_log,
            args.dt_bias, args.state, args.state.stride(0), args.state_indices, nacc,
            args.output_gate, args.output_gate.stride(0), args.norm_weight,
            args.out, args.out.stride(0), vrec, kgrec)


def resolve_variant(variant: Optional[str] = None) -> Variant:
    """The :class:`Variant` named ``variant``, else ``$KDA_TRITON_VARIANT``, else the default.

    Raises:
      ValueError: an unknown name (the message lists the valid ones).
    """
    name = variant or os.environ.get(VARIANT_ENV, "").strip() or DEFAULT_VARIANT
    if name not in VARIANTS:
        raise ValueError(f"unknown KDA triton variant {name!r} (from "
                         f"{'argument' if variant else VARIANT_ENV}); valid: {', '.join(VARIANTS)}")
    return VARIANTS[name]


class AutoStep:
    """The ``auto`` variant: per call, a build of the ``chunked`` kernel when the batch has at
    least as many items (R*H) as the device has SMs (:data:`AUTO_CHUNKED`: by T and batch
    size), else :class:`TritonStep` with the small-batch split.

    The choice uses shapes only (nothing is read from the device), so a CUDA graph captures
    one kernel per batch size.
    """

    def __init__(self, cfg: KdaConfig, device, variant: Variant):
        from kda.backends.triton.kda_decode_chunked import ChunkedStep
        self.cfg = cfg
        self.variant = variant
        self.small = TritonStep(cfg, device, variant)
        self._device = device
        self._chunked: Dict[str, "ChunkedStep"] = {}
        self._make_chunked = ChunkedStep

    def kernel_for(self, n_items: int) -> str:
        """The variant run for ``n_items`` items: "item" (with :meth:`TritonStep.nv_for` row
        blocks) below the SM count, else the ``chunked`` build :data:`AUTO_CHUNKED` names."""
        sms = self.small.num_sms
        if n_items < sms:
            return "item"
        for T_max, min_per_sm, name in AUTO_CHUNKED:
            if (T_max is None or self.cfg.T <= T_max) and n_items >= min_per_sm * sms:
                return name
        return "chunked_bv16"  # not reached: AUTO_CHUNKED ends with (None, 1, ...)

    def __call__(self, args: KdaArgs) -> None:
        name = self.kernel_for(args.state_indices.shape[0] * self.cfg.num_heads)
        if name == "item":
            return self.small(args)
        step = self._chunked.get(name)
        if step is None:
            step = self._chunked[name] = self._make_chunked(self.cfg, self._device,
                                                            VARIANTS[name])
        step(args)


def build_step(cfg: KdaConfig, device, variant: Optional[str] = None):
    """Build the Triton step function for ``cfg`` on ``device``.

    Args:
      cfg: the static configuration (validated).
      device: the CUDA device (or the CPU under ``TRITON_INTERPRET=1``).
      variant: a key of :data:`VARIANTS`; default ``$KDA_TRITON_VARIANT``, else ``auto``.

    Returns:
      A :class:`TritonStep` (``auto``: :class:`AutoStep`; the ``chunked`` kernel:
      :class:`kda.backends.triton.kda_decode_chunked.ChunkedStep`): ``step(args: KdaArgs) -> None``
      writes in place.
    """
    v = resolve_variant(variant)
    if v.name == "auto":
        return AutoStep(cfg, device, v)
    if v.kernel == "chunked":
        from kda.backends.triton.kda_decode_chunked import ChunkedStep
        return ChunkedStep(cfg, device, v)
    return TritonStep(cfg, device, v)


# --------------------------------------------------------------------------------------------
# offline compilation (no GPU needed): PTX / SASS / resource inspection
# --------------------------------------------------------------------------------------------

_DT = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_offline(cfg: KdaConfig, variant: str = "item", nv: Optional[int] = None,
                    arch: int = 90, stride_divisible: bool = True, **options):
    """Compile the kernel for ``cfg`` for an NVIDIA GPU of compute capability ``arch`` without
    a GPU (Triton's bundled ptxas), as the JIT would for 16-byte aligned tensors.

    Args:
      cfg: the configuration. variant: a key of :data:`VARIANTS`. nv: V-row blocks per item
        (default: the variant's, 1 for ``auto``). arch: 90 = sm_90a (H100/H200).
      stride_divisible: specialize the row/slot strides as multiples of 16 elements (the
        common case; the kernel's own alignment hints do not depend on it).

    Returns:
      triton's CompiledKernel: ``.asm["ttgir" | "ptx" | "cubin"]``, ``.metadata.shared``
      (see :func:`resource_usage` for registers and spills).
    """
    v = resolve_variant(variant)
    if v.kernel == "chunked":
        from kda.backends.triton.kda_decode_chunked import compile_chunked_offline
        return compile_chunked_offline(cfg, v, arch=arch, stride_divisible=stride_divisible,
                                       **options)
    nv = nv or v.nv or 1
    consts = dict(
        H=cfg.num_heads, T=cfg.T, L=cfg.window, SD=cfg.conv_layout == "SD",
        HAS_BIAS=cfg.has_conv_bias, BOUNDED=cfg.lower_bound is not None, GATE_MODE=cfg.gate_mode,
        RECORD=cfg.record, NV=nv, BV=D // nv, EVICT=v.evict, PERSISTENT=v.persistent,
        NUM_STAGES=v.num_stages, INTERP=False, ITERS_INTERP=0)
    opts = {"num_warps": v.num_warps or (8 if nv == 1 else 4), "num_stages": 1}
    cap = v.maxnreg if nv == 1 else v.split_maxnreg
    if cap:
        opts["maxnreg"] = cap
    opts.update(options)
    consts["PROWS"] = opts["num_warps"]
    return compile_kernel_offline(_kda_decode_kernel, cfg, consts, opts, arch, stride_divisible)


def compile_kernel_offline(kernel, cfg: KdaConfig, consts: dict, opts: dict, arch: int,
                           stride_divisible: bool):
    """Compile one of the two Triton kernels offline (no GPU) with the signature the JIT would
    give a call with 16-byte aligned tensors: pointers typed from ``cfg``'s dtypes and
    16-divisible, ``scale`` / ``norm_eps`` / ``lower_bound`` fp32, the row strides
    16-divisible when ``stride_divisible``, other integers i32, ``consts`` as constexprs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr = {
        "x_ptr": "*bf16", "cw_ptr": "*" + _DT[cfg.conv_weight_dtype], "cb_ptr": "*fp32",
        "cs_ptr": "*" + _DT[cfg.conv_state_dtype], "fa_ptr": "*bf16", "fb_ptr": "*bf16",
        "beta_ptr": "*bf16", "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "st_ptr": "*fp32",
        "si_ptr": "*i32", "nacc_ptr": "*i32", "og_ptr": "*bf16",
        "nw_ptr": "*" + _DT[cfg.norm_weight_dtype], "out_ptr": "*bf16", "vrec_ptr": "*fp32",
        "kgrec_ptr": "*bf16", "scr_ptr": "*fp32", "ctr_ptr": "*i32"}
    strides = ("stride_x", "stride_cs", "stride_fa", "stride_og", "stride_out", "stride_st")
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptr:
            sig[name] = ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "norm_eps", "lower_bound"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if stride_divisible and name in strides:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def resource_usage(compiled) -> Dict[str, int]:
    """Registers, spill bytes, local-memory stack and shared memory of a compiled kernel, read
    from its cubin with the cuobjdump that Triton bundles (no GPU needed).

    Returns:
      {"regs", "stack", "spill_stores", "spill_loads", "shared"} (bytes except regs).
    """
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia import compiler as nv_compiler

    cuobjdump = os.path.join(os.path.dirname(nv_compiler.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        txt = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], check=True,
                             capture_output=True, text=True).stdout
    def field(key):
        m = re.search(key + r":(\d+)", txt)
        return int(m.group(1)) if m else -1
    ptx = compiled.asm["ptx"]
    spill_st = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", txt)) or 0
    spill_ld = sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", txt)) or 0
    return {"regs": field("REG"), "stack": field("STACK"), "shared": compiled.metadata.shared,
            "local": field("LOCAL"), "spill_stores": spill_st, "spill_loads": spill_ld,
            "ptx_local": len(re.findall(r"(ld|st)\.local", ptx))}


# --------------------------------------------------------------------------------------------
# GPU timing and checks (for the benchmark harness and the lead's H200 runs)
# --------------------------------------------------------------------------------------------

def check_variants(variants: Optional[List[str]] = None, device="cuda",
                   matrix: str = "ci") -> List[str]:
    """Run every named variant (default: all) on the conformance cases against the reference;
    return the failures (empty when everything matches)."""
    from kda.reference import reference_step
    from kda.testing import clone_args, compare_step, make_case
    from tests.conformance.cases import cases

    failures = []
    for spec in cases(matrix):
        for name in variants or list(VARIANTS):
            args = make_case(spec, device)
            before = clone_args(args)
            expected = clone_args(args)
            reference_step(spec.cfg, expected)
            build_step(spec.cfg, device, name)(args)
            errs = compare_step(args, expected, before)
            if errs:
                failures.append(f"{name} {spec.id}: " + "; ".join(errs))
    return failures


def _main(argv=None) -> int:
    """``python3 -m kda.backends.triton.kda_decode check ...`` (see --help).

    Variants are timed by the project's benchmark:
    ``python3 -m tools.bench.bench --backends=triton --triton_variants=item,vsplit4,...``.
    """
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m kda.backends.triton.kda_decode")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="every variant vs the reference on the conformance cases")
    c.add_argument("--variants", default="", help="comma-separated (default: all)")
    c.add_argument("--matrix", default="ci", choices=("ci", "full"))
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda, or cpu with TRITON_INTERPRET=1")
    a = p.parse_args(argv)
    names = [v for v in a.variants.split(",") if v] or None
    if a.cmd == "check":
        fails = check_variants(names, device=a.device, matrix=a.matrix)
        for f in fails:
            print("FAIL", f)
        print(f"check: {len(fails)} failures ({a.matrix} matrix, variants: "
              f"{', '.join(names or VARIANTS)})")
        return 1 if fails else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
