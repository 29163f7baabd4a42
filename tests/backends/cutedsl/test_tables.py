"""The measured schedule tables (``backends/cutedsl/tables.py``): the file format, the lookup,
the default for a GPU without a table, the policy reading a table, and every shipped table's
rows and evidence. Pure Python."""

import json
import os

import pytest
import torch

from kda.backends.cutedsl import policy, tables
from kda.backends.cutedsl import schedule as S
from kda.backends.cutedsl.problem import Problem
from kda.config import KdaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _row(state, T, heads, items, axes, us, touch=1.0):
    return tables.Row(state=state, T=T, heads=heads, items=items,
                      axes=tuple(sorted(axes.items())), times=tuple(sorted(us.items())),
                      touch_us=touch)


def _table():
    rows = [_row("fp32", 1, 12, 12, policy.SPLIT8, {"split8": 2.0, "stream": 3.0}),
            _row("fp32", 1, 12, 96, policy.STREAM, {"split8": 9.0, "stream": 6.0}),
            _row("fp32", 1, 12, 1536, policy.STREAM4, {"stream": 70.0, "stream4": 66.0}),
            _row("fp32", 1, 96, 96, policy.STREAMG, {"stream": 8.0, "streamg": 7.0}),
            _row("fp32", 4, 12, 12, policy.SPLIT4, {"split4": 5.0, "split8": 6.0}),
            _row("bf16", 1, 12, 12, policy.SPLIT4, {"split4": 2.5})]
    return tables.Table(device="NVIDIA Test GPU", sms=100, source="docs/results/x/tune-x.json",
                        rows=tuple(rows), meta=(("date", "2026-12-07"),))


def test_slug():
    assert tables.slug("NVIDIA H200") == "nvidia-h200"
    assert tables.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert tables.slug("  NVIDIA H20 (x) ") == "nvidia-h20-x"


def test_round_trip(tmp_path):
    t = _table()
    path = tmp_path / "t.json"
    t.dump(str(path))
    d = json.loads(path.read_text())
    assert d["format"] == tables.FORMAT and d["device"] == "NVIDIA Test GPU" and d["sms"] == 100
    assert d["rows"][0] == {"state": "fp32", "T": 1, "heads": 12, "items": 12,
                            "schedule": policy.SPLIT8, "us": {"split8": 2.0, "stream": 3.0},
                            "touch_us": 1.0}
    assert tables.Table.from_json(d) == t
    d["format"] = 99
    with pytest.raises(ValueError, match="table format"):
        tables.Table.from_json(d)


def test_lookup():
    """The call's dtype and T, the nearest measured heads and items (log scale, ties: the
    smaller); None where the table has no row of the dtype and T."""
    t = _table()
    assert t.axes_for(12, 1, False, 12) == policy.SPLIT8
    assert t.axes_for(33, 1, False, 12) == policy.SPLIT8        # sqrt(12 * 96) = 33.9
    assert t.axes_for(34, 1, False, 12) == policy.STREAM
    assert t.axes_for(384, 1, False, 12) == policy.STREAM       # sqrt(96 * 1536) = 384: a tie
    assert t.axes_for(385, 1, False, 12) == policy.STREAM4
    assert t.axes_for(10 ** 6, 1, False, 12) == policy.STREAM4
    assert t.axes_for(12, 1, False, 33) == policy.SPLIT8       # sqrt(12 * 96) = 33.9
    assert t.axes_for(12, 1, False, 34) == policy.STREAMG
    assert t.axes_for(12, 4, False, 12) == policy.SPLIT4
    assert t.axes_for(12, 2, False, 12) is None                 # T = 2 not measured
    assert t.axes_for(12, 1, True, 96) == policy.SPLIT4
    assert t.axes_for(12, 4, True, 12) is None
    assert t.all_axes(1, False, 12) == [policy.SPLIT8, policy.STREAM, policy.STREAM4]
    assert t.all_axes(2, False, 12) == []


def test_nearest_breaks_ties_to_the_smaller():
    assert tables._nearest({2, 8}, 4) == 2 and tables._nearest({16, 64}, 32) == 16
    assert tables._nearest({12, 48}, 24) == 12 and tables._nearest({12, 48}, 25) == 48
    for a in range(1, 40):
        for b in range(a + 1, 80):
            for want in range(1, 120):
                if want * want == a * b:        # the geometric mean: a tie
                    assert tables._nearest({a, b}, want) == a


@pytest.mark.parametrize("field,value,msg", [
    ("state", "fp16", "state: expected fp32 or bf16"), ("T", 0, "T: expected 1..8"),
    ("T", 9, "T: expected 1..8"), ("items", 0, "heads, items: expected >= 1"),
    ("heads", 0, "heads, items: expected >= 1"), ("us", {}, "us, touch_us"),
    ("schedule", {"rows": "cluster", "prep": "cluster", "items": "one", "clustr": 4},
     "schedule"),
    ("schedule", {"rows": "warp", "prep": "inline", "items": "range"}, "schedule"),
])
def test_a_broken_table_is_refused_at_load(tmp_path, field, value, msg):
    """A table file whose rows are out of range raises when it is loaded, naming the row,
    not at the first step that looks it up."""
    d = _table().to_json()
    d["rows"][0][field] = value
    path = tmp_path / "nvidia-test-gpu.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=msg):
        tables.for_device("NVIDIA Test GPU", str(tmp_path))


def test_policy_reads_the_table():
    """With a table the policy takes its row where it has one that serves the problem, the
    default elsewhere; :func:`policy.schedules` holds every schedule it may return."""
    t = _table()
    for T in (1, 2, 4):
        for H in (12, 96):
            pb = Problem.from_config(KdaConfig(num_heads=H, T=T))
            all_ = policy.schedules(pb, 100, table=t)
            for R in (1, 2, 3, 8, 30, 100, 128, 512):
                s = policy.schedule_for(pb, R * H, 100, table=t)
                assert s in all_, (T, H, R)
                row = t.axes_for(R * H, T, False, H)
                want = row if row is not None else policy.default_axes(R * H, T, False, H, 100)
                assert s.axes() == want, (T, H, R)
    # a row whose schedule cannot serve the problem (Prep.GROUP at T = 2): the default
    bad = tables.Table(device="x", sms=100, source="x", rows=(
        _row("fp32", 2, 12, 12, policy.STREAMG, {"streamg": 1.0}),))
    pb = Problem.from_config(KdaConfig(num_heads=12, T=2))
    assert policy.schedule_for(pb, 12, 100, table=bad).axes() == \
        policy.default_axes(12, 2, False, 12, 100)
    assert policy.schedules(pb, 100, table=bad) == policy.schedules(pb, 100)
    # a gate-batch row in record mode at T = 1 (the tuner measures without records): the same
    # schedule without the gate batches
    gb = dict(policy.STREAM, gate_batch=True)
    t_gb = tables.Table(device="x", sms=100, source="x", rows=(
        _row("fp32", 1, 12, 12, gb, {"stream+gb": 1.0}),))
    rec = Problem.from_config(KdaConfig(num_heads=12, T=1, record=True))
    assert policy.schedule_for(rec, 12, 100, table=t_gb).axes() == policy.STREAM
    assert policy.schedules(rec, 100, table=t_gb) == \
        (policy.schedule_for(rec, 12, 100, table=t_gb),)
    plain = Problem.from_config(KdaConfig(num_heads=12, T=1))
    assert policy.schedule_for(plain, 12, 100, table=t_gb).gate_batch


def test_unknown_gpu_gets_the_default(tmp_path):
    assert tables.for_device("NVIDIA Nonexistent 9000", str(tmp_path)) is None
    assert "the default in SM waves" in tables.describe("NVIDIA Nonexistent 9000")
    for name in tables.shipped():          # a GPU of a shipped name with other SMs
        sms = tables.for_device(name).sms
        assert "the measured table" in tables.describe(name, sms)
        assert "measured on %d SMs, this GPU has %d" % (sms, sms // 2) in \
            tables.describe(name, sms // 2)
    assert "no GPU here" in tables.describe(None)
    broken = tmp_path / "nvidia-broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="nvidia-broken.json"):
        tables.for_device("NVIDIA Broken", str(tmp_path))


def _shipped():
    return [n for n in sorted(os.listdir(tables.TABLE_DIR)) if n.endswith(".json")] \
        if os.path.isdir(tables.TABLE_DIR) else []


@pytest.mark.parametrize("name", _shipped() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no table shipped"))])
def test_shipped_table(name):
    """A shipped table: named for its device, each row's schedule serves its problem and is
    the fastest of its measured candidates, beside a positive touch time; its source run is in
    the repository and holds the same cells."""
    with open(os.path.join(tables.TABLE_DIR, name)) as f:
        t = tables.Table.from_json(json.load(f))
    assert tables.slug(t.device) + ".json" == name
    assert tables.for_device(t.device) == t
    for r in t.rows:
        pb = Problem.from_config(KdaConfig(num_heads=r.heads, T=r.T, state_dtype=(
            torch.bfloat16 if r.state == "bf16" else torch.float32)))
        s = S.from_axes(pb, r.schedule)
        us = dict(r.times)
        assert us[s.name] == min(us.values()) and r.touch_us > 0, r
    src = os.path.join(ROOT, t.source)
    assert os.path.exists(src), t.source
    with open(src) as f:
        cells = json.load(f)["cells"]
    assert {(c["state"], c["T"], c["H"], c["items"]) for c in cells} == \
        {(r.state, r.T, r.heads, r.items) for r in t.rows}
