"""KdaStream: the persistent, prefetching CuTe DSL kernel and its host wrapper.

Grid = ``ncta`` CTAs (host: :func:`kda.backend.stream_grid`: 2 per SM -- persistent -- or
ceil(items / k) for at most k items per CTA, ``ITEMS_PER_CTA`` by T in
:mod:`kda.backends.cutedsl.backend`); CTA ``i`` walks the contiguous item range
``[i*items // ncta, (i+1)*items // ncta)`` (items = R*H). Schedule per CTA:

  prologue  (``griddepcontrol.wait`` first under programmatic dependent launch: slot ids,
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
  end       fence + barrier + ``griddepcontrol.launch_dependents`` (after the prologue instead
            with ``KDA_CUTEDSL_PDL=early``; see ``README.md``).

With ``fb_smem`` (T=1, :class:`kda.backends.cutedsl.static.KernelStatic`; ``KDA_CUTEDSL_FB_SMEM``)
items are numbered head-major (item = h*R + r), so a CTA's consecutive items share the head;
the head's f_b rows are cp.async-staged into shared memory with the prologue and, when the
next item's head differs, with group E(n+1); the gate then runs after the E(n) wait and
barrier and reads its A fragments from there instead of loading 32 KiB of f_b from L2 for
every item.

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

#: The thread that issues the L2 prefetches (warp 7, lane 0).
PF_THREAD = 224


def _pf_pred(tid, item, end):
    """1 in the L2-prefetching thread when ``item`` is one of this CTA's (< ``end``), else 0."""
    return Int32(tid == PF_THREAD) & Int32(item < end)


class KdaStream:
    """The streamed kernel for one :class:`KernelStatic`; ``launch`` is what gets compiled."""

    kind = "stream"

    def __init__(self, ks: KernelStatic):
        self.ks = ks
        self.math = ItemMath(ks)
        self.plan = SmemPlan(ks.T, ks.fb_smem)

    @cute.kernel
    def kernel(self, x: cute.Pointer, cw: cute.Pointer, cb: cute.Pointer, cs: cute.Pointer,
               fa: cute.Pointer, fb: cute.Pointer, beta: cute.Pointer, alog: cute.Pointer,
               dtb: cute.Pointer, state: cute.Pointer, si: cute.Pointer, na: cute.Pointer,
               og: cute.Pointer, nw: cute.Pointer, out: cute.Pointer, vrec: cute.Pointer,
               kgrec: cute.Pointer, R: Int32, slots: Int32, x_rs: Int32, fa_rs: Int32,
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
        # Under PDL, wait for the predecessor before reading anything: slot ids, windows,
        # pages and operands may all be its output (launch_dependents alone does not make
        # its writes visible here).
        if cutlass.const_expr(self.ks.pdl):
            P.griddep_wait()
        vals, nacc = self.math.slot_values(p, start, Int32(start < end))
        self.math.make_desc(p, start, Int32(start < end), vals, nacc, desc)
        self.math.stage_slot_values(p, vals, nacc, Int32(0))
        # fb_smem: the head whose f_b rows FB holds (-1: none yet)
        fbh = Int32(-1)
        if cutlass.const_expr(self.ks.fb_smem):
            fbh = P.sel_i32(Int32(start < end), desc[1], fbh)
        # page_last: group E(start) (with the f_b rows), then the page, group S(start), as in
        # the loop, so that phase A of the first item overlaps its arrival
        self.math.issue_first(p, desc, wreg, also=(
            (lambda: self.math.issue_fb(p, desc[1], Int32(start < end)))
            if self.ks.fb_smem else None))
        if cutlass.const_expr(self.ks.pdl_early):
            P.griddep_launch()
        P.bar_sync()                          # SL[0] (thread 0) is visible to every thread

        PFD = self.ks.prefetch
        if cutlass.const_expr(PFD > 1):
            # L2 prefetch of the pages of items start+1 .. start+PFD-1 (the loop prefetches
            # n+PFD during item n)
            for i in cutlass.range_constexpr(1, PFD):
                self.math.prefetch_slot_first(p, start + i, _pf_pred(tid, start + i, end))
                self.math.prefetch_slot_second(p, start + i, _pf_pred(tid, start + i, end))
                self.math.prefetch_page(p, start + i, _pf_pred(tid, start + i, end))

        q = Int32(0)
        for n in cutlass.range(start, end, 1, unroll=1):
            nvalid = Int32(n + 1 < end)
            nslot = self.math.load_slot_lane(p, n + 1, nvalid)
            if cutlass.const_expr(PFD > 0):
                # L2 prefetch of item n+PFD's page, in three parts: its slot word now, (T>1)
                # the source slot from the accepted count before the page wait, the prefetch
                # itself next to item n+1's cp.async (see prefetch_page)
                self.math.prefetch_slot_first(p, n + PFD, _pf_pred(tid, n + PFD, end))
            vals, nacc = self.math.staged_slot_values(p, q)
            self.math.make_desc(p, n, Int32(1), vals, nacc, desc)
            live = desc[5]
            hp = self.math.head_loads(p, desc[1])
            if cutlass.const_expr(not self.ks.fb_smem):
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
            if cutlass.const_expr(self.ks.fb_smem):
                if live != 0:
                    self.math.gate(p, desc, hp)  # A fragments from FB (staged with E(n))
            for i in cutlass.range_constexpr(4):
                ogr[i] = Float32(0.0)       # not loop-carried: ogr is per item
            if live != 0:
                self.math.phase_a(p, desc, hp, wreg, ogr)
            self.math.store_slot_lane(p, nslot, q ^ 1)
            P.bar_sync()
            # the operand staging buffers are free: prefetch item n+1's rows and registers
            nvals, nna = self.math.staged_slot_values(p, q ^ 1)
            self.math.make_desc(p, n + 1, nvalid, nvals, nna, ndesc)
            if cutlass.const_expr(self.ks.fb_smem):
                # item n+1's head rows into FB when the head changes (item n's gate, the only
                # reader, is two barriers back); they land with group E(n+1)
                fchange = nvalid & Int32(ndesc[1] != fbh)
                self.math.issue_fb(p, ndesc[1], fchange)
                fbh = P.sel_i32(fchange, ndesc[1], fbh)
            self.math.issue_operands(p, ndesc)
            self.math.load_window(p, ndesc, wreg)   # SD layout: cp.async too
            self.math.load_beta(p, ndesc, wreg)
            P.cp_async_commit()               # group E(n+1): rows and window history
            if cutlass.const_expr(PFD > 0):
                self.math.prefetch_slot_second(p, n + PFD, _pf_pred(tid, n + PFD, end))
            # item n's page (S(n)) must have landed; E(n+1) may stay in flight. Each thread
            # reads back only the chunks it copied itself: no barrier needed before reading.
            P.cp_async_wait_group(1)
            # S is written and read inside one branch, so it is never loop-carried
            if live != 0:
                self.math.load_state_regs(p, S)
                # this thread has read its state chunks, the only ones it stages: prefetch item
                # n+1's state page into them (no barrier: H200, 749d079, 0.8-1.6% faster at
                # R >= 128 than with one here)
                self.math.issue_state(p, ndesc)
                P.cp_async_commit()           # group S(n+1)
                if cutlass.const_expr(PFD > 0):
                    self.math.prefetch_page(p, n + PFD, _pf_pred(tid, n + PFD, end))
                self.math.phase_b(p, desc, q, S, ogr)
            else:
                self.math.issue_state(p, ndesc)
                P.cp_async_commit()           # group S(n+1)
                if cutlass.const_expr(PFD > 0):
                    self.math.prefetch_page(p, n + PFD, _pf_pred(tid, n + PFD, end))
                self.math.write_zeros(p, desc)
            q = q ^ 1

        if cutlass.const_expr(self.ks.pdl and not self.ks.pdl_early):
            P.fence_gpu()
            P.bar_sync()
            P.griddep_launch()

    @cute.jit
    def launch(self, x: cute.Pointer, cw: cute.Pointer, cb: cute.Pointer, cs: cute.Pointer,
               fa: cute.Pointer, fb: cute.Pointer, beta: cute.Pointer, alog: cute.Pointer,
               dtb: cute.Pointer, state: cute.Pointer, si: cute.Pointer, na: cute.Pointer,
               og: cute.Pointer, nw: cute.Pointer, out: cute.Pointer, vrec: cute.Pointer,
               kgrec: cute.Pointer, R: Int32, slots: Int32, x_rs: Int32, fa_rs: Int32,
               beta_rs: Int32, og_rs: Int32, out_rs: Int32, state_ss: Int64, cs_ss: Int64,
               scale: Float32, eps: Float32, lb: Float32, ncta: Int32, stream: cuda.CUstream):
        """Host entry: launch ``ncta`` CTAs of 256 threads on ``stream`` (each walks an item range)."""
        self.kernel(x, cw, cb, cs, fa, fb, beta, alog, dtb, state, si, na, og, nw, out, vrec,
                    kgrec, R, slots, x_rs, fa_rs, beta_rs, og_rs, out_rs, state_ss, cs_ss,
                    scale, eps, lb, ncta).launch(
            grid=[ncta, 1, 1], block=[NTHREADS, 1, 1], stream=stream, use_pdl=self.ks.pdl,
            min_blocks_per_mp=2,
            preferred_smem_carveout=carveout_percent(self.plan.total))
