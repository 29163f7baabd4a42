"""Where a ``cuda`` step's time goes: per-CTA timestamps from the kernel's trace build.

Builds the CUDA extension with ``KDA_CUDA_TRACE=1`` (its own cache directory; the kernel's
thread 0 then writes globaltimer / clock64 stamps at entry, after griddepcontrol.wait, at the
item loop's start, at eight points of each of a CTA's first 63 items and at exit, see
``kda_decode.cu``; that build spills 8 bytes at T = 2..6, the production build none), runs
``--steps`` steps back to back on the benchmark's workload (queued behind a sleep kernel, so
the device runs them without host gaps, PDL as configured), and prints per step and over
the steps after the first: the kernel's span, the gap after its predecessor, how far CTAs
start and end apart, and the median phase times of an item. The ``KDA_CUDA_*`` knobs of
``backends/cuda/backend.py`` apply as in any run.

    python3 -m tools.bench.cuda_trace --batches=32,128 --tokens=1,5 --out_dir=/tmp/trace

(The benchmark's flags: ``--heads`` (default 32), ``--batches`` (here default 32,128,512),
``--tokens`` (1,2,5), ``--pool_gib`` (here default 8), ``--out_dir``, ``--tag``; and
``--trace_steps``.)

Writes ``trace-[<tag>-]R<R>-T<T>.npz`` (the stamps, :func:`compact` form) to
``--out_dir`` if given. Needs an sm_90 GPU and nvcc.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import List

from absl import app, flags

from tools.bench import bench  # noqa: F401  (--batches, --tokens, --heads, --pool_gib, --out_dir, --tag)

FLAGS = flags.FLAGS
flags.DEFINE_integer("trace_steps", 8, "cuda_trace: steps traced back to back (one slot set each)")

#: cuda_trace's defaults where the benchmark's flags have none
DEFAULT_BATCHES, DEFAULT_POOL_GIB = ["32", "128", "512"], 8.0

# KDA_TRACE_CTAS, KDA_TRACE_STRIDE (kda_decode.h) and kTracePoints (kda_decode.cu); item n's
# points are columns 8 + POINTS * n + k, k in POINT_NAMES order
CTAS, STRIDE = 1024, 512
POINT_NAMES = ("top", "B1", "conv", "B2", "B3", "rec", "B4", "end")
POINTS = len(POINT_NAMES)
ITEMS = (STRIDE - 8) // POINTS
#: per-item phases reported, between consecutive points: (column title, from, to)
PHASES = tuple((f"{a}>{b}", k, k + 1) for k, (a, b) in enumerate(zip(POINT_NAMES, POINT_NAMES[1:])))


def _med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def compact(tr):
    """The stamps [steps, CTAs, STRIDE] as int32 [steps, CTAs that ran, columns used]:
    globaltimer columns relative to the first step's first entry (+1 ns), clock64 columns relative to the
    CTA's own entry clock (``analyse`` reads either form)."""
    import numpy as np

    ctas = int((tr[:, :, 1] != 0).sum(axis=1).max())
    used = min(STRIDE, 8 + POINTS * int(min(ITEMS, tr[:, :, 7].max())))
    t = tr[:, :ctas, :used].astype(np.int64)
    first = np.where(t[:, :, 1] != 0, t[:, :, 0], np.iinfo(np.int64).max).min()
    out = t.copy()
    for j in (0, 1):
        out[:, :, j] = np.where(t[:, :, 1] != 0, t[:, :, j] - first + 1, 0)
    for j in [3, 4, 5, 6] + list(range(8, used)):
        out[:, :, j] = np.where(t[:, :, j] != 0, t[:, :, j] - t[:, :, 3], 0)
    return out.astype(np.int32)


def analyse(tr) -> List[dict]:
    """Per step: phase figures in microseconds from the stamps ``tr`` [steps, CTAs, STRIDE]."""
    rows = []
    prev_end = None
    for k in range(tr.shape[0]):
        s = tr[k]
        live = [b for b in range(s.shape[0]) if s[b, 1] != 0]
        ent = {b: int(s[b, 0]) for b in live}
        ext = {b: int(s[b, 1]) for b in live}
        t0, t1 = min(ent.values()), max(ext.values())
        ghz = {b: (int(s[b, 6]) - int(s[b, 3])) / max(1, ext[b] - ent[b]) for b in live}

        def us(b, c0, c1):
            return (int(s[b, c1]) - int(s[b, c0])) / ghz[b] / 1e3

        def at(b, c):  # microseconds from the kernel's first CTA entry to clock column c
            return (ent[b] - t0) / 1e3 + us(b, 3, c)

        phase = {name: [] for name, _, _ in PHASES}
        gap, first_b2, last_end = [], [], []
        for b in live:
            n_it = min(int(s[b, 7]), ITEMS)
            if n_it <= 0:
                continue
            first_b2.append(at(b, 8 + 3))
            if int(s[b, 7]) <= ITEMS:   # (a CTA past ITEMS items has no stamp of its last)
                last_end.append(at(b, 8 + POINTS * (n_it - 1) + 7))
            for n in range(n_it):
                c = 8 + POINTS * n
                for name, k0, k1 in PHASES:   # (dead items skip the live-only points)
                    if s[b, c + k0] != 0 and s[b, c + k1] != 0:
                        phase[name].append(us(b, c + k0, c + k1))
                if n + 1 < n_it:
                    gap.append(us(b, c + 7, c + POINTS))  # end -> next top: operands wait
        rows.append(dict(
            step=k, ctas=len(live), span=(t1 - t0) / 1e3,
            after_prev=(t0 - prev_end) / 1e3 if prev_end is not None else float("nan"),
            entry_spread=(max(ent.values()) - t0) / 1e3,
            wait=_med([us(b, 3, 4) for b in live]), prologue=_med([us(b, 4, 5) for b in live]),
            first_page=_med(first_b2), first_page_max=max(first_b2) if first_b2 else float("nan"),
            **{name: _med(v) for name, v in phase.items()},
            item_next=_med(gap), items=_med([float(s[b, 7]) for b in live]),
            last_end_min=min(last_end) if last_end else float("nan"), last_end_med=_med(last_end),
            exit_min=(min(ext.values()) - t0) / 1e3, exit_max=(t1 - t0) / 1e3,
            ghz=_med(list(ghz.values()))))
        prev_end = t1
    return rows


COLS = [("span", "span"), ("after_prev", "gap"), ("entry_spread", "entries"), ("wait", "wait"),
        ("prologue", "prolog"), ("first_page", "page0"), ("first_page_max", "page0max")]
COLS += [(name, name) for name, _, _ in PHASES]
COLS += [("item_next", "end>top"), ("items", "items"), ("last_end_min", "lastmin"),
        ("last_end_med", "lastmed"), ("exit_min", "exitmin"), ("exit_max", "exitmax"),
        ("ghz", "GHz")]


def main(argv):
    del argv
    os.environ["KDA_CUDA_TRACE"] = "1"
    import numpy as np
    import torch

    from kda.backends.cuda.backend import BACKEND
    from kda.config import KdaConfig
    from tools.bench.harness import Workload

    dev = torch.device("cuda")
    steps = FLAGS.trace_steps
    pool_gib = FLAGS.pool_gib if FLAGS.pool_gib is not None else DEFAULT_POOL_GIB
    print("knobs:", {k: v for k, v in sorted(os.environ.items()) if k.startswith("KDA_CUDA_")})
    for H, T, R in [(int(h), int(t), int(r)) for h in FLAGS.heads for t in FLAGS.tokens
                    for r in (FLAGS.batches or DEFAULT_BATCHES)]:
        cfg = KdaConfig(num_heads=H, T=T, window=T + 2)
        wl = Workload(cfg, R, dev, pool_gib, sets=steps)
        step = BACKEND.build(cfg, dev)
        tr = torch.zeros(steps, CTAS, STRIDE, dtype=torch.int64, device=dev)
        for i in range(2 * steps):     # warm up (and build) without the trace
            step(wl.args_for(i % steps))
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)       # the host queues every step meanwhile
        for i in range(steps):
            step.trace = tr[i]
            step(wl.args_for(i))
        step.trace = None
        torch.cuda.synchronize()
        t = tr.cpu().numpy()
        rows = analyse(t)
        print(f"\n== H={H} R={R} T={T}: microseconds (phase figures are medians "
              f"over CTAs and items)")
        print(f"{'step':>5s} " + " ".join(f"{h:>8s}" for _, h in COLS))
        for r in rows:
            print(f"{r['step']:5d} " + " ".join(f"{r[c]:8.2f}" for c, _ in COLS))
        steady = rows[1:]
        print("  med " + " ".join(f"{_med([r[c] for r in steady]):8.2f}" for c, _ in COLS))
        if FLAGS.out_dir:
            os.makedirs(FLAGS.out_dir, exist_ok=True)
            name = f"trace-{FLAGS.tag + '-' if FLAGS.tag else ''}{'' if H == 32 else f'H{H}-'}R{R}-T{T}.npz"
            np.savez_compressed(os.path.join(FLAGS.out_dir, name), stamps=compact(t))
        del wl
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
