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
  head-major), one CTA per C items, each taking the contiguous range of the same formula;
  with ``Schedule.tail`` the last ``sms // 2`` CTAs (one more where the rest ends on half a
  block, fewer where the items do not fill them) take C/2 items each, so the last wave ends on CTAs of half the length and fewer SMs idle
  while it drains (:func:`tail_ranges`).

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
    ``block`` items with ``Items.BLOCKS`` (with ``tail``: ``sms // 2`` CTAs of ``block / 2``
    items, one more where the rest ends on half a block, or as many as the items fill, in
    place of half as many of ``block``,
    :func:`tail_ranges`), else one per SM and at most one per item (the one-item schedules
    size their grids from R and do not read it)."""
    if sched.items == Items.BLOCKS:
        C = sched.block
        if sched.tail:
            half = min(sms // 2, -(-items // (C // 2)))
            return -(-max(items - half * (C // 2), 0) // C) + half
        return -(-items // C)
    return min(sms, items)


def tail_ranges(n, b, grid, C: int, wide=Int64, narrow=Int32):
    """The items ``[i0, i1)`` of CTA ``b`` of ``grid`` over ``n`` items in blocks of ``C``
    with the tail: the last ``x = 2 * grid - ceil(n / (C/2))`` CTAs (clamped to [0, grid])
    take C/2 items each, the others share the rest in balanced ranges. So the grid alone
    says how many CTAs are halved: ``ceil(n / C)`` CTAs take C items (at most one of them
    C/2), and each CTA more moves C items of the last wave onto two CTAs of C/2
    (:func:`ctas`). Branch-free; ``wide`` / ``narrow`` are the integer types of the products
    and of the results (Int64 / Int32 in a kernel, ``int`` on the host)."""
    half = C // 2
    x = _min(_max(2 * grid - (n + (half - 1)) // half, 0), grid)
    n1 = n - _min(x * half, n)          # the items of the CTAs of C
    g1 = grid - x
    d = wide(_max(g1, 1))
    i0 = (wide(_min(b, g1)) * wide(n1)) // d + _max(b - g1, 0) * half
    i1 = (wide(_min(b + 1, g1)) * wide(n1)) // d + _max(b + 1 - g1, 0) * half
    return narrow(_min(i0, wide(n))), narrow(_min(i1, wide(n)))


# cutlass.min / max take plain ints too, but about 50x slower than Python's on the host (the
# tail's range tests call them some million times): Python's on ints, CuTe DSL's on its values
def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else cutlass.min(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else cutlass.max(a, b)


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
    the head-major walk, C for blocks of C requests (``tail``: the last wave's CTAs at C/2),
    of ``H`` heads per request."""

    def __init__(self, H: int, block: int = 0, tail: bool = False):
        self.H = H
        self.block = block
        self.tail = tail

    def item_range(self, n, block, grid):
        """The items ``[i0, i1)`` of CTA ``block`` of ``grid``: balanced contiguous ranges,
        or with the tail :func:`tail_ranges`."""
        if self.tail:
            return tail_ranges(n, block, grid, self.block)
        i0 = Int32((Int64(block) * Int64(n)) // Int64(grid))
        i1 = Int32((Int64(block + 1) * Int64(n)) // Int64(grid))
        return i0, i1

    def head_run_end(self, i, R):
        """The end of item ``i``'s run of consecutive items of one head in the walk's order,
        as far as the walk's structure goes: ``(i // R + 1) * R`` in the head-major walk; in
        blocks of C the end of ``i``'s block (its C requests of one head), or in the last
        block's region (its ``R % C`` requests, head-major) of that run. Every item in
        ``[i, end)`` has ``i``'s head; the item at ``end`` has another one but with one head
        (H = 1), where the next block's is the same. Plain ints on the host, Int32 in a kernel.
        """
        if self.block == 0:
            return (i // R + 1) * R
        C, H = self.block, self.H
        full = (R // C) * C
        cl = _max(R - full, 1)
        in_blocks = (i // C + 1) * C
        in_last = full * H + ((i - full * H) // cl + 1) * cl
        if isinstance(i, int) and isinstance(R, int):
            return in_blocks if i < full * H else in_last
        return cutlass.select_(i < full * H, in_blocks, in_last)

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
