"""``tools/kda tune`` (tools/bench/tune.py) on a CPU: its plan, the timing budget, the winner
and the table it writes (the format ``cutedsl`` reads). The sweep itself needs a GPU."""

import json

import pytest

from kda.backends.cutedsl import policy, tables
from tools.bench import tune


def test_plan_leaves_out_what_cannot_serve_a_cell():
    cells = tune.plan([12, 96], [1, 4], [1, 8], ["fp32", "bf16"], list(tune.DEFAULT_CANDIDATES))
    assert len(cells) == 2 * 2 * 2 * 2
    for c in cells:
        assert c["items"] == c["R"] * c["H"]
        assert ("streamg" in c["candidates"]) == (c["T"] == 1)
        assert set(c["candidates"]) <= set(tune.DEFAULT_CANDIDATES)
    assert {c["state"] for c in cells} == {"fp32", "bf16"}


def test_default_candidates_are_every_name_but_the_blocks_of_16():
    assert len(set(tune.DEFAULT_CANDIDATES)) == len(tune.DEFAULT_CANDIDATES)
    assert set(tune.DEFAULT_CANDIDATES) == \
        {n for n in tune.CANDIDATE_NAMES if not n.startswith("stream16")}


def test_iters_for_keeps_within_the_budget():
    assert tune.iters_for(5.0, 200, 8, 0.3) == 200              # small steps: all of them
    assert tune.iters_for(9000.0, 200, 8, 0.3) == 32            # 9 ms steps: 0.3 s -> 33, in sets
    assert tune.iters_for(10 ** 6, 200, 8, 0.3) == 24           # never below 3 replays
    assert tune.iters_for(1000.0, 200, 8, 0.3) % 8 == 0


def test_winner_and_table(tmp_path):
    assert tune.winner({"stream": 3.0, "split8": 2.0, "wide": 2.0}) == "split8"
    cells = [
        {"state": "fp32", "T": 1, "H": 12, "R": 1, "items": 12, "us": {"split8": 2.0,
         "stream": 3.0}, "winner": "split8", "schedule": policy.SPLIT8, "touch_us": 2.5},
        {"state": "fp32", "T": 1, "H": 12, "R": 64, "items": 768, "us": {"stream": 40.0,
         "stream4": 38.0}, "winner": "stream4", "schedule": policy.STREAM4, "touch_us": 35.0},
    ]
    t = tune.make_table("NVIDIA Test GPU", 100, "docs/results/x/tune-test.json", cells,
                        {"date": "2026-12-07"})
    path = tmp_path / "nvidia-test-gpu.json"
    t.dump(str(path))
    back = tables.Table.from_json(json.loads(path.read_text()))
    assert back == t and back.device == "NVIDIA Test GPU"
    assert tables.for_device("NVIDIA Test GPU", str(tmp_path)) == t
    assert back.axes_for(12, 1, False, 12) == policy.SPLIT8
    assert back.axes_for(700, 1, False, 12) == policy.STREAM4
    assert dict(back.rows[1].times) == {"stream": 40.0, "stream4": 38.0}


def test_plan_drops_cells_no_candidate_serves():
    """A T no candidate serves (the groups' prep at T > 1) leaves no cell behind."""
    cells = tune.plan([12], [1, 4], [1, 8], ["fp32"], ["streamg"])
    assert {c["T"] for c in cells} == {1} and len(cells) == 2
    assert tune.plan([12], [4], [1], ["fp32"], ["streamg"]) == []


def _cell(state, T, H, R, sched, us):
    return {"state": state, "T": T, "H": H, "R": R, "items": R * H, "us": {"x": us},
            "winner": "x", "schedule": sched, "touch_us": us / 1.1}


def test_a_group_cut_short_stays_out_of_the_table():
    planned = [{"state": "bf16", "T": 1, "H": h, "R": r} for h in (12, 96) for r in (1, 512)]
    done = [_cell("bf16", 1, 12, 1, policy.SPLIT8, 3.0), _cell("bf16", 1, 12, 512, policy.STREAM4, 300.0),
            _cell("bf16", 1, 96, 1, policy.SPLIT4, 6.0)]        # H=96 R=512 not reached
    whole = tune.whole_groups(planned, done)
    assert [(c["H"], c["R"]) for c in whole] == [(12, 1), (12, 512)]
    assert tune.whole_groups(planned[:2], done[:2]) == done[:2]


def test_a_new_run_keeps_the_rows_of_groups_it_did_not_measure():
    old = tune.make_table("G", 100, "docs/results/a/tune-g.json",
                          [_cell("fp32", 1, 12, 1, policy.SPLIT8, 2.0),
                           _cell("fp32", 2, 12, 1, policy.SPLIT8, 4.0)], {"commit": "abc"})
    new = tune.make_table("G", 100, "docs/results/b/tune-g.json",
                          [_cell("fp32", 2, 12, 1, policy.SPLIT4, 3.0)], {"commit": "def"}, old)
    assert [(r.T, r.schedule == policy.SPLIT4) for r in new.rows] == [(1, False), (2, True)]
    assert new.source == "docs/results/b/tune-g.json"
    assert "docs/results/a/tune-g.json (abc)" in dict(new.meta)["kept_rows"]
    # a table measured on another SM count is not merged
    other = tune.make_table("G", 78, "s", [_cell("fp32", 2, 12, 1, policy.SPLIT4, 3.0)], {}, old)
    assert len(other.rows) == 1 and "kept_rows" not in dict(other.meta)


def test_the_table_goes_to_the_source_tree_under_bazel_run(monkeypatch, tmp_path):
    monkeypatch.setenv("BUILD_WORKSPACE_DIRECTORY", str(tmp_path))
    assert tune.table_path("NVIDIA H20") == \
        str(tmp_path / "backends" / "cutedsl" / "tables" / "nvidia-h20.json")
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY")
    assert tune.table_path("NVIDIA H20") == tables.path_for("NVIDIA H20")


def test_the_tuner_tunes_both_state_dtypes_by_default():
    """Its plan (--dry_run, no GPU) has both dtypes unless --state_dtype names one."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=root)

    def plan(*extra):
        out = subprocess.run([sys.executable, "-m", "tools.bench.tune", "--dry_run",
                              "--heads=12", "--batches=1", "--tokens=1", "--candidates=split4",
                              *extra], cwd=root, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return [line.split()[0] for line in out.stdout.splitlines() if " T=1 H=12 " in line]

    assert plan() == ["fp32", "bf16"]
    assert plan("--state_dtype=bf16") == ["bf16"]


@pytest.mark.parametrize("flag", ["--finalists=0", "--iters=0", "--sets=0"])
def test_counts_below_one_are_refused_in_the_plan(flag):
    """--finalists=0 passed the plan and would have failed on the GPU after the compiles (a
    CLI trial); counts below 1 are one line, exit 2."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-m", "tools.bench.tune", "--dry_run", flag],
                         cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and flag in out.stdout, out.stdout
