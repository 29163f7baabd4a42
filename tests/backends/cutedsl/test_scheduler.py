"""The schedules' grids (``backends/cutedsl/scheduler.py``), host side: the streamed grid is
one CTA per SM and at most one per item, or one per ``block`` items, with the tail ``sms // 2``
CTAs of half a block more; the tail's ranges cover every item once. (The device walks run in
the GPU tests: every streamed case beside the one-CTA kernel.)"""

import pytest

from kda.backends.cutedsl import schedule as S
from kda.backends.cutedsl import scheduler
from kda.backends.cutedsl.problem import Problem
from kda.config import KdaConfig


def test_ctas():
    pb = Problem.from_config(KdaConfig(num_heads=2, T=1, window=3))
    assert scheduler.ctas(S.stream(pb, prep=S.Prep.GROUP), 12, 10) == 10
    assert scheduler.ctas(S.stream(pb), 12, 10) == 10 and scheduler.ctas(S.stream(pb), 7, 10) == 7
    four = S.stream(pb, block=4)
    assert scheduler.ctas(four, 12, 10) == 3 and scheduler.ctas(four, 13, 10) == 4
    for C in S.BLOCKS:
        for items in (1, C - 1, C, C + 1, 1000):
            assert scheduler.ctas(S.stream(pb, block=C), items, 132) == -(-items // C)


def test_tail_ctas():
    pb = Problem.from_config(KdaConfig(num_heads=2, T=1, window=3))
    four = S.stream(pb, block=4, tail=True)
    # 132 SMs: 66 CTAs of 2 items, the other 4000 - 132 items in CTAs of 4
    assert scheduler.ctas(four, 4000, 132) == 967 + 66
    # fewer items than the tail holds: as many CTAs of 2 as the items fill
    assert scheduler.ctas(four, 10, 132) == 5
    assert scheduler.ctas(S.stream(pb, block=2, tail=True), 1, 132) == 1


@pytest.mark.parametrize("C", S.BLOCKS)
def test_tail_ranges_cover_every_item_once(C):
    """For every grid the host may give (and any other from ceil(n / C) up), the ranges of the
    CTAs are contiguous, in order, cover [0, n) exactly, hold at most C items each, and the
    last ``x`` CTAs at most C / 2 (x: the halved CTAs the grid implies)."""
    pb = Problem.from_config(KdaConfig(num_heads=2, T=1, window=3))
    sched = S.stream(pb, block=C, tail=True)
    for n in (1, C // 2, C - 1, C, C + 1, 3 * C + 1, 97, 1000, 4096, 24576):
        grids = {scheduler.ctas(sched, n, sms) for sms in (1, 2, 3, 16, 78, 132)}
        grids |= set(range(-(-n // C), -(-n // (C // 2)) + 1, max(1, n // 50)))
        for grid in sorted(grids):
            ranges = [scheduler.tail_ranges(n, b, grid, C, int, int) for b in range(grid)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n, (n, grid, ranges[-3:])
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (n, grid)
            sizes = [i1 - i0 for i0, i1 in ranges]
            assert min(sizes) >= 0 and max(sizes) <= C, (n, grid, sizes)
            x = min(max(2 * grid - -(-n // (C // 2)), 0), grid)
            assert all(sz <= C // 2 for sz in sizes[grid - x:]), (n, grid, x, sizes)


def test_tail_of_the_host_grid():
    """The host's grid halves ``sms // 2`` CTAs (one more where the rest ends on half a
    block) once the items fill them, else as many as they fill; no CTA is left empty."""
    pb = Problem.from_config(KdaConfig(num_heads=2, T=1, window=3))
    for C in S.BLOCKS:
        sched = S.stream(pb, block=C, tail=True)
        for sms in (78, 132):
            for n in list(range(1, sms * C // 2, 7)) + list(range(sms * C // 2, 40 * sms * C, 997)):
                grid = scheduler.ctas(sched, n, sms)
                x = min(max(2 * grid - -(-n // (C // 2)), 0), grid)
                if n >= (sms // 2) * (C // 2):
                    assert x in (sms // 2, sms // 2 + 1), (C, sms, n, grid, x)
                sizes = [b - a for a, b in (scheduler.tail_ranges(n, i, grid, C, int, int)
                                            for i in range(grid))]
                assert min(sizes) > 0 and sum(sizes) == n, (C, sms, n, grid)


def _walk_heads(H, R, C):
    """The head of each item in the walk's order (module docstring of the scheduler): the
    head-major walk (C = 0), or blocks of C requests, head-major inside each, the last block's
    ``R % C`` requests head-major."""
    heads = {}
    full = (R // C) * C if C else 0
    for r in range(R):
        for h in range(H):
            if not C:
                i = h * R + r
            elif r < full:
                i = (r // C) * H * C + h * C + r % C
            else:
                i = full * H + h * (R - full) + (r - full)
            heads[i] = h
    assert sorted(heads) == list(range(R * H))
    return [heads[i] for i in range(R * H)]


@pytest.mark.parametrize("C", (0,) + S.BLOCKS)
def test_head_run_end(C):
    """``ItemWalk.head_run_end(i)``: every item from ``i`` to it has ``i``'s head (the gate
    batches of ``Schedule.gate_batch`` never span two heads), and with more than one head it is
    the first item of another head (or the walk's end)."""
    for H, R in ((1, 1), (1, 3), (1, 2 * max(C, 1) + 1), (3, 5), (12, 8), (5, 41), (32, 3),
                 (7, 2 * max(C, 1) + 1)):
        heads = _walk_heads(H, R, C)
        walk = scheduler.ItemWalk(H, C)
        for i in range(R * H):
            end = min(walk.head_run_end(i, R), R * H)
            nxt = next((k for k in range(i + 1, R * H) if heads[k] != heads[i]), R * H)
            assert i < end <= nxt, (H, R, C, i, end, nxt)
            if H > 1:
                assert end == nxt, (H, R, C, i, end, nxt)
