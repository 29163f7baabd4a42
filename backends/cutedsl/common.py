"""The per-item math of the one-CTA-per-item CuTe DSL kernel (:mod:`kda.backends.cutedsl.wide`).

One *item* is one (request r, head h), ``item = r * H + h``. A CTA of 256 threads processes
an item in these phases (the contract: ``docs/contract.md``). Global operands are the
family's tensor views (:func:`kda.backends.cutedsl.args.make_views`), shared memory is the
kernel's storage struct (:func:`storage_fields`, viewed through :class:`Smem`):

* staging (:meth:`ItemMath.issue_state`, :meth:`ItemMath.issue_operands`,
  :meth:`ItemMath.load_window`, :meth:`ItemMath.load_beta`): the 64 KiB state page is copied
  with 16-byte ``cp.async.cg`` (CuTe's ``CopyG2SOp`` atom) into ``Smem.page`` [16 chunk, 256
  thread, 4] fp32 (a bf16 page: 8-byte ``cp.async.ca`` of the same chunks into [16, 256, 4]
  bf16, widened to fp32 on the way to registers, and stored back rounded once to nearest
  even, so the arithmetic is the fp32 page's); every thread stages exactly the chunks it
  later owns, so no barrier is needed to consume them. The token rows of x (q|k|v of head h)
  and of the output gate are staged the same way (8-element chunks; narrower copies for
  rows that are not 16-byte aligned), and so is the conv-window history in the SD layout
  (DS: per-channel register loads); the beta logits go to registers.
* :meth:`ItemMath.head_loads` + :meth:`ItemMath.gate`: the gate projection on the tensor
  cores (:mod:`kda.backends.cutedsl.gate`: ``mma.sync m16n8k16`` bf16 -> fp32, warp w
  computes key features 16w..16w+15 for 8 token columns over 8 k-steps; gate_mode 0 one
  accumulator chain, gate_mode 1 four chains combined ((c0+c1)+c2)+c3), rounded once to
  bf16, and the decay. It needs no staged data (A fragments = f_b rows, B fragments = f_a
  rows, both from global), so the kernel runs it while the staging lands.
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
the same order (the item rules and arithmetic of :mod:`kda.backends.cutedsl.item`, warp-then-
quarter norm sums, the gate of :mod:`kda.backends.cutedsl.gate`), so the family is
bit-identical. All arithmetic that feeds a rounding point is written with explicit
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
from cutlass import BFloat16, Float32, Int16, Int32
from cutlass.cute.nvgpu import cpasync

from kda.backends.cutedsl import item, ptx as P
from kda.backends.cutedsl.gate import decay, gate_mma, gate_tile
from kda.backends.cutedsl.item import chunk, reg_chunk, store4
from kda.backends.cutedsl.problem import Problem

D = 128
NTHREADS = 256


def storage_fields(T: int) -> dict:
    """The wide kernel's shared memory for T tokens, as :func:`cute.struct` fields (every
    region 16-byte aligned; the sizes of :class:`kda.backends.cutedsl.static.SmemPlan`).

    Staging: ``page`` the state page [16 chunk][256 thread][4] fp32 (a bf16 page uses its
    first half as [16][256][4] bf16); ``x`` the x rows [T][3 (q, k, v)][128] bf16; ``og`` the
    output-gate rows [T][128] bf16; ``win`` the conv-window history [3 pos][3 part][128] in
    the cache dtype (SD layout only; 4608 bytes). Per-item buffers: ``q``, ``k``, ``v``,
    ``a`` (alpha), ``o``: [T][128] fp32; ``beta`` [8] fp32; ``slots`` the raw slot ids and
    accepted count [32] int32; ``sq``, ``sk``, ``so``: per-warp sums of q^2, k^2, ob^2
    [T][4] fp32 (36 words each).
    """
    A, M = cute.struct.Align, cute.struct.MemRange
    return {
        "page": A[M[Float32, 16 * NTHREADS * 4], 128],
        "x": A[M[BFloat16, 3 * T * D], 16],
        "og": A[M[BFloat16, T * D], 16],
        "win": A[M[Float32, 9 * D], 16],
        "q": A[M[Float32, T * D], 16],
        "k": A[M[Float32, T * D], 16],
        "v": A[M[Float32, T * D], 16],
        "a": A[M[Float32, T * D], 16],
        "o": A[M[Float32, T * D], 16],
        "beta": A[M[Float32, 8], 16],
        "slots": A[M[Int32, 32], 16],
        "sq": A[M[Float32, 36], 16],
        "sk": A[M[Float32, 36], 16],
        "so": A[M[Float32, 36], 16],
    }


class Smem(SimpleNamespace):
    """The tensors of the storage struct (:func:`storage_fields`) for one :class:`Problem`."""

    def __init__(self, pb: Problem, storage):
        T = pb.T
        st = BFloat16 if pb.state_bf16 else Float32
        page = cute.make_tensor(cute.recast_ptr(storage.page.data_ptr(), dtype=st),
                                cute.make_layout((16, NTHREADS, 4), stride=(4 * NTHREADS, 4, 1)))
        cs = BFloat16 if pb.cs_bf16 else Float32
        win = cute.make_tensor(cute.recast_ptr(storage.win.data_ptr(), dtype=cs),
                               cute.make_layout((3, 3, D), stride=(3 * D, D, 1)))
        rows = cute.make_layout((T, D), stride=(D, 1))
        sums = cute.make_layout((T, 4), stride=(4, 1))
        super().__init__(
            page=page, win=win,
            x=storage.x.get_tensor(cute.make_layout((T, 3, D), stride=(3 * D, D, 1))),
            og=storage.og.get_tensor(rows),
            q=storage.q.get_tensor(rows), k=storage.k.get_tensor(rows),
            v=storage.v.get_tensor(rows), a=storage.a.get_tensor(rows),
            o=storage.o.get_tensor(rows),
            beta=storage.beta.get_tensor(cute.make_layout((8,))),
            slots=storage.slots.get_tensor(cute.make_layout((32,))),
            sq=storage.sq.get_tensor(sums), sk=storage.sk.get_tensor(sums),
            so=storage.so.get_tensor(sums))


def pieces(t: cute.Tensor, n: int) -> cute.Tensor:
    """A tensor whose last mode is contiguous as ``[..., size / n, n]``: its n-element pieces
    (the units of a copy), the same memory."""
    shape, stride = t.shape, t.stride
    return cute.make_tensor(t.iterator, cute.make_layout(
        (*shape[:-1], shape[-1] // n, n), stride=(*stride[:-1], n, 1)))


@cute.jit
def when(pred, fn: cutlass.Constexpr):
    """``fn()`` where ``pred`` (a run-time condition)."""
    if pred:
        fn()


@cute.jit
def load_or0(pred, read: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """``dtype(read())`` where ``pred``, else 0."""
    v = dtype(0)
    if pred:
        v = dtype(read())
    return v


def g2s_atom(dtype, nbytes: int):
    """The cp.async atom of ``nbytes`` per copy: 16 bytes through L2 only (``.cg``), else
    ``.ca`` (``.cg`` takes 16 bytes only)."""
    mode = cpasync.LoadCacheMode.GLOBAL if nbytes == 16 else cpasync.LoadCacheMode.ALWAYS
    return cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), dtype,
                               num_bits_per_copy=nbytes * 8)


class ItemMath:
    """Per-item device code for one :class:`Problem` and the one-CTA schedule's
    ``page_last`` (:class:`kda.backends.cutedsl.schedule.Schedule`).

    The methods are called while a kernel is traced. ``p`` is the kernel's
    ``SimpleNamespace`` of runtime values (:func:`make_params`: the global views ``g``, the
    shared tensors ``s``, scalars and thread coordinates); ``desc`` is an Int32 register
    tensor holding the item descriptor ``[r, h, src, conv_slot, off, live]``; ``ops`` the
    item's operand registers (:meth:`op_regs`).
    """

    def __init__(self, pb: Problem, page_last: bool):
        self.pb = pb
        self.page_last = page_last
        self.T = pb.T
        self.H = pb.H
        self.dim = pb.H * D
        self._raw_cs = Int16 if pb.cs_bf16 else Int32     # the cache's values as raw bits

    def op_regs(self, p):
        """Registers for the raw operands loaded before phase A: the DS window history (q or
        v channel: 0..2, k channel: 3..5) as the cache's raw bits, and beta (its dtype)."""
        return SimpleNamespace(
            hist=cute.make_rmem_tensor(cute.make_layout((6,)), self._raw_cs),
            beta=cute.make_rmem_tensor(cute.make_layout((1,)), p.g.beta.element_type))

    # ------------------------------------------------------------------ item descriptors
    def slot_values(self, p, r):
        """The raw slot values of request ``r`` (uniform loads by every thread): T slot ids and
        the accepted count (0 for T = 1)."""
        T = self.T
        vals = [p.g.state_indices[r, t] for t in range(T)]
        na = p.g.num_accepted_tokens[r] if T > 1 else Int32(0)
        return vals, na

    def stage_slot_values(self, p, vals, na):
        """Thread 0 writes the raw slot values to ``slots`` (read after the next barrier)."""
        def write():
            for t in range(self.T):
                p.s.slots[t] = vals[t]
            p.s.slots[self.T] = na
        when(p.tid == 0, write)

    def item_rh(self, item_):
        """(request r, head h) of ``item``: item = r*H + h."""
        r = item_ // self.H
        return r, item_ - r * self.H

    def make_desc(self, p, item_, vals, na, desc):
        """Item descriptor from the raw slot values (contract section 2, liveness:
        :func:`kda.backends.cutedsl.item.source_slot`, :func:`~kda.backends.cutedsl.item.is_live`;
        the conv slot is ``state_indices[r, 0]``)."""
        r, h = self.item_rh(item_)
        cslot = vals[0]
        src, off = item.source_slot(vals, na, self.T)
        desc[0] = r
        desc[1] = h
        desc[2] = src
        desc[3] = cslot
        desc[4] = off
        desc[5] = Int32(item.is_live(src, cslot, p.slots))

    # ------------------------------------------------------------------------- staging
    def issue_first(self, p, desc, ops):
        """The window history, the x / output-gate rows and beta as one cp.async group, then,
        with ``page_last``, the state page as a group of its own (phase A may then run while it
        lands); without it the page is issued first, in that one group."""
        if not self.page_last:
            self.issue_state(p, desc)
        self.load_window(p, desc, ops)
        self.issue_operands(p, desc)
        self.load_beta(p, desc, ops)
        cute.arch.cp_async_commit_group()
        if self.page_last:
            self.issue_state(p, desc)
            cute.arch.cp_async_commit_group()

    def issue_state(self, p, desc):
        """cp.async this thread's 16 chunks of the state page ``state[src, h]`` (if live) into
        ``page[j, tid]``: 16 bytes each (fp32), or 8 (bf16)."""
        h, src, live = desc[1], desc[2], desc[5]
        g, s = p.g, p.s
        atom = g2s_atom(g.state.element_type, 8 if self.pb.state_bf16 else 16)

        def copy():
            page = g.state[src, h, None, None]
            for j in range(16):
                m, c = j // 4, j % 4
                cute.copy(atom, chunk(page[p.row0 + 32 * m, None], p.l8, c),
                          s.page[j, p.tid, None])
        when(live != 0, copy)

    def issue_operands(self, p, desc):
        """cp.async the token rows of x (q|k|v of head h) and output gate (if live): 16-byte
        copies, or with :attr:`Problem.row_bytes` < 16 :meth:`_issue_rows_narrow`."""
        if self.pb.row_bytes != 16:
            self._issue_rows_narrow(p, desc)
            return
        T, dim, g, s = self.T, self.dim, p.g, p.s
        r, h, live = desc[0], desc[1], desc[5]
        tid = p.tid
        atom = g2s_atom(BFloat16, 16)
        gx = pieces(g.x, 8)                          # [N, 3*dim/8, 8]
        sx = pieces(cute.make_tensor(s.x.iterator, cute.make_layout((3 * T * D,))), 8)
        nx = 48 * T
        for i in range((nx + NTHREADS - 1) // NTHREADS):
            ch = tid + NTHREADS * i
            t = ch // 48
            m = ch - t * 48
            part = m >> 4
            piece = m & 15
            ok = live != 0 if NTHREADS * (i + 1) <= nx else (live != 0) & (ch < nx)
            when(ok, lambda ch=ch, t=t, part=part, piece=piece: cute.copy(
                atom, gx[r * T + t, part * (dim // 8) + h * (D // 8) + piece, None],
                sx[ch, None]))
        # output gate rows: threads 0 .. 16T-1
        t = tid >> 4
        piece = tid & 15
        gog = pieces(g.output_gate, 8)
        sog = pieces(cute.make_tensor(s.og.iterator, cute.make_layout((T * D,))), 8)
        when((live != 0) & (tid < 16 * T), lambda: cute.copy(
            atom, gog[r * T + t, h * (D // 8) + piece, None], sog[tid, None]))

    def _issue_rows_narrow(self, p, desc):
        """The rows of :meth:`issue_operands` when they are not 16-byte aligned (an engine's
        packed projection with H % 8 != 0 heads), into the same staging layout: 8- or 4-byte
        ``cp.async`` (row_bytes 8 / 4, in the same group), or for 2-byte aligned rows four
        16-bit loads per 8-byte piece and one 8-byte shared store (complete at once; the
        barrier after the wait publishes them with the copies)."""
        T, dim, g, s = self.T, self.dim, p.g, p.s
        rb = self.pb.row_bytes
        ew = 2 if rb == 4 else 4                # elements per piece
        per = D // ew                           # pieces per 128-element row
        r, h, live = desc[0], desc[1], desc[5]
        tid = p.tid
        atom = g2s_atom(BFloat16, rb) if rb != 2 else None

        def copy_rows(nrows, src_piece, dst):
            """``nrows`` rows of 128 elements: piece ``e`` of row ``i`` from ``src_piece(i,
            e)`` to ``dst[i * per + e]`` (``dst``: the staged rows as pieces)."""
            n = nrows * per
            for i in range((n + NTHREADS - 1) // NTHREADS):
                ci = tid + NTHREADS * i
                row = ci // per
                e = ci - row * per
                ok = live != 0 if NTHREADS * (i + 1) <= n else (live != 0) & (ci < n)
                if rb == 2:
                    def copy(row=row, e=e, ci=ci):
                        w = cute.make_rmem_tensor(cute.make_layout((ew,)), BFloat16)
                        src = src_piece(row, e)
                        for k in range(ew):
                            w[k] = src[k]
                        cute.autovec_copy(w, dst[ci, None])
                else:
                    def copy(row=row, e=e, ci=ci):
                        cute.copy(atom, src_piece(row, e), dst[ci, None])
                when(ok, copy)

        # x: row 3t + part is token t's q, k or v slice of head h; then the output gate rows
        gx = pieces(g.x, ew)
        gog = pieces(g.output_gate, ew)
        copy_rows(3 * T, lambda row, e: gx[r * T + row // 3,
                                            (row - (row // 3) * 3) * (dim // ew) + h * per + e,
                                            None],
                  pieces(cute.make_tensor(s.x.iterator, cute.make_layout((3 * T * D,))), ew))
        copy_rows(T, lambda row, e: gog[r * T + row, h * per + e, None],
                  pieces(cute.make_tensor(s.og.iterator, cute.make_layout((T * D,))), ew))

    def load_window(self, p, desc, ops):
        """Stage the history conv_state[conv_slot, c, off..off+2] of the item's 384 channels.

        SD (window-first) layout: each history position holds the head's q, k and v channels
        contiguously, so the 3 x 3 x 256 B (bf16; 512 B fp32) are copied with 16-byte
        ``cp.async`` into ``win`` [3 pos][3 part][128] (cache dtype). DS (dim-first): the three
        values of a channel are contiguous but not aligned, so each thread loads its own
        channels' values (raw bits) into ``ops.hist`` (q or v channel: 0..2, k channel: 3..5). Both paths
        read through L2 (the previous step, possibly a PDL predecessor, wrote them).
        """
        h, cslot, off, live = desc[1], desc[3], desc[4], desc[5]
        g, s, tid = p.g, p.s, p.tid
        cs = g.conv_state
        if self.pb.layout == "SD":
            epc = 8 if self.pb.cs_bf16 else 4      # elements per 16-byte piece
            per = D // epc                          # pieces per 128-channel part
            n = 9 * per
            atom = g2s_atom(cs.element_type, 16)
            # [slot, channel piece, position, element] (the slot stride: 16-byte multiples)
            gw = cute.make_tensor(cs.iterator, cute.make_layout(
                (cs.shape[0], 3 * self.dim // epc, cs.shape[2], epc),
                stride=(cute.assume(cs.stride[0], divby=epc), epc, 3 * self.dim, 1)))
            sw = pieces(cute.make_tensor(s.win.iterator, cute.make_layout((9 * D,))), epc)
            for i in range((n + NTHREADS - 1) // NTHREADS):
                ci = tid + NTHREADS * i
                pos = ci // (3 * per)
                rem = ci - pos * (3 * per)
                part = rem // per
                piece = rem - part * per
                ok = live != 0 if NTHREADS * (i + 1) <= n else (live != 0) & (ci < n)
                when(ok, lambda ci=ci, pos=pos, part=part, piece=piece: cute.copy(
                    atom, gw[cslot, part * (self.dim // epc) + h * per + piece, off + pos, None],
                    sw[ci, None]))
        else:
            d = tid & 127
            ch_a = (tid >> 7) * (2 * self.dim) + h * D + d      # q (tid < 128) or v channel
            ch_b = self.dim + h * D + d                          # k channel (tid < 128 only)
            ok_b = (live != 0) & (tid < 128)
            for j in range(3):
                ops.hist[j] = load_or0(
                    live != 0, lambda j=j: _load_cg(cs, (cslot, ch_a, off + j), self._raw_cs),
                    self._raw_cs)
                ops.hist[3 + j] = load_or0(
                    ok_b, lambda j=j: _load_cg(cs, (cslot, ch_b, off + j), self._raw_cs),
                    self._raw_cs)

    def _history(self, p, part, d, ops, base):
        """The 3 history values of channel (part, d), widened to fp32: from ``win`` (SD) or
        ``ops.hist[base..]`` (DS)."""
        if self.pb.layout == "SD":
            return [Float32(p.s.win[pos, part, d]) for pos in range(3)]
        hist = cute.recast_tensor(ops.hist, p.g.conv_state.element_type)
        return [Float32(hist[base + e]) for e in range(3)]

    def load_beta(self, p, desc, ops):
        """Raw beta of token tid-128 (threads 128 .. 128+T-1): the bf16 logit, or with
        :attr:`Problem.beta_activated` the fp32 value."""
        r, h, live = desc[0], desc[1], desc[5]
        tb = p.tid - 128
        ok = (live != 0) & (tb >= 0) & (tb < self.T)
        ops.beta[0] = load_or0(ok, lambda: p.g.beta[r * self.T + tb, h], p.g.beta.element_type)

    def write_zeros(self, p, desc):
        """A dead item: its T output rows are exact zeros; nothing else is written (16-byte
        stores, or element stores on rows that are not 16-byte aligned)."""
        r, h = desc[0], desc[1]
        tid, out = p.tid, p.g.out
        if self.pb.row_bytes != 16:
            for i in range((self.T * D + NTHREADS - 1) // NTHREADS):
                idx = tid + NTHREADS * i
                t = idx >> 7

                def zero(t=t, idx=idx):
                    out[r * self.T + t, h * D + (idx & 127)] = BFloat16(0.0)
                when(t < self.T, zero)
            return
        t = tid >> 4
        piece = tid & 15

        def zero16():
            z = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
            z.fill(0.0)
            cute.autovec_copy(z, pieces(out, 8)[r * self.T + t, h * (D // 8) + piece, None])
        when(tid < 16 * self.T, zero16)

    # --------------------------------------------------------------------------- phase A
    def _conv(self, p, h, cslot, part, d, hist, w, acc0):
        """Conv + SiLU of channel ``part*dim + h*128 + d`` for the T tokens
        (:func:`kda.backends.cutedsl.item.conv_silu`); rewrites the window to [w1, w2, x_0 ..
        x_{T-1}] (positions 0..T+1, in the cache dtype: a bf16 cache gets the bits it held
        back, the values went through fp32 exactly). ``hist`` the 3 history values (fp32),
        ``w`` (4 taps) and ``acc0`` (bias or 0) from :meth:`head_loads`.
        """
        pb, T, dim, g = self.pb, self.T, self.dim, p.g
        ch = part * dim + h * D + d
        xs = [Float32(p.s.x[t, part, d]) for t in range(T)]
        ys = item.conv_silu(hist + xs, w, acc0, T)
        # window rewrite: all history was read (registers) before this point
        new = [hist[1], hist[2]] + xs
        if pb.cs_bf16:
            cs16 = cute.recast_tensor(g.conv_state, Int16)
            for pos in range(T + 2):
                cs16[cslot, ch, pos] = Int16(P.f32_bits(new[pos]) >> 16)
        else:
            for pos in range(T + 2):
                g.conv_state[cslot, ch, pos] = new[pos]
        return ys

    def head_loads(self, p, h):
        """Issue every per-head global load of phase A at once (they stay in L2).

        Conv taps and bias of this thread's channels (q or v: ``wa``/``ba``; k: ``wb``/``bb``,
        threads 0-127 only), the warp's f_b A fragment of the gate MMA (``rA``: 16 rows, all
        k), the dt_bias values of this thread's accumulators and A_log[h].
        """
        pb, dim, g = self.pb, self.dim, p.g
        tid = p.tid
        d = tid & 127
        part_a = (tid >> 7) * 2
        is_qk = tid < 128
        hp = SimpleNamespace()
        hp.wa = [Float32(g.conv_weight[part_a, e, h * D + d]) for e in range(4)]
        hp.wb = [load_or0(is_qk, lambda e=e: g.conv_weight[1, e, h * D + d], Float32)
                 for e in range(4)]
        if pb.has_bias:
            hp.ba = Float32(g.conv_bias[part_a * dim + h * D + d])
            hp.bb = load_or0(is_qk, lambda: g.conv_bias[dim + h * D + d], Float32)
        else:
            hp.ba = Float32(0.0)
            hp.bb = Float32(0.0)
        hp.mma, hp.thr = gate_mma(p.lane)
        tA = hp.thr.partition_A(cute.local_tile(g.f_b, (16, D), (h * (D // 16) + p.warp, 0)))
        hp.rA = hp.mma.make_fragment_A(tA)
        cute.autovec_copy(tA, hp.rA)
        cC = hp.thr.partition_C(cute.make_identity_tensor((16, 8)))
        hp.dtb = [Float32(g.dt_bias[h * D + p.warp * 16 + cC[i][0]]) for i in range(4)]
        hp.alog = Float32(g.A_log[h])
        return hp

    def gate_b(self, p, desc, hp):
        """The gate MMA's B fragment: this lane's values of the f_a rows of the item's tokens
        (global; its token column ``g`` is zero from T on)."""
        T, g = self.T, p.g
        r = desc[0]
        rows = cute.make_tensor(cute.domain_offset((r * T, 0), g.f_a).iterator,
                                cute.make_layout((8, D), stride=(g.f_a.stride[0], 1)))
        tB = hp.thr.partition_B(rows)
        rB = hp.mma.make_fragment_B(tB)
        rB.fill(0.0)
        when(p.g8 < T, lambda: cute.autovec_copy(tB, rB))
        return rB

    def gate(self, p, desc, hp):
        """Gate projection on the tensor cores (:func:`kda.backends.cutedsl.gate.gate_tile`),
        decay alpha into ``a``, rg record.

        rg[k, t] = bf16(sum_j f_b[h*128+k, j] * f_a[n_t, j]); x = rg + dt_bias;
        alpha = :func:`kda.backends.cutedsl.gate.decay` (x). A fragment from :meth:`head_loads`
        (global), B fragment = f_a rows from global (:meth:`gate_b`): it needs no staged data,
        so the kernel runs it before waiting for the staging; it only writes ``a``.
        """
        pb, g, s = self.pb, p.g, p.s
        h, cslot = desc[1], desc[3]
        rB = self.gate_b(p, desc, hp)
        A = P.fexp(hp.alog)

        def emit(i, f16, t, rg):
            kk = p.warp * 16 + f16
            s.a[t, kk] = decay(pb, A, p.lb, P.fadd(rg, hp.dtb[i]))
            if pb.record:
                g.kg_record[cslot, h, t, D + kk] = BFloat16(rg)

        gate_tile(pb, hp.mma, hp.thr, hp.rA, rB, emit)

    def phase_a(self, p, desc, hp, ops, ogr):
        """Conv, norms and output gate of a live item (after :meth:`gate`; module docstring).

        Reads the staged rows, ``hp`` (:meth:`head_loads`) and ``ops``; leaves q-hat, k-hat,
        v and beta in shared memory and the sigmoid of this thread's output-gate values in
        ``ogr``. Contains one block barrier. The state page is moved to registers separately
        (:meth:`load_state_regs`).
        """
        T = self.T
        self._phase_a_conv(p, desc, ops, hp)
        cute.arch.barrier()
        self._phase_a_norm(p)
        # output gate of this thread's epilogue tokens t = tid//128 + 2i, channel tid%128
        half = p.tid >> 7
        v = p.tid & 127
        for i in range((T + 1) // 2):
            ogr[i] = P.sigmoid(Float32(p.s.og[half + 2 * i, v]))

    def load_state_regs(self, p, S):
        """The staged state page: shared -> registers (own chunks only: no barrier needed; bf16
        widened to fp32)."""
        for j in range(16):
            raw = cute.make_rmem_tensor(cute.make_layout((4,)), p.s.page.element_type)
            cute.autovec_copy(p.s.page[j, p.tid, None], raw)
            m, c = j // 4, j % 4
            for e in range(4):
                S[m, 4 * c + e] = Float32(raw[e])

    @cute.jit
    def _phase_a_conv(self, p, desc, ops, hp):
        if p.tid < 128:
            self._conv_qk(p, desc, ops, hp)
        else:
            self._conv_v(p, desc, ops, hp)

    def _conv_qk(self, p, desc, ops, hp):
        """Threads 0-127: q and k channel ``tid``; per-warp sums of squares; k record."""
        pb, T, g, s = self.pb, self.T, p.g, p.s
        h, cslot = desc[1], desc[3]
        d = p.tid
        yq = self._conv(p, h, cslot, 0, d, self._history(p, 0, d, ops, 0), hp.wa, hp.ba)
        yk = self._conv(p, h, cslot, 1, d, self._history(p, 1, d, ops, 3), hp.wb, hp.bb)
        for t in range(T):
            s.q[t, d] = yq[t]
            s.k[t, d] = yk[t]
            sq = P.warp_sum(P.fmul(yq[t], yq[t]))
            sk = P.warp_sum(P.fmul(yk[t], yk[t]))

            def sums(t=t, sq=sq, sk=sk):
                s.sq[t, p.warp] = sq
                s.sk[t, p.warp] = sk
            when(p.lane == 0, sums)
            if pb.record:
                g.kg_record[cslot, h, t, d] = BFloat16(yk[t])

    def _conv_v(self, p, desc, ops, hp):
        """Threads 128-255: v channel ``tid-128``; beta of token ``tid-128``."""
        T, s = self.T, p.s
        h, cslot = desc[1], desc[3]
        d = p.tid - 128
        yv = self._conv(p, h, cslot, 2, d, self._history(p, 2, d, ops, 0), hp.wa, hp.ba)
        for t in range(T):
            s.v[t, d] = yv[t]
        if self.pb.beta_activated:      # the engine's sigmoid(beta), used as it is
            beta = Float32(ops.beta[0])
        else:
            beta = P.sigmoid(Float32(ops.beta[0]))

        def put():
            s.beta[d] = beta
        when(d < T, put)

    @cute.jit
    def _phase_a_norm(self, p):
        if p.tid < 128:
            self._norm(p)

    def _norm(self, p):
        """q-hat = q * rsqrt(sum q^2 + 1e-6) * scale, k-hat = k * rsqrt(sum k^2 + 1e-6)."""
        s, tid = p.s, p.tid
        for t in range(self.T):
            sq = item.quarter_sum(lambda i, t=t: s.sq[t, i])
            sk = item.quarter_sum(lambda i, t=t: s.sk[t, i])
            iq = item.inv_norm(sq)
            ik = item.inv_norm(sk)
            s.q[t, tid] = item.q_hat(s.q[t, tid], iq, p.scale)
            s.k[t, tid] = P.fmul(s.k[t, tid], ik)

    # --------------------------------------------------------------------------- phase B
    def _store_state(self, p, slot, h, S):
        """This thread's 64 state values to state[slot, h]: 16 bytes per chunk (fp32), or 8
        rounded to bf16 once (nearest even)."""
        page = p.g.state[slot, h, None, None]
        for m in range(4):
            for c in range(4):
                store4(reg_chunk(S, m, c), chunk(page[p.row0 + 32 * m, None], p.l8, c),
                       self.pb.state_bf16)

    def phase_b(self, p, desc, S, ogr):
        """The recurrence over the T tokens, state stores / records, and the epilogue.

        Per token :func:`kda.backends.cutedsl.item.token` on the thread's rows ``row0 + 32m``
        (``S``: :func:`kda.backends.cutedsl.item.state_regs` of 4 rows). Then
        out = bf16(ob * rsqrt(mean(ob^2) + eps) * norm_weight * sigmoid(gate)). Contains two
        block barriers.
        """
        pb, T, g, s = self.pb, self.T, p.g, p.s
        r, h, src, cslot = desc[0], desc[1], desc[2], desc[3]
        for t in range(T):
            def emit(m, u, ob, t=t):        # lane 0 of each row (item.token)
                s.o[t, p.row0 + 32 * m] = ob
                if pb.record:
                    g.v_record[cslot, h, t, p.row0 + 32 * m] = u

            item.token(S, s.a[t, None], s.k[t, None], s.q[t, None], s.beta[t],
                       lambda m, t=t: s.v[t, p.row0 + 32 * m], p.l8, emit)
            if T > 1 and not pb.record:
                dst = s.slots[t]
                when((dst > 0) & (dst < p.slots), lambda dst=dst: self._store_state(p, dst, h, S))
        if T == 1 and not pb.record:
            self._store_state(p, src, h, S)
        cute.arch.barrier()
        self._epilogue(p, r, h, ogr)

    def _epilogue(self, p, r, h, ogr):
        """Gated RMSNorm: warp sums of ob^2, then the 4 warps of a token half, fixed order."""
        T, s = self.T, p.s
        half = p.tid >> 7
        v = p.tid & 127
        wq = (p.tid >> 5) & 3
        obs = []
        for i in range((T + 1) // 2):
            t = half + 2 * i
            # odd T: the last pass of the upper half has no token (t == T; its results are
            # not stored), so it reads row T-1 rather than past the o buffer
            row = t if 2 * i + 1 < T else Int32(T - 1)
            ob = s.o[row, v]
            sq = P.warp_sum(P.fmul(ob, ob))
            ok = p.lane == 0 if 2 * i + 1 < T else (p.lane == 0) & (t < T)

            def put(t=t, sq=sq):
                s.so[t, wq] = sq
            when(ok, put)
            obs.append(ob)
        cute.arch.barrier()
        for i in range((T + 1) // 2):
            t = half + 2 * i
            ssum = item.quarter_sum(lambda j, t=t: s.so[t, j])
            y = item.gated_rmsnorm(obs[i], ssum, p.eps, p.nwv, ogr[i])

            def put_out(t=t, y=y):
                p.g.out[r * T + t, h * D + v] = BFloat16(y)
            if 2 * i + 1 < T:
                put_out()
            else:
                when(t < T, put_out)


def _load_cg(t: cute.Tensor, coord, raw):
    """The bits of ``t[coord]`` as ``raw`` (an integer type of its width), read through L2 only
    (``ld.global.cg``: data this or another grid wrote)."""
    ptr = cute.recast_ptr(cute.domain_offset(coord, t).iterator, dtype=raw)
    return cute.arch.load(ptr, raw, cop="cg")


def thread_coords(tid):
    """Per-thread constants: lane, warp, MMA group (``g8``), state row and column lane."""
    return dict(tid=tid, lane=tid & 31, warp=tid >> 5, g8=(tid & 31) >> 2, row0=tid >> 3,
                l8=tid & 7)


def make_params(pb: Problem, g, s, tid, a) -> SimpleNamespace:
    """The SimpleNamespace of runtime values the ItemMath methods read: the global views ``g``
    (:func:`kda.backends.cutedsl.args.make_views`), the shared tensors ``s`` (:class:`Smem`),
    the scalars of the kernel's arguments ``a`` and the thread's coordinates; ``nwv`` =
    norm_weight[tid % 128] as fp32 (shared by all heads)."""
    p = SimpleNamespace(g=g, s=s, slots=a.slots, scale=a.scale, eps=a.eps, lb=a.lb,
                        **thread_coords(tid))
    p.nwv = Float32(g.norm_weight[tid & 127])
    return p


__all__ = ["ItemMath", "Smem", "make_params", "storage_fields", "Problem", "D", "NTHREADS"]
