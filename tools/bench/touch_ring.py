"""The ``touch_ring`` peer: the streamed CuTe DSL kernels' pipeline moving the step's state
pages with no math (:mod:`kda.backends.cutedsl.ring`), and its host wrapper.

Same traffic as the ``touch`` peer (:mod:`tools.bench.touch`: read each live item's source
page, write it to each of its write slots; dead items move nothing), moved the way the
streamed kernel moves it: persistent CTAs over head-major item ranges, each consumer warp
bulk-copying value-row units into its own shared-memory stages ``depth`` items ahead. A
warp moves its unit shared -> registers (a bf16 page widened to fp32, as the math does) ->
global, 16 rows per pass, each lane 4 rows x 16 key columns (the 8 lanes of a row cover
its 128 columns, so a warp store writes 4 rows x 128 contiguous bytes of fp32, or 4 x 64
bytes of bf16); T > 1 writes each pass to the T slots in token order.

So its fraction of the floor, against ``touch``'s in the same run, says whether the
pipeline itself can carry the step's bytes: the streamed kernel's ceiling.
"""

import dataclasses
from typing import Callable, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.runtime import make_ptr

from kda.backends.cutedsl.ring import WarpRing
from kda.backends.cutedsl.schedule import Items, Prep, Rows, Schedule
from kda.config import HEAD_DIM as D
from kda.config import KdaArgs, KdaConfig


@dataclasses.dataclass(frozen=True)
class TouchRingStatic:
    """What one touch_ring kernel is compiled for: H, T, the state dtype and the streamed
    kernels' ring (a ``Rows.WARP`` :class:`kda.backends.cutedsl.schedule.Schedule`: its
    ``unit_rows``, ``consumers`` and ``depth``, the head-major walk, no early reads)."""

    H: int
    T: int
    state_bf16: bool
    ring: Schedule


class TouchRing:
    """The touch_ring kernel for one :class:`TouchRingStatic`; ``launch`` is compiled."""

    def __init__(self, ts: TouchRingStatic):
        self.ts = ts
        self.T = ts.T
        self.H = ts.H
        self.st = BFloat16 if ts.state_bf16 else Float32
        self.ring = WarpRing(ts.ring, ts.T, self.st)
        self.threads = 32 * ts.ring.consumers
        fields = self.ring.fields()
        self.Storage = cute.struct(type("TouchRingStorage", (), {"__annotations__": fields}))

    @cute.kernel
    def kernel(self, state: cute.Pointer, si: cute.Pointer, na: cute.Pointer, R: Int32,
               slots: Int32, state_ss: Int64):
        T, H = self.T, self.H
        tid, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        storage = cutlass.memory.SmemAllocator().allocate(self.Storage)
        g_state = cute.make_tensor(state, cute.make_layout(
            (slots, H, D, D),
            stride=(cute.assume(state_ss, divby=8 if self.ts.state_bf16 else 4), D * D, D, 1)))
        g_si = cute.make_tensor(si, cute.make_layout((R, T), stride=(T, 1)))
        g_na = cute.make_tensor(na, cute.make_layout((R,)))
        self.ring.init(storage, tid)
        cute.arch.sync_threads()
        cute.arch.griddepcontrol_wait()
        i0, i1 = self.ring.items.item_range(R * H, block, grid)
        u = warp % self.ring.units

        def unit(stage, j, h, dst, refill):
            self._unit(g_state, stage, h, dst, refill, u, lane, slots)

        def skip(j):
            pass

        self.ring.walk(storage, g_state, g_si, g_na, R, slots, i0, i1, warp, lane, unit, skip)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _unit(self, g_state, stage, h, dst, refill, u, lane, slots):
        """One unit: shared -> registers -> the write slots, 16 rows per pass."""
        rows = self.ts.ring.unit_rows
        grp = lane // 8
        l8 = lane % 8
        for p in cutlass.range_constexpr(rows // 16):
            S = cute.make_rmem_tensor(cute.make_layout((4, 16), stride=(16, 1)), Float32)
            for m in cutlass.range_constexpr(4):
                row = p * 16 + 4 * m + grp
                for c in cutlass.range_constexpr(4):
                    raw = cute.make_rmem_tensor(cute.make_layout((4,)), self.st)
                    cute.autovec_copy(cute.local_tile(stage[row, None], (4,), (l8 + 8 * c,)), raw)
                    for e in cutlass.range_constexpr(4):
                        S[m, 4 * c + e] = Float32(raw[e])
            if p == rows // 16 - 1:
                refill()
            for t in cutlass.range_constexpr(len(dst)):
                if (dst[t] > 0) & (dst[t] < slots):
                    for m in cutlass.range_constexpr(4):
                        row = u * rows + p * 16 + 4 * m + grp
                        for c in cutlass.range_constexpr(4):
                            self._put(S, m, c, cute.local_tile(
                                g_state[dst[t], h, row, None], (4,), (l8 + 8 * c,)))

    def _put(self, S, m, c, dst):
        """Registers (fp32) -> ``dst`` (4 elements of the state dtype)."""
        raw = cute.make_rmem_tensor(cute.make_layout((4,)), self.st)
        for e in range(4):
            raw[e] = self.st(S[m, 4 * c + e])
        cute.autovec_copy(raw, dst)

    @cute.jit
    def launch(self, state: cute.Pointer, si: cute.Pointer, na: cute.Pointer, R: Int32,
               slots: Int32, state_ss: Int64, grid: Int32, stream: cuda.CUstream):
        self.kernel(state, si, na, R, slots, state_ss).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True)


_compiled = {}


def compile_touch_ring(ts: TouchRingStatic):
    """The compiled kernel for ``ts`` (once per process)."""
    fn = _compiled.get(ts)
    if fn is None:
        obj = TouchRing(ts)
        st = BFloat16 if ts.state_bf16 else Float32
        fake = [make_ptr(st, 0, cute.AddressSpace.gmem, assumed_align=16),
                make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=4),
                make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=4),
                Int32(1), Int32(2), Int64(4), Int32(1), cuda.CUstream(0)]
        fn = cute.compile(obj.launch, *fake)
        _compiled[ts] = fn
    return fn


def make_touch_ring(cfg: KdaConfig, args: KdaArgs, ctas_per_sm: int = 1,
                    grid: Optional[int] = None, **shape
                    ) -> Callable[[torch.Tensor, Optional[torch.Tensor]], None]:
    """A step function ``fn(state_indices, num_accepted_tokens)`` moving ``args.state`` as the
    step would (see the module docstring), on ``ctas_per_sm`` persistent CTAs per SM.

    Args:
      cfg: the step's configuration (H, T, state dtype).
      args: its buffers; only ``args.state`` ([slots, H, 128, 128], fp32 or bf16, each slot
        contiguous, slot stride a multiple of 16 bytes) is used.
      ctas_per_sm: persistent CTAs per SM (the grid is at most one CTA per item).
      grid: a fixed number of CTAs instead (tests: several items and ring passes per CTA).
      shape: the ring's ``rows`` (unit rows), ``consumers`` and ``depth`` (default: the
        streamed kernel's 128 KiB ring, one 16 KiB fp32 unit per warp or two 8 KiB bf16
        units).
    """
    state = args.state
    bf16 = state.dtype == torch.bfloat16
    shape = {"rows": 32, "consumers": 8, "depth": 2 if bf16 else 1, **shape}
    ring = Schedule(rows=Rows.WARP, prep=Prep.WARPGROUP, items=Items.RANGE,
                    unit_rows=shape["rows"], consumers=shape["consumers"], depth=shape["depth"])
    ts = TouchRingStatic(H=cfg.num_heads, T=cfg.T, state_bf16=bf16, ring=ring)
    fn = compile_touch_ring(ts)
    st = BFloat16 if ts.state_bf16 else Float32
    sms = torch.cuda.get_device_properties(state.device).multi_processor_count
    slots = state.shape[0]
    sp = make_ptr(st, state.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

    def step(state_indices: torch.Tensor, num_accepted: Optional[torch.Tensor]) -> None:
        R = state_indices.shape[0]
        nacc = num_accepted if num_accepted is not None else state_indices
        ctas = grid if grid is not None else min(sms * ctas_per_sm, R * cfg.num_heads)
        stream = cuda.CUstream(torch.cuda.current_stream(state.device).cuda_stream)
        fn(sp, make_ptr(Int32, state_indices.data_ptr(), cute.AddressSpace.gmem, assumed_align=4),
           make_ptr(Int32, nacc.data_ptr(), cute.AddressSpace.gmem, assumed_align=4),
           Int32(R), Int32(slots), Int64(state.stride(0)), Int32(ctas), stream)
    return step


__all__ = ["TouchRingStatic", "compile_touch_ring", "make_touch_ring"]
