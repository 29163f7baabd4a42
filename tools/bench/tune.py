"""Tune ``cutedsl`` for the GPU this runs on: a measured schedule table.

    tools/kda tune [flags]                 # on a GPU: sweep, then write the table
    tools/kda tune --dry_run               # anywhere: the plan (cells, candidates)
    python3 -m tools.bench.tune --results_dir=docs/results/<date>-<gpu>   # GPU machine

For each (state dtype, T, heads, batch) of the grid, every candidate schedule
(:mod:`tools.schedules`; those that cannot serve the cell are left out) runs the step on the
benchmark's workload (:mod:`tools.bench.harness`: 8 GiB state pool, rotating slot sets,
CUDA-graph replay) beside the ``touch`` peer, in one process: a short screen of every
candidate, then the fastest ``--finalists`` again at full length; the fastest time wins the
cell. The table (:mod:`kda.backends.cutedsl.tables`: one row per cell, the winner's
schedule axes and every candidate's step time with ``touch``'s) goes to the package of the
source tree (also under ``bazel run``), named for the device
(``backends/cutedsl/tables/<device>.json``), and the whole run's cells to ``--results_dir``
(``tune-<device>.json``, the table's name) beside it, which the table names as its source.
Both state dtypes are tuned unless ``--state_dtype`` names one.

A group of cells (state dtype, T, heads) enters the table only whole: one cut short by
``--budget_s`` stays in the results file, and its batches run the default there. The rows of
a device's previous table whose groups this run did not measure are kept (a run of
``--tokens=2`` adds T = 2 to the table, it does not drop T = 1 and 4); the table's meta names
the table they came from.
``--other_backends`` also times the project's other GPU backends at each cell (into the
results file).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from typing import Dict, List

import torch
from absl import flags, logging

from tools import flags as _shared_flags  # noqa: F401  (defines --state_dtype, --gate_mode)
from tools.flags import STATE_DTYPES, run, user_path
from tools.schedules import BUILD

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The tool's flags (defined when it runs as a program, so that its functions import
    beside the bench's flags of the same names)."""
    flags.DEFINE_list("heads", ["12", "32", "96"], "H values")
    flags.DEFINE_list("tokens", ["1", "4"], "T values (a T the table has not measured runs the "
                      "default in SM waves)")
    flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32", "64", "128", "256", "512"],
                      "R values")
    flags.DEFINE_list("candidates", None, "schedule names (default: "
                      + ", ".join(DEFAULT_CANDIDATES) + "; any of tools.schedules' names but "
                      "the early-reading builds may be named)")
    flags.DEFINE_list("other_backends", [], "the project's other backends to time at each cell "
                      "(e.g. cutedsl_wide,cuda,triton)")
    flags.DEFINE_integer("screen_iters", 24, "timed iterations of the screen")
    flags.DEFINE_integer("iters", 200, "timed iterations of the finalists (fewer where that many "
                         "would take more than --max_s; 3 replays of the sets at least)")
    flags.DEFINE_float("max_s", 0.3, "seconds one timing may take, about")
    flags.DEFINE_integer("finalists", 3, "candidates timed again at full length")
    flags.DEFINE_float("pool_gib", 8.0, "state pool size in GiB")
    flags.DEFINE_integer("sets", 8, "rotating slot sets")
    flags.DEFINE_float("budget_s", 0, "stop starting cells after this many seconds (0: none); "
                       "the cells measured go to the results file, the groups (state dtype, "
                       "T, heads) measured whole to the table")
    flags.DEFINE_string("table", "", "where the table goes (default: the package's table of this "
                        "device in the source tree, rows of groups not measured kept)")
    flags.DEFINE_string("results_dir", "", "where the run's cells go (tune-<device>.json)")
    flags.DEFINE_string("source", "", "the path the table names as its source, where the "
                        "results file will be committed, e.g. docs/results/<run>/"
                        "tune-<device>.json (default: the results file, relative to the "
                        "repository where it is inside it)")
    flags.DEFINE_bool("dry_run", False, "print the plan and exit (no GPU needed)")
    flags.DEFINE_integer("jobs", 0, "processes compiling the candidates into the compile cache "
                         "before the sweep (0: one per CPU)")
    # the tuner's own default: both state dtypes (the shared flag's default is the bench's)
    FLAGS.set_default("state_dtype", list(STATE_DTYPES))


#: The names the tuner can time: every schedule name (:data:`tools.schedules.BUILD`) but the
#: early-reading builds (those need ``KdaConfig.early_reads``; the policy applies its measured
#: rule for them, and a table row holds a schedule's axes, which its flags follow).
CANDIDATE_NAMES = tuple(n for n in BUILD if "+early" not in n)
#: The candidates by default: all of :data:`CANDIDATE_NAMES` but the blocks of 16 requests
#: (``--candidates`` names them), in the order that breaks ties (:func:`winner`).
DEFAULT_CANDIDATES = ("split2", "split4", "split8", "split4+direct", "split8+direct",
                      "split2+qk", "split4+qk", "split8+qk", "split4+direct+qk",
                      "split8+direct+qk", "stream",
                      "streamg", "stream2", "stream4", "stream8", "stream2t", "stream4t",
                      "stream8t", "stream+gb", "streamg+gb", "stream2+gb", "stream4+gb",
                      "stream8+gb", "stream2t+gb", "stream4t+gb", "stream8t+gb", "wide")


def plan(heads, tokens, batches, state_dtypes, candidates) -> List[dict]:
    """The cells of the sweep and each one's candidates (names whose schedule serves it); a
    cell no candidate serves is left out."""
    from kda.config import KdaConfig
    from tools.schedules import parse

    cells = []
    for sd in state_dtypes:
        for T in tokens:
            for H in heads:
                cfg = KdaConfig(num_heads=H, T=T, window=T + 2, state_dtype=STATE_DTYPES[sd])
                names = []
                for name in candidates:
                    try:
                        parse(name, cfg)
                    except ValueError:
                        continue
                    names.append(name)
                for R in batches if names else ():
                    cells.append({"state": sd, "T": T, "H": H, "R": R, "items": R * H,
                                  "candidates": names, "cfg": cfg})
    return cells


def print_plan(console, cells, candidates) -> None:
    """The plan of ``--dry_run``: a line per (state dtype, T, heads) group (its batches and
    candidates, the same for each batch), then each candidate left out of some group, once per
    reason, with the groups it concerns."""
    from tools.schedules import parse

    groups: Dict[tuple, List[dict]] = {}
    for c in cells:
        groups.setdefault(_group(c), []).append(c)
    left: Dict[tuple, List[tuple]] = {}
    for (sd, T, H), cs in groups.items():
        names = cs[0]["candidates"]
        console.print(f"{sd} T={T} H={H} R={','.join(str(c['R']) for c in cs)}: "
                      f"{len(names)} candidates: {', '.join(names)}")
        for name in candidates:
            if name not in names:
                try:
                    parse(name, cs[0]["cfg"])
                except ValueError as e:       # "Schedule <name> for <problem>: <reasons>"
                    left.setdefault((name, str(e).split(": ", 1)[-1]), []).append((sd, T, H))
    for (name, why), where in left.items():
        ts = sorted({T for _, T, _ in where})
        console.print(f"  left out {name} at T={','.join(map(str, ts))} ({len(where)} of "
                      f"{len(groups)} groups): {why}")
    console.print(f"{len(cells)} cells, {sum(len(c['candidates']) for c in cells)} "
                  "candidate timings")


def _builds(cells):
    """The (problem, schedule) pairs the cells' candidates run."""
    from kda.backends.cutedsl.problem import Problem
    from tools.schedules import parse

    return [(Problem.from_config(c["cfg"]), parse(n, c["cfg"])[1]) for c in cells
            for n in c["candidates"]]


def winner(times: Dict[str, float]) -> str:
    """The fastest candidate (ties: the first named)."""
    return min(times, key=times.get)


def _group(cell) -> tuple:
    """The (state dtype, T, heads) group of a cell or of a table row."""
    if isinstance(cell, dict):
        return cell["state"], cell["T"], cell["H"]
    return cell.state, cell.T, cell.heads


def whole_groups(planned: List[dict], done: List[dict]) -> List[dict]:
    """The measured cells ``done`` (a prefix of ``planned``: the sweep runs the plan in order
    and stops at its budget) of the groups whose every planned cell was measured."""
    left = {_group(c) for c in planned[len(done):]}
    return [c for c in done if _group(c) not in left]


def make_table(device: str, sms: int, source: str, cells: List[dict], meta: dict,
               previous=None):
    """The :class:`kda.backends.cutedsl.tables.Table` of measured ``cells`` (each with
    ``us``, ``touch_us`` and its ``schedule`` axes), with the rows of ``previous`` (the
    device's table before this run, same SM count) whose groups ``cells`` do not measure."""
    from kda.backends.cutedsl.tables import Row, Table

    rows = tuple(Row(state=c["state"], T=c["T"], heads=c["H"], items=c["items"],
                     axes=tuple(sorted(c["schedule"].items())),
                     times=tuple(sorted(c["us"].items())), touch_us=c["touch_us"])
                 for c in cells)
    meta = dict(meta)
    if previous is not None and previous.sms == sms:
        measured = {_group(c) for c in cells}
        kept = tuple(r for r in previous.rows if _group(r) not in measured)
        if kept:
            rows = tuple(sorted(kept + rows, key=lambda r: (r.state, r.T, r.heads, r.items)))
            meta["kept_rows"] = (f"{len(kept)} rows of groups this run did not measure, from "
                                 f"{previous.source} ({dict(previous.meta).get('commit', '?')})")
    return Table(device=device, sms=sms, source=source, rows=rows,
                 meta=tuple(sorted(meta.items())))


def iters_for(step_us: float, iters: int, sets: int, max_s: float) -> int:
    """Timed iterations for a step of about ``step_us``: ``iters``, fewer where those would
    take more than ``max_s`` seconds, never fewer than 3 replays of the ``sets`` steps."""
    fit = int(max_s / max(step_us, 1e-3) * 1e6)
    return max(3 * sets, min(iters, fit // sets * sets))


def _measure(make, wl, bw, iters, guess_us=None):
    """Step time (us) of ``make`` on ``wl``: ``iters`` iterations, or with a step time guessed
    (``guess_us``) as many as :func:`iters_for` allows."""
    from tools.bench import harness

    if guess_us is not None:
        iters = iters_for(guess_us, iters, FLAGS.sets, FLAGS.max_s)
    return harness.measure("x", make, wl, bw, iters, min(20, iters), "graph").time_us


def _sweep(cells, console, budget_s) -> List[dict]:
    """Time every cell (module docstring); returns the measured ones."""
    from kda.backends.cutedsl.backend import KdaBackend
    from tools.bench import harness
    from tools.schedules import parse

    device = torch.device("cuda", torch.cuda.current_device())
    bw = harness.copy_bandwidth(device)
    t0 = time.time()
    done = []
    launchers = {}
    for c in cells:
        if budget_s and time.time() - t0 > budget_s:
            console.print(f"budget of {budget_s:.0f} s spent: {len(cells) - len(done)} cells "
                          "left unmeasured")
            break
        cfg = c["cfg"]
        wl = harness.Workload(cfg, c["R"], device, FLAGS.pool_gib, FLAGS.sets)
        makes = {}
        for name in c["candidates"]:
            key = (name, cfg)
            if key not in launchers:
                launchers[key] = KdaBackend.launcher(parse(name, cfg)[1], cfg, device)
            makes[name] = lambda w, L=launchers[key]: (lambda i: L(w.args_for(i)))
        screen = {n: _measure(m, wl, bw, FLAGS.screen_iters) for n, m in makes.items()}
        us = dict(screen)
        final = []
        # the fastest at full length wins; a candidate whose screen beats it is timed at full
        # length too, until none does
        for n in sorted(screen, key=screen.get):
            if len(final) >= FLAGS.finalists and screen[n] >= min(us[f] for f in final):
                break
            us[n] = _measure(makes[n], wl, bw, FLAGS.iters, screen[n])
            final.append(n)
        guess = min(us[f] for f in final)
        touch = _measure(harness.peer_step("touch"), wl, bw, FLAGS.iters, guess)
        others = {b: _measure(harness.backend_step(b), wl, bw, FLAGS.iters, guess)
                  for b in FLAGS.other_backends}
        best = winner(us)
        out = {k: v for k, v in c.items() if k not in ("cfg", "candidates")}
        out.update(us={n: round(v, 3) for n, v in us.items()}, finalists=final, winner=best,
                   schedule=parse(best, cfg)[1].axes(), touch_us=round(touch, 3),
                   backends={b: round(v, 3) for b, v in others.items()})
        done.append(out)
        console.print(f"{c['state']} T={c['T']} H={c['H']} R={c['R']}: {best} "
                      f"{us[best]:.1f} us ({us[best] / touch:.3f} of touch {touch:.1f}); "
                      + ", ".join(f"{n} {us[n]:.1f}" for n in sorted(us, key=us.get)[1:4]))
        del wl
        torch.cuda.empty_cache()
    return done


def main(argv):
    del argv
    from kda.backends.cutedsl.problem import MAX_T
    from tools.progress import tool_console

    console = tool_console()
    heads = [int(h) for h in FLAGS.heads]
    tokens = [int(t) for t in FLAGS.tokens]
    batches = [int(b) for b in FLAGS.batches]
    state_dtypes = list(dict.fromkeys(FLAGS.state_dtype))
    candidates = FLAGS.candidates or list(DEFAULT_CANDIDATES)
    unknown = [n for n in candidates if n not in CANDIDATE_NAMES]
    if unknown:
        console.print(f"--candidates: expected names from {', '.join(CANDIDATE_NAMES)} "
                      f"(early-reading builds are not candidates: a table row holds a schedule's "
                      f"axes, which its flags follow), got {', '.join(unknown)}")
        return 2
    bad = [f"--{n}={v}" for n, vs in (("heads", heads), ("tokens", tokens), ("batches", batches),
                                      ("finalists", [FLAGS.finalists]),
                                      ("screen_iters", [FLAGS.screen_iters]),
                                      ("iters", [FLAGS.iters]), ("sets", [FLAGS.sets]))
           for v in vs if v < 1 or (n == "tokens" and v > MAX_T)]
    if bad:
        console.print(f"expected heads, batches, finalists, screen_iters, iters and sets >= 1 "
                      f"and tokens 1..{MAX_T}, got {', '.join(bad)}")
        return 2
    cells = plan(heads, tokens, batches, state_dtypes, candidates)
    if not cells:
        console.print("no cell has a candidate that serves it (--candidates, --tokens)")
        return 2
    if FLAGS.dry_run:
        print_plan(console, cells, candidates)
        return 0
    if not torch.cuda.is_available():
        console.print("tools/kda tune measures on a GPU: none here (--dry_run prints the plan)")
        return 2
    from kda.backends.cutedsl import cache, tables
    from kda.backends.cutedsl.backend import import_cutedsl, sm_count
    from tools.bench import harness

    why = import_cutedsl()
    if why:
        console.print(f"cutedsl cannot run here: {why}")
        return 2
    name = torch.cuda.get_device_name()
    sms = sm_count(torch.cuda.current_device())
    console.print(f"tuning cutedsl on {name} ({sms} SMs): {len(cells)} cells")
    t0 = time.time()
    builds = cache.precompile(_builds(cells), FLAGS.jobs or None)
    console.print(f"{len(builds)} kernels compiled or loaded in {time.time() - t0:.0f} s")
    done = _sweep(cells, console, FLAGS.budget_s)
    if not done:
        console.print("no cell was measured")
        return 1
    now = datetime.datetime.now(datetime.timezone.utc)
    gpu = tables.slug(name)
    meta = {"date": now.isoformat(timespec="seconds"), "commit": harness.git_commit(),
            "command": " ".join(["python3 -m tools.bench.tune"] + sys.argv[1:]),
            "torch": torch.__version__, "python": platform.python_version(),
            "pool_gib": FLAGS.pool_gib, "sets": FLAGS.sets, "iters": FLAGS.iters,
            "screen_iters": FLAGS.screen_iters, "gate": "softplus", "layout": "SD"}
    source = "(not written)"
    results_dir = user_path(FLAGS.results_dir)
    if results_dir:
        os.makedirs(results_dir, exist_ok=True)
        path = os.path.join(results_dir, f"tune-{gpu}.json")
        with open(path, "w") as f:
            json.dump({"meta": {**meta, "device": name, "sms": sms}, "cells": done}, f, indent=1)
        console.print(f"wrote {path}")
        source = _repo_relative(path)
    if FLAGS.source:
        source = FLAGS.source
    whole = whole_groups(cells, done)
    if len(whole) < len(done):
        console.print(f"{len(done) - len(whole)} cells of a group cut short by --budget_s stay "
                      "out of the table (the results file has them)")
    if not whole:
        console.print("no group was measured whole: no table written")
        return 1
    out = user_path(FLAGS.table) or table_path(name)
    previous = None
    if os.path.exists(out):
        try:
            with open(out) as f:
                previous = tables.Table.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as e:
            console.print(f"{out}: the previous table cannot be read ({e}); it is replaced")
    table = make_table(name, sms, source, whole, meta, previous)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    table.dump(out)
    kept = dict(table.meta).get("kept_rows")
    console.print(f"wrote {out} ({len(table.rows)} rows" + (f"; {kept}" if kept else "") + ")")
    return 0


#: The tree this file is in (under ``bazel run``: its runfiles tree).
_TREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _repo_root() -> str:
    """The source tree: the workspace ``bazel run`` was started in
    (``BUILD_WORKSPACE_DIRECTORY``), else the tree this file is in."""
    return os.environ.get("BUILD_WORKSPACE_DIRECTORY") or _TREE


def table_path(device_name: str) -> str:
    """Where the tuned table of ``device_name`` goes by default: the package's tables folder
    (:data:`kda.backends.cutedsl.tables.TABLE_DIR`) in the source tree, not in a ``bazel run``
    runfiles tree, where it would be lost."""
    from kda.backends.cutedsl import tables

    return tables.path_for(device_name, os.path.join(
        _repo_root(), os.path.relpath(tables.TABLE_DIR, _TREE)))


def _repo_relative(path: str) -> str:
    root = _repo_root()
    full = os.path.abspath(path)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else full



if __name__ == "__main__":
    define_flags()
    logging.set_verbosity(logging.WARNING)
    run(main)
