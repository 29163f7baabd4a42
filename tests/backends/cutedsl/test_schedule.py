"""The schedule and problem records (``backends/cutedsl/schedule.py``, ``problem.py``): their
validation, the fields :func:`schedule.make` derives from the problem, names and tags, and the
streamed kernel's shared memory computed without CuTe DSL against its storage struct."""

import dataclasses
import os

import pytest
import torch

from kda.backends.cutedsl import schedule as S
from kda.backends.cutedsl.problem import Problem
from kda.config import KdaConfig

bf16, f32 = torch.bfloat16, torch.float32


def _pb(T=1, state_bf16=False, **kw):
    return Problem.from_config(KdaConfig(num_heads=8, T=T, window=T + 2,
                                         state_dtype=bf16 if state_bf16 else f32, **kw))


def test_problem_is_validated():
    pb = _pb()
    for field, bad, msg in (("T", 9, "T: expected 1..8"), ("T", 0, "T: expected 1..8"),
                            ("L", 2, "L: expected >= T"), ("layout", "XY", "layout"),
                            ("gate_mode", 2, "gate_mode"), ("row_bytes", 12, "row_bytes"),
                            ("H", 0, "H: expected >= 1")):
        with pytest.raises(ValueError, match=msg):
            dataclasses.replace(pb, **{field: bad})
    with pytest.raises(dataclasses.FrozenInstanceError):
        pb.T = 2


@pytest.mark.parametrize("fields,msg", [
    (dict(rows="cta", prep="warpgroup", items="one"), "rows=CTA runs with prep=INLINE"),
    (dict(rows="cta", prep="inline", items="range"), "rows=CTA runs with"),
    (dict(rows="cluster", prep="cluster", items="one", cluster=3), "cluster: expected one of"),
    (dict(rows="cluster", prep="cluster", items="one"), "cluster: expected one of"),
    (dict(rows="cta", prep="inline", items="one", cluster=2), "cluster: expected 1"),
    (dict(rows="warp", prep="inline", items="range"), "prep=WARPGROUP or GROUP"),
    (dict(rows="warp", prep="warpgroup", items="one"), "items=RANGE or BLOCKS"),
    (dict(rows="warp", prep="warpgroup", items="range", unit_rows=24), "unit_rows"),
    (dict(rows="warp", prep="warpgroup", items="range", unit_rows=64, consumers=3),
     "consumers: expected a positive multiple of 2"),
    (dict(rows="warp", prep="warpgroup", items="range", depth=0), "depth"),
    (dict(rows="warp", prep="group", items="blocks", block=4), "prep=GROUP runs with"),
    (dict(rows="warp", prep="group", items="range", early_reads=True), "prep=GROUP runs with"),
    (dict(rows="warp", prep="warpgroup", items="blocks"), "block: expected one of"),
    (dict(rows="warp", prep="warpgroup", items="range", block=4), "block: expected one of"),
    (dict(rows="warp", prep="warpgroup", items="blocks", block=3), "block: expected one of"),
    (dict(rows="warp", prep="warpgroup", items="range", tail=True), "tail: a field of"),
    (dict(rows="cta", prep="inline", items="one", tail=True), "tail: a field of"),
    (dict(rows="warp", prep="warpgroup", items="blocks", block=4, tail=1), "tail: expected a bool"),
    (dict(rows="cluster", prep="cluster", items="one", cluster=4, gate_batch=True),
     "flags of rows=WARP only"),
    (dict(rows="cluster", prep="cluster", items="one", cluster=2, state_direct=True),
     "state_direct: a flag of rows=CLUSTER with cluster >= 4"),
    (dict(rows="warp", prep="warpgroup", items="range", state_direct=True),
     "state_direct: a flag of rows=CLUSTER"),
    (dict(rows="warp", prep="warpgroup", items="range", split_qk=True),
     "split_qk: a flag of rows=CLUSTER"),
    (dict(rows="cta", prep="inline", items="one", split_qk=True),
     "split_qk: a flag of rows=CLUSTER"),
    (dict(rows="cluster", prep="cluster", items="one", cluster=4, split_qk=1),
     "split_qk: expected a bool"),
    (dict(rows="cta", prep="inline", items="one", prefetch=True), "flags of rows=WARP only"),
    (dict(rows="cluster", prep="cluster", items="one", cluster=4, early_reads=True),
     "flags of rows=WARP only"),
    (dict(rows="warp", prep="warpgroup", items="range", page_last=True), "page_last"),
    (dict(rows="diagonal", prep="warpgroup", items="range"), "is not a valid Rows"),
    (dict(rows="cta", prep="inline", items="one", depth=7), "the ring of rows=WARP only"),
    (dict(rows="cluster", prep="cluster", items="one", cluster=4, consumers=4),
     "the ring of rows=WARP only"),
    (dict(rows="cluster", prep="cluster", items="one", cluster=4.0), "cluster: expected an int"),
    (dict(rows="warp", prep="warpgroup", items="range", unit_rows=16, consumers=32),
     "pass 1024 threads"),
    (dict(rows="warp", prep="group", items="range", consumers=24),
     "prep=GROUP runs at most 5 consumer groups"),
])
def test_schedule_is_validated(fields, msg):
    with pytest.raises(ValueError, match=msg):
        S.Schedule(**fields)


def test_make_fills_the_measured_defaults():
    """:func:`schedule.make` fills every field not given by :func:`schedule.default_flags`'
    rules; given fields win; a schedule that cannot serve the problem is refused."""
    for T in range(1, 9):
        for sb in (False, True):
            pb = _pb(T, sb)
            s = S.stream(pb)
            assert s.depth == (2 if sb else 1) and s.prefetch == (T < 8)
            assert s.x_ahead == (T <= 4) and s.walk == (T == 1)
            assert s.token_loop == (sb and T > 1) and not s.early_reads and not s.page_last
            assert s.stage_fb == (T <= 6)       # the f_b rows fit beside the ring up to T = 6
            w = S.wide(pb)
            assert w.page_last and not (w.prefetch or w.stage_fb or w.walk or w.token_loop)
            c = S.split(pb, 4)
            assert c.cluster == 4 and not c.page_last
    pb = _pb(2)
    assert S.stream(pb, unit_rows=16, depth=2).depth == 2
    assert not S.stream(pb, prefetch=False).prefetch
    with pytest.raises(ValueError, match="prep=GROUP serves T = 1"):
        S.stream(pb, prep=S.Prep.GROUP)
    with pytest.raises(ValueError, match="stage_fb: the f_b rows do not fit"):
        S.stream(_pb(8), stage_fb=True)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        S.stream(_pb(8), depth=2)
    assert S.from_axes(pb, S.stream(pb, block=4).axes()) == S.stream(pb, block=4)


def test_names_and_tags():
    """Names are for logs (the family's short names); tags name every field, so that two
    schedules have one tag only if they are equal."""
    pb = _pb()
    scheds = [S.wide(pb), S.wide(pb, page_last=False)] + [S.split(pb, C) for C in S.CLUSTERS]
    scheds += [S.stream(pb), S.stream(pb, early_reads=True), S.stream(pb, prep=S.Prep.GROUP),
               S.stream(pb, prefetch=False), S.stream(pb, unit_rows=16, depth=2),
               S.stream(pb, walk=False),
               S.stream(pb, unit_rows=16), S.stream(pb, consumers=4),
               S.stream(pb, stage_fb=False)] + [S.stream(pb, block=C) for C in S.BLOCKS]
    tails = [S.stream(pb, block=C, tail=True) for C in S.BLOCKS]
    assert len({s.tag() for s in scheds + tails}) == len(scheds + tails)
    assert [s.name for s in tails] == ["stream2t", "stream4t", "stream8t", "stream16t"]
    assert tails[1].axes() == {"rows": "warp", "prep": "warpgroup", "items": "blocks",
                               "block": 4, "tail": True}
    assert S.from_axes(pb, tails[1].axes()) == tails[1]
    batched = [S.stream(pb, gate_batch=True), S.stream(pb, block=8, gate_batch=True),
               S.stream(pb, prep=S.Prep.GROUP, gate_batch=True)]
    assert [s.name for s in batched] == ["stream+gb", "stream8+gb", "streamg+gb"]
    assert len({s.tag() for s in scheds + tails + batched}) == len(scheds + tails + batched)
    assert batched[1].axes()["gate_batch"] is True
    assert S.from_axes(pb, batched[1].axes()) == batched[1]
    assert [s.name for s in scheds[:5]] == ["wide", "wide", "split2", "split4", "split8"]
    assert [s.name for s in scheds[5:8]] == ["stream", "stream+early", "streamg"]
    assert [s.name for s in scheds[-4:]] == ["stream2", "stream4", "stream8", "stream16"]
    assert S.stream(pb, block=4).axes() == {"rows": "warp", "prep": "warpgroup",
                                            "items": "blocks", "block": 4}
    shared = [S.split(pb, C, split_qk=True) for C in S.CLUSTERS]
    shared += [S.split(pb, C, state_direct=True, split_qk=True) for C in (4, 8)]
    assert [s.name for s in shared] == ["split2+qk", "split4+qk", "split8+qk",
                                        "split4+direct+qk", "split8+direct+qk"]
    every = scheds + tails + batched + shared + [S.split(pb, 8, state_direct=True)]
    assert len({s.tag() for s in every}) == len(every)
    assert shared[3].axes() == {"rows": "cluster", "prep": "cluster", "items": "one",
                                "cluster": 4, "state_direct": True, "split_qk": True}
    assert S.from_axes(pb, shared[3].axes()) == shared[3]


def test_gate_batch_serves_one_token_without_record():
    """The gate in batches of items takes one MMA column per item: T = 1, and no record rows
    (they would need every batch item's conv slot at the gate)."""
    assert S.stream(_pb(1), gate_batch=True).gate_batch
    with pytest.raises(ValueError, match="gate_batch serves T = 1 without record mode, got T=2"):
        S.stream(_pb(2), gate_batch=True)
    rec = Problem.from_config(KdaConfig(num_heads=8, T=1, window=3, record=True))
    with pytest.raises(ValueError, match="got T=1, record"):
        S.stream(rec, gate_batch=True)


STRUCT_CASES = [
    dict(T=1), dict(T=1, state_bf16=True), dict(T=4), dict(T=7), dict(T=8),
    dict(T=2, state_bf16=True), dict(T=8, state_bf16=True),
]


@pytest.mark.parametrize("kw", STRUCT_CASES, ids=[str(k) for k in STRUCT_CASES])
def test_stream_smem_matches_the_storage_struct(kw):
    """The pure-Python size of the streamed kernel's shared memory (what decides
    ``stage_fb``) is its CuTe DSL storage struct's size."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from kda.backends.cutedsl.stream import KdaStream

    pb = _pb(**kw)
    variants = [S.stream(pb), S.stream(pb, block=4), S.stream(pb, stage_fb=False),
                S.stream(pb, unit_rows=64, consumers=4)]
    if pb.T == 1:
        variants += [S.stream(pb, prep=S.Prep.GROUP), S.stream(pb, gate_batch=True),
                     S.stream(pb, prep=S.Prep.GROUP, gate_batch=True)]
    for s in variants:
        k = KdaStream(pb, s)
        assert k.Storage.__sizeof__() == S.stream_smem_bytes(pb, s, s.stage_fb), s
