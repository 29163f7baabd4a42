"""The CuTe DSL family's schedules by name, for tools and tests: ``tools.gpu.step_check
cutedsl:streamg``, the tuner's candidates, the tests' cases. The names are
:attr:`kda.backends.cutedsl.schedule.Schedule.name`'s; the backend itself never reads one."""

from kda.backends.cutedsl import schedule as S
from kda.backends.cutedsl.problem import Problem

#: label -> a function of (problem, **fields) giving the schedule
BUILD = {
    "wide": S.wide,
    **{f"split{C}": (lambda pb, C=C, **kw: S.split(pb, C, **kw)) for C in S.CLUSTERS},
    "stream": S.stream,
    "stream+early": lambda pb, **kw: S.stream(pb, early_reads=True, **kw),
    "streamg": lambda pb, **kw: S.stream(pb, prep=S.Prep.GROUP, **kw),
    **{f"stream{C}": (lambda pb, C=C, **kw: S.stream(pb, block=C, **kw)) for C in S.BLOCKS},
    **{f"stream{C}t": (lambda pb, C=C, **kw: S.stream(pb, block=C, tail=True, **kw))
       for C in S.BLOCKS},
    **{f"split{C}+direct": (lambda pb, C=C, **kw: S.split(pb, C, state_direct=True, **kw))
       for C in S.CLUSTERS if C >= 4},
    **{f"split{C}+qk": (lambda pb, C=C, **kw: S.split(pb, C, split_qk=True, **kw))
       for C in S.CLUSTERS},
    **{f"split{C}+direct+qk": (lambda pb, C=C, **kw: S.split(pb, C, state_direct=True,
                                                          split_qk=True, **kw))
       for C in S.CLUSTERS if C >= 4},
    "stream+gb": lambda pb, **kw: S.stream(pb, gate_batch=True, **kw),
    "streamg+gb": lambda pb, **kw: S.stream(pb, prep=S.Prep.GROUP, gate_batch=True, **kw),
    **{f"stream{C}+gb": (lambda pb, C=C, **kw: S.stream(pb, block=C, gate_batch=True, **kw))
       for C in S.BLOCKS},
    **{f"stream{C}t+gb": (lambda pb, C=C, **kw: S.stream(pb, block=C, tail=True, gate_batch=True,
                                                          **kw))
       for C in S.BLOCKS},
}


def build(kind, cfg, rows=16, **fields):
    """(problem, schedule) of label ``kind`` for ``cfg`` on rows of ``rows`` alignment."""
    pb = Problem.from_config(cfg, row_bytes=rows)
    return pb, BUILD[kind](pb, **fields)


def parse(name, cfg, rows=16, **fields):
    """:func:`build`, or ValueError naming the known names."""
    if name not in BUILD:
        raise ValueError(f"schedule name: expected one of {', '.join(BUILD)}, got {name!r}")
    return build(name, cfg, rows, **fields)
