"""``tools/kda tune`` (tools/bench/tune.py) on a CPU: its plan, the timing budget, the winner
and the table it writes (the format ``cutedsl`` reads). The sweep itself needs a GPU."""

import json

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
