"""KdaStream: the streamed CuTe DSL kernel (CTAs walk item ranges) and its host wrapper.

Grid = ``ncta`` CTAs (host: :func:`kda.backend.stream_grid`: at least 2 per SM, and
ceil(items / k) for at most k items per CTA, k by T from
:func:`kda.backends.cutedsl.policy.items_per_cta`); CTA ``i`` walks the contiguous item range
``[i*items // ncta, (i+1)*items // ncta)`` (items = R*H). Schedule per CTA:

  prologue  (``griddepcontrol.wait`` first, for programmatic dependent launch: slot ids,
            windows, pages and operands may all be the predecessor's output) slots of the
            first item; load its window history, stage its x / output-gate rows and load
            its beta (group E(start)), then cp.async its state page (group S(start)), in
            the loop's order, so that its phase A overlaps the page's arrival
            (``KernelStatic.page_last``; off: the page first, all one group).
  loop n    load item n+1's slot ids (one per lane of warp 0) and item n's per-head
            parameters; item n's gate projection (tensor cores, f_a from global); wait for
            item n's operand rows only (cp.async group E(n); its page, group S(n), may still
            be landing) + barrier; phase A of item n (conv, norms); stage item n+1's slot
            ids; barrier (frees the operand buffers); issue item n+1's operand rows
            (cp.async, group E(n+1)) and window / beta register loads; wait for S(n) and move
            item n's state page shared -> registers; cp.async item n+1's state page (group
            S(n+1); each thread into the chunks it has just read, so no barrier). All of
            these fly during item n's
            recurrence and epilogue (phase B, or zeros if item n is dead) and item n+1's
            gate projection and phase A.
  end       fence + barrier + ``griddepcontrol.launch_dependents`` (after this CTA's last
            write, so a dependent launch on the same buffers reads the results).

The per-item math is :class:`kda.backends.cutedsl.common.ItemMath`, the very same calls the wide
kernel (:mod:`kda.backends.cutedsl.wide`) makes, so results are bit-identical to it.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from kda.backends.cutedsl import ptx as P
from kda.backends.cutedsl.common import NTHREADS, ItemMath, make_params
from kda.backends.cutedsl.static import KernelStatic, SmemPlan, carveout_percent


class KdaStream:
    """The streamed kernel for one :class:`KernelStatic`; ``launch`` is what gets compiled."""

    kind = "stream"

    def __init__(self, ks: KernelStatic):
        self.ks = ks
        self.math = ItemMath(ks)
        self.plan = SmemPlan(ks.T)

    @cute.kernel
    def kernel(self, x: cute.Pointer, cw: cute.Pointer, cb: cute.Pointer, cs: cute.Pointer,
               fa: cute.Pointer, fb: cute.Pointer, beta: cute.Pointer, alog: cute.Pointer,
               dtb: cute.Pointer, state: cute.Pointer, si: cute.Pointer, og: cute.Pointer,
               nw: cute.Pointer, na: cute.Pointer, vrec: cute.Pointer, kgrec: cute.Pointer,
               out: cute.Pointer, R: Int32, slots: Int32, x_rs: Int32, fa_rs: Int32,
               beta_rs: Int32, og_rs: Int32, out_rs: Int32, state_ss: Int64, cs_ss: Int64,
               scale: Float32, eps: Float32, lb: Float32, ncta: Int32):
        """Device code: CTA ``blockIdx.x`` walks its item range (see the module docstring)."""
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        buf = smem.allocate(self.plan.total, byte_alignment=128)
        p = make_params(self.ks, Int32(buf.toint()), Int32(tid), x=x, cw=cw, cb=cb, cs=cs,
                        fa=fa, fb=fb, beta=beta, alog=alog, dtb=dtb, state=state, si=si, na=na,
                        og=og, nw=nw, out=out, vrec=vrec, kgrec=kgrec, R=R, slots=slots, x_rs=x_rs,
                        fa_rs=fa_rs, beta_rs=beta_rs, og_rs=og_rs, out_rs=out_rs,
                        state_ss=state_ss, cs_ss=cs_ss, scale=scale, eps=eps, lb=lb)
        desc = cute.make_rmem_tensor(cute.make_layout((8,)), Int32)
        ndesc = cute.make_rmem_tensor(cute.make_layout((8,)), Int32)
        wreg = cute.make_rmem_tensor(cute.make_layout((8,)), Int32)
        S = cute.make_rmem_tensor(cute.make_layout((64,)), Float32)
        ogr = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)

        items = Int64(R * self.ks.H)
        start = Int32((Int64(cta) * items) // Int64(ncta))
        end = Int32((Int64(cta + 1) * items) // Int64(ncta))

        # prologue: the first item
        # Wait for the predecessor (programmatic dependent launch) before reading anything:
        # slot ids, windows, pages and operands may all be its output (launch_dependents
        # alone does not make its writes visible here).
        P.griddep_wait()
        vals, nacc = self.math.slot_values(p, start, Int32(start < end))
        self.math.make_desc(p, start, Int32(start < end), vals, nacc, desc)
        self.math.stage_slot_values(p, vals, nacc, Int32(0))
        # page_last: group E(start), then the page, group S(start), as in the loop, so that
        # phase A of the first item overlaps its arrival
        self.math.issue_first(p, desc, wreg)
        P.bar_sync()                          # SL[0] (thread 0) is visible to every thread

        q = Int32(0)
        for n in cutlass.range(start, end, 1, unroll=1):
            nvalid = Int32(n + 1 < end)
            nslot = self.math.load_slot_lane(p, n + 1, nvalid)
            vals, nacc = self.math.staged_slot_values(p, q)
            self.math.make_desc(p, n, Int32(1), vals, nacc, desc)
            live = desc[5]
            hp = self.math.head_loads(p, desc[1])
            if live != 0:
                self.math.gate(p, desc, hp)  # needs no staged data: overlaps the staging
            # item n's operand rows (group E(n)) must have landed; its state page (S(n), the
            # most recent group) may still be landing during phase A. Without page_last the
            # prologue committed the first item's page and rows as one group: wait for
            # everything there.
            if cutlass.const_expr(self.ks.page_last):
                P.cp_async_wait_group(1)
            else:
                if n == start:
                    P.cp_async_wait_all()
                else:
                    P.cp_async_wait_group(1)
            P.bar_sync()
            for i in cutlass.range_constexpr(4):
                ogr[i] = Float32(0.0)       # not loop-carried: ogr is per item
            if live != 0:
                self.math.phase_a(p, desc, hp, wreg, ogr)
            self.math.store_slot_lane(p, nslot, q ^ 1)
            P.bar_sync()
            # the operand staging buffers are free: prefetch item n+1's rows and registers
            nvals, nna = self.math.staged_slot_values(p, q ^ 1)
            self.math.make_desc(p, n + 1, nvalid, nvals, nna, ndesc)
            self.math.issue_operands(p, ndesc)
            self.math.load_window(p, ndesc, wreg)   # SD layout: cp.async too
            self.math.load_beta(p, ndesc, wreg)
            P.cp_async_commit()               # group E(n+1): rows and window history
            # item n's page (S(n)) must have landed; E(n+1) may stay in flight. Each thread
            # reads back only the chunks it copied itself: no barrier needed before reading.
            P.cp_async_wait_group(1)
            # S is written and read inside one branch, so it is never loop-carried
            if live != 0:
                self.math.load_state_regs(p, S)
                # this thread has read its state chunks, the only ones it stages: prefetch item
                # n+1's state page into them (no barrier: 0.8-1.6% faster on the H200 at
                # R >= 128 than with one here)
                self.math.issue_state(p, ndesc)
                P.cp_async_commit()           # group S(n+1)
                self.math.phase_b(p, desc, q, S, ogr)
            else:
                self.math.issue_state(p, ndesc)
                P.cp_async_commit()           # group S(n+1)
                self.math.write_zeros(p, desc)
            q = q ^ 1

        P.fence_gpu()
        P.bar_sync()
        P.griddep_launch()

    @cute.jit
    def launch(self, x: cute.Pointer, cw: cute.Pointer, cb: cute.Pointer, cs: cute.Pointer,
               fa: cute.Pointer, fb: cute.Pointer, beta: cute.Pointer, alog: cute.Pointer,
               dtb: cute.Pointer, state: cute.Pointer, si: cute.Pointer, og: cute.Pointer,
               nw: cute.Pointer, na: cute.Pointer, vrec: cute.Pointer, kgrec: cute.Pointer,
               out: cute.Pointer, R: Int32, slots: Int32, x_rs: Int32, fa_rs: Int32,
               beta_rs: Int32, og_rs: Int32, out_rs: Int32, state_ss: Int64, cs_ss: Int64,
               scale: Float32, eps: Float32, lb: Float32, ncta: Int32, stream: cuda.CUstream):
        """Host entry: launch ``ncta`` CTAs of 256 threads on ``stream`` (each walks an item range)."""
        self.kernel(x, cw, cb, cs, fa, fb, beta, alog, dtb, state, si, og, nw, na, vrec,
                    kgrec, out, R, slots, x_rs, fa_rs, beta_rs, og_rs, out_rs, state_ss, cs_ss,
                    scale, eps, lb, ncta).launch(
            grid=[ncta, 1, 1], block=[NTHREADS, 1, 1], stream=stream, use_pdl=True,
            min_blocks_per_mp=2,
            preferred_smem_carveout=carveout_percent(self.plan.total))
