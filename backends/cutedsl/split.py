"""KdaSplit: the fused KDA decode step with each (request, head) item split over a cluster.

Grid ``(C, H, R)``, clusters of ``C`` CTAs along x (C in 2, 4, 8): CTA rank ``p`` of the
cluster of item (r, h) owns the value rows ``[p*128/C, (p+1)*128/C)`` of the item's state
page. 160 threads: warps 0-3 ("main") run the conv, the norms, the recurrence of the CTA's
rows and the RMSNorm epilogue of the tokens the CTA owns; warp 4 ("gate") projects the gate
for the key features ``[p*128/C, (p+1)*128/C)`` on the tensor cores and sends their decays to
every CTA of the cluster.

Per CTA:

1. (before ``griddepcontrol.wait``: model weights only) conv taps and bias of the thread's
   channels, norm weight; the gate warp bulk-copies the CTA's f_b rows into shared memory.
   After the wait the dependents are released (they read this kernel's outputs only after
   their own wait) and the activations (x, output gate, beta, the gate warp's f_a
   fragments), which do not depend on the slot ids, are requested first.
2. slot ids -> liveness; the window history of the thread's q / k / v channels is requested
   (the conv waits on it; behind the launch's row reads it would come back last), then the
   CTA's state rows, one contiguous block, with one bulk copy (``cp.async.bulk``, completion
   on an mbarrier), or with ``Schedule.state_direct`` loaded by the main threads straight
   into the registers the recurrence uses (one load of each 4-column chunk: 16 bytes fp32, 8
   bytes bf16; in flight while step 3 runs).
3. main warps: conv + SiLU of all 256 q / k channels (every CTA: they are the key vector)
   and of the CTA's v channels; the window of the CTA's v channels is rewritten; q / k L2
   norms. With ``Schedule.split_qk`` the q / k channels are shared out instead: the 256 are
   8 warp-blocks of 32 (q warps 0-3, k warps 0-3 of the one-CTA kernel), each CTA's last
   ``8 / C`` main warps conv ``8 / C`` blocks, rewrite their windows, and ``st.async`` the
   outputs and each block's warp sum of squares into every CTA's shared memory (one
   mbarrier per CTA counts the bytes); then every main thread forms its q / k channel's norm
   from the four warp sums in warp order. The gate warp meanwhile: MMA, rounding, decay,
   ``st.async`` of the decays into every CTA's shared memory (one mbarrier per CTA counts the
   bytes).
4. main warps: the recurrence of the CTA's rows (all T tokens, rows in waves of up to 32
   straight from the staged block), state stores, ``o`` of each row sent with ``st.async`` to the CTA
   that owns the token (``t % C``).
5. the owner of token t: gated RMSNorm over the 128 values, ``out``; rank 0 writes the new
   q / k windows, kept in its shared memory since step 3, once every CTA's o of token 0
   arrived (so every CTA has read the history; with ``split_qk`` each window was rewritten in
   step 3 by the one thread that read it).

Every value is computed in the same order whatever C, and in the same order as the
one-CTA-per-item kernel (:mod:`kda.backends.cutedsl.wide`): the item arithmetic of
:mod:`kda.backends.cutedsl.item` (conv per channel, norm and RMSNorm scalings, the
recurrence's per-row reduction), the same warp sums, the same MMA chains per feature, the
explicitly rounded arithmetic of :mod:`kda.backends.cutedsl.ptx`. So every cluster size and
the wide kernel give bit-identical results.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from kda.backends.cutedsl import item, ptx as N
from kda.backends.cutedsl.args import KernelArgs, Launch, make_views
from kda.backends.cutedsl.common import load_or0
from kda.backends.cutedsl.item import chunk, reg_chunk, state_regs, store4
from kda.backends.cutedsl.gate import decay, gate_mma, gate_tile, smem_fragment
from kda.backends.cutedsl.pipeline import ClusterExchange, Sync, sync
from kda.backends.cutedsl.problem import Problem
from kda.backends.cutedsl.schedule import FB_ROW, Rows, Schedule
from kda.backends.cutedsl.scheduler import grid

D = 128
MAIN = 128          # conv / norm / recurrence / epilogue threads (warps 0-3)
NTHREADS = MAIN + 32  # + the gate warp
LANES = 8           # lanes per state row: a warp instruction covers 4 rows x 128 bytes
GROUPS = MAIN // LANES  # rows per pass
QK_BLOCKS = 2 * D // 32  # warp-blocks of q / k channels (split_qk: shared out over the cluster)
RED_ROWS = 3        # per token, the four warps' sums of q^2, k^2 and o^2 (s_red)


class KdaSplit(Launch):
    """The split kernel for one :class:`Problem` and a ``Rows.CLUSTER`` :class:`Schedule`
    (its cluster size); ``launch`` is what gets compiled."""

    def __init__(self, pb: Problem, sched: Schedule):
        if sched.rows != Rows.CLUSTER:
            raise ValueError(f"KdaSplit: expected a rows=CLUSTER schedule, got {sched.name}")
        self.pb = pb
        self.sched = sched
        self.C = sched.cluster
        self.rows = D // self.C            # value rows of one CTA
        self.F = D // self.C               # gate features of one CTA
        self.passes = self.rows // GROUPS
        self.wave = min(2, self.passes)
        # state_direct: the CTA's rows (one wave) loaded into registers after the slot ids
        self.direct = sched.state_direct
        # split_qk: the CTA's last qk_warps main warps conv as many of the q / k warp-blocks
        self.qk = sched.split_qk
        self.qk_warps = QK_BLOCKS // self.C
        assert QK_BLOCKS % self.C == 0 and self.qk_warps <= MAIN // 32, self.C
        self.T = pb.T
        self.H = pb.H
        self.dim = pb.H * D

    # ------------------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, a: KernelArgs):
        pb, T, C, dim = self.pb, self.T, self.C, self.dim
        tid, _, _ = cute.arch.thread_idx()
        rank, h, r = cute.arch.block_idx()
        g = make_views(pb, a)
        slots, scale, eps, lb = a.slots, a.scale, a.eps, a.lb

        smem = cutlass.memory.SmemAllocator()
        st_t = g.state.element_type           # fp32, or bf16 (widened on load)
        st_bytes = st_t.width // 8
        s_state = None
        if cutlass.const_expr(not self.direct):
            s_state = smem.allocate_tensor(st_t, cute.make_layout((self.rows, D), stride=(D, 1)),
                                           byte_alignment=128)
        if cutlass.const_expr(self.qk):
            # the q rows then the k rows of every token, one buffer: a block's st.async offset
            # is which * T * D + t * D + channel
            s_qk = smem.allocate_tensor(Float32, cute.make_layout((2 * T, D), stride=(D, 1)),
                                        byte_alignment=16)
            s_q = cute.make_tensor(s_qk.iterator, cute.make_layout((T, D), stride=(D, 1)))
            s_k = cute.make_tensor(s_qk.iterator + T * D, cute.make_layout((T, D), stride=(D, 1)))
        else:
            s_q = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)),
                                       byte_alignment=16)
            s_k = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)),
                                       byte_alignment=16)
        s_a = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), byte_alignment=16)
        s_o = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), byte_alignment=16)
        s_v = smem.allocate_tensor(Float32, cute.make_layout((T, self.rows), stride=(self.rows, 1)),
                                   byte_alignment=16)
        s_b = smem.allocate_tensor(Float32, cute.make_layout((8,)), byte_alignment=16)
        s_red = smem.allocate_tensor(Float32, cute.make_layout((T, RED_ROWS, 4),
                                                               stride=(RED_ROWS * 4, 4, 1)),
                                     byte_alignment=16)
        # rank 0: the new q / k windows (thread tid: q channel tid, k channel tid), kept from
        # the start until every CTA has read the history, then written without a re-read
        s_win = None
        if cutlass.const_expr(not self.qk):
            s_win = smem.allocate_tensor(g.conv_state.element_type, cute.make_layout(
                (2, T + 2, MAIN), stride=((T + 2) * MAIN, MAIN, 1)), byte_alignment=16)
        # the gate warp's f_b rows, rows padded to 136 bf16 so that the MMA fragment loads
        # of a warp hit 32 distinct banks
        s_fb = smem.allocate_tensor(BFloat16, cute.make_layout((self.F, D), stride=(FB_ROW, 1)),
                                    byte_alignment=16)
        # the gate warp's dt_bias of the CTA's F features (copied with s_fb)
        s_dtb = smem.allocate_tensor(Float32, cute.make_layout((self.F,)), byte_alignment=16)
        bars = ClusterExchange(smem.allocate_array(Int64, ClusterExchange.count(T, self.qk)), T,
                               self.qk)
        bar_state = bars.state
        bar_alpha = bars.alpha
        bar_fb = bars.fb

        # mbarriers: one arrival each (with the bytes they expect), completed by the copies
        if tid == 0:
            # (state_direct: no copy counts on the state's barrier; it completes at once)
            bars.init(rank, C, 0 if self.direct else self.rows * D * st_bytes, T * D * 4,
                      self.F * (D * 2 + 4), D * 4, T * (2 * D + QK_BLOCKS) * 4 if self.qk else 0)
        cute.arch.sync_threads()
        cute.arch.cluster_arrive_relaxed()

        # ---- 1. weights (before the PDL wait: nothing a predecessor writes). Every thread
        # loads (the gate warp's copies are unused), so no value leaves a branch.
        is_main = tid < MAIN
        lane = tid % 32
        ch = h * D + tid % MAIN                       # q / k channel of a main thread
        vch = h * D + rank * self.rows + tid % self.rows  # v channel (main threads < rows)
        # (split_qk: "q" is the thread's channel of its warp-block, q or k, at x / conv_state
        # channel qch; no "k" values)
        qch = ch
        qk_on = is_main                 # (split_qk: a thread of the CTA's q / k warps)
        wk, bk = None, None
        if cutlass.const_expr(self.qk):
            qk_on = is_main & self._qk_warp(tid)
            _, which, chl = self._qk_block(rank, tid)
            qch = which * dim + h * D + chl
            wq = [Float32(g.conv_weight[which, e, h * D + chl]) for e in range(4)]
        else:
            wq = [Float32(g.conv_weight[0, e, ch]) for e in range(4)]
            wk = [Float32(g.conv_weight[1, e, ch]) for e in range(4)]
        wv = [Float32(g.conv_weight[2, e, vch]) for e in range(4)]
        bq = Float32(0.0)
        if cutlass.const_expr(not self.qk):
            bk = Float32(0.0)
        bv = Float32(0.0)
        if cutlass.const_expr(pb.has_bias):
            bq = g.conv_bias[qch]
            if cutlass.const_expr(not self.qk):
                bk = g.conv_bias[dim + ch]
            bv = g.conv_bias[2 * dim + vch]
        nwv = Float32(g.norm_weight[tid % MAIN])
        # A_log[h] for the gate warp's decay, loaded here so that no load waits after its MMA
        alog = Float32(g.A_log[h])

        # the gate warp's f_b rows (the MMA's A operand): the CTA's F rows of head h, one
        # bulk copy per row into the padded rows of s_fb
        if tid >= MAIN:
            rows_fb = cute.local_tile(g.f_b, (self.F, D), (h * C + rank, 0))
            atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), BFloat16, num_bits_per_copy=D * 16)
            for i in cutlass.range_constexpr((self.F + 31) // 32):
                row = lane + 32 * i
                if row < self.F:
                    cute.copy(atom, rows_fb[row, None], s_fb[row, None], mbar_ptr=bar_fb)
            if lane == 0:
                dtb_g = cute.local_tile(g.dt_bias, (self.F,), (h * C + rank,))
                atom_b = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32,
                                             num_bits_per_copy=self.F * 32)
                cute.copy(atom_b, dtb_g, s_dtb, mbar_ptr=bar_fb)

        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # ---- 1, after the wait: the activations (independent of the slot ids, so requested
        # first): x of the thread's q / k / v channels, the output gate, beta; the gate warp's
        # f_a fragments
        n0 = r * T
        if cutlass.const_expr(self.qk):   # read by the q / k warps only
            xq = [load_or0(qk_on, lambda t=t: g.x[n0 + t, qch], g.x.element_type)
                  for t in range(T)]
        else:
            xq = [g.x[n0 + t, qch] for t in range(T)]
        xk = None if self.qk else [g.x[n0 + t, dim + ch] for t in range(T)]
        xv = [g.x[n0 + t, 2 * dim + vch] for t in range(T)]
        ogr = [g.output_gate[n0 + t, ch] for t in range(T)]
        braw = g.beta[n0 + tid % T, h]
        mma, thr = gate_mma(lane)
        # B operand: the request's f_a rows, tokens padded to 8 columns (lane: token lane // 4)
        gB = cute.make_tensor(g.f_a.iterator + Int64(n0) * g.f_a.stride[0],
                              cute.make_layout((8, D), stride=(g.f_a.stride[0], 1)))
        tB = thr.partition_B(gB)
        rB = mma.make_fragment_B(tB)
        rB.fill(0.0)
        if (tid >= MAIN) & (lane // 4 < T):
            cute.autovec_copy(tB, rB)

        # ---- 2. slots and liveness (every thread, uniform loads)
        # (the T slot ids and num_accepted_tokens are loaded together: selecting the source
        # slot costs no second round trip)
        ids = [g.state_indices[r, t] for t in range(T)]
        cslot = ids[0]
        accepted = Int32(0)
        if cutlass.const_expr(T > 1):
            accepted = g.num_accepted_tokens[r]
        src, off = item.source_slot(ids, accepted, T)
        live = item.is_live(src, cslot, slots)

        S = state_regs(self.wave) if self.direct else None
        if live:
            if is_main:
                # the window history of the thread's q / k / v channels, requested before
                # the rows: behind the launch's burst of row reads it comes back last
                if cutlass.const_expr(self.qk):   # read (and rewritten) by its thread only
                    hq = [load_or0(qk_on, lambda j=j: g.conv_state[cslot, qch, off + j],
                                   g.conv_state.element_type) for j in range(3)]
                else:
                    hq = [g.conv_state[cslot, qch, off + j] for j in range(3)]
                hk = None if self.qk else [g.conv_state[cslot, dim + ch, off + j]
                                           for j in range(3)]
                hv = [g.conv_state[cslot, 2 * dim + vch, off + j] for j in range(3)]
                if cutlass.const_expr(self.direct):
                    # the CTA's rows, in flight while the conv and norms run
                    self._load_rows(g, src, h, rank, tid // LANES, tid % LANES, S)
                elif tid == 0:
                    rows_g = cute.local_tile(g.state[src, h, None, None], (self.rows, D),
                                             (rank, 0))
                    atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), st_t,
                                               num_bits_per_copy=self.rows * D * st_t.width)
                    cute.copy(atom, cute.group_modes(rows_g, 0, 2),
                              cute.group_modes(s_state, 0, 2), mbar_ptr=bar_state)
                self._main(g, tid, rank, h, r, cslot, src, off, slots, wq, wk, wv, bq, bk, bv,
                           nwv, xq, xk, xv, ogr, braw, hq, hk, hv, scale, eps, s_state, s_q, s_k,
                           s_a, s_o, s_v, s_b, s_red, s_win, bars, S)
            else:
                self._gate(g, mma, thr, rB, s_fb, bar_fb, lane, rank, h, r, cslot, lb, s_a,
                           bar_alpha, alog, s_dtb)
        else:
            if rank == 0:
                if is_main:
                    for t in cutlass.range_constexpr(T):
                        g.out[r * T + t, h * D + tid] = BFloat16(0.0)
            if tid >= MAIN:
                bars.wait(bar_fb)     # no copy into this CTA is left in flight

    # ------------------------------------------------------------------------- main warps
    @cute.jit
    def _main(self, g, tid, rank, h, r, cslot, src, off, slots, wq, wk, wv, bq, bk, bv, nwv,
              xq, xk, xv, ogr, braw, hq, hk, hv, scale, eps, s_state, s_q, s_k, s_a, s_o, s_v,
              s_b, s_red, s_win, bars, S_direct):
        """Steps 3-5 of a main thread (module docstring): ``hq`` / ``hk`` / ``hv`` the window
        history of its q, k and v channels (``hv`` used where ``tid < rows``; with
        ``split_qk`` ``wq`` / ``bq`` / ``xq`` / ``hq`` are those of its warp-block's channel,
        q or k, and the k ones None)."""
        pb, T, C, dim = self.pb, self.T, self.C, self.dim
        warp_i = tid // 32
        lane = tid % 32
        n0 = r * T
        vch = rank * self.rows + tid
        yq, yk = None, None
        if cutlass.const_expr(self.qk):
            self._qk_send(g, tid, rank, h, cslot, wq, bq, xq, hq, s_q, s_red, bars)
        else:
            if rank == 0:
                for i, win in enumerate((self._window(g, hq, xq), self._window(g, hk, xk))):
                    for pos in cutlass.range_constexpr(T + 2):
                        s_win[i, pos, tid] = win[pos]
        if tid < T:
            if cutlass.const_expr(pb.beta_activated):
                s_b[tid] = Float32(braw)      # the engine's sigmoid(beta), used as it is
            else:
                s_b[tid] = N.sigmoid(Float32(braw))
        if cutlass.const_expr(not self.qk):
            yq = self._conv(hq, xq, wq, bq)
            yk = self._conv(hk, xk, wk, bk)
        if tid < self.rows:
            yv = self._conv(hv, xv, wv, bv)
            for t in cutlass.range_constexpr(T):
                s_v[t, tid] = yv[t]
            self._rewrite(g, cslot, 2 * dim + h * D + vch, hv, xv)
        if cutlass.const_expr(self.qk):
            bars.wait(bars.qk)      # every warp-block's outputs and sums
        else:
            for t in cutlass.range_constexpr(T):
                sq = N.warp_sum(N.fmul(yq[t], yq[t]))
                sk = N.warp_sum(N.fmul(yk[t], yk[t]))
                if lane == 0:
                    s_red[t, 0, warp_i] = sq
                    s_red[t, 1, warp_i] = sk
                if cutlass.const_expr(pb.record):
                    if rank == 0:
                        g.kg_record[cslot, h, t, tid] = BFloat16(yk[t])
            sync(Sync.MAIN, MAIN)
        for t in cutlass.range_constexpr(T):
            sq = item.quarter_sum(lambda i, t=t: s_red[t, 0, i])
            sk = item.quarter_sum(lambda i, t=t: s_red[t, 1, i])
            iq = item.inv_norm(sq)
            ik = item.inv_norm(sk)
            if cutlass.const_expr(self.qk):     # in place: channel tid's own outputs
                s_q[t, tid] = item.q_hat(s_q[t, tid], iq, scale)
                s_k[t, tid] = N.fmul(s_k[t, tid], ik)
            else:
                s_q[t, tid] = item.q_hat(yq[t], iq, scale)
                s_k[t, tid] = N.fmul(yk[t], ik)
        # output gate (used by the owner of each token)
        ogs = [N.sigmoid(Float32(v)) for v in ogr]
        sync(Sync.MAIN, MAIN)
        if cutlass.const_expr(not self.qk):
            cute.arch.cluster_wait()
        bars.wait(bars.alpha)       # the decays of every feature
        if cutlass.const_expr(not self.direct):
            bars.wait(bars.state)   # the CTA's state rows
        self._recurrence(g, tid, rank, h, r, cslot, src, slots, s_state, s_q, s_k, s_a, s_o,
                         s_v, s_b, bars, S_direct)
        # epilogue of the owned tokens
        for t in cutlass.range_constexpr(T):
            if rank == t % C:
                bars.wait(bars.o(t))
                ob = s_o[t, tid]
                so = N.warp_sum(N.fmul(ob, ob))
                if lane == 0:
                    s_red[t, 2, warp_i] = so
                sync(Sync.MAIN, MAIN)
                ss = item.quarter_sum(lambda i, t=t: s_red[t, 2, i])
                y = item.gated_rmsnorm(ob, ss, eps, nwv, ogs[t])
                g.out[n0 + t, h * D + tid] = BFloat16(y)
        if cutlass.const_expr(not self.qk):
            if rank == 0:
                # every CTA's o of token 0 arrived (rank 0 owns it), so every CTA has read the
                # q / k history: rank 0 writes the new windows it kept in shared memory
                for i in cutlass.range_constexpr(2):
                    for pos in cutlass.range_constexpr(T + 2):
                        g.conv_state[cslot, i * dim + h * D + tid, pos] = s_win[i, pos, tid]

    def _qk_warp(self, tid):
        """``split_qk``: whether main thread ``tid`` is in one of the CTA's q / k warps (its
        last ``qk_warps``)."""
        return tid // 32 >= MAIN // 32 - self.qk_warps

    def _qk_block(self, rank, tid):
        """``split_qk``: (warp-block, 0 for q or 1 for k, channel of the head) of thread
        ``tid`` of CTA ``rank``: block ``rank * qk_warps + warp % qk_warps`` of the 8 (q warps
        0-3, then k warps 0-3 of the one-CTA kernel), its lane's channel."""
        qb = rank * self.qk_warps + (tid // 32) % self.qk_warps
        return qb, qb // 4, (qb % 4) * 32 + tid % 32

    @cute.jit
    def _qk_send(self, g, tid, rank, h, cslot, w, b, x, hist, s_qk, s_red, bars):
        """``split_qk``, step 3's q / k part: the CTA's last ``qk_warps`` main warps conv their
        warp-block's channel (``w``, ``b``, ``x``, ``hist``), rewrite its window (no other
        thread reads it), and send each token's output to ``s_qk`` (q rows, then k rows) and
        the warp's sum of squares to ``s_red[t, 0 or 1, warp]`` of every CTA of the cluster,
        as the one-CTA kernel's warp of those channels sums it. Every main thread first waits
        for the cluster (every CTA's barriers set up)."""
        pb, T, C, dim = self.pb, self.T, self.C, self.dim
        cute.arch.cluster_wait()
        if self._qk_warp(tid):
            qb, which, chl = self._qk_block(rank, tid)
            y = self._conv(hist, x, w, b)
            self._rewrite(g, cslot, which * dim + h * D + chl, hist, x)
            for t in cutlass.range_constexpr(T):
                ss = N.warp_sum(N.fmul(y[t], y[t]))
                for q in cutlass.range_constexpr(C):
                    cute.arch.store_async_dsmem(s_qk.iterator + (which * (T * D) + t * D + chl),
                                                N.f32_bits(y[t]), bars.qk, Int32(q))
                if tid % 32 == 0:
                    for q in cutlass.range_constexpr(C):
                        cute.arch.store_async_dsmem(
                            s_red.iterator + (t * (RED_ROWS * 4) + which * 4 + qb % 4),
                            N.f32_bits(ss), bars.qk, Int32(q))
                if cutlass.const_expr(pb.record):
                    if which == 1:
                        g.kg_record[cslot, h, t, chl] = BFloat16(y[t])

    def _conv(self, hist_raw, x_raw, w, bias):
        """acc = bias; acc = fma(s[t+e], w[e], acc) over s = [w0, w1, w2, x_0..]; bf16(silu)."""
        seq = [Float32(v) for v in hist_raw] + [Float32(v) for v in x_raw]
        return item.conv_silu(seq, w, bias, self.T)

    @staticmethod
    def _window(g, hist_raw, x_raw):
        """The new window: [w1, w2, x_0 .. x_{T-1}] (raw values, cast to the cache dtype)."""
        return [hist_raw[1], hist_raw[2]] + [g.conv_state.element_type(v) for v in x_raw]

    def _rewrite(self, g, cslot, ch, hist_raw, x_raw):
        """Writes :meth:`_window` to channel ``ch`` of slot ``cslot``."""
        new = self._window(g, hist_raw, x_raw)
        for pos in range(self.T + 2):
            g.conv_state[cslot, ch, pos] = new[pos]

    @cute.jit
    def _recurrence(self, g, tid, rank, h, r, cslot, src, slots, s_state, s_q, s_k, s_a, s_o,
                    s_v, s_b, bars, S_direct):
        """The recurrence of the CTA's rows, in waves of ``wave`` passes of 16 rows (from the
        staged rows, or with ``state_direct`` the one wave already in ``S_direct``).

        Thread (group, l8) holds, of each row ``pass*16 + group`` of a wave, the key columns
        4*(l8 + 8c) .. +3 (c = 0..3); per token :func:`kda.backends.cutedsl.item.token`,
        each row's ``o`` sent to the CTA that owns the token.
        """
        pb, T, C = self.pb, self.T, self.C
        grp = tid // LANES
        l8 = tid % LANES
        W = self.wave
        for w0 in cutlass.range_constexpr(0, self.passes, W):
            S = S_direct if self.direct else state_regs(W)
            for w in cutlass.range_constexpr(0 if self.direct else W):
                row = (w0 + w) * GROUPS + grp
                for c in cutlass.range_constexpr(4):
                    if cutlass.const_expr(pb.state_bf16):   # widened to fp32 (exactly)
                        raw = cute.make_rmem_tensor(cute.make_layout((4,)), BFloat16)
                        cute.autovec_copy(chunk(s_state[row, None], l8, c), raw)
                        for e in cutlass.range_constexpr(4):
                            S[w, 4 * c + e] = Float32(raw[e])
                    else:
                        cute.autovec_copy(chunk(s_state[row, None], l8, c), reg_chunk(S, w, c))
            for t in cutlass.range_constexpr(T):
                def emit(w, u, ob, t=t, w0=w0):
                    grow = rank * self.rows + (w0 + w) * GROUPS + grp
                    cute.arch.store_async_dsmem(s_o.iterator + (t * D + grow), N.f32_bits(ob),
                                                bars.o(t), Int32(t % C))
                    if cutlass.const_expr(pb.record):
                        g.v_record[cslot, h, t, grow] = u

                b_t = s_b[t]
                item.token(S, s_a[t, None], s_k[t, None], s_q[t, None], b_t,
                            lambda w, t=t, w0=w0: s_v[t, (w0 + w) * GROUPS + grp], l8, emit)
                if cutlass.const_expr(not pb.record and T > 1):
                    dst = g.state_indices[r, t]
                    if (dst > 0) & (dst < slots):
                        self._store_rows(g, dst, h, rank, w0, grp, l8, S)
            if cutlass.const_expr(not pb.record and T == 1):
                self._store_rows(g, src, h, rank, w0, grp, l8, S)

    def _load_rows(self, g, slot, h, rank, grp, l8, S):
        """The CTA's rows of state[slot, h] (one wave: :attr:`state_direct`) into ``S``, as
        :meth:`_recurrence` holds them: a 16-byte load per 4-column chunk (fp32), or an
        8-byte one whose four bf16 values are widened exactly."""
        for w in range(self.wave):
            row = rank * self.rows + w * GROUPS + grp
            for c in range(4):
                src = chunk(g.state[slot, h, row, None], l8, c)
                if cutlass.const_expr(self.pb.state_bf16):
                    raw = cute.make_rmem_tensor(cute.make_layout((4,)), BFloat16)
                    cute.autovec_copy(src, raw)
                    for e in range(4):
                        S[w, 4 * c + e] = Float32(raw[e])
                else:
                    cute.autovec_copy(src, reg_chunk(S, w, c))

    def _store_rows(self, g, slot, h, rank, w0, grp, l8, S):
        """Stores of the wave's rows to state[slot, h]: 16 bytes per chunk (fp32), or 8 rounded
        to bf16 once (nearest even)."""
        for w in range(self.wave):
            row = rank * self.rows + (w0 + w) * GROUPS + grp
            for c in range(4):
                store4(reg_chunk(S, w, c), chunk(g.state[slot, h, row, None], l8, c),
                       self.pb.state_bf16)

    # --------------------------------------------------------------------------- gate warp
    @cute.jit
    def _gate(self, g, mma, thr, rB, s_fb, bar_fb, lane, rank, h, r, cslot, lb, s_a, bar_alpha,
              alog, s_dtb):
        """Features [rank*F, (rank+1)*F): rg = bf16(f_b rows . f_a) on the tensor cores
        (gate_mode 0: one chain over the 8 k-steps; 1: four chains of two, summed
        ((c0+c1)+c2)+c3), then x = rg + dt_bias, the decay, sent to every CTA's s_a (``alog``:
        A_log[h]; ``s_dtb``: dt_bias of the F features)."""
        pb, C, F = self.pb, self.C, self.F
        A = N.fexp(alog)
        ClusterExchange.wait(bar_fb)
        # dt_bias of the lane's accumulator values [tile][value], read before the MMA
        cC = thr.partition_C(cute.make_identity_tensor((16, 8)))
        dtb = [[s_dtb[16 * mt + cC[i][0]] for i in range(cute.size(cC))] for mt in range(F // 16)]
        cute.arch.cluster_wait()
        for mt in cutlass.range_constexpr(F // 16):
            rA = smem_fragment(mma, lane, cute.local_tile(s_fb, (16, D), (mt, 0)), "A")

            def emit(i, f16, t, rg, mt=mt):
                feat = rank * F + 16 * mt + f16
                alpha = decay(pb, A, lb, N.fadd(rg, dtb[mt][i]))
                if cutlass.const_expr(pb.record):
                    g.kg_record[cslot, h, t, D + feat] = BFloat16(rg)
                for q in cutlass.range_constexpr(C):
                    cute.arch.store_async_dsmem(s_a.iterator + (t * D + feat),
                                                N.f32_bits(alpha), bar_alpha, Int32(q))

            gate_tile(pb, mma, thr, rA, rB, emit)

    # -------------------------------------------------------------------------------- host
    def _launch(self, a: KernelArgs, stream):
        """C x H x R CTAs in clusters of C on ``stream`` (:func:`scheduler.grid`)."""
        self.kernel(a).launch(grid=grid(self.sched, self.H, a), block=[NTHREADS, 1, 1],
                              cluster=[self.C, 1, 1], stream=stream, use_pdl=True)

