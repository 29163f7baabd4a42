"""The per-item kernel of the fused KDA decode step (one Triton launch), and its host wrapper.

Contract: ``docs/contract.md`` (section 2 formulas, section 3 rounding points) plus the project's
decisions (liveness, per-token state writes, record rows, window rewrite, 64-bit slot offsets).
The device helpers it is built from are those of :mod:`kda.backends.triton.common`.

Work decomposition
------------------
One *item* is one (request r, head h), numbered ``item = r * H + h``. A *work unit* is one
item, or, with V-row splitting (``NV > 1``), one block of ``BV = 128 / NV`` value rows of an
item: program ``w = item * NV + vb``. Every work unit recomputes the cheap per-item part (conv
of the q and k channels, L2 norms, the gate projection, decay, beta) and owns the rows
``vb*BV .. vb*BV+BV-1`` of the 128x128 fp32 state page, of ``u`` and of ``o``.

Per work unit (all of it runs with ``live``-masked loads and stores, no data-dependent branch;
a dead item's loads are masked off, so it costs no bandwidth):

1. slots: T=1 ``src = conv_slot = state_indices[r]``, ``off = 0``; T>1 ``a = clamp(nacc[r], 1, T)``,
   ``src = state_indices[r, a-1]``, ``conv_slot = state_indices[r, 0]``, ``off = a-1``. The item
   is live iff ``0 < src < slots`` and ``0 < conv_slot < slots``; slot offsets are int64.
2. the gate projection ``rg = bf16(f_a @ f_b_h^T)`` on tensor cores (``_gate_projection``).
   The T gate rows are parked, as bf16, in the item's own out rows and read back per token:
   that cuts the MMA layout of the dot's result off from the state tile (Triton prefers MMA
   layouts when layouts meet, and the 64 KiB page would go through shared memory into it).
   Each out row is overwritten with the result later; barriers order every read of a row
   before its write.
3. the state rows, 16-byte loads along the key dimension (the page is contiguous per slot; a
   row is 512 bytes) with ``evict_first``; then a CTA barrier, so that no thread's state write
   (T>1: a token's write slot may be ``src``) can land before another thread's read.
4. per token t (a runtime loop, T <= 8): the conv + SiLU on [num_warps, 128] tiles (rows q, k, v and
   padding: the state tile's own layout, 4 values per thread) with fma taps over the sequence
   [w0, w1, w2, x_0, ..] (operands reloaded per token from L1/L2 rather than held in
   registers); y rounded to bf16; q/k L2 norm (eps 1e-6 on the sum of squares); decay from
   the gate row; beta; the recurrence on the block's rows; the state write, streaming
   (``.cs``) (T=1: to ``src``; T>1: to ``state_indices[r, t]`` when that slot is valid;
   record mode: none, records instead); ``o`` rounded to bf16 and parked in out row t
   (V-split: in the scratch).
5. the gated RMSNorm of all T rows as one [T, 128] tile (each value computed once; in the
   state's row layout every value would be recomputed by the 32 lanes of a warp).
6. the conv window rewrite: ``new[0] = w1, new[1] = w2, new[2+t] = x_t`` for the item's 3x128
   channels. It reloads w1, w2, then a CTA barrier, then stores: every read of the old window
   by any thread of the CTA happens before any write.

Builds and registers
--------------------
:data:`ITEM_NV1`: one program of 8 warps per item (BV = 128), 64 state floats per thread,
every access a 16-byte vector, at most 128 registers so that two programs share an SM (one
program's page loads overlap the other's math). :data:`ITEM_NV2` / :data:`ITEM_NV4`: 2 or 4
programs of 4 warps per item (BV = 64 / 32), no register cap: one item's page streams
through 2 or 4 SMs. The offline sm_90a compile at H=32
(:func:`kda.backends.triton.offline.compile_offline`, checked by the backend's tests) reports
for NV=1 128 registers, no stack at T <= 2 and 16 bytes at T = 5 and 8; NV=2 192-254
registers, NV=4 128-168, no stack. The kernel is ~2k SASS instructions whatever T (the
token loop is not unrolled).

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
step's previous launch used (the launch policy picks NV per batch size). The scratch and
counters belong to the step function, one pair per CUDA stream it is called on
(:class:`kda.backend.StreamBuffers`: the counters are zeroed before their first launch and
never made during capture), so launches on two streams at once never share them; graphs
captured on one stream share that stream's pair (do not replay two of them at once). Dead
items: each block writes zeros to its own out rows and touches nothing else (no counter).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from kda.backend import StreamBuffers
from kda.backends.triton.common import (
    D, _bf16_rne, _bf16_round, _decay, _delta_rule, _finish_rows, _fma, _gate_projection,
    _load_f32, _rowoff, _sigmoid, _write_window, config_constants, config_scalars, interpreter_enabled,
    interpreter_quiet, kernel_operands, rows16, sm_count)
from kda.config import KdaArgs, KdaConfig


# --------------------------------------------------------------------------------------------
# the kernel
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["unused0", "num_slots", "unused1", "unused2"])
def _kda_decode_kernel(
        x_ptr, stride_x, cw_ptr, cb_ptr, cs_ptr, stride_cs,
        fa_ptr, stride_fa, fb_ptr, beta_ptr, stride_beta, alog_ptr, dtb_ptr,
        st_ptr, stride_st, si_ptr, nacc_ptr, og_ptr, stride_og, nw_ptr,
        out_ptr, stride_out, vrec_ptr, kgrec_ptr, scr_ptr, ctr_ptr,
        unused0, num_slots, unused1, unused2, scale, norm_eps, lower_bound,
        H: tl.constexpr, T: tl.constexpr, L: tl.constexpr, SD: tl.constexpr,
        HAS_BIAS: tl.constexpr, BOUNDED: tl.constexpr, GATE_MODE: tl.constexpr,
        RECORD: tl.constexpr, INTERP: tl.constexpr, NV: tl.constexpr, PROWS: tl.constexpr,
        BETA_ACT: tl.constexpr, ROWS16: tl.constexpr,
        STATE_BF16: tl.constexpr):
    """The fused KDA decode step for one work unit: rows ``vb*BV ..`` of item ``pid // NV``
    (see the module docstring).

    Grid: ``R * H * NV`` programs of ``PROWS`` warps. Pointers: the :class:`KdaArgs` tensors
    (unused optional ones point at any tensor and are never dereferenced), the V-split scratch
    and counters (NV > 1); strides in elements. ``unused0..2`` are not read: they keep the
    parameter layout, and with it the compiled code (PTX and ptxas's register assignment),
    of the builds the launch policy's figures were measured with.
    """
    DIM: tl.constexpr = H * 128
    BV: tl.constexpr = 128 // NV
    TP: tl.constexpr = 1 if T == 1 else (2 if T == 2 else (4 if T <= 4 else 8))
    if SD:
        STRIDE_C: tl.constexpr = 1
        STRIDE_L: tl.constexpr = 3 * H * 128
    else:
        STRIDE_C: tl.constexpr = L
        STRIDE_L: tl.constexpr = 1
    w = tl.program_id(0)
    item = w // NV
    vb = w % NV
    r = item // H
    h = item % H
    r64 = r.to(tl.int64)
    item64 = item.to(tl.int64)

    # ---- 1. slots and liveness ----------------------------------------------------------
    # (the always-true masks keep the predicated loads of the builds the policy measured)
    if T == 1:
        src = tl.load(si_ptr + r64, mask=True, other=0)
        cslot = src
        off = 0
    else:
        a = tl.load(nacc_ptr + r64, mask=True, other=1)
        a = tl.minimum(tl.maximum(a, 1), T)
        src = tl.load(si_ptr + r64 * T + (a - 1), mask=True, other=0)
        cslot = tl.load(si_ptr + r64 * T, mask=True, other=0)
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
    # then one explicit 128-value conversion to the row layout. (Other shapes make Triton
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
                         INTERP, ROWS16)
    # The raw gate rows go through the item's own out rows (each is overwritten with the
    # result later; a barrier separates every read of row t from the write of row t). Read
    # back in a layout of Triton's choosing, they cut the MMA layout of tl.dot's result off
    # from the state tile: Triton prefers MMA layouts for elementwise ops, and S * alpha
    # would otherwise move the 64 KiB page through shared memory into the MMA layout.
    tt = tl.arange(0, 16)
    g_ptr = (out_ptr + _rowoff(n0 + tt.to(tl.int64), stride_out, ROWS16)[:, None] + h * 128
             + dd[None, :])
    tl.store(g_ptr, G.to(tl.bfloat16), mask=(tt[:, None] < T) & live)
    A = tl.exp(tl.load(alog_ptr + h).to(tl.float32))

    # ---- 4. the state rows (128-bit loads along the key dimension) -------------------------
    st_rows = st_ptr + tl.multiple_of(src64 * stride_st, 4) + h * (128 * 128)
    st_off = vv[:, None] * 128 + dd[None, :]
    S = tl.load(st_rows + st_off, mask=live, other=0.0, eviction_policy="evict_first")
    if STATE_BF16:
        S = S.to(tl.float32)                                   # widened once, fp32 from here
    # every thread's reads of the state page precede any state write (a token's write slot
    # may be the source slot), and the gate rows stored above are visible to every thread
    tl.debug_barrier()

    # ---- 5. tokens -----------------------------------------------------------------------
    # A loop, not unrolled: unrolled, the T=8 body is ~11k instructions (instruction-cache
    # pressure, seconds of compile time per configuration).
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
                    s_e = _load_f32(x_ptr + _rowoff(n0, stride_x, ROWS16) + chan, cmask)
            else:
                s_w = _load_f32(c_ptr + (off + p) * STRIDE_L, cmask & (p < 3))
                s_x = _load_f32(x_ptr + _rowoff(n0 + p - 3, stride_x, ROWS16) + chan,
                                cmask & (p >= 3))
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

        out_row = out_ptr + _rowoff(n, stride_out, ROWS16) + h * 128
        rg = _load_f32(out_row + dd, live)                          # row t of the gate tile
        g = rg + _load_f32(dtb_ptr + h * 128 + dd, True)
        alpha = _decay(g, A, lower_bound, BOUNDED)
        b_t = tl.load(beta_ptr + n * stride_beta + h, mask=live, other=0.0).to(tl.float32)
        if not BETA_ACT:                     # raw logits (activated: fp32, used as it is)
            b_t = _sigmoid(b_t)

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
            if STATE_BF16:                      # the state's one rounding (fp32 S carries on)
                tl.store(dst, _bf16_rne(S, INTERP), mask=valid, cache_modifier=".cs")
            else:
                tl.store(dst, S, mask=valid, cache_modifier=".cs")     # streaming store

        ob = _bf16_round(o, INTERP)
        tl.debug_barrier()                   # every thread has read row t's gate (above)
        if NV == 1:
            # o (bf16 values) parks in out row t until the epilogue below
            tl.store(out_row + vv, ob.to(tl.bfloat16), mask=live)
        else:
            tl.store(scr_ptr + (item64 * T + t) * 128 + vv, ob, mask=live)
            tl.store(out_row + vv, tl.zeros([BV], dtype=tl.bfloat16), mask=live == 0)

    # ---- 6. V-split: the last block of the item finishes it; conv window -----------------
    if NV == 1:
        tl.debug_barrier()                   # all o rows are in place
        _finish_rows(out_ptr + _rowoff(n0, stride_out, ROWS16) + h * 128, stride_out, out_ptr,
                     stride_out, og_ptr, stride_og, nw_ptr, n0, h, norm_eps, live, True, T, TP,
                     INTERP, False, ROWS16)
        _write_window(cs_base, x_ptr, stride_x, n0, h, off, live, DIM, T, STRIDE_C, STRIDE_L,
                      ROWS16)
    else:
        tl.debug_barrier()                   # all threads' scratch writes and window reads ...
        old = tl.atomic_add(ctr_ptr + item64, 1, mask=live, sem="acq_rel", scope="gpu")
        tl.debug_barrier()                   # ... before the release; loads below after acquire
        last = live & ((old & (NV - 1)) == (NV - 1))
        _finish_rows(scr_ptr + item64 * (T * 128), 128, out_ptr, stride_out,
                     og_ptr, stride_og, nw_ptr, n0, h, norm_eps, last, last, T, TP, INTERP, True,
                     ROWS16)
        _write_window(cs_base, x_ptr, stride_x, n0, h, off, last, DIM, T, STRIDE_C, STRIDE_L,
                      ROWS16)
        # every sibling's increment came before the last one's: the counter goes back to zero
        # for the next launch, whatever its NV
        tl.store(ctr_ptr + item64, tl.zeros_like(old), mask=last)


# --------------------------------------------------------------------------------------------
# builds and host wrapper
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ItemBuild:
    """One compiled form of :func:`_kda_decode_kernel`.

    Attributes:
      name: the name the launch policy uses (:mod:`kda.backends.triton.policy`).
      nv: programs (V-row blocks) per item: 1, 2 or 4.
      num_warps: warps per program (also the rows of the conv tiles).
      maxnreg: register cap per thread passed to ptxas (None: Triton's choice).
    """

    name: str
    nv: int
    num_warps: int
    maxnreg: Optional[int] = None

    @property
    def kernel(self):
        """The Triton kernel this build compiles."""
        return _kda_decode_kernel

    def constants(self, cfg: KdaConfig, interp: bool) -> dict:
        """The kernel's constexprs for ``cfg`` (``interp``: the interpreter's emulations), all
        but ``ROWS16``, which each call takes from its rows (:func:`rows16`)."""
        return dict(config_constants(cfg, interp), NV=self.nv, PROWS=self.num_warps)

    def options(self, interp: bool) -> dict:
        """Triton's launch options (the register cap only on the GPU)."""
        opts = {"num_warps": self.num_warps, "num_stages": 1}
        if self.maxnreg and not interp:
            opts["maxnreg"] = self.maxnreg
        return opts


#: One 8-warp program per item, <= 128 registers (two programs per SM).
ITEM_NV1 = ItemBuild("item_nv1", nv=1, num_warps=8, maxnreg=128)
#: Two 4-warp programs per item (64 value rows each), last-arriver finish.
ITEM_NV2 = ItemBuild("item_nv2", nv=2, num_warps=4)
#: Four 4-warp programs per item (32 value rows each), last-arriver finish.
ITEM_NV4 = ItemBuild("item_nv4", nv=4, num_warps=4)
#: The builds by name.
BUILDS = {b.name: b for b in (ITEM_NV1, ITEM_NV2, ITEM_NV4)}


class ItemStep:
    """Launches :func:`_kda_decode_kernel` for one :class:`KdaConfig` (callable).

    ``step(args, build)`` launches ``build`` (any of :data:`BUILDS`; default
    :data:`ITEM_NV1`) once on the current stream, grid ``R * H * build.nv``, and writes
    ``args.out``, the state pages, the conv windows and (record mode) the records in place.
    Nothing is read back from the device and nothing is allocated per call, except (V-split
    builds) the scratch and counters of a stream the step has not run on before, or growing
    them when a larger batch than ever before arrives on it (:class:`kda.backend.StreamBuffers`);
    all builds share them.

    Args (constructor):
      cfg: the static configuration (validated).
      device: the CUDA device, or the CPU under ``TRITON_INTERPRET=1``.

    Raises (at call time):
      RuntimeError: a V-split launch during CUDA-graph capture on a stream this step has not
        run on, with no spare counters left by an eager step of at least this batch.
    """

    def __init__(self, cfg: KdaConfig, device):
        self.cfg = cfg
        self.device = torch.device(device)
        self.interp = interpreter_enabled()
        self._scalars = config_scalars(cfg)
        # V-split: per CUDA stream, the o rows' scratch and the per-item counters
        self._scratch = StreamBuffers(self.device, torch.float32, False, "the V-split scratch")
        self._counters = StreamBuffers(self.device, torch.int32, True, "the V-split counters",
                                       min_elems=sm_count(self.device, self.interp))

    @property
    def scratch(self) -> Optional[torch.Tensor]:
        """The current stream's V-split scratch (None before its first V-split step)."""
        return self._scratch.current()

    @property
    def counters(self) -> Optional[torch.Tensor]:
        """The current stream's per-item counters (None before its first V-split step)."""
        return self._counters.current()

    def __call__(self, args: KdaArgs, build: ItemBuild = ITEM_NV1) -> None:
        cfg = self.cfg
        R = args.state_indices.shape[0]
        if R == 0:
            return
        n_items = R * cfg.num_heads
        if build.nv > 1:
            scr = self._scratch.get(n_items * cfg.T * D)
            ctr = self._counters.get(n_items)
        else:
            scr = ctr = args.x                  # never dereferenced
        with interpreter_quiet(self.interp):
            build.kernel[(n_items * build.nv,)](
                *kernel_operands(args), scr, ctr, 0, args.state.shape[0], 0, 0, *self._scalars,
                **build.constants(cfg, self.interp), ROWS16=rows16(args),
                **build.options(self.interp))


__all__ = ["ItemBuild", "ItemStep", "ITEM_NV1", "ITEM_NV2", "ITEM_NV4", "BUILDS"]
