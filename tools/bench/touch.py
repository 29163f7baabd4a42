"""The "touch" peer: a Triton kernel that moves exactly the state bytes of a decode step and
does nothing else, and its host wrapper. Its fraction of the copy-bandwidth floor is the
practical ceiling of any fused step on the same pages (the benchmark runs it beside our
backends, so every table shows how far each backend is from it).

Per item (request r, head h), like the step (``docs/contract.md`` section 6): T=1 reads the
page of slot ``state_indices[r]`` and writes it back there; T>1 reads the page of slot
``state_indices[r, a-1]`` (``a`` = ``num_accepted_tokens[r]`` clamped to 1..T) and writes
it to each slot ``state_indices[r, t]``, t < T, that is in 1..slots-1. An item is dead (no
read, no write) when its source slot or its conv slot (``state_indices[r, 0]``; T=1: the
source) is outside 1..slots-1; the benchmark's slots never are. The pages move in the
pool's dtype (fp32, or bf16 for ``--state_dtype=bf16``: half the bytes). No conv window, operands,
norm or output: the floor also counts those bytes (4.3% of the step's at T=1, 3.9% at T=2,
3.5% at T=5, H=32), so a touch at the copy bandwidth would read about 1.045 at T=1 (1.036
at T=5), and a fused step moving all its bytes as efficiently as the touch kernel moves the
pages would read the touch fraction divided by that: 0.93 where the touch kernel reads 0.97.

Two decompositions (:data:`TOUCH_PEERS`): ``touch`` = one 8-warp program per item holding
the 64 KiB page in registers (64 floats per thread), the shape of the wide kernels;
``touch_rows32`` = four 4-warp programs per item of 32 value rows each, the shape of
fla-core's recurrence kernel. 16-byte loads and stores along the key dimension, 64-bit slot
offsets.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from kda.config import HEAD_DIM as D
from kda.config import KdaArgs, KdaConfig

#: peer name -> (value rows per program, warps per program)
TOUCH_PEERS = {"touch": (128, 8), "touch_rows32": (32, 4)}


@triton.jit
def _touch_kernel(st_ptr, si_ptr, nacc_ptr, num_slots,
                  H: tl.constexpr, T: tl.constexpr, ROWS: tl.constexpr):
    """Grid: ``R * H * (128 // ROWS)`` programs; program = (item, row block)."""
    NB: tl.constexpr = 128 // ROWS
    pid = tl.program_id(0)
    item = pid // NB
    blk = pid % NB
    r64 = (item // H).to(tl.int64)
    h = item % H
    if T == 1:
        src = tl.load(si_ptr + r64)
        cslot = src
    else:
        a = tl.minimum(tl.maximum(tl.load(nacc_ptr + r64), 1), T)
        src = tl.load(si_ptr + r64 * T + (a - 1))
        cslot = tl.load(si_ptr + r64 * T)
    live = (src > 0) & (src < num_slots) & (cslot > 0) & (cslot < num_slots)
    rows = blk * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * 128 + tl.arange(0, 128)[None, :]
    page = (tl.where(live, src, 0).to(tl.int64) * H + h) * (128 * 128)
    S = tl.load(st_ptr + page + offs, mask=live, other=0.0)
    for t in tl.static_range(T):
        if T == 1:
            dst = src
        else:
            dst = tl.load(si_ptr + r64 * T + t)
        ok = live & (dst > 0) & (dst < num_slots)
        tl.store(st_ptr + (tl.where(ok, dst, 0).to(tl.int64) * H + h) * (128 * 128) + offs, S,
                 mask=ok)


def make_touch(name: str, cfg: KdaConfig, args: KdaArgs
               ) -> Callable[[torch.Tensor, Optional[torch.Tensor]], None]:
    """A step function ``fn(state_indices, num_accepted_tokens)`` that touches ``args.state``
    as the step would (see the module docstring).

    Args:
      name: a key of :data:`TOUCH_PEERS`.
      cfg: the step's configuration (H, T).
      args: its buffers; only ``args.state`` ([slots, H, 128, 128] fp32 or bf16, contiguous)
        is used. A bf16 pool moves as bf16 pages (32 KiB, as the step's bf16 state).

    Raises:
      ValueError: unknown ``name`` or a non-contiguous state pool.
    """
    if name not in TOUCH_PEERS:
        raise ValueError(f"unknown touch peer {name!r}; valid: {sorted(TOUCH_PEERS)}")
    if not args.state.is_contiguous():
        raise ValueError("touch: state must be contiguous [slots, H, 128, 128]")
    rows, warps = TOUCH_PEERS[name]
    H, T = cfg.num_heads, cfg.T
    state = args.state
    slots = state.shape[0]

    def step(state_indices: torch.Tensor, num_accepted: Optional[torch.Tensor]) -> None:
        R = state_indices.shape[0]
        nacc = num_accepted if num_accepted is not None else state_indices
        _touch_kernel[(R * H * (D // rows),)](state, state_indices, nacc, slots,
                                              H=H, T=T, ROWS=rows, num_warps=warps)
    return step


__all__ = ["TOUCH_PEERS", "make_touch"]
