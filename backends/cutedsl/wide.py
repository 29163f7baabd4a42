"""KdaWide: the wide CuTe DSL kernel (one 256-thread CTA per item) and its host wrapper.

Grid = R*H CTAs, CTA ``b`` processes item ``b`` (request ``b // H``, head ``b % H``):

  1. ``griddepcontrol.wait`` (programmatic dependent launch: everything below may read the
     predecessor's output), then the slots (contract section 2 liveness);
  2. load the window history, stage x / output-gate rows
     and load beta (cp.async group 1), then stage the state page (group 2; with
     ``Schedule.page_last`` off, the page first and everything one group);
  3. the gate projection (:meth:`ItemMath.gate`, no staged data needed) while the staging
     lands; wait for group 1, a barrier, :meth:`ItemMath.phase_a` while the page lands;
     wait for the page, a barrier, :meth:`ItemMath.phase_b` (or zeros for a dead item);
  4. fence + barrier + ``griddepcontrol.launch_dependents`` (the trigger comes after this CTA's
     last write, so a dependent launch of the same step on the same buffers reads the
     results).

The per-item math is :mod:`kda.backends.cutedsl.common`; the split kernel
(:mod:`kda.backends.cutedsl.split`) computes every value in the same order, so both produce
bit-identical results.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator

from kda.backends.cutedsl.args import KernelArgs, Launch, make_views
from kda.backends.cutedsl.common import NTHREADS, ItemMath, Smem, make_params, storage_fields
from kda.backends.cutedsl.item import state_regs
from kda.backends.cutedsl.problem import Problem
from kda.backends.cutedsl.schedule import Rows, Schedule
from kda.backends.cutedsl.scheduler import grid
from kda.backends.cutedsl.static import SmemPlan, carveout_percent


class KdaWide(Launch):
    """The wide kernel for one :class:`Problem` and a ``Rows.CTA`` :class:`Schedule`;
    ``launch`` is what gets compiled."""

    def __init__(self, pb: Problem, sched: Schedule):
        if sched.rows != Rows.CTA:
            raise ValueError(f"KdaWide: expected a rows=CTA schedule, got {sched.name}")
        self.pb = pb
        self.sched = sched
        self.math = ItemMath(pb, sched.page_last)
        self.Storage = cute.struct(type("KdaWideStorage", (), {
            "__annotations__": storage_fields(pb.T)}))
        # the host's carveout hint and the occupancy check count SmemPlan's bytes
        self.smem_bytes = SmemPlan(pb.T).total
        assert self.Storage.size_in_bytes() <= self.smem_bytes, "storage_fields follows SmemPlan"

    @cute.kernel
    def kernel(self, a: KernelArgs):
        """Device code: CTA ``blockIdx.x`` processes item ``blockIdx.x`` (see the module docstring)."""
        tid, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        storage = SmemAllocator().allocate(self.Storage)
        p = make_params(self.pb, make_views(self.pb, a), Smem(self.pb, storage), Int32(tid), a)
        desc = cute.make_rmem_tensor(cute.make_layout((8,)), Int32)
        ops = self.math.op_regs(p)
        S = state_regs(4)                    # the thread's 4 rows of the page
        ogr = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)

        # Wait for the predecessor (programmatic dependent launch) before reading anything:
        # slot ids, windows, pages and operands may all be its output (launch_dependents
        # alone does not make its writes visible here).
        cute.arch.griddepcontrol_wait()
        r, _ = self.math.item_rh(Int32(item))
        vals, nacc = self.math.slot_values(p, r)
        self.math.make_desc(p, Int32(item), vals, nacc, desc)
        self.math.stage_slot_values(p, vals, nacc)
        self.math.issue_first(p, desc, ops)  # page_last: operands, then the page
        hp = self.math.head_loads(p, desc[1])
        live = desc[5]
        if live != 0:
            self.math.gate(p, desc, hp)      # needs no staged data: overlaps the staging
        if cutlass.const_expr(self.sched.page_last):
            cute.arch.cp_async_wait_group(1)  # the operands (the page may still be landing)
        else:
            cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if live != 0:
            self.math.phase_a(p, desc, hp, ops, ogr)
        if cutlass.const_expr(self.sched.page_last):
            # the page: each thread reads back only the chunks it copied itself, so its own
            # wait suffices (the barrier below is phase A's)
            cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if live != 0:
            self.math.load_state_regs(p, S)
            self.math.phase_b(p, desc, S, ogr)
        else:
            self.math.write_zeros(p, desc)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        cute.arch.griddepcontrol_launch_dependents()

    def _launch(self, a: KernelArgs, stream):
        """R*H CTAs of 256 threads on ``stream`` (:func:`scheduler.grid`)."""
        self.kernel(a).launch(
            grid=grid(self.sched, self.pb.H, a), block=[NTHREADS, 1, 1], stream=stream,
            use_pdl=True, min_blocks_per_mp=2,
            preferred_smem_carveout=carveout_percent(self.smem_bytes))
