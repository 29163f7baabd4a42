"""The benchmark tools on the CPU: the harness produces a table and JSON (labelled as CPU wall
clock), the README's table is the one the committed results generate, and the host-overhead
tool measures every entry point."""

import json
import os

import pytest
import torch
from absl import flags
from absl.testing import flagsaver

from tools.bench import bench, host_overhead, report

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_readme_table_is_generated_from_committed_results(monkeypatch):
    """README's generated block, and the tier summary in the run's own README, are what the
    runs behind ``auto``'s tables generate (kda.auto.SOURCE: the fp32 reference run, then the
    bf16-state run), all of them GPU runs of committed results."""
    from kda import auto

    rel = [p for paths in auto.SOURCE.values() for p in paths]
    for p in rel:
        meta = report.load_run(os.path.join(ROOT, p))[0]
        assert meta["gpu"] and not meta.get("hot_state"), p
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    assert report.main(["--check", *rel]) == 0, \
        "README.md's table or the run's tier summary is stale: run python3 -m tools.bench.report " \
        + " ".join(rel)


def _run(path, sd, cells):
    meta = {"device": "NVIDIA H200", "date": "d", "commit": "c", "copy_bandwidth_Bps": 4e12,
            "timing": "t", "gate": "softplus", "layout": "SD", "gpu": True}
    json.dump({"meta": meta, "cells": [
        {"backend": b, "H": H, "T": T, "R": R, "time_us": t, "floor_us": 1.0, "frac": 0.5,
         "state_dtype": sd} for b, H, T, R, t in cells]}, open(path, "w"))
    return str(path)


def test_tiers_summary_by_items(tmp_path):
    """The tier summary: per tier and (state dtype, T) the range of cutedsl over touch (the
    small tier as us over touch), '-' for an empty tier, and the cells another backend of
    the project won by more than 0.5% (a peer never counts)."""
    fp = _run(tmp_path / "a.json", "fp32", [
        ("touch", 32, 1, 128, 100.0), ("cutedsl", 32, 1, 128, 105.0), ("cuda", 32, 1, 128, 104.0),
        ("touch", 12, 1, 512, 200.0), ("cutedsl", 12, 1, 512, 218.0),
        ("touch", 32, 1, 8, 10.0), ("cutedsl", 32, 1, 8, 12.5), ("touch_ring", 32, 1, 8, 9.0),
        ("touch", 12, 1, 1, 3.0), ("cutedsl", 12, 1, 1, 2.9), ("cuda", 12, 1, 1, 2.89)])
    bf = _run(tmp_path / "b.json", "bf16", [
        ("touch", 32, 4, 128, 50.0), ("cutedsl", 32, 4, 128, 60.0),
        ("cutedsl_wide", 32, 4, 128, 59.9)])
    text = report.tiers([fp, bf])
    assert "| tier | fp32 T=1 | bf16 T=4 |" in text
    assert "| large | 1.05-1.09 | 1.20-1.20 |" in text
    assert "| mid | 1.25-1.25 | - |" in text
    assert "| small | -0.1 to -0.1 us | - |" in text
    # cuda 104.0 against 105.0 (1.0%) counts; cuda 2.89 against 2.9 and wide 59.9 against 60.0
    # do not (under 0.5%), nor does the touch_ring peer
    assert "fp32 T=1 H=32 R=128 (`cuda` 104.0 us against 105.0)" in text
    assert "R=1 (" not in text and "cutedsl_wide" not in text and "touch_ring" not in text
    only_fast = report.tiers([bf])
    assert "fastest backend in every cell: no other is faster by more than 0.5%" in only_fast


def test_bench_cpu_run_writes_json(tmp_path, capsys):
    FLAGS.unparse_flags()
    FLAGS(["bench"])
    try:
        with flagsaver.flagsaver(backends=["reference"], batches=["1", "2"], tokens=["1", "2"],
                                 heads=["2"], iters=1, warmup=0, pool_gib=0.01,
                                 out_dir=str(tmp_path), tag="t", plot=True, device="cpu"):
            assert bench.main(["bench"]) == 0
    finally:
        FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert "NOT GPU timings" in out
    data = json.load(open(tmp_path / "bench-t.json"))
    assert data["meta"]["timing"] == "CPU wall clock"
    assert {(c["T"], c["R"]) for c in data["cells"]} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(c["time_us"] > 0 and c["bytes"] > 0 for c in data["cells"])
    assert (tmp_path / "bench-t.png").exists()


def test_bench_state_dtype_is_a_dimension(tmp_path, capsys):
    """--state_dtype=fp32,bf16: every cell twice, named by its state dtype, the bf16 floor
    counting half the page bytes; the report's table gets a state column."""
    FLAGS.unparse_flags()
    FLAGS(["bench"])
    try:
        with flagsaver.flagsaver(backends=["reference"], batches=["1"], tokens=["1"],
                                 heads=["2"], iters=1, warmup=0, pool_gib=0.01,
                                 state_dtype=["fp32", "bf16"], out_dir=str(tmp_path), tag="s",
                                 plot=True, device="cpu"):
            assert bench.main(["bench"]) == 0
    finally:
        FLAGS.unparse_flags()
    cells = {c["state_dtype"]: c for c in json.load(open(tmp_path / "bench-s.json"))["cells"]}
    assert set(cells) == {"fp32", "bf16"}
    # one live request, 2 heads, T=1: a page read and written, 32 KiB less each in bf16
    assert cells["fp32"]["bytes"] - cells["bf16"]["bytes"] == 2 * 2 * 128 * 128 * 2
    assert "| state |" in report.table(str(tmp_path / "bench-s.json"), str(tmp_path))


def test_host_overhead_measures_every_entry_point():
    res = host_overhead.measure(heads=2, batch=4, tokens=1, calls=20)
    assert len(res) == 3 and all(v > 0 for v in res.values())


def test_report_without_a_json_is_a_usage_error(monkeypatch, tmp_path, capsys):
    """No path used to rewrite the README with an empty table (found by a new-user trial)."""
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{report.BEGIN}\nold\n{report.END}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    assert report.main([]) == 2
    assert report.main(["missing.json"]) == 2
    assert "old" in readme.read_text()
    assert "usage" in capsys.readouterr().err


def test_bench_flags_are_checked_when_parsed():
    for bad in (["--backends=nope"], ["--pool_gib=0"]):
        FLAGS.unparse_flags()
        try:
            with pytest.raises(flags.IllegalFlagValueError):
                FLAGS(["bench", *bad])
        finally:
            FLAGS.unparse_flags()


def test_default_tag_names_the_device_and_the_time():
    """Without --tag the file is named by the device and the UTC date and time, so a rerun
    never overwrites the last run's file."""
    import datetime
    t = datetime.datetime(2026, 12, 1, 17, 29, 43, tzinfo=datetime.timezone.utc)
    assert bench.default_tag("NVIDIA H200", t) == "h200-20261201-172943"
    assert bench.default_tag("Intel Xeon", t) == "Intel_Xeon-20261201-172943"
    assert bench.default_tag("NVIDIA H200", t + datetime.timedelta(seconds=1)) != \
        bench.default_tag("NVIDIA H200", t)


class _Workload:
    """Stands in for harness.Workload: no pool allocated."""

    def __init__(self, cfg, R, device, pool_gib, sets, hot=False):
        self.cfg, self.R = cfg, R


@pytest.fixture
def fake_harness(monkeypatch):
    """bench.main with the harness's pool, copy and timing stood in for: ``run(on_measure,
    **flags)`` runs it on the CPU with the reference backend and no peers; ``on_measure(k,
    cell)`` is called before the k-th measurement (from 0) returns its cell. Returns (exit
    status, stdout, measured cells)."""
    from tools.bench import harness

    def run(on_measure=lambda k, cell: None, **flag_values):
        measured = []

        def measure(name, make, wl, copy_bw, iters, warmup, mode):
            cfg = wl.cfg
            cell = harness.Cell(backend=name, H=cfg.num_heads, R=wl.R, T=cfg.T, gate=cfg.gate,
                                layout=cfg.conv_layout, time_us=100.0 + len(measured),
                                floor_us=10.0, frac=0.1, bytes=1, mode="cpu-wall", iters=iters,
                                state_dtype="bf16" if cfg.state_dtype == torch.bfloat16 else "fp32")
            on_measure(len(measured), cell)
            measured.append(cell)
            return cell

        monkeypatch.setattr(harness, "measure", measure)
        monkeypatch.setattr(harness, "Workload", _Workload)
        monkeypatch.setattr(harness, "copy_bandwidth", lambda device, gib: 1e10)
        monkeypatch.setenv("COLUMNS", "80")
        FLAGS.unparse_flags()
        FLAGS(["bench"])
        try:
            with flagsaver.flagsaver(backends=["reference"], peers=["none"], device="cpu",
                                     **flag_values):
                rc = bench.main(["bench"])
        finally:
            FLAGS.unparse_flags()
        return rc, measured
    return run


def test_cpu_default_grid_is_small_and_of_the_flags_state_dtype(fake_harness):
    """Without grid flags a CPU measures a small grid (a 2-core machine measured 13 of the
    48 cells of the old default in 5:40), of the state dtypes --state_dtype's default names
    (what --help says), not both."""
    rc, measured = fake_harness()
    assert rc == 0
    assert [(c.H, c.T, c.R, c.state_dtype) for c in measured] == \
        [(32, 1, 1, "fp32"), (32, 1, 8, "fp32")]
    assert {c.state_dtype for c in measured} == set(FLAGS["state_dtype"].default)


def test_each_cell_is_printed_as_it_finishes(fake_harness, capsys):
    """A cell's line is out before the next cell's measurement starts, not only in the table
    at the end."""
    seen = []

    def on_measure(k, cell):
        seen.append(capsys.readouterr().out)
    rc, measured = fake_harness(on_measure, heads=["2"], tokens=["1"], batches=["1", "2", "3"])
    seen.append(capsys.readouterr().out)
    assert rc == 0 and len(measured) == 3
    for k in range(3):
        line = f"H=2 T=1 R={k + 1} fp32: floor 10.0 us | reference {100 + k:.1f} (0.10)"
        assert line not in "".join(seen[:k + 1])
        assert line in seen[k + 1].splitlines(), seen[k + 1]


def test_ctrl_c_prints_the_table_of_what_finished(fake_harness, capsys, tmp_path):
    """SIGINT during the third cell: the two finished cells' table, a line that says so,
    nothing written to --out_dir, exit status 130."""
    import os
    import signal
    import time

    def on_measure(k, cell):
        if k == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)                      # the signal interrupts the sleep
    try:
        rc, measured = fake_harness(on_measure, heads=["2"], tokens=["1"],
                                    batches=["1", "2", "3"], out_dir=str(tmp_path / "out"))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended bench.main without its table")
    out = capsys.readouterr().out
    assert rc == bench.INTERRUPTED == 130
    assert "interrupted (Ctrl-C) after 2 of 3 cells: the table of what finished; nothing " \
        "written" in out.splitlines()
    table = out[out.index("fused KDA decode step"):]
    rows = [line for line in table.splitlines() if line.startswith("│ 2 ")]
    assert [r.split("│")[3].strip() for r in rows] == ["1", "2"], table
    assert "100.0 (0.10)" in rows[0] and "101.0 (0.10)" in rows[1]
    assert not (tmp_path / "out").exists()


def test_a_failed_cells_verdict_is_one_line(fake_harness, capsys):
    """In a log (80 columns) the failure of a cell and the closing verdict are whole lines."""
    def on_measure(k, cell):
        if k == 1:
            raise RuntimeError("a long reason why this cell could not be measured, longer than "
                               "a log's 80 columns")
    rc, _ = fake_harness(on_measure, heads=["2"], tokens=["1"], batches=["1", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert "reference H=2 T=1 R=2 failed: RuntimeError: a long reason why this cell could not " \
        "be measured, longer than a log's 80 columns" in lines
    assert "1 cell(s) failed (exit status 1): reference H=2 T=1 R=2" in lines
