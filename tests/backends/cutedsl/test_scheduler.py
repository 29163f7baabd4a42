"""The schedules' grids (``backends/cutedsl/scheduler.py``), host side: the streamed grid is
one CTA per SM and at most one per item, or one per ``block`` items. (The device walks run
in the GPU tests: every streamed case beside the one-CTA kernel.)"""

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
