"""One-call GPU check of the CuTe DSL backends: correctness, then a short performance table.

Run on the H200 from the repository root (after CuTe DSL is installed there):

    python3 tests/backends/cutedsl/gpu_check.py            # tests + benchmark
    python3 tests/backends/cutedsl/gpu_check.py --no-tests # benchmark only
    python3 tests/backends/cutedsl/gpu_check.py --quick    # fewer cells

1. runs ``tests/backends/cutedsl/test_cutedsl_gpu.py`` (wide == stream bit for bit, grid sizes
   bit for bit, chained steps against the reference) with pytest;
2. times both kernels at H=32 on an 8 GiB state pool with rotating slot sets (CUDA-graph
   replays, median; ``tools.bench.harness`` semantics) against the copy-bandwidth floor, plus
   the host cost of one eager call and the compile / load time of every kernel.

Everything printed is also written to ``$OUT/cutedsl_gpu_check.txt`` when ``$OUT`` is set.
The last lines are the summary table.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, ROOT)

_log = io.StringIO()


def say(*a):
    """Print and log."""
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    _log.write(s + "\n")


def run_tests(extra):
    """Run test_cutedsl_gpu.py with pytest; return its exit code."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
           os.path.join(HERE, "test_cutedsl_gpu.py"), "--kda-require-backends", "-s"] + extra
    say("$", " ".join(cmd))
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    out = p.stdout + p.stderr
    _log.write(out)
    tail = "\n".join(out.strip().splitlines()[-40:])
    print(tail)
    say(f"pytest exit code {p.returncode} in {time.time() - t0:.0f} s")
    return p.returncode


def bench(quick: bool):
    """Time both kernels at H=32 against the copy-bandwidth floor; print the table."""
    import torch

    from kda.backends.cutedsl import cache
    from kda.config import KdaConfig
    from kda.registry import get_backend
    from tools.bench import harness

    dev = torch.device("cuda", torch.cuda.current_device())
    say(f"device: {torch.cuda.get_device_name(dev)}, SMs "
        f"{torch.cuda.get_device_properties(dev).multi_processor_count}")
    bw = harness.copy_bandwidth(dev)
    say(f"copy bandwidth: {bw / 1e12:.3f} TB/s (read + write)")
    H = 32
    cells = [(1, 1), (8, 1), (32, 1), (128, 1), (512, 1), (8, 2), (128, 2), (8, 5), (128, 5)]
    if quick:
        cells = [(1, 1), (128, 1), (512, 1), (128, 5)]
    rows = []
    for R, T in cells:
        cfg = KdaConfig(num_heads=H, T=T, window=T + 2)
        wl = harness.Workload(cfg, R, dev, pool_gib=8.0, sets=4)
        res = {}
        for name in ("cutedsl", "cutedsl_wide"):
            b = get_backend(name)
            why = b.availability() or "; ".join(b.unsupported(cfg, dev))
            if why:
                say(f"{name}: cannot run: {why}")
                continue
            try:
                fn = b.build(cfg, dev)
                if R == cells[0][0] and T == cells[0][1]:
                    say(f"  {name}: carveout hint applied: {getattr(fn, 'carveout_set', '?')}")
                make = lambda w, fn=fn: (lambda i: fn(w.args_for(i)))  # noqa: E731
                cell = harness.measure(name, make, wl, bw, iters=60 if R <= 32 else 30,
                                       warmup=5, mode="auto")
            except Exception as e:  # noqa: BLE001 - report and go on with the other cells
                say(f"  {name} H{H} R{R} T{T}: FAILED {type(e).__name__}: {e}")
                torch.cuda.synchronize()
                continue
            res[name] = cell
            say(f"  {name:13s} H{H} R{R:<4d} T{T}: {cell.time_us:9.1f} us  floor "
                f"{cell.floor_us:8.1f} us  frac {cell.frac:5.3f}  ({cell.mode})")
        rows.append((R, T, res))
        del wl
        torch.cuda.empty_cache()

    # host cost of an eager call (R=1, T=1): CPU time per call, GPU not the limit
    cfg = KdaConfig(num_heads=H, T=1, window=3)
    wl = harness.Workload(cfg, 1, dev, pool_gib=1.0, sets=2)
    host = {}
    for name in ("cutedsl", "cutedsl_wide"):
        fn = get_backend(name).build(cfg, dev)
        args = wl.args_for(0)
        for _ in range(20):
            fn(args)
        torch.cuda.synchronize()
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            fn(args)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host[name] = (t1 - t0) / n * 1e6
        say(f"  {name}: eager host time per call {host[name]:.2f} us")
    del wl

    say("compile / load times:")
    for rec in cache.COMPILE_LOG:
        say(f"  {rec.kind:6s} {rec.tag:52s} {rec.source:8s} {rec.seconds:6.2f} s")

    say("")
    say("SUMMARY (H=32; time us / fraction of the copy-bandwidth floor; graph replays)")
    say(f"{'R':>4s} {'T':>2s} | {'stream us':>10s} {'frac':>6s} | {'wide us':>10s} {'frac':>6s} | "
        f"{'wide/stream':>11s}")
    for R, T, res in rows:
        s, w = res.get("cutedsl"), res.get("cutedsl_wide")
        sp = f"{w.time_us / s.time_us:11.2f}" if s and w else f"{'-':>11s}"
        say(f"{R:4d} {T:2d} | " + (f"{s.time_us:10.1f} {s.frac:6.3f}" if s else f"{'-':>17s}")
            + " | " + (f"{w.time_us:10.1f} {w.frac:6.3f}" if w else f"{'-':>17s}") + f" | {sp}")
    say("targets: stream frac >= 0.90 at R=128/512 T=1, >= 0.85 at R=128 T=5; "
        "wide/stream >= 1.2 at R=128 T=5; R=1 T=1 graph replay < 6 us")
    say("eager host us/call: " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))


def main():
    """Command line entry point."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args()
    rc = 0
    try:
        if not a.no_tests:
            rc = run_tests(a.pytest_args)
        if not a.no_bench:
            bench(a.quick)
    finally:
        out = os.environ.get("OUT")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "cutedsl_gpu_check.txt"), "w") as f:
                f.write(_log.getvalue())
    sys.exit(rc)


if __name__ == "__main__":
    main()
