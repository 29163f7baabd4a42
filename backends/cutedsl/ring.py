"""The state pipeline of the streamed CuTe DSL kernels: persistent CTAs whose consumer warps
each keep their own small ring of shared-memory stages filled by bulk copies of value-row
*units* of the items' state pages.

Work: the step's ``R * H`` items (request r, head h) in the order and ranges of
:mod:`kda.backends.cutedsl.scheduler` (head-major, or in blocks of C requests). ``j``
below is an item's position in its CTA's walk. A live item's page ``state[src, h]``
([128 value rows, 128 key columns], each slot contiguous) is cut into ``units = 128 // rows``
blocks of ``rows`` value rows; a block is one contiguous run of ``rows * 128`` elements,
moved by one ``cp.async.bulk`` completing on the stage's mbarrier. The rows of a page are
independent given the per-item vectors (k, q, decay, beta, v), so a unit is a whole piece of
work.

Consumers: ``consumers`` warps in ``groups = consumers // units`` groups; warp ``w`` is unit
``w % units`` of group ``w // units``, and group ``g`` takes the items ``j = g, g + groups,
...``, so the warps of a group work on the units of one item at once and the groups take
turns by item. A warp loads the slot ids of 32 of its items at a time (lane l: its item
``32 b + l``; the next batch is requested when a batch starts), and keeps ``depth`` items of
lookahead: right after it has read a unit out of its stage (:meth:`WarpRing.walk`'s
``refill``), it issues the copy of the unit ``depth`` items ahead into that stage. So a
warp's copies and waits touch only its own stages: no other warp is on its path, and a dead
item (contract section 2 and 6: live iff ``0 < src < slots`` and ``0 < conv_slot < slots``)
moves nothing.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync

from kda.backends.cutedsl import item
from kda.backends.cutedsl.schedule import Schedule
from kda.backends.cutedsl.pipeline import StageRing, init_fence, release_reads
from kda.backends.cutedsl.scheduler import ItemWalk

D = 128


class WarpRing:
    """Device code of the consumers' stages of a ``Rows.WARP`` schedule (its ring:
    ``unit_rows``, ``consumers``, ``depth``; its ``block`` and ``early_reads``), T tokens, a
    state dtype and ``H`` heads. ``storage`` is the kernel's shared-memory struct, which holds
    :meth:`fields`."""

    def __init__(self, sched: Schedule, T: int, st_dtype, H: int = 1):
        self.sched = sched
        #: :meth:`walk` issues its first slot-id loads and page copies, then waits for the
        #: PDL predecessor (:attr:`kda.config.KdaConfig.early_reads`); else the caller waits
        #: before the walk
        self.early_reads = sched.early_reads
        #: the item order (:class:`kda.backends.cutedsl.scheduler.ItemWalk`): 0 head-major,
        #: C in blocks of C requests, head-major inside (H heads)
        self.items = ItemWalk(H, sched.block, sched.tail)
        self.T = T
        self.st_dtype = st_dtype
        self.rows = sched.unit_rows
        self.units = sched.units
        self.groups = sched.groups
        self.depth = sched.depth
        self.consumers = sched.consumers
        self.unit_bytes = sched.unit_rows * D * st_dtype.width // 8
        #: per item of a batch: live, source slot, head, then the T write slots (T=1: source)
        self.fields_per_item = 3 + T

    def fields(self) -> dict:
        """The struct fields of the stages (name -> type), for the kernel's storage struct."""
        return {
            "full": cute.struct.MemRange[Int64, self.sched.stages],
            "data": cute.struct.Align[
                cute.struct.MemRange[self.st_dtype, self.sched.stages * self.rows * D], 128],
        }

    def data(self, storage) -> cute.Tensor:
        """The stages' data, ``[stages, rows, 128]`` (warp w's are ``w * depth ..``)."""
        return storage.data.get_tensor(cute.make_layout(
            (self.sched.stages, self.rows, D), stride=(self.rows * D, D, 1)))

    @cute.jit
    def init(self, storage, tid):
        """Thread 0 initializes every stage's mbarrier (:class:`pipeline.StageRing`); the
        caller syncs the CTA before the stages are used."""
        if tid == 0:
            StageRing.init(storage.full.data_ptr(), self.sched.stages)
            init_fence()

    def stages(self, storage, w) -> StageRing:
        """Warp ``w``'s stages."""
        return StageRing(storage.full.data_ptr(), self.depth, w * self.depth)

    # ------------------------------------------------------------------------ walk
    @cute.jit
    def _load_batch(self, bat, row, b, si, na, R, slots, i0, i1, g, lane):
        """Row ``row`` (static) of ``bat`` := the slot ids of the warp's items ``32 b + lane``:
        live, source slot, head, the T slot ids."""
        T = self.T
        j = g + self.groups * (32 * b + lane)
        i = i0 + j
        ok = i < i1
        r, h = self.items.split_item(i, R)   # r in [0, R) for every lane: loads in bounds
        ids = [si[r, t] for t in range(T)]
        cslot = ids[0]
        accepted = Int32(0)
        if cutlass.const_expr(T > 1):
            accepted = na[r]
        src, _ = item.source_slot(ids, accepted, T)
        live = item.is_live(src, cslot, slots, ok)
        bat[row, 0] = Int32(live)
        bat[row, 1] = src
        bat[row, 2] = h
        for t in cutlass.range_constexpr(T):
            bat[row, 3 + t] = ids[t]

    @cute.jit
    def _issue(self, storage, state, ctr, pend, w, lane):
        """If the pending item is live: its unit into the warp's next stage (``ctr[0]``)."""
        if pend[0] != 0:
            u = w % self.units
            n = ctr[0]
            s = w * self.depth + n % self.depth
            release_reads()          # our reads of the stage, before the copy refills it
            cute.arch.sync_warp()
            if lane == 0:
                full = self.stages(storage, w).announce(n, self.unit_bytes)
                blk = cute.local_tile(state[pend[1], pend[2], None, None], (self.rows, D), (u, 0))
                atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), self.st_dtype,
                                           num_bits_per_copy=self.unit_bytes * 8)
                cute.copy(atom, cute.group_modes(blk, 0, 2),
                          cute.group_modes(self.data(storage)[s, None, None], 0, 2),
                          mbar_ptr=full)
            ctr[0] = n + 1

    @cute.jit
    def walk(self, storage, state: cute.Tensor, si: cute.Tensor, na: cute.Tensor, R: Int32,
             slots: Int32, i0: Int32, i1: Int32, w: Int32, lane: Int32, unit, skip,
             before_copies=None):
        """Consumer warp ``w``'s loop over its group's items of ``[i0, i1)``.

        For every live item it waits for the unit's stage, then calls ``unit(stage, j, h,
        dst, refill)``: ``stage`` the unit's [rows, 128] data, ``j`` the item's position in
        the CTA's walk, ``h`` its head, ``dst`` its T write slots (T=1: the source; ``dst[0]``
        is the conv slot); ``unit`` calls ``refill()`` once, right after its last read of the
        stage, which issues the copy ``depth`` items ahead into it. For a dead item it calls
        ``skip(j)``.

        ``state``: [slots, H, 128, 128]; ``si``: [R, T] slot ids; ``na``: [R] accepted counts
        (read at T > 1 only); ``before_copies()``, if given, runs once after the first slot
        ids are requested and before the first page copy.
        """
        T = self.T
        F = self.fields_per_item
        dep = self.depth
        g = w // self.units
        nq = (i1 - i0 - g + self.groups - 1) // self.groups      # this group's items
        # row 0: the batch of the current item, row 1: the next batch
        bat = cute.make_rmem_tensor(cute.make_layout((2, F), stride=(F, 1)), Int32)
        pend = cute.make_rmem_tensor(cute.make_layout((3,)), Int32)
        ctr = cute.make_rmem_tensor(cute.make_layout((2,)), Int32)   # units issued, consumed
        ctr[0] = Int32(0)
        ctr[1] = Int32(0)
        self._load_batch(bat, 0, Int32(0), si, na, R, slots, i0, i1, g, lane)
        self._load_batch(bat, 1, Int32(1), si, na, R, slots, i0, i1, g, lane)
        if cutlass.const_expr(before_copies is not None):
            before_copies()
        for q in cutlass.range_constexpr(dep):          # the first depth items (lookahead < 32)
            for f in cutlass.range_constexpr(3):
                pend[f] = cute.arch.shuffle_sync(bat[0, f], q)
            if nq <= q:
                pend[0] = Int32(0)
            self._issue(storage, state, ctr, pend, w, lane)
        if cutlass.const_expr(self.early_reads):
            # the pages are written only after this wait (by the items' units)
            cute.arch.griddepcontrol_wait()
        for q in cutlass.range(nq, unroll=1):
            if (q % 32 == 0) & (q > 0):
                for f in cutlass.range_constexpr(F):
                    bat[0, f] = bat[1, f]
                self._load_batch(bat, 1, q // 32 + 1, si, na, R, slots, i0, i1, g, lane)
            lq = q % 32
            # the item depth ahead: in this batch or the next
            qa = q + dep
            la = qa % 32
            for f in cutlass.range_constexpr(3):
                v0 = cute.arch.shuffle_sync(bat[0, f], la)
                v1 = cute.arch.shuffle_sync(bat[1, f], la)
                pend[f] = v0
                if qa // 32 != q // 32:
                    pend[f] = v1
            if qa >= nq:
                pend[0] = Int32(0)
            live = cute.arch.shuffle_sync(bat[0, 0], lq)
            if live != 0:
                fq = [cute.arch.shuffle_sync(bat[0, f], lq) for f in range(1, F)]
                n = ctr[1]
                s = w * dep + n % dep
                self.stages(storage, w).wait(n)
                dst = [fq[2 + t] for t in range(T)] if T > 1 else [fq[0]]

                def refill():
                    self._issue(storage, state, ctr, pend, w, lane)

                unit(self.data(storage)[s, None, None], g + self.groups * q, fq[1], dst, refill)
                ctr[1] = n + 1
            else:
                self._issue(storage, state, ctr, pend, w, lane)
                skip(g + self.groups * q)
