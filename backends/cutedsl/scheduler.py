"""Which items a CTA takes: the grid of a schedule and the walk of its CTAs over the step's
items (the role of FA4's ``tile_scheduler.py`` in this family).

A step has ``R * H`` items (request r, head h). By :class:`kda.backends.cutedsl.schedule.Items`:

* ``ONE``: CTA (or, with ``Rows.CLUSTER``, cluster) ``b`` takes item ``b``; the grid is R*H
  CTAs (``[R * H]``) or R*H clusters of C CTAs (``[C, H, R]``), from the R the kernel gets;
* ``RANGE``: items walked head-major (``item = h * R + r``), one CTA per SM and at most one
  per item (:func:`ctas`), CTA ``b`` of ``G`` taking the contiguous range
  ``[b * n // G, (b + 1) * n // G)``;
* ``BLOCKS`` of C requests: head-major inside a block (``item = (r // C) * H * C + h * C +
  r % C`` for the whole blocks; the last block holds the ``R % C`` requests left,
  head-major), one CTA per C items, each taking the contiguous range of the same formula.

Consecutive items of a CTA then share the head's parameters. :func:`ctas` is the host side
(the launcher writes it into the streamed kernel's ``ctas`` argument); :class:`ItemWalk` the
device side.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kda.backends.cutedsl.schedule import Items, Rows, Schedule


def ctas(sched: Schedule, items: int, sms: int) -> int:
    """The grid of a streamed schedule for ``items`` items on ``sms`` SMs: one CTA per
    ``block`` items with ``Items.BLOCKS``, else one per SM and at most one per item (the
    one-item schedules size their grids from R and do not read it)."""
    if sched.items == Items.BLOCKS:
        return -(-items // sched.block)
    return min(sms, items)


def grid(sched: Schedule, H: int, a) -> list:
    """The launch grid of ``sched`` for a step of ``a.R`` requests of ``H`` heads (``a``:
    the kernel's :class:`kda.backends.cutedsl.args.KernelArgs`; the streamed schedules' CTAs
    in ``a.ctas``, from :func:`ctas`). With ``Rows.CLUSTER`` the clusters are the grid's x."""
    if sched.items != Items.ONE:
        return [a.ctas, 1, 1]
    if sched.rows == Rows.CLUSTER:
        return [sched.cluster, H, a.R]
    return [a.R * H, 1, 1]


class ItemWalk:
    """Device code of a streamed schedule's item order (module docstring): ``block`` = 0 for
    the head-major walk, C for blocks of C requests, of ``H`` heads per request."""

    def __init__(self, H: int, block: int = 0):
        self.H = H
        self.block = block

    @staticmethod
    def item_range(n, block, grid):
        """The items ``[i0, i1)`` of CTA ``block`` of ``grid``: balanced contiguous ranges."""
        i0 = Int32((Int64(block) * Int64(n)) // Int64(grid))
        i1 = Int32((Int64(block + 1) * Int64(n)) // Int64(grid))
        return i0, i1

    def split_item(self, i, R):
        """(request, head) of item ``i`` in the walk's order; the request is in [0, R) for
        any ``i`` >= 0 (a lookahead past the last item loads in bounds)."""
        if self.block == 0:
            h = i // R
            return i - h * R, h
        C, H = self.block, self.H
        full = (R // C) * C                 # requests in whole blocks
        b = i // (H * C)
        rem = i - b * (H * C)
        h = rem // C
        r = b * C + rem - h * C
        # the last block's R - full requests, head-major
        cl = cutlass.max(R - full, Int32(1))
        j = cutlass.max(i - full * H, Int32(0))
        h2 = j // cl
        tail = i >= full * H
        r = cutlass.min(Int32(cutlass.select_(tail, full + j - h2 * cl, r)), R - 1)
        return r, Int32(cutlass.select_(tail, h2, h))

    @cute.jit
    def step_item(self, rh, i, R):
        """``rh`` := (request, head) of item ``i`` from those of item ``i - 1`` (as
        :meth:`split_item` gives them; head-major walks step without a division)."""
        if cutlass.const_expr(self.block == 0):
            r = rh[0] + 1
            wrap = r >= R
            rh[0] = cutlass.select_(wrap, Int32(0), r)
            rh[1] = cutlass.select_(wrap, rh[1] + 1, rh[1])
        else:
            r, h = self.split_item(i, R)
            rh[0] = r
            rh[1] = h
