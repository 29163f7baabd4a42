"""The benchmark tools on the CPU: the harness produces a table and JSON (labelled as CPU wall
clock), the README's table is the one the committed results generate, and the host-overhead
tool measures every entry point."""

import glob
import json
import os

import pytest
from absl import flags
from absl.testing import flagsaver

from tools.bench import bench, host_overhead, report

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_readme_table_is_generated_from_committed_results(monkeypatch):
    runs = [(report.load_run(p)[0]["date"], p)
            for p in glob.glob(os.path.join(ROOT, "docs", "results", "*", "bench-*.json"))
            if report.load_run(p)[0]["gpu"] and not report.load_run(p)[0].get("hot_state")]
    assert runs
    paths = [max(runs)[1]]                   # the README shows the newest GPU run
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    assert report.main(["--check", *[os.path.relpath(p, ROOT) for p in paths]]) == 0, \
        "README.md's table is stale: run python3 -m tools.bench.report " + " ".join(paths)


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
    for bad in (["--backends=nope"], ["--triton_variants=bogus"], ["--pool_gib=0"]):
        FLAGS.unparse_flags()
        try:
            with pytest.raises(flags.IllegalFlagValueError):
                FLAGS(["bench", *bad])
        finally:
            FLAGS.unparse_flags()


def _cells_of_cited_run(text: str, lead: str):
    """{(backend, R, T): (time_us, frac)} of the run whose folder follows ``lead`` in ``text``."""
    import re
    m = re.search(re.escape(lead) + r".*?`(docs/results/[^`/]+)/?`", text, re.S)
    assert m, f"no cited results folder after {lead!r}"
    with open(os.path.join(ROOT, m.group(1), "bench-h200.json")) as f:
        cells = json.load(f)["cells"]
    return {(c["backend"], c["R"], c["T"]): (c["time_us"], c["frac"]) for c in cells
            if c["H"] == 32}


def test_hand_written_figures_match_the_cited_run():
    """The README's summary table and docs/backends.md's target table are typed by hand: each
    figure must be the cited run's (time to 0.1 us, fraction to 2 decimals), so the prose
    cannot drift from the measurement (a review found such drift)."""
    import re
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    cells = _cells_of_cited_run(readme, "All numbers below come from one run at commit")
    names = {"`cuda`": "cuda", "`cutedsl` (stream)": "cutedsl", "`cutedsl_wide`": "cutedsl_wide",
             "`triton`": "triton", "fla-core recurrence only": "fla_recurrent",
             "fla-core unfused whole step": "fla_unfused",
             "`touch_rows32`": "touch_rows32", "`touch`": "touch"}
    checked = 0
    for line in readme.split(report.BEGIN)[0].splitlines():   # the generated table follows
        m = re.match(r"\| (.+?) \| ([\d.]+) \(([\d.]+)\) \| ([\d.]+) \(([\d.]+)\) \| "
                     r"([\d.]+) \(([\d.]+)\) \|", line)
        if not m:
            continue
        name = next((v for k, v in names.items() if m.group(1).startswith(k)), None)
        assert name, line
        for i, (R, T) in enumerate(((128, 1), (512, 1), (128, 5))):
            t_us, frac = cells[(name, R, T)]
            got = (m.group(2 + 2 * i), m.group(3 + 2 * i))
            assert got == (f"{t_us:.1f}", f"{frac:.2f}"), (line, R, T, cells[(name, R, T)])
            checked += 1
    assert checked == 24
    with open(os.path.join(ROOT, "docs", "backends.md")) as f:
        doc = f.read()
    cells = _cells_of_cited_run(doc, "Figures are from")
    checked = 0
    for m in re.finditer(r"^\| (\w+) R=(\d+) T=(\d+) \| >= [\d.]+ \| ([\d.]+) \(([\d.]+) us\)",
                         doc, re.M):
        t_us, frac = cells[(m.group(1), int(m.group(2)), int(m.group(3)))]
        assert (m.group(4), m.group(5)) == (f"{frac:.2f}", f"{t_us:.1f}"), m.group(0)
        checked += 1
    assert checked == 9
    m = re.search(r"^\| cutedsl R=1 T=1, per step in a CUDA graph \| < 6 us \| ([\d.]+) us", doc, re.M)
    assert m and m.group(1) == f"{cells[('cutedsl', 1, 1)][0]:.1f}", m and m.group(0)
