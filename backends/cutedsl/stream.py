"""KdaStream: the persistent, pipelined CuTe DSL kernel of the fused KDA decode step.

It serves the ``Rows.WARP`` schedules (:mod:`kda.backends.cutedsl.schedule`). With
``Items.RANGE`` one CTA per SM (grid ``ctas``, at most one per item) walks a contiguous
head-major range of the step's items; with ``Items.BLOCKS`` of C, each CTA of a grid of
``ceil(items / C)`` takes C items in blocks of C requests, head-major inside (one head, C
requests), and the hardware starts the next CTA on an SM when one exits, so the CTAs in flight
cover all heads of a few consecutive requests (:mod:`kda.backends.cutedsl.scheduler`). Two
roles (warp numbers of the default ring: 8 consumer warps of 32-row units):

* **consumers** (warps 0..7): each keeps its own stages filled with bulk copies of one
  value-row unit per item, ``depth`` items ahead (:class:`kda.backends.cutedsl.ring.WarpRing`);
  with 32-row units the 4 warps of a group take the 4 units of one item at once and the
  groups take turns by item. A consumer runs the delta rule over its rows for the T tokens
  straight from the stage (S *= alpha; u = beta (v - S.k); S += u k; o = S.q), stores the
  state (per token at T > 1) or the record rows, and leaves ``o`` of its rows in the item's
  slot;
* **prep** (the warpgroup after the consumers, warps 8..11): per item, conv + SiLU of its 384 channels (thread
  ``p``: q, k and v channel ``p``), the window rewrite, the q / k L2 norms, beta, the output
  gate's sigmoid and the gate projection on the tensor cores with its decay, into one of
  ``groups + 1`` item slots; ``groups`` items later, once the item's consumers are done, the
  gated RMSNorm of its ``o`` and ``out`` (dead items: zeros).

With ``Prep.GROUP`` (T = 1), each consumer group prepares its own items: its 128
threads (thread ``c``: q, k and v channel ``c``) do the conv + SiLU, the window rewrite and
the q / k norms of the item before its units, and the gated RMSNorm of its ``o`` after them,
with the item's operands loaded one group item ahead; the prep warpgroup keeps the gate and
decay, the output gate's sigmoid and beta. Where an SM has few items, the two groups then
prepare in parallel instead of in turn on the one prep warpgroup.

Slots of the item ring are reused in turn (item ``j`` of the CTA's walk takes slot
``j % slots``), guarded by three mbarriers each: *ready* (prep -> consumers, one arrival per
prep thread), *done* (the item's consumers -> prep, one arrival per lane of each unit warp, for
a dead item too, so that every warp passes every phase of its slots) and *free* (the epilogue
-> the next prep of that slot, one arrival per prep thread once its reads of the slot are
done). A slot holds its item's warp sums of the q / k norms and of the RMSNorm too, so the
prep warps sync once per norm, between their sums and their reads, and never to hand a
slot back. With ``Prep.GROUP`` the group's epilogue frees the slot (one arrival per lane
of each unit warp) and *done* is not used. With the prep warpgroup (and no early reads) the
consumers' first page copies wait on named barrier ``Sync.FIRST_OPS`` until the prep has
requested its first item's window and activations, which otherwise came back behind the
launch's burst of page reads.

Every value is computed in the order of the other kernels of the family (the item arithmetic
of :mod:`kda.backends.cutedsl.item`, the same warp sums of the norms, the same MMA chains per
gate feature, the explicitly rounded arithmetic of :mod:`kda.backends.cutedsl.ptx`), so its
results are bit-identical to :mod:`kda.backends.cutedsl.wide`'s and
:mod:`kda.backends.cutedsl.split`'s.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int16, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from kda.backends.cutedsl import item, ptx as N
from kda.backends.cutedsl.args import KernelArgs, Launch, make_views
from kda.backends.cutedsl.gate import decay, gate_mma, gate_tile, smem_fragment
from kda.backends.cutedsl.ring import WarpRing
from kda.backends.cutedsl.item import chunk, reg_chunk, state_regs, store4
from kda.backends.cutedsl.pipeline import (FA_STAGES, ItemSlots, Mbarriers, Sync, init_fence,
                                            arrive, release_reads, sync)
from kda.backends.cutedsl.problem import Problem
from kda.backends.cutedsl.schedule import FB_ROW, GATE_BATCH, PREP_THREADS, Prep, Rows, Schedule
from kda.backends.cutedsl.scheduler import grid

D = 128
PREP = PREP_THREADS   # prep threads (one warpgroup)
OPS_WINDOW = 1        # _load_ops: an item's conv-window history
OPS_ACTIVATIONS = 2   # _load_ops: its x, output-gate logits and beta


class KdaStream(Launch):
    """The streamed kernel for one :class:`Problem` and a ``Rows.WARP`` :class:`Schedule`;
    ``launch`` is what gets compiled. The schedule's fields it reads: ``prep`` (``GROUP``:
    the consumer groups prepare their own items, see the module docstring), ``items`` and
    ``block`` (the launcher's grid, :func:`kda.backends.cutedsl.scheduler.ctas`), the ring
    (``unit_rows``, ``consumers``, ``depth``) and the flags ``early_reads``, ``stage_fb``,
    ``prefetch``, ``x_ahead``, ``walk``, ``token_loop``.

    Raises:
      ValueError: a schedule of another kernel, or one that cannot serve ``pb``
      (:meth:`Schedule.check`).
    """

    def __init__(self, pb: Problem, sched: Schedule):
        if sched.rows != Rows.WARP:
            raise ValueError(f"KdaStream: expected a rows=WARP schedule, got {sched.name}")
        sched.check(pb)
        self.pb = pb
        self.sched = sched
        self.block = sched.block
        self.group_prep = sched.prep == Prep.GROUP
        self.prefetch = sched.prefetch
        self.x_ahead = sched.x_ahead
        self.walk = sched.walk
        self.gate_batch = sched.gate_batch
        self.T = pb.T
        self.H = pb.H
        self.token_loop = sched.token_loop
        self.dim = pb.H * D
        self.st = BFloat16 if pb.state_bf16 else Float32
        # early_reads: the walk and the prep wait for the PDL predecessor after their first
        # slot ids, pages and windows
        self.early = sched.early_reads
        self.ring = WarpRing(sched, pb.T, self.st, pb.H)
        self.items = self.ring.items        # the item order and ranges (scheduler.ItemWalk)
        self.units = sched.units
        self.rows = sched.unit_rows
        # item slots: the one being prepared and one per consumer group; an item's epilogue
        # runs LAG items after its prep, once its group is done with it (Schedule.lag)
        self.LAG = sched.lag
        self.NI = self.LAG + 1
        self.prep0 = 32 * sched.consumers      # first prep thread
        self.threads = self.prep0 + PREP
        #: the consumers' first page copies wait until the prep has requested its first
        #: item's window and activations (behind a launch's burst of page reads they came
        #: back last); the groups' prep requests them before its walk; with the early reads
        #: pages and windows are all requested before the PDL wait, in no fixed order
        self.windows_first = not self.group_prep and not self.early
        T, NI = pb.T, self.NI
        fields = dict(self.ring.fields())
        fields.update({
            # the item slots' ready / done / free mbarriers (pipeline.ItemSlots)
            "slotbars": cute.struct.MemRange[Int64, ItemSlots.PER_SLOT * NI],
            "q": cute.struct.Align[cute.struct.MemRange[Float32, NI * T * D], 16],
            "k": cute.struct.Align[cute.struct.MemRange[Float32, NI * T * D], 16],
            "a": cute.struct.Align[cute.struct.MemRange[Float32, NI * T * D], 16],
            "v": cute.struct.Align[cute.struct.MemRange[Float32, NI * T * D], 16],
            "o": cute.struct.Align[cute.struct.MemRange[Float32, NI * T * D], 16],
            "og": cute.struct.Align[cute.struct.MemRange[Float32, NI * T * D], 16],
            "beta": cute.struct.Align[cute.struct.MemRange[Float32, NI * 8], 16],
            "desc": cute.struct.Align[cute.struct.MemRange[Int32, NI * 4], 16],
            # per slot: the warp sums [token][q^2, k^2, o^2][warp] of its item's norms
            "red": cute.struct.Align[cute.struct.MemRange[Float32, NI * T * 3 * 4], 16],
            # f_a rows of two items (the gate's B operand; rows T.. stay zero), cp.async-filled
            "fabar": cute.struct.MemRange[Int64, 2],
            "fa": cute.struct.Align[cute.struct.MemRange[BFloat16, 2 * 8 * FB_ROW], 16],
        })
        if self.group_prep:
            # each group's warp sums: [group][q, k, o^2][warp] (the o^2 sums apart, since a
            # warp may still read an item's while the group's next conv writes the q / k sums)
            fields["gred"] = cute.struct.Align[
                cute.struct.MemRange[Float32, sched.groups * 3 * 4], 16]
        if self.gate_batch:
            # the decays of a gate batch: [item of the batch][feature]
            fields["gb"] = cute.struct.Align[cute.struct.MemRange[Float32, GATE_BATCH * D], 16]
        # stage_fb: the head's f_b rows (the gate's A operand) staged in shared memory when
        # the head changes; else read from L2
        self.fb_smem = sched.stage_fb
        if self.fb_smem:
            fields.update({
                "fbbar": cute.struct.MemRange[Int64, 1],
                "fb": cute.struct.Align[cute.struct.MemRange[BFloat16, D * FB_ROW], 16],
            })
        self.Storage = cute.struct(type("KdaStreamStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------------ views
    def _slots(self, storage, name):
        """Item-slot vectors ``[NI, T, 128]`` fp32 (q-hat, k-hat, alpha, v, o, output gate)."""
        T = self.T
        return getattr(storage, name).get_tensor(cute.make_layout((self.NI, T, D),
                                                                  stride=(T * D, D, 1)))

    def _descs(self, storage):
        """Per slot: the item's request, head and liveness (for its epilogue)."""
        return storage.desc.get_tensor(cute.make_layout((self.NI, 4), stride=(4, 1)))

    def _sums(self, storage):
        """Per slot: its item's warp sums ``[NI, T, 3 (q^2, k^2, o^2), 4 warps]``."""
        T = self.T
        return storage.red.get_tensor(cute.make_layout((self.NI, T, 3, 4),
                                                       stride=(T * 12, 12, 4, 1)))

    def _betas(self, storage):
        return storage.beta.get_tensor(cute.make_layout((self.NI, 8), stride=(8, 1)))

    def _item_slots(self, storage) -> ItemSlots:
        """The item slots' barriers (:class:`kda.backends.cutedsl.pipeline.ItemSlots`)."""
        return ItemSlots(storage.slotbars.data_ptr(), self.NI)

    def _fa_bars(self, storage) -> Mbarriers:
        """The f_a stages' barriers: item j's rows in stage ``j % 2``."""
        return Mbarriers(storage.fabar.data_ptr(), FA_STAGES)

    def _fb_bar(self, storage) -> Mbarriers:
        """The staged f_b rows' barrier (one bulk copy of a head's rows at a time)."""
        return Mbarriers(storage.fbbar.data_ptr(), 1)

    # ------------------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, a: KernelArgs):
        tid, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        warp_i = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        g = make_views(self.pb, a)
        R, slots, scale, eps, lb, ctas = a.R, a.slots, a.scale, a.eps, a.lb, a.ctas
        storage = cutlass.memory.SmemAllocator().allocate(self.Storage)
        self.ring.init(storage, tid)
        if tid == 0:
            # every writer of an item's slot arrives (its own writes are released to the
            # waiters): the 128 prep threads on *ready*, each unit's 32 lanes on *done*;
            # every reader on *free* (the prep threads after the epilogue; group_prep: each
            # unit's 32 lanes)
            self._item_slots(storage).init(PREP, self.units * 32,
                                           self.units * 32 if self.group_prep else PREP)
            Mbarriers.init(storage.fabar.data_ptr(), FA_STAGES, PREP)
            if cutlass.const_expr(self.fb_smem):
                Mbarriers.init(storage.fbbar.data_ptr(), 1, 1)
            init_fence()
        cute.arch.sync_threads()
        i0, i1 = self.items.item_range(R * self.H, block, ctas)
        if tid < self.prep0:
            if cutlass.const_expr(not self.early):
                # every consumer read (slot ids, pages) may be a predecessor's output
                cute.arch.griddepcontrol_wait()
            u = warp_i % self.units
            stores = self._slot_tensors(storage)
            gp = None
            if cutlass.const_expr(self.group_prep):
                gp = self._group_start(g, warp_i, lane, i0, i1, R, slots)

            def unit(stage, j, h, dst, refill):
                if cutlass.const_expr(self.group_prep):
                    self._group_conv(storage, g, gp, j, h, dst[0], warp_i, lane, scale)
                    self._group_next(g, gp, j, i0, i1, R, slots, warp_i, lane)
                self._unit(g, stores, stage, j, h, dst, refill, u, lane, slots)
                if cutlass.const_expr(self.group_prep):
                    self._group_epilogue(storage, g, gp, j, i0, R, warp_i, lane, eps, True)

            def skip(j):
                if cutlass.const_expr(self.group_prep):
                    self._group_next(g, gp, j, i0, i1, R, slots, warp_i, lane)
                self._skip(stores, j)
                if cutlass.const_expr(self.group_prep):
                    self._group_epilogue(storage, g, gp, j, i0, R, warp_i, lane, eps, False)

            before_copies = None
            if cutlass.const_expr(self.windows_first):
                def before_copies():
                    sync(Sync.FIRST_OPS, self.threads)
            self.ring.walk(storage, g.state, g.state_indices, g.num_accepted_tokens, R, slots,
                           i0, i1, warp_i, lane, unit, skip, before_copies)
        else:
            self._prep_loop(storage, g, tid - self.prep0, i0, i1, R, slots, scale, eps, lb)
            if cutlass.const_expr(self.block):
                self._release_head_lines(g, tid - self.prep0, i0, i1, R)
        cute.arch.griddepcontrol_launch_dependents()

    # ----------------------------------------------------------------------- f_b staging
    def _fb(self, storage):
        """The staged f_b rows of one head, ``[128, 128]`` bf16 in padded rows."""
        return storage.fb.get_tensor(cute.make_layout((D, D), stride=(FB_ROW, 1)))

    @cute.jit
    def _stage_fb(self, storage, g, pt, h):
        """Prep thread ``pt`` bulk-copies f_b row ``h*128 + pt`` into the staged rows (f_b is a
        model weight: no predecessor writes it); thread 0 arrives with the 32 KiB the copies
        bring. Every prep thread fences its earlier reads of the rows, then the prep warps
        sync, then the copies go. In blocks the rows are marked L2 evict-last: the next CTA of
        the head comes H * C items later, and the pages streamed meanwhile evict rows of normal
        priority from 96 heads on (:meth:`_release_head_lines` returns them)."""
        fb = self._fb_bar(storage)
        bar = fb.at(0)
        release_reads()
        sync(Sync.PREP, PREP)
        if pt == 0:
            fb.arrive_with_bytes(0, D * D * 2)
        if cutlass.const_expr(self.block):
            N.bulk_g2s_evict_last(self._fb(storage)[pt, None].iterator,
                                  g.f_b[h * D + pt, None].iterator, D * 2, bar)
        else:
            atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), BFloat16, num_bits_per_copy=D * 16)
            cute.copy(atom, g.f_b[h * D + pt, None], self._fb(storage)[pt, None], mbar_ptr=bar)

    @cute.jit
    def _release_head_lines(self, g, pt, i0, i1, R):
        """In blocks: the CTA holding a head's last request returns the L2 lines that head's
        CTAs marked evict-last (its f_b rows, prep thread ``pt`` row ``h*128 + pt``, and its conv
        weights and bias) to the normal priority, so that a launch leaves no evict-last lines
        behind (a CTA of the head started after it would mark them again)."""
        for i in cutlass.range(i0, i1):
            r, h = self.items.split_item(i, R)
            if r == R - 1:
                if cutlass.const_expr(self.fb_smem):
                    N.l2_evict_normal_256(g.f_b[h * D + pt, None].iterator)
                self._head_conv_lines(g, h * D + pt, pt, N.l2_evict_normal_line)

    # ------------------------------------------------------------------------ consumers
    def _slot_tensors(self, storage):
        """The item slots' tensors the consumers use, with the slots' barriers."""
        return (self._slots(storage, "q"), self._slots(storage, "k"), self._slots(storage, "a"),
                self._slots(storage, "v"), self._slots(storage, "o"), self._betas(storage),
                self._item_slots(storage))

    @cute.jit
    def _skip(self, stores, j):
        """A dead item of the warp's group: it passes the item's *ready* and arrives *done*
        (the slot's phases then count every item, so the parity of each later wait holds;
        with ``group_prep`` the group's epilogue follows instead of *done*)."""
        slots = stores[6]
        slots.consumer_wait(j)
        if cutlass.const_expr(not self.group_prep):
            slots.consumer_release(j)

    @cute.jit
    def _unit(self, g, stores, stage, j, h, dst, refill, u, lane, slots):
        """One unit of item ``j`` (the CTA's ``j``-th; its ``stage`` holds rows ``u*rows ..``):
        its passes of 16 rows (:meth:`_pass`), then *done* (with ``group_prep`` the group's
        epilogue follows instead)."""
        grp = lane // 8
        l8 = lane % 8
        slot = j % self.NI
        stores[6].consumer_wait(j)
        if cutlass.const_expr(self.token_loop):
            for p in cutlass.range(self.rows // 16, unroll=1):
                self._pass(g, stores, stage, p, slot, h, dst, refill, u, grp, l8, slots)
        else:
            for p in cutlass.range_constexpr(self.rows // 16):
                self._pass(g, stores, stage, p, slot, h, dst, refill, u, grp, l8, slots)
        if cutlass.const_expr(not self.group_prep):
            stores[6].consumer_release(j)

    @cute.jit
    def _pass(self, g, stores, stage, p, slot, h, dst, refill, u, grp, l8, slots):
        """Pass ``p`` of a unit: its 16 rows from the stage into registers (lane: 4 rows x 16
        key columns), the stage refilled after the last pass's read, then the T tokens, each
        token's state stored at T > 1 (at T = 1 once, after the token)."""
        pb, T = self.pb, self.T
        s_q, s_k, s_a, s_v, s_o, s_b = stores[:6]
        S = state_regs(4)
        for m in cutlass.range_constexpr(4):
            row = p * 16 + 4 * m + grp
            for c in cutlass.range_constexpr(4):
                raw = cute.make_rmem_tensor(cute.make_layout((4,)), self.st)
                cute.autovec_copy(chunk(stage[row, None], l8, c), raw)
                for e in cutlass.range_constexpr(4):
                    S[m, 4 * c + e] = Float32(raw[e])     # bf16: widened exactly
        if p == self.rows // 16 - 1:
            refill()
        base = u * self.rows + p * 16 + grp     # page row of register row m: + 4m
        if cutlass.const_expr(self.token_loop):
            for t in cutlass.range(T, unroll=1):
                self._token(g, S, s_q, s_k, s_a, s_v, s_o, s_b, slot, t, base, h, dst[0], l8)
                if cutlass.const_expr(not pb.record):
                    d = dst[0]             # dst[t], selected (a register list has no run-time index)
                    for tt in cutlass.range_constexpr(1, T):
                        d = Int32(cutlass.select_(t == tt, dst[tt], d))
                    if (d > 0) & (d < slots):
                        self._store(g, S, d, h, base, l8)
        else:
            for t in cutlass.range_constexpr(T):
                self._token(g, S, s_q, s_k, s_a, s_v, s_o, s_b, slot, t, base, h, dst[0], l8)
                if cutlass.const_expr(not pb.record and T > 1):
                    if (dst[t] > 0) & (dst[t] < slots):
                        self._store(g, S, dst[t], h, base, l8)
        if cutlass.const_expr(not pb.record and T == 1):
            self._store(g, S, dst[0], h, base, l8)

    @cute.jit
    def _token(self, g, S, s_q, s_k, s_a, s_v, s_o, s_b, slot, t, base, h, cslot, l8):
        """Token ``t`` of the delta rule (:func:`kda.backends.cutedsl.item.token`) on the 4
        register rows (page rows ``base + 4m``): ``o`` into the item's slot, ``u`` to the
        record."""
        def emit(m, u, ob):
            s_o[slot, t, base + 4 * m] = ob
            if cutlass.const_expr(self.pb.record):
                g.v_record[cslot, h, t, base + 4 * m] = u

        b_t = s_b[slot, t]
        item.token(S, s_a[slot, t, None], s_k[slot, t, None], s_q[slot, t, None], b_t,
                    lambda m: s_v[slot, t, base + 4 * m], l8, emit)

    def _store(self, g, S, slot, h, base, l8):
        """The 4 register rows to state[slot, h]: 16 bytes per chunk (fp32), or 8 rounded to
        bf16 once (nearest even)."""
        for m in range(4):
            for c in range(4):
                store4(reg_chunk(S, m, c), chunk(g.state[slot, h, base + 4 * m, None], l8, c),
                       self.pb.state_bf16)

    # ------------------------------------------------------------ group prep (T = 1)
    def _group_start(self, g, w, lane, i0, i1, R, slots):
        """The operand pipeline of warp ``w``'s group (``group_prep``), before its walk:
        registers for the operands of its current item (the q / k / v window history and x of
        channel ``c = 32 (w % units) + lane``), its conv weights and bias with their head
        (``cst[2]``), the conv slots of its next two items (``cst[0]``, ``cst[1]``) and the
        norm weight of channel ``c``; the first item's operands are loaded."""
        G = self.sched.groups
        grp = w // self.units
        c = (w % self.units) * 32 + lane
        ops = (cute.make_rmem_tensor(cute.make_layout((9,)), g.conv_state.element_type),
               cute.make_rmem_tensor(cute.make_layout((3,)), g.x.element_type))
        cst = cute.make_rmem_tensor(cute.make_layout((3,)), Int32)
        cs0 = self._group_si(g, i0 + grp, R)
        cst[0] = self._group_si(g, i0 + grp + G, R)
        cst[1] = self._group_si(g, i0 + grp + 2 * G, R)
        cst[2] = Int32(-1)
        self._group_load(g, i0 + grp, i1, cs0, R, slots, ops, c)
        return ops, self._conv_regs(g), cst, Float32(g.norm_weight[c])

    @cute.jit
    def _group_si(self, g, i, R):
        """Item ``i``'s conv slot (at T = 1 also its source; its request is in bounds for any
        ``i``)."""
        return g.state_indices[self.items.split_item(i, R)[0], 0]

    @cute.jit
    def _group_load(self, g, i, i1, cslot, R, slots, ops, c):
        """Item ``i``'s window history and x of channel ``c`` of q, k and v into ``ops``, if
        it is live (at T = 1: ``0 < cslot < slots``)."""
        r, h = self.items.split_item(i, R)
        hist, xs = ops
        if item.is_live(cslot, cslot, slots, i < i1):      # (at T = 1 the source is the conv slot)
            c_hist, c_x, _ = self._op_coords((r, h, cslot, cslot, Int32(0)), c)
            for part in cutlass.range_constexpr(3):
                for e in cutlass.range_constexpr(3):
                    hist[3 * part + e] = g.conv_state[c_hist[part][e]]
                xs[part] = g.x[c_x[part][0]]

    @cute.jit
    def _group_next(self, g, gp, j, i0, i1, R, slots, w, lane):
        """After the group's item ``j``: the operands of its next item ``j + groups`` (conv
        slot ``cst[0]``) into ``ops``, and the conv slot of item ``j + 3 groups``."""
        ops, _, cst, _ = gp
        G = self.sched.groups
        c = (w % self.units) * 32 + lane
        self._group_load(g, i0 + j + G, i1, cst[0], R, slots, ops, c)
        cst[0] = cst[1]
        cst[1] = self._group_si(g, i0 + j + 3 * G, R)

    def _group_red(self, storage):
        """The groups' warp sums, ``[groups, 3, 4]`` fp32: q^2, k^2 and o^2 per warp."""
        return storage.gred.get_tensor(cute.make_layout((self.sched.groups, 3, 4),
                                                        stride=(12, 4, 1)))

    @cute.jit
    def _group_conv(self, storage, g, gp, j, h, cslot, w, lane, scale):
        """Item ``j``'s conv + SiLU of channel ``c`` of q, k and v, its window rewrite and the
        q / k L2 norms into its slot, once the slot is free (the prep's order: warp sums, then
        the group's 4 warps in order). The group's warps sync after the sums and after the
        slot writes (named barrier ``2 + group``)."""
        (hist, xs), hc, cst, _ = gp
        grp = w // self.units
        u = w % self.units
        c = u * 32 + lane
        slot = j % self.NI
        self._item_slots(storage).prep_acquire(j)
        if h != cst[2]:
            self._load_head_conv(g, hc, h, c)
            cst[2] = h
        hv = [Float32(hist[e]) for e in range(9)]
        xv = [Float32(xs[e]) for e in range(3)]
        yq, yk, yv = self._conv_window(g, hc, hv, xv, cslot, h * D + c)
        red = self._group_red(storage)
        sq = N.warp_sum(N.fmul(yq[0], yq[0]))
        sk = N.warp_sum(N.fmul(yk[0], yk[0]))
        if lane == 0:
            red[grp, 0, u] = sq
            red[grp, 1, u] = sk
        if cutlass.const_expr(self.pb.record):
            g.kg_record[cslot, h, 0, c] = BFloat16(yk[0])
        sync(Sync.GROUP + grp, self.units * 32)
        iq = item.inv_norm(item.quarter_sum(lambda i: red[grp, 0, i]))
        ik = item.inv_norm(item.quarter_sum(lambda i: red[grp, 1, i]))
        self._slots(storage, "q")[slot, 0, c] = item.q_hat(yq[0], iq, scale)
        self._slots(storage, "k")[slot, 0, c] = N.fmul(yk[0], ik)
        self._slots(storage, "v")[slot, 0, c] = yv[0]
        # every warp of the group sees the item's vectors
        sync(Sync.GROUP + grp, self.units * 32)

    @cute.jit
    def _group_epilogue(self, storage, g, gp, j, i0, R, w, lane, eps, live: cutlass.Constexpr):
        """Item ``j``'s gated RMSNorm by its group, warp ``u`` the channels ``32u + lane`` (the
        prep epilogue's split and order: warp sums of ob^2, then the 4 warps in order); a dead
        item's row of ``out`` is zeros. Then every lane arrives *free*."""
        grp = w // self.units
        u = w % self.units
        c = u * 32 + lane
        slot = j % self.NI
        r, h = self.items.split_item(i0 + j, R)
        if cutlass.const_expr(live):
            red = self._group_red(storage)
            cute.arch.sync_warp()          # the warp's o rows, written by its lanes l8 == 0
            ob = self._slots(storage, "o")[slot, 0, c]
            so = N.warp_sum(N.fmul(ob, ob))
            if lane == 0:
                red[grp, 2, u] = so
            sync(Sync.GROUP + grp, self.units * 32)
            ss = item.quarter_sum(lambda i: red[grp, 2, i])
            y = item.gated_rmsnorm(ob, ss, eps, gp[3], self._slots(storage, "og")[slot, 0, c])
            g.out[r, h * D + c] = BFloat16(y)
        else:
            g.out[r, h * D + c] = BFloat16(0.0)
        self._item_slots(storage).epilogue_release(j)

    # ----------------------------------------------------------------------------- prep
    @cute.jit
    def _prep_loop(self, storage, g, pt, i0, i1, R, slots, scale, eps, lb):
        """The prep warps: item j's prep, then item j-LAG's epilogue; the last LAG epilogues
        after the loop.

        No global load is used where it is issued: the slot ids of item j+3 (j+2 without the
        L2 prefetch) are read during item j, item j+1's operands as soon as item j's are used,
        into the registers they replace, item j+1's f_a rows by cp.async into the other
        shared-memory stage, a new head's parameters (conv weights and bias, dt_bias, A_log,
        the staged f_b rows) once the current head's are."""
        nwv = Float32(g.norm_weight[pt])
        mma, thr = gate_mma(pt % 32)
        hc, hg = self._head_regs(g)
        # the head of hp / the staged f_b rows (fbs[0]) and the phase of their copies (fbs[1])
        fbs = cute.make_rmem_tensor(cute.make_layout((2,)), Int32)
        fbs[0] = self.items.split_item(i0, R)[1]
        fbs[1] = Int32(0)
        if i0 < i1:
            # the first item's head: model weights (no predecessor writes them)
            if cutlass.const_expr(not self.group_prep):
                self._load_head_conv(g, hc, fbs[0], pt)
            self._load_head_gate(g, thr, hg, fbs[0], pt)
            if cutlass.const_expr(self.fb_smem):
                self._stage_fb(storage, g, pt, fbs[0])
        if cutlass.const_expr(not self.early):
            # every other read (slot ids, windows, activations) may be a predecessor's output
            cute.arch.griddepcontrol_wait()
        # slot ids ``ahead`` items ahead, operands one item ahead; with the L2 prefetch, the
        # rows of the item after next into L2 (their loads then hit L2)
        ahead = 3 if self.prefetch else 2
        nraw = self.T + (3 if self.walk else 1)
        raw = cute.make_rmem_tensor(cute.make_layout((nraw,)), Int32)
        dsc = cute.make_rmem_tensor(cute.make_layout((6,)), Int32)
        dsc2 = cute.make_rmem_tensor(cute.make_layout((6,)), Int32)
        # walk: (request, head) of the item whose slot ids are loaded next
        rh = cute.make_rmem_tensor(cute.make_layout((2,)), Int32)
        r0, h0 = self.items.split_item(i0, R)
        rh[0] = r0
        rh[1] = h0
        self._load_si(g, raw, i0, rh, R)
        if cutlass.const_expr(self.prefetch):
            raw1 = cute.make_rmem_tensor(cute.make_layout((nraw,)), Int32)
            self._step(rh, i0 + 1, R)
            self._load_si(g, raw1, i0 + 1, rh, R)
            self._derive(raw, dsc, i0, i1, R, slots)
            self._derive(raw1, dsc2, i0 + 1, i1, R, slots)
        else:
            self._derive(raw, dsc, i0, i1, R, slots)
        self._step(rh, i0 + ahead - 1, R)
        self._load_si(g, raw, i0 + ahead - 1, rh, R)
        ops = self._ops_regs(g)
        if cutlass.const_expr(self.early):
            # the first window before the wait, the activations (a predecessor's output) after
            self._load_ops(g, dsc, ops, pt, OPS_WINDOW)
            cute.arch.griddepcontrol_wait()
            self._load_ops(g, dsc, ops, pt, OPS_ACTIVATIONS)
        else:
            self._load_ops(g, dsc, ops, pt)
        if cutlass.const_expr(self.windows_first):
            arrive(Sync.FIRST_OPS, self.threads)
        s_fa = self._fa_rows(storage)
        for st in cutlass.range_constexpr(2):
            for t in cutlass.range_constexpr(self.T, 8):
                s_fa[st, t, pt] = BFloat16(0.0)
        sync(Sync.PREP, PREP)
        bat = None
        if cutlass.const_expr(self.gate_batch):
            # the gate's batches (:meth:`_gate_of_batch`): the current batch's first item and
            # end, the f_a stages' use and the end of the batch after it; its rows now
            gb = cute.make_rmem_tensor(cute.make_layout((4,)), Int32)
            gb[0] = Int32(0)
            gb[1] = Int32(0)
            gb[2] = Int32(0)
            gb[3] = self._batch_end(Int32(0), i0, i1, R)
            self._copy_fa_batch(storage, g, gb[0], gb[3], gb[2], i0, R, pt)
            bat = (gb, i0, i1, R)
        else:
            self._copy_fa(storage, g, dsc, 0, pt)
        self._prefetch(g, dsc2, pt)
        for j in cutlass.range(i1 - i0, unroll=1):
            cur = [dsc[f] for f in range(6)]
            if cutlass.const_expr(self.prefetch):
                for f in cutlass.range_constexpr(6):
                    dsc[f] = dsc2[f]
                self._derive(raw, dsc2, i0 + j + 2, i1, R, slots)
            else:
                self._derive(raw, dsc, i0 + j + 1, i1, R, slots)
            self._step(rh, i0 + j + ahead, R)
            self._load_si(g, raw, i0 + j + ahead, rh, R)
            self._prefetch(g, dsc2, pt)
            self._prep(storage, g, mma, thr, pt, j, cur, dsc, ops, hc, hg, scale, lb, fbs, bat)
            if cutlass.const_expr(not self.group_prep):
                if j >= self.LAG:
                    self._epilogue(storage, g, pt, j - self.LAG, eps, nwv)
        if cutlass.const_expr(not self.group_prep):
            first = cutlass.max(i1 - i0 - self.LAG, Int32(0))
            for j in cutlass.range(first, i1 - i0, unroll=1):
                self._epilogue(storage, g, pt, j, eps, nwv)
        # the f_a phase of the item (batch) past the range (its arrivals came with the last)
        if cutlass.const_expr(self.gate_batch):
            self._fa_bars(storage).wait(bat[0][2])
        else:
            self._fa_bars(storage).wait(i1 - i0)
        if cutlass.const_expr(self.fb_smem):
            if i0 < i1:
                # no copy into this CTA's shared memory outlives it
                self._fb_bar(storage).wait_parity(0, fbs[1])

    @cute.jit
    def _step(self, rh, i, R):
        """With :attr:`walk`, ``rh`` := (request, head) of item ``i``, stepped from item
        ``i - 1``'s."""
        if cutlass.const_expr(self.walk):
            self.items.step_item(rh, i, R)

    @cute.jit
    def _load_si(self, g, raw, i, rh, R):
        """Item ``i``'s slot ids and accepted count (its request is in bounds for any ``i``)
        into ``raw``, as they are; with :attr:`walk`, then its (request, head) ``rh``."""
        T = self.T
        if cutlass.const_expr(self.walk):
            r = rh[0]
        else:
            r = self.items.split_item(i, R)[0]
        for t in cutlass.range_constexpr(T):
            raw[t] = g.state_indices[r, t]
        if cutlass.const_expr(T > 1):
            raw[T] = g.num_accepted_tokens[r]
        if cutlass.const_expr(self.walk):
            raw[T + 1] = r
            raw[T + 2] = rh[1]

    @cute.jit
    def _derive(self, raw, dsc, i, i1, R, slots):
        """``dsc`` := (r, h, conv slot, source slot, window offset, live) of item ``i`` from
        its :meth:`_load_si` values (contract section 2 and the project's liveness rule; an
        item past ``i1`` is dead)."""
        T = self.T
        if cutlass.const_expr(self.walk):
            r, h = raw[T + 1], raw[T + 2]
        else:
            r, h = self.items.split_item(i, R)
        cslot = raw[0]
        src, off = item.source_slot([raw[t] for t in range(T)], raw[T] if T > 1 else Int32(0),
                                    T)
        live = item.is_live(src, cslot, slots, i < i1)
        dsc[0] = r
        dsc[1] = h
        dsc[2] = cslot
        dsc[3] = src
        dsc[4] = off
        dsc[5] = Int32(live)

    def _ops_regs(self, g):
        """Registers for one item's operands, in their memory types (widened where used):
        the q / k / v window history (3 each), x of the q / k / v channel per token, the
        output-gate logit per token, beta."""
        T = self.T
        return (cute.make_rmem_tensor(cute.make_layout((9,)), g.conv_state.element_type),
                cute.make_rmem_tensor(cute.make_layout((3 * T,)), g.x.element_type),
                cute.make_rmem_tensor(cute.make_layout((T,)), g.output_gate.element_type),
                cute.make_rmem_tensor(cute.make_layout((1,)), g.beta.element_type))

    def _op_coords(self, dsc, pt):
        """Prep thread ``pt``'s operand coordinates for the item in ``dsc``: the window history
        in ``conv_state`` ([part][position]), x ([part][token]) and the output gate
        ([token]), as :meth:`_load_ops` reads them and :meth:`_prefetch` brings them to L2."""
        T, dim = self.T, self.dim
        r, h, cslot, off = dsc[0], dsc[1], dsc[2], dsc[4]
        n0 = r * T
        ch = h * D + pt
        hist = [[(cslot, part * dim + ch, off + e) for e in range(3)] for part in range(3)]
        xs = [[(n0 + t, part * dim + ch) for t in range(T)] for part in range(3)]
        ogs = [(n0 + t, ch) for t in range(T)]
        return hist, xs, ogs

    @cute.jit
    def _load_ops(self, g, dsc, ops, pt, which=OPS_WINDOW | OPS_ACTIVATIONS):
        """The operands of prep thread ``pt`` for the item in ``dsc`` (if live) into ``ops``:
        ``which`` of its window history (:data:`OPS_WINDOW`) and its activations, x, the
        output gate and beta (:data:`OPS_ACTIVATIONS`)."""
        T = self.T
        hist, xs, ogs, bs = ops
        if dsc[5] != 0:
            c_hist, c_x, c_og = self._op_coords(dsc, pt)
            for part in cutlass.range_constexpr(0 if self.group_prep else 3):
                if cutlass.const_expr(which & OPS_WINDOW):
                    for e in cutlass.range_constexpr(3):
                        hist[3 * part + e] = g.conv_state[c_hist[part][e]]
                if cutlass.const_expr(self.x_ahead and which & OPS_ACTIVATIONS):
                    for t in cutlass.range_constexpr(T):
                        xs[part * T + t] = g.x[c_x[part][t]]
            if cutlass.const_expr(which & OPS_ACTIVATIONS):
                for t in cutlass.range_constexpr(T):
                    ogs[t] = g.output_gate[c_og[t]]
                bs[0] = g.beta[dsc[0] * T + pt % T, dsc[1]]

    @cute.jit
    def _prefetch(self, g, dsc, pt):
        """The lines :meth:`_load_ops` and :meth:`_copy_fa` will read for the item in ``dsc``
        (if live) into L2 (in the DS layout one line holds a channel's window)."""
        T = self.T
        if cutlass.const_expr(self.prefetch):
            if dsc[5] != 0:
                c_hist, c_x, c_og = self._op_coords(dsc, pt)
                for part in cutlass.range_constexpr(3):
                    for e in cutlass.range_constexpr(3 if self.pb.layout == "SD" else 1):
                        N.prefetch_l2(cute.domain_offset(c_hist[part][e], g.conv_state).iterator)
                    for t in cutlass.range_constexpr(T):
                        N.prefetch_l2(cute.domain_offset(c_x[part][t], g.x).iterator)
                for t in cutlass.range_constexpr(T):
                    N.prefetch_l2(cute.domain_offset(c_og[t], g.output_gate).iterator)
                if pt < 2 * T:
                    N.prefetch_l2(cute.domain_offset((dsc[0] * T + pt // 2, (pt % 2) * (D // 2)),
                                                     g.f_a).iterator)

    def _head_regs(self, g):
        """Registers for one head's parameters: the conv weights (4 per part) and bias of the
        thread's 3 channels; dt_bias of its 8 gate accumulator values and A_log."""
        return (self._conv_regs(g), cute.make_rmem_tensor(cute.make_layout((9,)), Float32))

    def _conv_regs(self, g):
        """Registers for a head's conv weights (4 per part) and bias of a thread's 3 channels."""
        return (cute.make_rmem_tensor(cute.make_layout((12,)), g.conv_weight.element_type),
                cute.make_rmem_tensor(cute.make_layout((3,)), g.conv_bias.element_type))

    @cute.jit
    def _load_head_conv(self, g, hc, h, pt):
        ch = h * D + pt
        hw, hb = hc
        for part in cutlass.range_constexpr(3):
            for e in cutlass.range_constexpr(4):
                hw[4 * part + e] = g.conv_weight[part, e, ch]
            if cutlass.const_expr(self.pb.has_bias):
                hb[part] = g.conv_bias[part * self.dim + ch]
        if cutlass.const_expr(self.block):
            self._head_conv_lines(g, ch, pt, N.prefetch_l2_evict_last)

    @cute.jit
    def _head_conv_lines(self, g, ch, pt, hint):
        """``hint`` (:func:`ptx.prefetch_l2_evict_last`: blocks reuse them H * C items later, as
        the f_b rows; or :func:`ptx.l2_evict_normal_line`) on each L2 line of a head's conv
        weights and bias (channel ``ch`` of prep thread ``pt``; one thread per 128-byte line)."""
        per_line = 64 if cutlass.const_expr(self.pb.cw_bf16) else 32
        if pt % per_line == 0:
            for part in cutlass.range_constexpr(3):
                for e in cutlass.range_constexpr(4):
                    hint(cute.domain_offset((part, e, ch), g.conv_weight).iterator)
        if cutlass.const_expr(self.pb.has_bias):
            if pt % 32 == 0:
                for part in cutlass.range_constexpr(3):
                    hint(cute.domain_offset((part * self.dim + ch,), g.conv_bias).iterator)

    @cute.jit
    def _load_head_gate(self, g, thr, hg, h, pt):
        pw = pt // 32
        cC = thr.partition_C(cute.make_identity_tensor((16, 8)))
        for mi in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(4):
                f16, _ = cC[i]
                hg[4 * mi + i] = g.dt_bias[h * D + 16 * (2 * pw + mi) + f16]
        hg[8] = g.A_log[h]

    @cute.jit
    def _prep(self, storage, g, mma, thr, pt, j, desc, dn, ops, hc, hg, scale, lb, fbs, bat):
        """The CTA's ``j``-th item (``desc``: :meth:`_derive`'s fields; ``ops``, ``hc``, ``hg``:
        its operands and head parameters; its f_a rows in stage ``j % 2``) into slot ``j % NI``: conv,
        window, norms, beta, output gate, gate and decay; then *ready* (a dead item: *ready*
        only). Each register set is refilled for the next item (``dn``) once it is used. With
        ``gate_batch`` (``bat``: :meth:`_prep_loop`'s batch state) the decays come from the
        item's batch (:meth:`_gate_of_batch`)."""
        pb, T, dim = self.pb, self.T, self.dim
        slot = j % self.NI
        r, h, cslot, live = desc[0], desc[1], desc[2], desc[5]
        if cutlass.const_expr(self.gate_batch):
            # the next item starts a new head (a batch's gate needs its head's rows whether
            # or not its first item is live)
            new_head = (j + 1 < bat[2] - bat[1]) & (dn[1] != fbs[0])
        else:
            # the next live item starts a new head
            new_head = (dn[5] != 0) & (dn[1] != fbs[0])
        slots = self._item_slots(storage)
        slots.prep_acquire(j)
        s_desc = self._descs(storage)
        if cutlass.const_expr(not self.group_prep):
            if pt == 0:    # what the item's epilogue needs
                s_desc[slot, 0] = r
                s_desc[slot, 1] = h
                s_desc[slot, 2] = live
        s_q = self._slots(storage, "q")
        s_k = self._slots(storage, "k")
        s_v = self._slots(storage, "v")
        s_og = self._slots(storage, "og")
        s_b = self._betas(storage)
        s_red = self._sums(storage)
        pw = pt // 32
        lane = pt % 32
        n0 = r * T
        ch = h * D + pt
        hist, xs, ogs, bs = ops
        if cutlass.const_expr(self.group_prep):
            if live != 0:      # the output gate and beta: the group does the conv and norms
                s_og[slot, 0, pt] = N.sigmoid(Float32(ogs[0]))
                self._beta(s_b, slot, pt, bs)
        elif live != 0:
            hv = [Float32(hist[e]) for e in range(9)]
            if cutlass.const_expr(self.x_ahead):
                xv = [Float32(xs[e]) for e in range(3 * T)]
            else:
                xv = [Float32(g.x[n0 + e % T, (e // T) * dim + ch]) for e in range(3 * T)]
            yq, yk, yv = self._conv_window(g, hc, hv, xv, cslot, ch)
            for t in cutlass.range_constexpr(T):
                # q and k wait for their norms in the slot (fp32, exactly)
                s_q[slot, t, pt] = yq[t]
                s_k[slot, t, pt] = yk[t]
                s_v[slot, t, pt] = yv[t]
                s_og[slot, t, pt] = N.sigmoid(Float32(ogs[t]))
                sq = N.warp_sum(N.fmul(yq[t], yq[t]))
                sk = N.warp_sum(N.fmul(yk[t], yk[t]))
                if lane == 0:
                    s_red[slot, t, 0, pw] = sq
                    s_red[slot, t, 1, pw] = sk
                if cutlass.const_expr(pb.record):
                    g.kg_record[cslot, h, t, pt] = BFloat16(yk[t])
            self._beta(s_b, slot, pt, bs)
        self._load_ops(g, dn, ops, pt)
        if cutlass.const_expr(not self.group_prep):
            if new_head:
                self._load_head_conv(g, hc, dn[1], pt)
        if cutlass.const_expr(self.gate_batch):
            self._gate_of_batch(storage, g, mma, thr, pt, j, h, lb, hg, fbs, bat)
            s_a = self._slots(storage, "a")
            s_gb = self._batch_decays(storage)
            col = j - bat[0][0]
            if live != 0:
                s_a[slot, 0, pt] = s_gb[col, pt]
        else:
            # every thread passes every phase of the f_a stages (a dead item's too), so that
            # no thread's arrival for item j + 2 can land in item j's phase
            self._fa_bars(storage).wait(j)
            if live != 0:
                if cutlass.const_expr(self.fb_smem):
                    self._fb_bar(storage).wait_parity(0, fbs[1])
                rB = smem_fragment(mma, pt % 32, self._fa_rows(storage)[j % 2, None, None], "B")
                self._gate(storage, g, mma, thr, pt, slot, h, cslot, lb, rB, hg)
            # (every prep thread read stage (j + 1) % 2 for item j - 1 before its arrival on
            # stage j % 2's barrier, waited for above)
            self._copy_fa(storage, g, dn, (j + 1) % 2, pt)
        if new_head:
            self._load_head_gate(g, thr, hg, dn[1], pt)
        if cutlass.const_expr(not self.group_prep):
            if live != 0:
                sync(Sync.PREP, PREP)
                for t in cutlass.range_constexpr(T):
                    sq = item.quarter_sum(lambda i, t=t: s_red[slot, t, 0, i])
                    sk = item.quarter_sum(lambda i, t=t: s_red[slot, t, 1, i])
                    iq = item.inv_norm(sq)
                    ik = item.inv_norm(sk)
                    s_q[slot, t, pt] = item.q_hat(s_q[slot, t, pt], iq, scale)
                    s_k[slot, t, pt] = N.fmul(s_k[slot, t, pt], ik)
        # (the slot's sums are written again only by its next item, after *free*, which every
        # prep thread arrives on after this item's epilogue)
        slots.prep_commit(j)
        if new_head:
            if cutlass.const_expr(self.fb_smem):
                # the rows staged last have landed (the first staging may not have been
                # waited for yet) before they are replaced
                self._fb_bar(storage).wait_parity(0, fbs[1])
                self._stage_fb(storage, g, pt, dn[1])
                fbs[1] = fbs[1] ^ 1
            fbs[0] = dn[1]

    @cute.jit
    def _beta(self, s_b, slot, pt, bs):
        """The item's beta per token into its slot (threads ``pt < T``)."""
        if pt < self.T:
            if cutlass.const_expr(self.pb.beta_activated):
                s_b[slot, pt] = Float32(bs[0])      # the engine's sigmoid(beta), as it is
            else:
                s_b[slot, pt] = N.sigmoid(Float32(bs[0]))

    @cute.jit
    def _conv_window(self, g, hc, hv, xv, cslot, ch):
        """Conv + SiLU of channel ``ch`` (of the head's 128) of q, k and v for the T tokens
        (:meth:`_conv`; ``hv``: the 3 history values per part, ``xv``: the T inputs per part,
        fp32), then the item's window rewrite. Returns the three parts' T values.

        Every history value of the item was read before. The values went through fp32
        exactly (a widening), so a bf16 cache gets its bits back as the high half of the
        fp32 bits (any NaN payload included), an fp32 cache the fp32."""
        pb, T, dim = self.pb, self.T, self.dim
        ys = [self._conv(hc, hv[3 * p:3 * p + 3], xv[p * T:(p + 1) * T], p) for p in range(3)]
        cs16 = cute.recast_tensor(g.conv_state, Int16) if pb.cs_bf16 else None
        for part in cutlass.range_constexpr(3):
            new = [hv[3 * part + 1], hv[3 * part + 2]] + xv[part * T:(part + 1) * T]
            for pos in cutlass.range_constexpr(T + 2):
                if cutlass.const_expr(pb.cs_bf16):
                    cs16[cslot, part * dim + ch, pos] = Int16(N.f32_bits(new[pos]) >> 16)
                else:
                    g.conv_state[cslot, part * dim + ch, pos] = new[pos]
        return ys

    def _conv(self, hc, hist, xs, part):
        """Conv + SiLU of the thread's channel of ``part`` for the T tokens (FP32): acc = bias;
        acc = fma(s[t+e], w[e], acc) over s = [w0, w1, w2, x_0 ..]; y_t = bf16(silu(acc))."""
        hw, hb = hc
        w = [Float32(hw[4 * part + e]) for e in range(4)]
        bias = Float32(0.0)
        if self.pb.has_bias:
            bias = Float32(hb[part])
        seq = hist + xs
        return item.conv_silu(seq, w, bias, self.T)

    def _fa_rows(self, storage):
        """The f_a rows of two items, ``[2, 8, 128]`` bf16 in padded rows."""
        return storage.fa.get_tensor(cute.make_layout((2, 8, D), stride=(8 * FB_ROW, FB_ROW, 1)))

    @staticmethod
    def _fa_chunks(g, s_fa, rb: int):
        """The f_a rows as chunks of ``rb`` bytes (4, 8 or 16): the cp.async atom, the rows in
        global ``(row, chunk, element)`` and the stages in shared memory ``(stage, row, chunk,
        element)``, and the chunks per row."""
        e = rb // 2                          # elements per chunk
        per_row = D // e
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=rb * 8)
        g_c = cute.make_tensor(g.f_a.iterator, cute.make_layout(
            (g.f_a.shape[0], per_row, e), stride=(g.f_a.stride[0], e, 1)))
        s_c = cute.make_tensor(s_fa.iterator, cute.make_layout(
            (2, 8, per_row, e), stride=(8 * FB_ROW, FB_ROW, e, 1)))
        return atom, g_c, s_c, per_row

    @cute.jit
    def _copy_fa(self, storage, g, dsc, st, pt):
        """The f_a rows of the item in ``dsc`` (if live) into stage ``st`` with cp.async (no
        register waits for them), chunks of the rows' alignment (16 bytes at most; element
        stores for 2-byte aligned rows); every prep thread then arrives on the stage's
        barrier once its copies have landed."""
        T, rb = self.T, min(self.pb.row_bytes, 16)
        fa = self._fa_bars(storage)
        s_fa = self._fa_rows(storage)
        if cutlass.const_expr(rb >= 4):
            if dsc[5] != 0:
                n0 = dsc[0] * T
                atom, g_c, s_c, per_row = self._fa_chunks(g, s_fa, rb)
                for k in cutlass.range_constexpr((T * per_row + PREP - 1) // PREP):
                    c = pt + PREP * k
                    if c < T * per_row:
                        t = c // per_row
                        ck = c - t * per_row
                        cute.copy(atom, g_c[n0 + t, ck, None], s_c[st, t, ck, None])
            fa.arrive_on_copies(st)
        else:
            if dsc[5] != 0:
                n0 = dsc[0] * T
                for t in cutlass.range_constexpr(T):
                    s_fa[st, t, pt] = g.f_a[n0 + t, pt]
            fa.arrive(st)

    @cute.jit
    def _gate(self, storage, g, mma, thr, pt, slot, h, cslot, lb, rB, hg,
              batch: cutlass.Constexpr = False):
        """Features ``32w .. 32w+31`` of prep warp w (two 16-row MMA tiles, A from the staged
        f_b rows, B the item's f_a rows ``rB``): rg = bf16(f_b rows . f_a) on the tensor cores
        (gate_mode 0: one chain over the 8 k-steps; 1: four chains of two, summed
        ((c0+c1)+c2)+c3), x = rg + dt_bias, the decay into the slot (``hg``: the head's
        dt_bias values of the thread's accumulators and A_log). With ``batch`` the B rows are
        up to 8 items of a gate batch, and column t's decays go to the batch's row t
        (:meth:`_batch_decays`; ``slot`` and ``cslot`` unused)."""
        pb = self.pb
        s_a = self._slots(storage, "a")
        s_gb = self._batch_decays(storage) if batch else None
        pw = pt // 32
        A = N.fexp(hg[8])
        for mi in cutlass.range_constexpr(2):
            mt = 2 * pw + mi
            if cutlass.const_expr(self.fb_smem):
                rA = smem_fragment(mma, pt % 32, cute.local_tile(self._fb(storage), (16, D),
                                                                 (mt, 0)), "A")
            else:
                tA = thr.partition_A(cute.local_tile(g.f_b, (16, D), (h * (D // 16) + mt, 0)))
                rA = mma.make_fragment_A(tA)
                cute.autovec_copy(tA, rA)

            def emit(i, f16, t, rg, mt=mt, mi=mi):
                feat = 16 * mt + f16
                if cutlass.const_expr(batch):
                    s_gb[t, feat] = decay(pb, A, lb, N.fadd(rg, hg[4 * mi + i]))
                else:
                    s_a[slot, t, feat] = decay(pb, A, lb, N.fadd(rg, hg[4 * mi + i]))
                    if cutlass.const_expr(pb.record):
                        g.kg_record[cslot, h, t, D + feat] = BFloat16(rg)

            gate_tile(pb, mma, thr, rA, rB, emit, GATE_BATCH if batch else 0)

    # ----------------------------------------------------------------------- gate batches
    def _batch_decays(self, storage):
        """The decays of a gate batch, ``[8 items, 128 features]`` fp32."""
        return storage.gb.get_tensor(cute.make_layout((GATE_BATCH, D), stride=(D, 1)))

    def _batch_end(self, s, i0, i1, R):
        """The end of the gate batch that starts at walk position ``s`` of the range
        ``[i0, i1)``: at most 8 items, the range's end, or where the head changes (``s`` past
        the range: an empty batch)."""
        n = i1 - i0
        e = cutlass.min(cutlass.min(s + GATE_BATCH, n), self.items.head_run_end(i0 + s, R) - i0)
        return cutlass.max(e, s)

    @cute.jit
    def _gate_of_batch(self, storage, g, mma, thr, pt, j, h, lb, hg, fbs, bat):
        """With ``gate_batch`` (T = 1): at the first item ``j`` of a batch (up to 8 consecutive
        items of the range with one head, :meth:`_batch_end`), the gate projection of all of
        them in one pass, item c of the batch in column c (its f_a row in row c of the stage
        :meth:`_copy_fa_batch` filled), the decays into :meth:`_batch_decays`; then the next
        batch's rows into the other stage. Every prep thread passes every batch (the stages'
        phases count batches); the PREP barriers keep a batch's decays until every thread has
        copied its column (:meth:`_prep`) and show the new ones to all."""
        gb, i0, i1, R = bat
        if j == gb[1]:
            k = gb[2]
            self._fa_bars(storage).wait(k)
            if cutlass.const_expr(self.fb_smem):
                self._fb_bar(storage).wait_parity(0, fbs[1])
            sync(Sync.PREP, PREP)
            rB = smem_fragment(mma, pt % 32, self._fa_rows(storage)[k % 2, None, None], "B")
            self._gate(storage, g, mma, thr, pt, Int32(0), h, Int32(0), lb, rB, hg, True)
            nxt = self._batch_end(gb[3], i0, i1, R)
            # (every prep thread read stage (k + 1) % 2 for batch k - 1 before the barrier
            # above)
            self._copy_fa_batch(storage, g, gb[3], nxt, k + 1, i0, R, pt)
            gb[0] = j
            gb[1] = gb[3]
            gb[2] = k + 1
            gb[3] = nxt
            sync(Sync.PREP, PREP)

    @cute.jit
    def _copy_fa_batch(self, storage, g, s, e, use, i0, R, pt):
        """The f_a rows of the gate batch of walk positions ``[s, e)`` (T = 1: item ``i0 + s +
        c``'s request row into row c) into stage ``use % 2`` with cp.async, chunks of the rows'
        alignment (as :meth:`_copy_fa`); every prep thread then arrives on the stage's use
        ``use``. Rows past the batch are left as they are: their columns are not read."""
        rb = min(self.pb.row_bytes, 16)
        fa = self._fa_bars(storage)
        s_fa = self._fa_rows(storage)
        st = use % 2
        if cutlass.const_expr(rb >= 4):
            atom, g_c, s_c, per_row = self._fa_chunks(g, s_fa, rb)
            for k in cutlass.range_constexpr(GATE_BATCH * per_row // PREP):
                idx = pt + PREP * k
                c = idx // per_row
                if c < e - s:
                    r = self.items.split_item(i0 + s + c, R)[0]
                    cute.copy(atom, g_c[r, idx - c * per_row, None], s_c[st, c, idx - c * per_row,
                                                                         None])
            fa.arrive_on_copies(use)
        else:
            for c in cutlass.range_constexpr(GATE_BATCH):
                if c < e - s:
                    r = self.items.split_item(i0 + s + c, R)[0]
                    s_fa[st, c, pt] = g.f_a[r, pt]
            fa.arrive(use)

    @cute.jit
    def _epilogue(self, storage, g, pt, j, eps, nwv):
        """The CTA's ``j``-th item, once its consumers are done: out = bf16(ob *
        rsqrt(mean(ob^2) + eps) * norm_weight * sigmoid(output gate)) per token (warp sums of
        ob^2, then the 4 warps in order); a dead item's rows are zeros. Then *free*."""
        T = self.T
        slot = j % self.NI
        self._item_slots(storage).epilogue_wait(j)
        s_desc = self._descs(storage)
        r, h, live = s_desc[slot, 0], s_desc[slot, 1], s_desc[slot, 2]
        n0 = r * T
        if live != 0:
            s_o = self._slots(storage, "o")
            s_og = self._slots(storage, "og")
            s_red = self._sums(storage)
            pw = pt // 32
            lane = pt % 32
            obs = [s_o[slot, t, pt] for t in range(T)]
            for t in cutlass.range_constexpr(T):
                so = N.warp_sum(N.fmul(obs[t], obs[t]))
                if lane == 0:
                    s_red[slot, t, 2, pw] = so
            sync(Sync.PREP, PREP)
            for t in cutlass.range_constexpr(T):
                ss = item.quarter_sum(lambda i, t=t: s_red[slot, t, 2, i])
                y = item.gated_rmsnorm(obs[t], ss, eps, nwv, s_og[slot, t, pt])
                g.out[n0 + t, h * D + pt] = BFloat16(y)
        else:
            for t in cutlass.range_constexpr(T):
                g.out[n0 + t, h * D + pt] = BFloat16(0.0)
        # every prep thread hands the slot (and its sums) back once its reads are done
        self._item_slots(storage).epilogue_release(j)

    # -------------------------------------------------------------------------------- host
    def _launch(self, a: KernelArgs, stream):
        """``a.ctas`` CTAs on ``stream`` (persistent: at most one per SM and per item; in
        blocks: one per C items; :func:`scheduler.grid`)."""
        self.kernel(a).launch(grid=grid(self.sched, self.H, a), block=[self.threads, 1, 1],
                              stream=stream,
                              use_pdl=True, min_blocks_per_mp=1)
