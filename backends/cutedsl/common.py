"""The per-item math of the one-CTA-per-item CuTe DSL kernel (:mod:`kda.backends.cutedsl.wide`).

One *item* is one (request r, head h), ``item = r * H + h``. A CTA of 256 threads processes
an item in these phases (the contract: ``docs/contract.md``):

* staging (:meth:`ItemMath.issue_state`, :meth:`ItemMath.issue_operands`,
  :meth:`ItemMath.load_window`, :meth:`ItemMath.load_beta`): the 64 KiB state page is copied
  with 16-byte ``cp.async`` into a [16 chunk, 256 thread, 4] fp32 shared buffer (a bf16 page:
  8-byte copies of the same chunks, widened to fp32 on the way to registers, and stored back
  rounded once to nearest even, so the arithmetic is the fp32 page's; every thread
  stages exactly the chunks it later owns, so no barrier is needed to consume them); the
  token rows of x (q|k|v of head h) and of the output gate are staged the same way, and so
  is the conv-window history in the SD layout (DS: per-channel register loads); the beta
  logits go to registers.
* :meth:`ItemMath.head_loads` + :meth:`ItemMath.gate`: the gate projection on the tensor
  cores (``mma.sync m16n8k16`` bf16 -> fp32, warp w computes key features 16w..16w+15 for 8
  token columns over 8 k-steps; gate_mode 0 one accumulator chain, gate_mode 1 four chains
  combined ((c0+c1)+c2)+c3), rounded once to bf16, and the decay. It needs no staged data
  (A fragments = f_b rows, B fragments = f_a rows, both from global), so the kernels run it
  while the staging lands.
* :meth:`ItemMath.phase_a`: conv + SiLU (threads 0-127: q and k channel ``tid``;
  128-255: v channel ``tid-128``) with the window rewritten in place, per-warp sums of q^2
  and k^2, beta, the q/k L2 normalization and the output-gate sigmoids. Then
  :meth:`ItemMath.load_state_regs` moves the state page into registers: thread ``tid`` owns
  value rows ``tid//8 + 32m`` (m = 0..3) and key columns ``4*(tid%8 + 8c) .. +3`` (c = 0..3).
  A row's 8 lanes are consecutive, so one warp instruction of the page's loads / stores covers
  4 rows x 128 contiguous bytes (whole L2 lines).
* :meth:`ItemMath.phase_b`: the delta-rule recurrence per token,
  :func:`kda.backends.cutedsl.item.token` (decay, S.k, u, rank-1 update, S.q, row sums in a
  fixed order, o rounded to bf16), the state stores (per token for T > 1) or the record rows,
  and the gated RMSNorm epilogue.

The split and streamed kernels (:mod:`kda.backends.cutedsl.split`,
:mod:`kda.backends.cutedsl.stream`) run the same recurrence and compute every other value in
the same order (the same conv per channel, warp-then-quarter norm sums, MMA chains), so the
family is bit-identical. All arithmetic that feeds a rounding point is written with explicit
``mul.rn`` / ``add.rn`` / ``fma.rn`` so no compiler-chosen contraction can make them differ.

Numerics (contract section 3): FP32 everywhere, bf16 rounding of y (conv output), rg (gate
projection), o and out; transcendental functions use the approximate hardware instructions
(ex2/rcp/rsqrt.approx), which the contract allows, except the precise log1p of the softplus.
Shapes: D = 128, H heads, T <= 8 tokens; slot offsets and row offsets are 64-bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from kda.backends.cutedsl import item, ptx as P
from kda.backends.cutedsl.problem import Problem
from kda.backends.cutedsl.static import SmemPlan

D = 128
NTHREADS = 256


class ItemMath:
    """Per-item device code for one :class:`Problem` and the one-CTA schedule's
    ``page_last`` (:class:`kda.backends.cutedsl.schedule.Schedule`).

    The methods are called while a kernel is traced. ``p`` is the kernel's
    ``SimpleNamespace`` of runtime values (pointers, strides, thread coordinates, the shared
    buffer's address); ``desc`` is an Int32 register tensor holding the item descriptor
    ``[r, h, src, conv_slot, off, live]``; ``wreg`` an Int32 register tensor with the raw
    window history (q or v channel: 0..2, k channel: 3..5) and the raw beta logit (6).
    """

    def __init__(self, pb: Problem, page_last: bool):
        self.pb = pb
        self.page_last = page_last
        self.T = pb.T
        self.H = pb.H
        self.dim = pb.H * D
        self.plan = SmemPlan(pb.T)

    # ------------------------------------------------------------------ item descriptors
    # The slot ids of a request are T+1 raw values: state_indices[r, 0..T-1] and (T > 1) the
    # accepted count. Phase B reads the per-token write slots from the shared array
    # SL[0].
    def slot_values(self, p, item, valid):
        """All raw slot values of ``item``'s request, loaded by every thread (uniform loads).

        Returns (slots, accepted): T Int32 values and the raw accepted count (0 for T = 1).
        """
        T = self.T
        r, _ = self.item_rh(p, item)
        vals = [P.gld_nc_b32_or0(p.state_indices + (r * T + t), valid) for t in range(T)]
        na = P.gld_nc_b32_or0(p.num_accepted_tokens + r, valid) if T > 1 else Int32(0)
        return vals, na

    def stage_slot_values(self, p, vals, na, q):
        """Thread 0 writes the raw slot values to SL[q] (read after the next barrier)."""
        base = p.sb + self.plan.SL + q * 64
        first = Int32(p.tid == 0)
        for t in range(self.T):
            P.sst_b32(base + 4 * t, vals[t], first)
        P.sst_b32(base + 4 * self.T, na, first)

    def item_rh(self, p, item):
        """(request r, head h) of ``item``: item = r*H + h."""
        r = item // self.H
        return r, item - r * self.H

    def make_desc(self, p, item, valid, vals, na, desc):
        """Item descriptor from the raw slot values (contract section 2, liveness).

        T = 1: src = conv_slot = state_indices[r], off = 0. T > 1: a = clamp(accepted, 1, T),
        src = state_indices[r, a-1], conv_slot = state_indices[r, 0], off = a-1. The item is
        live iff ``valid`` and 0 < src < slots and 0 < conv_slot < slots.
        """
        T = self.T
        r, h = self.item_rh(p, item)
        cslot = vals[0]
        if T == 1:
            src = cslot
            off = Int32(0)
        else:
            a = P.clamp_i32(na, 1, T)
            off = a - 1
            src = cslot
            for t in range(1, T):
                src = P.sel_i32(Int32(off == t), vals[t], src)
        live = P.live_flag(src, cslot, p.slots, valid)
        desc[0] = r
        desc[1] = h
        desc[2] = src
        desc[3] = cslot
        desc[4] = off
        desc[5] = live

    # ------------------------------------------------------------------------- staging
    def issue_first(self, p, desc, wreg):
        """A kernel's first item: the window history, the x / output-gate rows and beta as one
        cp.async group, then, with ``page_last``, the state page as a group of
        its own (phase A may then run while it lands); without it the page is issued first, in
        that one group."""
        if not self.page_last:
            self.issue_state(p, desc)
        self.load_window(p, desc, wreg)
        self.issue_operands(p, desc)
        self.load_beta(p, desc, wreg)
        P.cp_async_commit()
        if self.page_last:
            self.issue_state(p, desc)
            P.cp_async_commit()

    def issue_state(self, p, desc):
        """cp.async this thread's 16 chunks of the state page ``state[src, h]`` (if live):
        16 bytes each (fp32), or 8 (bf16, into [16 chunk][256 thread][8 bytes])."""
        h, src, live = desc[1], desc[2], desc[5]
        base = p.state + (Int64(src) * p.state_ss + Int64(h * (D * D) + p.row0 * D + 4 * p.l8))
        if self.pb.state_bf16:
            offs = [(j * 2048, _chunk_offset(j) // 2) for j in range(16)]
            P.cp_async8_multi(p.sb + self.plan.ST + p.tid * 8, base, offs, live)
        else:
            offs = [(j * 4096, _chunk_offset(j)) for j in range(16)]
            P.cp_async16_multi(p.sb + self.plan.ST + p.tid * 16, base, offs, live)

    def issue_operands(self, p, desc):
        """cp.async the token rows of x (q|k|v of head h) and output gate (if live): 16-byte
        copies, or with :attr:`Problem.row_bytes` < 16 :meth:`_issue_rows_narrow`."""
        if self.pb.row_bytes != 16:
            self._issue_rows_narrow(p, desc)
            return
        T, dim, pl = self.T, self.dim, self.plan
        r, h, live = desc[0], desc[1], desc[5]
        tid = p.tid
        nx = 48 * T
        for i in range((nx + NTHREADS - 1) // NTHREADS):
            ch = tid + NTHREADS * i
            t = ch // 48
            m = ch - t * 48
            part = m >> 4
            piece = m & 15
            gp = p.x + (Int64(r * T + t) * p.x_rs + (part * dim + h * D + piece * 8))
            if (NTHREADS * (i + 1) <= nx):
                ok = live
            else:
                ok = live & Int32(ch < nx)
            P.cp_async16(p.sb + pl.SX + ch * 16, gp, ok)
        # output gate rows: threads 0 .. 16T-1
        t = tid >> 4
        piece = tid & 15
        gp = p.output_gate + (Int64(r * T + t) * p.og_rs + (h * D + piece * 8))
        P.cp_async16(p.sb + pl.SOG + tid * 16, gp, live & Int32(tid < 16 * T))

    def _issue_rows_narrow(self, p, desc):
        """The rows of :meth:`issue_operands` when they are not 16-byte aligned (an engine's
        packed projection with H % 8 != 0 heads), into the same staging layout: 8- or 4-byte
        ``cp.async`` (row_bytes 8 / 4, in the same group), or for 2-byte aligned rows two
        pairs of 16-bit loads per 8-byte piece and one shared store (complete at once; the
        barrier after the wait publishes them with the copies)."""
        T, dim, pl = self.T, self.dim, self.plan
        rb = self.pb.row_bytes
        ew = 2 if rb == 4 else 4                # elements per piece
        per = D // ew                           # pieces per 128-element row
        r, h, live = desc[0], desc[1], desc[5]
        tid = p.tid

        def copy_rows(nrows, row_ptr, row_smem):
            """``nrows`` rows of 128 elements: row i from ``row_ptr(i)`` to ``row_smem(i)``."""
            n = nrows * per
            for i in range((n + NTHREADS - 1) // NTHREADS):
                ci = tid + NTHREADS * i
                row = ci // per
                e = (ci - row * per) * ew
                gp = row_ptr(row) + e
                sa = p.sb + row_smem(row) + e * 2
                ok = live if NTHREADS * (i + 1) <= n else live & Int32(ci < n)
                if rb == 2:
                    P.sst_v2_b32(sa, P.gld_nc_u16x2_or0(gp, ok), P.gld_nc_u16x2_or0(gp + 2, ok),
                                 ok)
                else:
                    P.cp_async_ca(sa, gp, rb, ok)

        # x: row 3t + part is token t's q, k or v slice of head h; then the output gate rows
        copy_rows(3 * T, lambda row: p.x + (Int64(r * T + row // 3) * p.x_rs
                                            + ((row - (row // 3) * 3) * dim + h * D)),
                  lambda row: pl.SX + row * (2 * D))
        copy_rows(T, lambda row: p.output_gate + (Int64(r * T + row) * p.og_rs + h * D),
                  lambda row: pl.SOG + row * (2 * D))

    def _window_ptr(self, p, cslot, ch, pos):
        """Address of conv_state[cslot, ch, pos] in either layout (64-bit slot offset)."""
        if (self.pb.layout == "SD"):
            return p.conv_state + (Int64(cslot) * p.cs_ss + Int64(pos * (3 * self.dim) + ch))
        return p.conv_state + (Int64(cslot) * p.cs_ss + Int64(ch * self.pb.L + pos))

    def _load_raw(self, gp, pred):
        if (self.pb.cs_bf16):
            return P.gld_cg_u16_or0(gp, pred)
        return P.gld_cg_b32_or0(gp, pred)

    def load_window(self, p, desc, wreg):
        """Stage the history conv_state[conv_slot, c, off..off+2] of the item's 384 channels.

        SD (window-first) layout: each history position holds the head's q, k and v channels
        contiguously, so the 3 x 3 x 256 B (bf16; 512 B fp32) are copied with 16-byte
        ``cp.async`` into the SW buffer [3 pos][3 part][128] (cache dtype). DS (dim-first):
        the three values of a channel are contiguous but not aligned, so each thread loads
        its own channels' values into ``wreg`` (q or v channel: 0..2, k channel: 3..5).
        Both paths read through L2 (the previous step, possibly a PDL predecessor, wrote them).
        """
        h, cslot, off, live = desc[1], desc[3], desc[4], desc[5]
        tid = p.tid
        if self.pb.layout == "SD":
            esz = 2 if self.pb.cs_bf16 else 4
            pieces = 256 // 16 * esz // 2          # 16-byte pieces per 128-channel part
            n = 9 * pieces
            for i in range((n + NTHREADS - 1) // NTHREADS):
                ci = tid + NTHREADS * i
                pos = ci // (3 * pieces)
                rem = ci - pos * (3 * pieces)
                part = rem // pieces
                piece = rem - part * pieces
                gp = self._window_ptr(p, cslot, part * self.dim + h * D + piece * (16 // esz),
                                      off + pos)
                ok = live if NTHREADS * (i + 1) <= n else live & Int32(ci < n)
                P.cp_async16(p.sb + self.plan.SW + ci * 16, gp, ok)
        else:
            d = tid & 127
            ch_a = (tid >> 7) * (2 * self.dim) + h * D + d      # q (tid < 128) or v channel
            ch_b = self.dim + h * D + d                          # k channel (tid < 128 only)
            ok_b = live & Int32(tid < 128)
            for j in range(3):
                wreg[j] = self._load_raw(self._window_ptr(p, cslot, ch_a, off + j), live)
                wreg[3 + j] = self._load_raw(self._window_ptr(p, cslot, ch_b, off + j), ok_b)

    def _history(self, p, part, d, wreg, base):
        """Raw history values (3) of channel (part, d): from SW (SD) or ``wreg[base..]`` (DS)."""
        if self.pb.layout == "SD":
            esz = 2 if self.pb.cs_bf16 else 4
            addr = p.sb + self.plan.SW + (part * D) * esz + d * esz
            if self.pb.cs_bf16:
                return [P.sld_u16(addr + pos * (3 * D * esz)) for pos in range(3)]
            return [P.sld_b32(addr + pos * (3 * D * esz)) for pos in range(3)]
        return [wreg[base], wreg[base + 1], wreg[base + 2]]

    def load_beta(self, p, desc, wreg):
        """Raw beta of token tid-128 (threads 128 .. 128+T-1): the bf16 logit's bits, or with
        :attr:`Problem.beta_activated` the fp32 value's."""
        r, h, live = desc[0], desc[1], desc[5]
        tb = p.tid - 128
        ok = live & Int32(tb >= 0) & Int32(tb < self.T)
        gp = p.beta + (Int64(r * self.T + tb) * p.beta_rs + h)
        if self.pb.beta_activated:
            wreg[6] = P.gld_nc_b32_or0(gp, ok)
        else:
            wreg[6] = P.gld_nc_u16_or0(gp, ok)

    def write_zeros(self, p, desc):
        """A dead item: its T output rows are exact zeros; nothing else is written (16-byte
        stores, or element stores on rows that are not 16-byte aligned)."""
        r, h = desc[0], desc[1]
        tid = p.tid
        if self.pb.row_bytes != 16:
            for i in range((self.T * D + NTHREADS - 1) // NTHREADS):
                idx = tid + NTHREADS * i
                t = idx >> 7
                gp = p.out + (Int64(r * self.T + t) * p.out_rs + (h * D + (idx & 127)))
                P.gst_b16(gp, Int32(0), Int32(t < self.T))
            return
        t = tid >> 4
        piece = tid & 15
        gp = p.out + (Int64(r * self.T + t) * p.out_rs + (h * D + piece * 8))
        P.gst_v4_zero(gp, Int32(tid < 16 * self.T))

    # --------------------------------------------------------------------------- phase A
    def _conv(self, p, h, cslot, part, d, hist_raw, w, acc0):
        """Conv + SiLU of channel ``part*dim + h*128 + d`` for the T tokens; rewrites the window.

        acc = bias (or 0); acc = fma(s[t+e], w[e], acc) for e = 0..3 over
        s = [w0, w1, w2, x_0 .. x_{T-1}]; y_t = bf16(silu(acc)). The window becomes
        [w1, w2, x_0 .. x_{T-1}] (positions 0..T+1), raw values in the cache dtype.
        ``w`` (4 taps) and ``acc0`` (bias or 0) come from :meth:`head_loads`.
        """
        pb, T, dim = self.pb, self.T, self.dim
        ch = part * dim + h * D + d
        store_ok = Int32(1)
        if (pb.cs_bf16):
            hist = [P.bf16_bits_to_f32(hr) for hr in hist_raw]
        else:
            hist = [P.f32_from_bits(hr) for hr in hist_raw]
        xraw = [P.sld_u16(p.sb + (self.plan.SX + ((t * 3 + part) * D) * 2) + d * 2)
                for t in range(T)]
        xs = [P.bf16_bits_to_f32(xr) for xr in xraw]
        ys = item.conv_silu(hist + xs, w, acc0, T)
        # window rewrite: all history was read (registers) before this point
        if (pb.cs_bf16):
            new = [hist_raw[1], hist_raw[2]] + xraw
            for pos in range(T + 2):
                P.gst_b16(self._window_ptr(p, cslot, ch, pos), new[pos], store_ok)
        else:
            new = [hist_raw[1], hist_raw[2]] + [P.f32_bits(xv) for xv in xs]
            for pos in range(T + 2):
                P.gst_b32(self._window_ptr(p, cslot, ch, pos), new[pos], store_ok)
        return ys

    def head_loads(self, p, h):
        """Issue every per-head global load of phase A at once (they stay in L2).

        Conv taps and bias of this thread's channels (q or v: ``wa``/``ba``; k: ``wb``/``bb``,
        threads 0-127 only), the f_b A fragments of the gate MMA (``fb``), the two dt_bias
        values of this thread's MMA rows and A_log[h].
        """
        pb, dim = self.pb, self.dim
        tid = p.tid
        d = tid & 127
        part_a = (tid >> 7) * 2
        is_qk = Int32(tid < 128)
        hp = SimpleNamespace()
        hp.wa, hp.wb = [], []
        for e in range(4):
            pa = p.conv_weight + (part_a * (4 * dim) + e * dim + h * D + d)
            pk = p.conv_weight + (4 * dim + e * dim + h * D + d)
            if pb.cw_bf16:
                hp.wa.append(P.bf16_bits_to_f32(P.gld_nc_u16(pa)))
                hp.wb.append(P.bf16_bits_to_f32(P.gld_nc_u16_or0(pk, is_qk)))
            else:
                hp.wa.append(P.gld_nc_f32(pa))
                hp.wb.append(P.gld_nc_f32_or0(pk, is_qk))
        if pb.has_bias:
            hp.ba = P.gld_nc_f32(p.conv_bias + (part_a * dim + h * D + d))
            hp.bb = P.gld_nc_f32_or0(p.conv_bias + (dim + h * D + d), is_qk)
        else:
            hp.ba = Float32(0.0)
            hp.bb = Float32(0.0)
        krow = p.warp * 16 + p.g
        fb0 = p.f_b + ((h * D + krow) * D + 2 * p.tig)
        fb8 = fb0 + 8 * D
        hp.fb = [(P.gld_nc_b32(fb0 + 16 * s), P.gld_nc_b32(fb8 + 16 * s),
                  P.gld_nc_b32(fb0 + (16 * s + 8)), P.gld_nc_b32(fb8 + (16 * s + 8)))
                 for s in range(8)]
        hp.dtb = [P.gld_nc_f32(p.dt_bias + (h * D + krow)),
                  P.gld_nc_f32(p.dt_bias + (h * D + krow + 8))]
        hp.alog = P.gld_nc_f32(p.A_log + h)
        return hp

    def gate_b(self, p, desc):
        """The gate MMA's B fragments: this thread's words of the f_a rows (global; rows only
        2-byte aligned: each word from two 16-bit loads)."""
        T, r = self.T, desc[0]
        gvalid = Int32(p.g < T)
        fa_row = p.f_a + (Int64(r * T + p.g) * p.fa_rs + 2 * p.tig)
        load = P.gld_nc_u16x2_or0 if self.pb.row_bytes == 2 else P.gld_nc_b32_or0
        return [(load(fa_row + 16 * s, gvalid), load(fa_row + (16 * s + 8), gvalid))
                for s in range(8)]

    def gate(self, p, desc, hp):
        """Gate projection on the tensor cores, decay alpha into shared memory, rg record.

        rg[k, t] = bf16(sum_j f_b[h*128+k, j] * f_a[n_t, j]); x = rg + dt_bias;
        gk = -exp(A_log) * softplus(x) (or lower_bound * sigmoid(exp(A_log) * x));
        alpha = exp(gk). A fragments from :meth:`head_loads` (global), B fragments = f_a rows
        from global (:meth:`gate_b`): it needs no staged data, so the kernels run it before
        waiting for the staging; it only writes CA (free once the previous item's phase B is
        over).
        """
        pb, T, pl = self.pb, self.T, self.plan
        r, h, cslot = desc[0], desc[1], desc[3]
        g, tig = p.g, p.tig
        krow = p.warp * 16 + g
        a = hp.fb
        b = self.gate_b(p, desc)
        zero = Float32(0.0)
        if (pb.gate_mode == 0):
            c = (zero, zero, zero, zero)
            for s in range(8):
                c = P.mma_bf16(*a[s], *b[s], *c)
        else:
            chains = []
            for q in range(4):
                c = P.mma_bf16(*a[2 * q], *b[2 * q], zero, zero, zero, zero)
                c = P.mma_bf16(*a[2 * q + 1], *b[2 * q + 1], *c)
                chains.append(c)
            c = tuple(P.fadd(P.fadd(P.fadd(chains[0][i], chains[1][i]), chains[2][i]),
                             chains[3][i]) for i in range(4))
        A = P.fexp(hp.alog)
        if (pb.bounded):
            coef = A
        else:
            coef = P.fsub(zero, A)
        rec_base = (Int64(cslot) * self.H + Int64(h)) * (T * 2 * D)
        for i in range(4):
            kk = krow + 8 * (i // 2)
            t = 2 * tig + (i % 2)
            valid = Int32(t < T)
            rg = P.bf16_round(c[i])
            xg = P.fadd(rg, hp.dtb[i // 2])
            if (pb.bounded):
                gk = P.fmul(p.lb, P.sigmoid(P.fmul(coef, xg)))
            else:
                gk = P.fmul(coef, P.softplus(xg))
            P.sst_f32(p.sb + pl.CA + (t * D + kk) * 4, P.fexp(gk), valid)
            if (pb.record):
                P.gst_b16(p.kg_record + (rec_base + Int64(t * (2 * D) + D + kk)),
                          P.f32_bits(rg) >> 16, valid)

    def phase_a(self, p, desc, hp, wreg, ogr):
        """Conv, norms and output gate of a live item (after :meth:`gate`; module docstring).

        Reads the staged rows, ``hp`` (:meth:`head_loads`) and ``wreg``; leaves q-hat, k-hat,
        v and beta in shared memory and the sigmoid of this thread's output-gate values in
        ``ogr``. Contains one block barrier. The state page is moved to registers separately
        (:meth:`load_state_regs`).
        """
        T, pl = self.T, self.plan
        self._phase_a_conv(p, desc, wreg, hp)
        P.bar_sync()
        self._phase_a_norm(p)
        # output gate of this thread's epilogue tokens t = tid//128 + 2i, channel tid%128
        half = p.tid >> 7
        v = p.tid & 127
        for i in range((T + 1) // 2):
            t = half + 2 * i
            raw = P.sld_u16(p.sb + pl.SOG + (t * D + v) * 2)
            ogr[i] = P.sigmoid(P.bf16_bits_to_f32(raw))

    def load_state_regs(self, p, S):
        """The staged state page: shared -> registers (own chunks only: no barrier needed; bf16
        widened to fp32)."""
        for j in range(16):
            if self.pb.state_bf16:
                s0, s1, s2, s3 = P.sld_bf16x4(p.sb + (self.plan.ST + j * 2048) + p.tid * 8)
            else:
                s0, s1, s2, s3 = P.sld_v4(p.sb + (self.plan.ST + j * 4096) + p.tid * 16)
            m, c = j // 4, j % 4
            S[m, 4 * c + 0] = s0
            S[m, 4 * c + 1] = s1
            S[m, 4 * c + 2] = s2
            S[m, 4 * c + 3] = s3

    @cute.jit
    def _phase_a_conv(self, p, desc, wreg, hp):
        if p.tid < 128:
            self._conv_qk(p, desc, wreg, hp)
        else:
            self._conv_v(p, desc, wreg, hp)

    def _conv_qk(self, p, desc, wreg, hp):
        """Threads 0-127: q and k channel ``tid``; per-warp sums of squares; k record."""
        pb, T, pl = self.pb, self.T, self.plan
        r, h, cslot = desc[0], desc[1], desc[3]
        d = p.tid
        yq = self._conv(p, h, cslot, 0, d, self._history(p, 0, d, wreg, 0), hp.wa, hp.ba)
        yk = self._conv(p, h, cslot, 1, d, self._history(p, 1, d, wreg, 3), hp.wb, hp.bb)
        lane0 = Int32(p.lane == 0)
        rec_base = (Int64(cslot) * self.H + Int64(h)) * (T * 2 * D)
        for t in range(T):
            P.sst_f32(p.sb + pl.CQ + (t * D + d) * 4, yq[t])
            P.sst_f32(p.sb + pl.CK + (t * D + d) * 4, yk[t])
            sq = P.warp_sum(P.fmul(yq[t], yq[t]))
            sk = P.warp_sum(P.fmul(yk[t], yk[t]))
            P.sst_f32(p.sb + pl.CRQ + (t * 4 + p.warp) * 4, sq, lane0)
            P.sst_f32(p.sb + pl.CRK + (t * 4 + p.warp) * 4, sk, lane0)
            if pb.record:
                P.gst_b16(p.kg_record + (rec_base + Int64(t * (2 * D) + d)),
                          P.f32_bits(yk[t]) >> 16, Int32(1))

    def _conv_v(self, p, desc, wreg, hp):
        """Threads 128-255: v channel ``tid-128``; beta of token ``tid-128``."""
        T, pl = self.T, self.plan
        h, cslot = desc[1], desc[3]
        d = p.tid - 128
        yv = self._conv(p, h, cslot, 2, d, self._history(p, 2, d, wreg, 0), hp.wa, hp.ba)
        for t in range(T):
            P.sst_f32(p.sb + pl.CV + (t * D + d) * 4, yv[t])
        addr = p.sb + pl.CB + d * 4
        if self.pb.beta_activated:      # the engine's sigmoid(beta), used as it is
            beta = P.f32_from_bits(wreg[6])
        else:
            beta = P.sigmoid(P.bf16_bits_to_f32(wreg[6]))
        P.sst_f32(addr, beta, Int32(d < T))

    @cute.jit
    def _phase_a_norm(self, p):
        if p.tid < 128:
            self._norm(p)

    def _norm(self, p):
        """q-hat = q * rsqrt(sum q^2 + 1e-6) * scale, k-hat = k * rsqrt(sum k^2 + 1e-6)."""
        pl = self.plan
        tid = p.tid
        for t in range(self.T):
            rq = p.sb + pl.CRQ + t * 16
            rk = p.sb + pl.CRK + t * 16
            sq = item.quarter_sum(lambda i, rq=rq: P.sld_f32(rq + 4 * i))
            sk = item.quarter_sum(lambda i, rk=rk: P.sld_f32(rk + 4 * i))
            iq = item.inv_norm(sq)
            ik = item.inv_norm(sk)
            aq = p.sb + pl.CQ + (t * D + tid) * 4
            ak = p.sb + pl.CK + (t * D + tid) * 4
            P.sst_f32(aq, item.q_hat(P.sld_f32(aq), iq, p.scale))
            P.sst_f32(ak, P.fmul(P.sld_f32(ak), ik))

    # --------------------------------------------------------------------------- phase B
    def _store_state(self, p, slot, h, S, ok):
        """Stores of this thread's 64 state values to state[slot, h] where ``ok``: 16 bytes per
        chunk (fp32), or 8 rounded to bf16 once (nearest even)."""
        base = p.state + (Int64(slot) * p.state_ss + Int64(h * (D * D) + p.row0 * D + 4 * p.l8))
        for j in range(16):
            x = [S[j // 4, 4 * (j % 4) + e] for e in range(4)]
            if self.pb.state_bf16:
                P.gst_bf16x4_off(base, _chunk_offset(j) // 2, *x, ok)
            else:
                P.gst_v4_f32_off(base, _chunk_offset(j), *x, ok)

    def phase_b(self, p, desc, q, S, ogr):
        """The recurrence over the T tokens, state stores / records, and the epilogue.

        Per token :func:`kda.backends.cutedsl.item.token` on the thread's rows ``row0 + 32m``
        (``S``: :func:`kda.backends.cutedsl.item.state_regs` of 4 rows). Then
        out = bf16(ob * rsqrt(mean(ob^2) + eps) * norm_weight * sigmoid(gate)). Contains two
        block barriers.
        """
        pb, T, pl = self.pb, self.T, self.plan
        r, h, src, cslot = desc[0], desc[1], desc[2], desc[3]
        sb = p.sb
        lane_l0 = Int32(p.l8 == 0)
        rec_base = (Int64(cslot) * self.H + Int64(h)) * (T * D)
        for t in range(T):
            tb = t * D * 4

            def emit(m, u, ob, tb=tb, t=t):     # on every lane: stores predicated on lane 0
                P.sst_f32(sb + pl.CO + tb + (p.row0 + 32 * m) * 4, ob, lane_l0)
                if pb.record:
                    P.gst_f32(p.v_record + (rec_base + Int64(t * D) + Int64(p.row0 + 32 * m)), u,
                              lane_l0)

            beta = P.sld_f32(sb + pl.CB + 4 * t)
            item.token(S, _smem_row(sb + pl.CA + tb), _smem_row(sb + pl.CK + tb),
                        _smem_row(sb + pl.CQ + tb), beta,
                        lambda m, tb=tb: P.sld_f32(sb + pl.CV + tb + (p.row0 + 32 * m) * 4),
                        p.l8, emit, lane0_only=False)
            if T > 1 and not pb.record:
                dst = P.sld_b32(sb + pl.SL + q * 64 + 4 * t)
                ok = Int32(dst > 0) & Int32(dst < p.slots)
                self._store_state(p, dst, h, S, ok)
        if (T == 1 and not pb.record):
            self._store_state(p, src, h, S, Int32(1))
        P.bar_sync()
        self._epilogue(p, r, h, ogr)

    def _epilogue(self, p, r, h, ogr):
        """Gated RMSNorm: warp sums of ob^2, then the 4 warps of a token half, fixed order."""
        T, pl = self.T, self.plan
        sb = p.sb
        half = p.tid >> 7
        v = p.tid & 127
        wq = (p.tid >> 5) & 3
        lane0 = Int32(p.lane == 0)
        obs = []
        for i in range((T + 1) // 2):
            t = half + 2 * i
            # odd T: the last pass of the upper half has no token (t == T; its results are
            # not stored), so it reads row T-1 rather than past the o buffer
            row = t if 2 * i + 1 < T else Int32(T - 1)
            ob = P.sld_f32(sb + pl.CO + (row * D + v) * 4)
            sq = P.warp_sum(P.fmul(ob, ob))
            if (2 * i + 1 < T):
                P.sst_f32(sb + pl.CRO + (t * 4 + wq) * 4, sq, lane0)
            else:
                P.sst_f32(sb + pl.CRO + (t * 4 + wq) * 4, sq, lane0 & Int32(t < T))
            obs.append(ob)
        P.bar_sync()
        for i in range((T + 1) // 2):
            t = half + 2 * i
            rr = sb + pl.CRO + t * 16
            ssum = item.quarter_sum(lambda j, rr=rr: P.sld_f32(rr + 4 * j))
            y = item.gated_rmsnorm(obs[i], ssum, p.eps, p.nwv, ogr[i])
            gp = p.out + (Int64(r * T + t) * p.out_rs + (h * D + v))
            if (2 * i + 1 < T):
                ok = Int32(1)
            else:
                ok = Int32(t < T)
            P.gst_b16(gp, P.bf16_bits(y), ok)


def _smem_row(addr):
    """The 128 fp32 at shared-memory byte address ``addr`` as a tensor."""
    return cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.smem, assumed_align=16),
                            cute.make_layout((D,)))


def thread_coords(tid):
    """Per-thread constants: lane, warp, MMA group/thread-in-group, state row and column lane."""
    return dict(tid=tid, lane=tid & 31, warp=tid >> 5, g=(tid & 31) >> 2, tig=tid & 3,
                row0=tid >> 3, l8=tid & 7)


def _chunk_offset(j):
    """Byte offset, from the thread's first element, of its state chunk j = 4m + c (16 bytes:
    row row0 + 32m, key columns 4*(l8 + 8c) .. +3)."""
    return ((j // 4) * 32 * D + 32 * (j % 4)) * 4


def load_norm_weight(pb: Problem, nw_ptr, tid):
    """norm_weight[tid % 128] as fp32 (shared by all heads: loaded once per CTA)."""
    v = tid & 127
    if pb.nw_bf16:
        return P.bf16_bits_to_f32(P.gld_nc_u16(nw_ptr + v))
    return P.gld_nc_f32(nw_ptr + v)


def make_params(pb: Problem, sb, tid, a) -> SimpleNamespace:
    """The SimpleNamespace of runtime values the ItemMath methods read: the kernel's arguments
    ``a`` (:class:`kda.backends.cutedsl.args.KernelArgs`), the shared-memory base ``sb`` and
    the thread's coordinates."""
    p = SimpleNamespace(sb=sb, **thread_coords(tid), **a._asdict())
    p.nwv = load_norm_weight(pb, p.norm_weight, tid)
    return p


__all__ = ["ItemMath", "make_params", "Problem", "SmemPlan", "D", "NTHREADS"]
