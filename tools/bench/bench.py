"""Benchmark the fused KDA decode step: our backends and the fla-core peers in one run.

    tools/kda bench <reference|triton|cutedsl|cutedsl_wide|cuda|all> [flags]

Every ``//tools/bench`` target is this program with ``--backends`` preset (``tools/kda
bench <backend>`` runs the target of that name):

    tools/kda bench cutedsl --heads=32 --batches=1,8,32,128,512 --tokens=1,2,5
    tools/kda bench all                            # every available backend + the peers
    python3 -m tools.bench.bench --backends=all --out_dir=docs/results/h200   # GPU machine

Per cell: median time, the copy-bandwidth floor (bytes the step must move / copy bandwidth
measured in the same run) and floor/time, side by side for every backend and peer. Each cell
is printed as it finishes; at the end a table, and ``bench-<tag>.json`` plus
``bench-<tag>.png`` (fraction of floor vs R, one panel per T) in ``--out_dir``. Ctrl-C stops
the run and prints the table of the cells that finished (nothing is written).

The grid: ``--heads`` x ``--tokens`` x ``--batches`` x ``--state_dtype`` (each cell names its
state dtype in the JSON's ``state_dtype``, fp32 when absent in older runs; a bf16 cell's floor
counts 32 KiB pages), beside every peer that runs here. Without ``--heads``, ``--tokens`` and
``--batches`` a GPU measures the grid of the reference runs and a CPU a small one (each
flag's help says both); ``--state_dtype`` is fp32 unless given. See :mod:`tools.bench.harness`
for the method.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from typing import List

import torch
from absl import app, flags, logging

from kda import registry
from kda.config import KdaConfig
from tools import flags as _shared_flags  # noqa: F401  (defines --gate_mode)
from tools.flags import STATE_DTYPES, quiet_third_party_warnings, run, user_path
from tools.bench import harness, peers, plot

FLAGS = flags.FLAGS

#: The flags left unset, on a GPU and on a CPU: the GPU grid is that of the reference runs
#: (docs/results); the CPU's is small, since there the reference backend takes 0.7 s a step
#: at H=32, R=8 (2.4 s beside a test run; a 2-core machine), and the timings are wall clock
#: anyway.
DEFAULTS = {
    "gpu": {"heads": [12, 32, 96], "tokens": [1, 4], "batches": [1, 8, 32, 128, 512],
            "iters": 200, "warmup": 20, "pool_gib": 8.0},
    "cpu": {"heads": [32], "tokens": [1], "batches": [1, 8],
            "iters": 5, "warmup": 1, "pool_gib": 0.5},
}


def _defaults(name: str) -> str:
    """The help's "(default GPU: ...; CPU: ...)" of flag ``name``, from :data:`DEFAULTS`."""
    gpu, cpu = (",".join(map(str, v)) if isinstance(v, list) else str(v)
                for v in (DEFAULTS["gpu"][name], DEFAULTS["cpu"][name]))
    return f"(default GPU: {gpu}; CPU: {cpu})"


flags.DEFINE_list("backends", ["all"], "backends to measure (names, or 'all' = every available one)")
flags.DEFINE_list("peers", ["auto"], "peers: fla_recurrent, fla_unfused, touch, touch_rows32, touch_ring, "
                  "'auto' (all that run here) or 'none'")
flags.DEFINE_list("heads", None, "H values (Kimi-Linear TP1..8: 32,16,8,4; K3-style: 12,24,48,96) "
                  + _defaults("heads"))
flags.DEFINE_list("batches", None, "R values " + _defaults("batches"))
flags.DEFINE_list("tokens", None, "T values " + _defaults("tokens"))
flags.DEFINE_enum("gate", "softplus", ["softplus", "bounded"], "gate kind (bounded: lower_bound -5)")
flags.DEFINE_enum("layout", "SD", ["SD", "DS"], "conv cache layout")
flags.DEFINE_float("pool_gib", None, "state pool size in GiB " + _defaults("pool_gib"))
flags.DEFINE_integer("sets", 8, "rotating slot sets")
flags.DEFINE_integer("iters", None, "timed iterations per cell " + _defaults("iters"))
flags.DEFINE_integer("warmup", None, "warm-up iterations " + _defaults("warmup"))
flags.DEFINE_enum("mode", "auto", ["auto", "graph", "eager"], "GPU timing: CUDA-graph replay or eager")
flags.DEFINE_string("out_dir", "", "where to write JSON and PNG (default: print only)")
flags.DEFINE_string("tag", "", "file name tag: bench-<tag>.json (default: the device's name and "
                    "the UTC date and time, e.g. h200-20261201-172943, so a rerun never "
                    "overwrites an earlier file)")
flags.DEFINE_float("max_items", 20000, "skip cells with more R*H items than this on the CPU")
flags.DEFINE_bool("hot_state", False, "every request of a step on one state slot (pages stay in "
                  "L2): times the kernels' compute / latency bound; 'frac' then compares with "
                  "the HBM floor and can exceed 1")
flags.DEFINE_bool("plot", True, "also write the PNG (needs matplotlib; else: python3 -m tools.bench.plot)")


def _all_positive(values) -> bool:
    try:
        return len(values) > 0 and all(int(v) >= 1 for v in values)
    except (TypeError, ValueError):
        return False


for _name in ("heads", "batches", "tokens"):
    flags.register_validator(_name, lambda v: v is None or _all_positive(v),
                             message=f"--{_name} takes a non-empty list of integers >= 1")
flags.register_validator(
    "backends", lambda v: v == ["all"] or all(n in registry.BACKEND_NAMES for n in v),
    message="--backends takes 'all' or names from: " + ", ".join(registry.BACKEND_NAMES))
flags.register_validator(
    "peers", lambda v: v in (["auto"], ["none"]) or all(n in peers.PEERS for n in v),
    message="--peers takes 'auto', 'none' or names from: " + ", ".join(peers.PEERS))
flags.register_validator("pool_gib", lambda v: v is None or v > 0, message="--pool_gib must be > 0")
for _name, _least in (("sets", 1), ("iters", 1), ("warmup", 0)):
    flags.register_validator(_name, lambda v, _l=_least: v is None or v >= _l,
                             message=f"--{_name} must be >= {_least}")
flags.register_validator("max_items", lambda v: v >= 1, message="--max_items must be >= 1")


def default_tag(device_name: str, now: datetime.datetime) -> str:
    """``--tag``'s default: the device's name ("h200" for an H200, else the name with
    underscores for blanks) and the UTC date and time to the second."""
    name = "h200" if "H200" in device_name else device_name.replace(" ", "_")
    return f"{name}-{now:%Y%m%d-%H%M%S}"


def _time_cell(c: harness.Cell) -> str:
    """A measured cell as the table and the per-cell lines show it: median us (fraction of
    the floor)."""
    return f"{c.time_us:.1f} ({c.frac:.2f})"


def _cell_line(row: List[harness.Cell]) -> str:
    """The line printed when a cell (one H, T, R, state dtype) has finished: its floor and
    every backend's and peer's time."""
    c = row[0]
    return (f"H={c.H} T={c.T} R={c.R} {c.state_dtype}: floor {c.floor_us:.1f} us | "
            + ", ".join(f"{m.backend} {_time_cell(m)}" for m in row))


#: Exit status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


def main(argv):
    del argv
    from rich.markup import escape
    from rich.table import Table

    from tools.progress import ToolProgress, tool_console

    console = tool_console()
    quiet_third_party_warnings(FLAGS.verbosity)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if FLAGS.device == "auto" else FLAGS.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench: error: --device=cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    out_dir = user_path(FLAGS.out_dir)
    made = bool(out_dir) and not os.path.exists(out_dir)
    if out_dir:                 # before the measurements: a bad path would lose them
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            print(f"bench: error: --out_dir={FLAGS.out_dir}: {e.strerror}", file=sys.stderr)
            return 2
    gpu = device.type == "cuda"
    if not gpu:
        console.print("[bold yellow]No CUDA device: these are CPU wall-clock timings, NOT GPU timings.[/]")
    unset = DEFAULTS["gpu" if gpu else "cpu"]

    def flag(name):
        value = getattr(FLAGS, name)
        return unset[name] if value is None else value

    names = registry.BACKEND_NAMES if FLAGS.backends == ["all"] else FLAGS.backends
    want_peers = list(peers.PEERS) if FLAGS.peers == ["auto"] else \
        [] if FLAGS.peers == ["none"] else FLAGS.peers
    for p in list(want_peers):
        why = peers.available(p, device)
        if why:
            console.print(f"[dim]{p}: skipped ({why})[/]")
            want_peers.remove(p)
    heads = [int(h) for h in flag("heads")]
    batches = [int(b) for b in flag("batches")]
    tokens = [int(t) for t in flag("tokens")]
    iters, warmup, pool = flag("iters"), flag("warmup"), flag("pool_gib")
    copy_bw = harness.copy_bandwidth(device, 2.0 if gpu else 0.25)
    dev_name = torch.cuda.get_device_name() if gpu else platform.processor() or "cpu"
    console.print(f"device: {dev_name}; copy bandwidth {copy_bw / 1e12:.3f} TB/s (read+write); "
                  f"state pool {pool} GiB, {FLAGS.sets} rotating slot sets, {iters} iterations")

    runners = []
    for n in names:
        why = registry.availability(n)
        if why:
            console.print(f"[dim]{n}: skipped ({why})[/]")
            continue
        runners.append((n, harness.backend_step(n)))
    runners += [(p, harness.peer_step(p)) for p in want_peers]

    cells: List[harness.Cell] = []
    failed: List[str] = []
    grid = [(H, T, R, sd) for H in heads for T in tokens for R in batches
            for sd in FLAGS.state_dtype]
    interrupted, done = False, 0
    with ToolProgress("cells", console) as bar:
        task = bar.add_task("cells", total=len(grid))
        try:
            for done, (H, T, R, sd) in enumerate(grid):
                bar.update(task, completed=done, info=f"H={H} T={T} R={R} {sd}")
                if not gpu and R * H > FLAGS.max_items:
                    console.print(f"[dim]H={H} T={T} R={R}: skipped on the CPU (R*H = {R * H} > "
                                  f"--max_items={FLAGS.max_items:g})[/]")
                    continue
                cfg = KdaConfig(num_heads=H, T=T, window=T + 2, conv_layout=FLAGS.layout,
                                lower_bound=-5.0 if FLAGS.gate == "bounded" else None,
                                gate_mode=FLAGS.gate_mode, state_dtype=STATE_DTYPES[sd])
                wl = harness.Workload(cfg, R, device, pool, FLAGS.sets, hot=FLAGS.hot_state)
                row = []
                for name, make in runners:
                    why = registry.unsupported_reasons(name, cfg, device) if name in registry.BACKEND_NAMES else []
                    if not why and sd != "fp32" and name in peers.PEERS and not name.startswith("touch"):
                        why = ["the peer keeps an fp32 state"]
                    if why:
                        logging.info("%s cannot run %s: %s", name, cfg.short(), why)
                        continue
                    if name.startswith("triton") and not gpu and R * H > 8:
                        console.print(f"[dim]{escape(name)} H={H} T={T} R={R}: skipped (Triton's CPU "
                                      "interpreter runs R*H <= 8 only)[/]")
                        continue
                    try:
                        row.append(harness.measure(name, make, wl, copy_bw, iters, warmup, FLAGS.mode))
                    except Exception as e:  # noqa: BLE001 - one failing cell must not hide the others
                        failed.append(f"{name} H={H} T={T} R={R}")
                        console.print(f"[red]{escape(name)} H={H} T={T} R={R} failed: "
                                      f"{type(e).__name__}: {escape(str(e))}[/]")
                        continue
                    cells.append(row[-1])      # in the table if Ctrl-C comes before the row ends
                if row:
                    console.print(escape(_cell_line(row)))
                del wl
                if gpu:
                    torch.cuda.empty_cache()
        except KeyboardInterrupt:
            interrupted = True
        else:
            bar.update(task, completed=len(grid), info="")

    if interrupted:
        console.print(f"[bold yellow]interrupted[/] (Ctrl-C) after {done} of {len(grid)} cells: "
                      + ("the table of what finished; nothing written" if cells
                         else "nothing had finished"))
        if not cells:
            return INTERRUPTED
    elif not cells:
        console.print("[bold red]no cell was measured[/] (no selected backend can run here, or every "
                      "cell failed: see above)")
        return 1
    order = list(dict.fromkeys(c.backend for c in cells))
    tab = Table(title=f"fused KDA decode step, {dev_name}, H={','.join(map(str, heads))}, "
                      f"{FLAGS.gate} gate, {FLAGS.layout}: median us (fraction of copy-bandwidth floor)"
                      + ("  [--hot_state: state in L2, not an HBM measurement]" if FLAGS.hot_state else "")
                      + ("" if gpu else "  [CPU wall clock, not GPU timings]"))
    tab.add_column("H")
    tab.add_column("T")
    tab.add_column("R")
    tab.add_column("state")
    tab.add_column("floor us", justify="right")
    for n in order:
        tab.add_column(escape(n), justify="right")
    keys = list(dict.fromkeys((c.H, c.T, c.R, c.state_dtype) for c in cells))
    for key in keys:
        row = {c.backend: c for c in cells if (c.H, c.T, c.R, c.state_dtype) == key}
        floor = next(iter(row.values())).floor_us
        tab.add_row(str(key[0]), str(key[1]), str(key[2]), key[3], f"{floor:.1f}",
                    *[_time_cell(row[n]) if n in row else "-" for n in order])
    console.print(tab)
    if interrupted:
        if made:                # nothing written: the folder made for the results goes too
            os.rmdir(out_dir)
        return INTERRUPTED

    if out_dir:
        now = datetime.datetime.now(datetime.timezone.utc)
        tag = FLAGS.tag or default_tag(dev_name, now)
        meta = {
            "date": now.isoformat(timespec="seconds"),
            "device": dev_name, "gpu": gpu, "commit": harness.git_commit(),
            "command": " ".join(["python3 -m tools.bench.bench"] + sys.argv[1:]),
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith("KDA_") or k == "TRITON_INTERPRET"},
            "copy_bandwidth_Bps": copy_bw,
            "torch": torch.__version__, "python": platform.python_version(),
            "pool_gib": pool, "sets": FLAGS.sets, "iters": iters, "gate": FLAGS.gate,
            "layout": FLAGS.layout, "gate_mode": FLAGS.gate_mode, "hot_state": FLAGS.hot_state,
            "timing": ("median over CUDA-event timed replays of one CUDA graph of `sets` steps "
                       "(one per slot set), divided by `sets`") if gpu else "CPU wall clock",
        }
        path = os.path.join(out_dir, f"bench-{tag}.json")
        with open(path, "w") as f:
            json.dump({"meta": meta, "cells": [c.__dict__ for c in cells]}, f, indent=1)
        console.print(f"wrote {path}")
        if FLAGS.plot:
            console.print(f"wrote {plot.plot_json(path)}")
    if failed:
        console.print(f"[bold red]{len(failed)} cell(s) failed[/] (exit status 1): "
                      + escape(", ".join(failed)))
        return 1
    return 0


if __name__ == "__main__":
    run(main)
