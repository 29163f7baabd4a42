"""The state ring of the streamed CuTe DSL kernels: persistent CTAs, a producer warp that
bulk-copies value-row *units* of the items' state pages into a ring of shared-memory stages,
and consumer warps that take the units in order.

Work: the step's ``R * H`` items (request r, head h) are walked head-major (``item = h * R +
r``), so that consecutive items of a CTA share the head's parameters; CTA ``b`` of ``G``
takes the contiguous range ``[b * n // G, (b + 1) * n // G)`` (:meth:`UnitRing.item_range`).
A live item's page ``state[src, h]`` ([128 value rows, 128 key columns], each slot
contiguous) is cut into ``units = 128 // rows`` blocks of ``rows`` value rows; a block is
one contiguous run of ``rows * 128`` elements, moved by one ``cp.async.bulk`` completing on
the stage's mbarrier. The rows of a page are independent given the per-item vectors (k, q,
decay, beta, v), so a unit is a whole piece of work.

Order: the producer numbers the units of the CTA's live items ``k = 0, 1, ...`` (item by
item, unit by unit); unit ``k`` goes to stage ``k % stages`` and to consumer warp
``k % consumers``. With ``consumers`` a multiple of ``units``, consumer ``w`` always gets
unit ``w % units`` of an item, the ``units`` warps of a group work on one item at once, and
the groups take turns by item. Each stage has a *full* mbarrier (one producer arrival plus
the copy's bytes) and an *empty* one (one consumer arrival), and a metadata row the producer
writes before its arrival: the head and the T slots the unit's rows go to (T=1: the source
slot), or a head of -1 that ends the consumer's loop. Waits use the mbarrier
phase parity of the stage's pass (``k // stages``); the producer's first pass waits on the
parity a fresh barrier reports complete.

Slot ids: the producer warp loads the ids of 32 items at once (lane j: item ``base + j``)
and walks them by shuffles, so one round trip serves 32 items (contract section 2 and 6 for
the liveness rule: live iff ``0 < src < slots`` and ``0 < conv_slot < slots``; a dead item
has no units).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync

D = 128
#: Metadata words per stage: head, then up to 8 slot ids.
META = 16


@dataclasses.dataclass(frozen=True)
class RingShape:
    """The static shape of a ring.

    Attributes:
      rows: value rows per unit (16, 32 or 64; ``units = 128 // rows``).
      consumers: consumer warps (a multiple of ``units``).
      depth: stages per consumer warp (``stages = consumers * depth``).
    """

    rows: int = 32
    consumers: int = 8
    depth: int = 1

    def __post_init__(self):
        if self.rows not in (16, 32, 64):
            raise ValueError(f"rows: expected 16, 32 or 64, got {self.rows!r}")
        if self.consumers % self.units:
            raise ValueError(f"consumers: expected a multiple of {self.units} (units per item), "
                             f"got {self.consumers!r}")
        if self.depth < 1:
            raise ValueError(f"depth: expected >= 1, got {self.depth!r}")

    @property
    def units(self) -> int:
        return D // self.rows

    @property
    def stages(self) -> int:
        return self.consumers * self.depth


class UnitRing:
    """Device code of the ring for one :class:`RingShape`, T tokens and a state dtype.

    ``storage`` is the kernel's shared-memory struct, which holds the fields
    :meth:`fields` names: ``full`` / ``empty`` (mbarriers), ``meta`` and ``data``.
    """

    def __init__(self, shape: RingShape, T: int, st_dtype):
        self.shape = shape
        self.T = T
        self.st_dtype = st_dtype
        self.rows = shape.rows
        self.units = shape.units
        self.stages = shape.stages
        self.consumers = shape.consumers
        self.unit_bytes = shape.rows * D * st_dtype.width // 8

    def fields(self) -> dict:
        """The struct fields of the ring (name -> type), for the kernel's storage struct."""
        return {
            "full": cute.struct.MemRange[Int64, self.stages],
            "empty": cute.struct.MemRange[Int64, self.stages],
            "meta": cute.struct.Align[cute.struct.MemRange[Int32, self.stages * META], 16],
            "data": cute.struct.Align[
                cute.struct.MemRange[self.st_dtype, self.stages * self.rows * D], 128],
        }

    # ------------------------------------------------------------------------ views
    def data(self, storage) -> cute.Tensor:
        """The stages' data, ``[stages, rows, 128]``."""
        return storage.data.get_tensor(cute.make_layout(
            (self.stages, self.rows, D), stride=(self.rows * D, D, 1)))

    def meta(self, storage) -> cute.Tensor:
        """The stages' metadata rows, ``[stages, META]`` Int32."""
        return storage.meta.get_tensor(cute.make_layout((self.stages, META), stride=(META, 1)))

    @staticmethod
    def item_range(n, block, grid):
        """The items ``[i0, i1)`` of CTA ``block`` of ``grid``: balanced contiguous ranges."""
        i0 = Int32((Int64(block) * Int64(n)) // Int64(grid))
        i1 = Int32((Int64(block + 1) * Int64(n)) // Int64(grid))
        return i0, i1

    # ------------------------------------------------------------------------ setup
    @cute.jit
    def init(self, storage, tid):
        """Thread 0 initializes every stage's mbarriers (one arrival each); the caller syncs
        the CTA before the ring is used."""
        if tid == 0:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(storage.full.data_ptr() + s, 1)
                cute.arch.mbarrier_init(storage.empty.data_ptr() + s, 1)
            cute.arch.mbarrier_init_fence()

    # ----------------------------------------------------------------------- producer
    @cute.jit
    def produce(self, storage, state: cute.Tensor, si: cute.Tensor, na: cute.Tensor, R: Int32,
                slots: Int32, n: Int32, block: Int32, grid: Int32, lane: Int32):
        """The producer warp's loop (all 32 lanes call it): the units of every live item of the
        CTA's range of the ``n`` items, then one end marker per consumer warp.

        ``state``: [slots, H, 128, 128]; ``si``: [R, T] slot ids; ``na``: [R] accepted counts
        (read at T > 1 only).
        """
        k = Int32(0)
        i0, i1 = self.item_range(n, block, grid)
        for base in cutlass.range(i0, i1, 32, unroll=1):
            k = self._batch(storage, state, si, na, R, slots, base,
                            cutlass.min(i1, base + 32), k, lane)
        for w in cutlass.range_constexpr(self.consumers):
            s = k % self.stages
            cute.arch.mbarrier_wait(storage.empty.data_ptr() + s, ((k // self.stages) & 1) ^ 1)
            if lane == 0:
                meta = self.meta(storage)
                meta[s, 0] = Int32(-1)
                cute.arch.mbarrier_arrive(storage.full.data_ptr() + s)
            k += 1

    @cute.jit
    def _batch(self, storage, state, si, na, R, slots, base, end, k, lane):
        """The units of the live items of ``[base, end)`` (at most 32: lane j loads the slot
        ids of item ``base + j``); returns the next unit number."""
        T = self.T
        data = self.data(storage)
        meta = self.meta(storage)
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), self.st_dtype,
                                   num_bits_per_copy=self.unit_bytes * 8)
        i = base + lane
        ok = i < end
        h = i // R
        r = i - h * R          # in [0, R) for every lane: its loads stay in bounds
        # the lane's item: every slot id, then liveness (contract section 2, project rule)
        ids = [si[r, t] for t in range(T)]
        cslot = ids[0]
        src = cslot
        if cutlass.const_expr(T > 1):
            a = cutlass.max(cutlass.min(na[r], Int32(T)), Int32(1))
            for t in cutlass.range_constexpr(1, T):
                if a == t + 1:
                    src = ids[t]
        live = ok & (src > 0) & (src < slots) & (cslot > 0) & (cslot < slots)
        for j in cutlass.range(end - base, unroll=1):
            lv = cute.arch.shuffle_sync(Int32(live), j)
            if lv != 0:
                hj = cute.arch.shuffle_sync(h, j)
                sj = cute.arch.shuffle_sync(src, j)
                dj = [cute.arch.shuffle_sync(ids[t], j) for t in range(T)]
                page = state[sj, hj, None, None]
                for u in cutlass.range_constexpr(self.units):
                    s = k % self.stages
                    cute.arch.mbarrier_wait(storage.empty.data_ptr() + s,
                                            ((k // self.stages) & 1) ^ 1)
                    if lane == 0:
                        meta[s, 0] = hj
                        if cutlass.const_expr(T == 1):
                            meta[s, 1] = sj
                        else:
                            for t in cutlass.range_constexpr(T):
                                meta[s, 1 + t] = dj[t]
                        full = storage.full.data_ptr() + s
                        cute.arch.mbarrier_arrive_and_expect_tx(full, self.unit_bytes)
                        blk = cute.local_tile(page, (self.rows, D), (u, 0))
                        cute.copy(atom, cute.group_modes(blk, 0, 2),
                                  cute.group_modes(data[s, None, None], 0, 2), mbar_ptr=full)
                    k += 1
        return k

    # ----------------------------------------------------------------------- consumers
    def stage_of(self, k):
        """(stage, parity) of unit number ``k``."""
        return k % self.stages, (k // self.stages) & 1

    @cute.jit
    def wait_full(self, storage, k):
        s, ph = self.stage_of(k)
        cute.arch.mbarrier_wait(storage.full.data_ptr() + s, ph)

    @cute.jit
    def release(self, storage, k, lane):
        """The consumer warp is done reading unit ``k``'s stage (call from all lanes)."""
        s, _ = self.stage_of(k)
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive(storage.empty.data_ptr() + s)
