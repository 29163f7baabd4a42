"""Regenerate the README's performance table, and the run's tier summary, from benchmark JSON
files.

    python3 -m tools.bench.report docs/results/<run>/bench-h200.json [more.json ...]

Replaces the text between ``<!-- perf-table:begin -->`` and ``<!-- perf-table:end -->`` in
README.md with one table per JSON (time in us and fraction of the copy-bandwidth floor per
backend and peer), headed by the run's device, date and command (its commit is in the JSON),
and the text between ``<!-- tiers:begin -->`` and ``<!-- tiers:end -->`` in each run folder's README.md (where it
has them) with ``cutedsl`` against ``touch`` per tier of items (:data:`TIERS`) from that
folder's JSONs of the project's bench (a peer harness's JSON, whose meta names its ``peer``,
times ``cutedsl`` on another gate beside other kernels: it gets a table, not a tier), so neither
shows a number by hand. ``--check`` exits non-zero when any is not
up to date.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import List

BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"
TIERS_BEGIN, TIERS_END = "<!-- tiers:begin -->", "<!-- tiers:end -->"
#: Tiers of a step by its items (R * H), largest first: (name, least items); the small tier
#: is summarized as the difference to the peer in us, the others as the ratio.
TIERS = (("large", 4096), ("mid", 256), ("small", 1))
#: Another backend counts as faster than ``cutedsl`` in a cell beyond this ratio (the runs'
#: repeatability).
FASTER = 1.005


@functools.lru_cache(maxsize=None)
def load_run(path: str):
    """(meta, cells) of a bench JSON, read once per path (callers do not modify them); the commit
    comes from a ``COMMIT`` file beside it when the JSON says "unknown" (the device machine's
    copy of the tree has no .git)."""
    with open(path) as f:
        data = json.load(f)
    meta, cells = data["meta"], data["cells"]
    commit_file = os.path.join(os.path.dirname(path), "COMMIT")
    if meta.get("commit", "unknown") == "unknown" and os.path.exists(commit_file):
        with open(commit_file) as f:
            meta["commit"] = f.read().strip()
    return meta, cells


def table(path: str, root: str) -> str:
    meta, cells = load_run(path)
    order = list(dict.fromkeys(c["backend"] for c in cells))
    sd = lambda c: c.get("state_dtype", "fp32")     # noqa: E731 (older runs: fp32 only)
    keys = list(dict.fromkeys((c["H"], c["T"], c["R"], sd(c)) for c in cells))
    dtypes = any(k[3] != "fp32" for k in keys)      # a "state" column only when it varies
    rel = os.path.relpath(path, root)
    # (the run's commit stays in its JSON and its folder's README: the project's README says
    # what is, and links the run)
    lines = [f"From [`{rel}`]({rel}): {meta['device']}, {meta['date']}, "
             f"copy bandwidth {meta['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, {meta['timing']}, "
             f"{meta['gate']} gate, {meta['layout']} conv layout. Command: `{meta['command']}`.",
             "",
             "| H | T | R | " + ("state | " if dtypes else "") + "floor us | " + " | ".join(order) + " |",
             "|---|---|---|" + ("---|" if dtypes else "") + "---|" + "---|" * len(order)]
    for key in keys:
        row = {c["backend"]: c for c in cells if (c["H"], c["T"], c["R"], sd(c)) == key}
        floor = next(iter(row.values()))["floor_us"]
        vals = [f"{row[n]['time_us']:.1f} ({row[n]['frac']:.2f})" if n in row else "-" for n in order]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + (f"{key[3]} | " if dtypes else "")
                     + f"{floor:.1f} | " + " | ".join(vals) + " |")
    png = os.path.splitext(rel)[0] + ".png"
    if os.path.exists(os.path.join(root, png)):
        lines += ["", f"![fraction of floor]({png})"]
    return "\n".join(lines)


def tiers(paths: List[str], backend: str = "cutedsl", peer: str = "touch") -> str:
    """The tier summary of the runs ``paths``: per tier (:data:`TIERS`) and column (state dtype,
    T) the range of ``backend``'s step time over ``peer``'s in the same cell, then the cells
    where another backend of the project was faster than ``backend`` by more than
    :data:`FASTER`."""
    from kda.registry import BACKEND_NAMES

    times, cols = {}, []
    for p in paths:
        for c in load_run(p)[1]:
            sd = c.get("state_dtype", "fp32")
            times.setdefault((sd, c["T"], c["H"], c["R"]), {})[c["backend"]] = c["time_us"]
            if (sd, c["T"]) not in cols:
                cols.append((sd, c["T"]))
    ranges, slower = {}, []
    for (sd, T, H, R), t in sorted(times.items()):
        if backend not in t or peer not in t:
            continue
        name = next(n for n, least in TIERS if H * R >= least)
        v = t[backend] - t[peer] if name == "small" else t[backend] / t[peer]
        ranges.setdefault((name, sd, T), []).append(v)
        for other, u in t.items():
            if other != backend and other in BACKEND_NAMES and u * FASTER < t[backend]:
                slower.append(f"{sd} T={T} H={H} R={R} (`{other}` {u:.1f} us against "
                              f"{t[backend]:.1f})")

    def cell(name, key):
        v = ranges.get((name,) + key)
        if not v:
            return "-"
        if name == "small":
            return f"{min(v):+.1f} to {max(v):+.1f} us"
        return f"{min(v):.2f}-{max(v):.2f}"

    bounds = ", ".join(f"{n} >= {least}" for n, least in TIERS[:-1])
    lines = [f"`{backend}` against `{peer}` of the same run (tiers by items = R * H: {bounds}, "
             f"small below; small cells as the difference in us):", "",
             "| tier | " + " | ".join(f"{sd} T={T}" for sd, T in cols) + " |",
             "|---|" + "---|" * len(cols)]
    lines += [f"| {n} | " + " | ".join(cell(n, k) for k in cols) + " |" for n, _ in TIERS]
    lines.append("")
    if slower:
        lines.append(f"`{backend}` is the fastest backend in every cell but these, where another "
                     f"is faster by more than {100 * (FASTER - 1):.1f}%: " + "; ".join(slower) + ".")
    else:
        lines.append(f"`{backend}` is the fastest backend in every cell: no other is faster by "
                     f"more than {100 * (FASTER - 1):.1f}%.")
    return "\n".join(lines)


def _replace(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with ``body`` between its markers ``begin`` and ``end``."""
    return text[: text.index(begin)] + begin + "\n" + body + "\n" + text[text.index(end):]


def render(paths: List[str], root: str) -> str:
    """The README's performance section from the JSONs ``paths`` (under ``root``)."""
    body = "\n\n".join(table(p, root) for p in paths)
    cmd = " ".join(["python3 -m tools.bench.report"] + [os.path.relpath(p, root) for p in paths])
    return f"Time per step in us (fraction of the copy-bandwidth floor). Generated by " \
           f"`{cmd}`; do not edit by hand.\n\n{body}"


def main(argv: List[str]) -> int:
    check = "--check" in argv
    paths = [a for a in argv if not a.startswith("--")]
    if not paths:
        print("usage: python3 -m tools.bench.report [--check] docs/results/<run>/bench-<tag>.json "
              "[more.json ...]\nrewrites README.md's performance table in place from the JSONs "
              "(--check: only compare); the table names the JSON it was generated from",
              file=sys.stderr)
        return 2
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.getcwd()
    missing = [p for p in paths if not os.path.isfile(os.path.join(root, p))]
    if missing:
        print(f"no such benchmark JSON: {', '.join(missing)}", file=sys.stderr)
        return 2
    paths = [os.path.join(root, p) for p in paths]
    readme = os.path.join(root, "README.md")
    with open(readme) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        print(f"{readme}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    new = _replace(text, BEGIN, END, render(paths, root))
    updates = [(readme, text, new)]
    for run_dir in dict.fromkeys(os.path.dirname(p) for p in paths):   # each run's own README
        run_readme = os.path.join(run_dir, "README.md")
        if os.path.isfile(run_readme):
            with open(run_readme) as f:
                run_text = f.read()
            if TIERS_BEGIN in run_text and TIERS_END in run_text:
                full = [p for p in paths if os.path.dirname(p) == run_dir
                        and "peer" not in load_run(p)[0]]
                if not full:        # only a peer harness's JSON named: the summary stays
                    continue
                updates.append((run_readme, run_text,
                                _replace(run_text, TIERS_BEGIN, TIERS_END, tiers(full))))
    if check:
        return 0 if all(old == new for _, old, new in updates) else 1
    for path, old, new in updates:
        if old != new:
            with open(path, "w") as f:
                f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
