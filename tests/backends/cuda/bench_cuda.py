"""Times the ``cuda`` backend against the copy-bandwidth floor (run on the GPU machine).

    python3 tests/backends/cuda/bench_cuda.py [--H 32] [--R 1,8,32,128,512] [--T 1,2,5]
                                              [--pdl both|on|off] [--json out.json]

Method (docs of the device tool, METHOD.md): the copy bandwidth is measured in the same
process (a 2 GiB device-to-device copy, bytes read + written); the floor of a step is
``kda.testing.step_bytes(cfg, R)`` over it. Every request is live. The state pool holds
several disjoint slot sets (each with its own operands), together at least 4x the 60 MiB L2,
and one CUDA graph runs one step per set back to back; the time per step is the median graph
replay time over the number of sets. Prints one table row per (T, R): time, floor, floor/time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from kda.config import GATE_RANK, HEAD_DIM, KdaArgs, KdaConfig  # noqa: E402
from kda.testing import step_bytes  # noqa: E402

D = HEAD_DIM
L2_BYTES = 60 * 2 ** 20


def _median_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy, read + write counted."""
    n = 2 * 2 ** 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), reps=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def make_sets(cfg: KdaConfig, R: int, sets: int):
    """``sets`` KdaArgs over one state pool, on disjoint random slots, every request live."""
    H, T, L, dim = cfg.num_heads, cfg.T, cfg.window, cfg.dim
    dev = "cuda"
    slots = R * T * sets + 1
    state = torch.empty(slots, H, D, D, device=dev).normal_(0, 0.5)
    conv_state = torch.randn(slots, L, 3 * dim, device=dev).to(cfg.conv_state_dtype).transpose(1, 2) \
        if cfg.conv_layout == "SD" else torch.randn(slots, 3 * dim, L, device=dev).to(cfg.conv_state_dtype)
    perm = (torch.randperm(slots - 1, device=dev) + 1).to(torch.int32)
    conv_weight = (torch.randn(3, 4, dim, device=dev) * 0.5).to(cfg.conv_weight_dtype)
    conv_bias = torch.randn(3 * dim, device=dev) * 0.2 if cfg.has_conv_bias else None
    f_b = (torch.randn(dim, GATE_RANK, device=dev) / math.sqrt(GATE_RANK)).bfloat16()
    A_log = torch.log(torch.rand(H, device=dev) * 15 + 1)
    dt_bias = torch.randn(dim, device=dev) - 1.0
    norm_weight = (torch.randn(D, device=dev) * 0.1 + 1).to(cfg.norm_weight_dtype)
    out = []
    N = R * T
    for s in range(sets):
        idx = perm[s * R * T:(s + 1) * R * T].view(R, T).contiguous()
        state_indices = idx[:, 0].contiguous() if T == 1 else idx
        nacc = torch.randint(1, T + 1, (R,), device=dev, dtype=torch.int32) if T > 1 else None
        v_rec = kg_rec = None
        if cfg.record:
            v_rec = torch.empty(slots, H, T, D, device=dev)
            kg_rec = torch.empty(slots, H, T, 2 * D, device=dev, dtype=torch.bfloat16)
        out.append(KdaArgs(
            x=torch.randn(N, 3 * dim, device=dev).bfloat16(), conv_weight=conv_weight,
            conv_bias=conv_bias, conv_state=conv_state,
            f_a=torch.randn(N, GATE_RANK, device=dev).bfloat16(), f_b=f_b,
            beta=(torch.randn(N, H, device=dev) * 2).bfloat16(), A_log=A_log, dt_bias=dt_bias,
            state=state, state_indices=state_indices, num_accepted_tokens=nacc,
            output_gate=(torch.randn(N, dim, device=dev) * 2).bfloat16(), norm_weight=norm_weight,
            out=torch.empty(N, dim, device=dev, dtype=torch.bfloat16), v_record=v_rec,
            kg_record=kg_rec))
    return out


def time_step(cfg: KdaConfig, R: int, pdl: bool, reps: int = 20) -> float:
    """Median seconds per step."""
    from backends.cuda import BACKEND

    os.environ["KDA_CUDA_PDL"] = "1" if pdl else "0"
    step = BACKEND.build(cfg, torch.device("cuda"))
    per_set = R * cfg.num_heads * D * D * 4 * (1 + cfg.T)
    sets = max(2, math.ceil(4 * L2_BYTES / per_set))
    sets = min(sets, 64)
    arg_sets = make_sets(cfg, R, sets)
    for a in arg_sets:  # warm up (and build) outside the capture
        step(a)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for a in arg_sets:
            step(a)
    ms = _median_ms(g.replay, reps=reps)
    del g, arg_sets
    torch.cuda.empty_cache()
    return ms * 1e-3 / sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--R", default="1,8,32,128,512")
    ap.add_argument("--T", default="1,2,5")
    ap.add_argument("--pdl", default="on", choices=("on", "off", "both"))
    ap.add_argument("--layout", default="SD", choices=("SD", "DS"))
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    ap.add_argument("--profile", action="store_true",
                    help="only launch the first (T, R) a few times, no graph (for ncu)")
    a = ap.parse_args(argv)
    if a.profile:
        from backends.cuda import BACKEND
        T, R = int(a.T.split(",")[0]), int(a.R.split(",")[0])
        cfg = KdaConfig(num_heads=a.H, T=T, window=T + 2, conv_layout=a.layout)
        step = BACKEND.build(cfg, torch.device("cuda"))
        for args in make_sets(cfg, R, 4):
            step(args)
        torch.cuda.synchronize()
        return 0
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e12:.3f} TB/s")
    pdls = {"on": [True], "off": [False], "both": [True, False]}[a.pdl]
    rows = []
    for T in [int(t) for t in a.T.split(",")]:
        for R in [int(r) for r in a.R.split(",")]:
            cfg = KdaConfig(num_heads=a.H, T=T, window=T + 2, conv_layout=a.layout)
            floor = step_bytes(cfg, R) / bw
            for pdl in pdls:
                t = time_step(cfg, R, pdl)
                rows.append(dict(H=a.H, T=T, R=R, layout=a.layout, pdl=pdl, us=t * 1e6,
                                 floor_us=floor * 1e6, frac=floor / t, copy_tbps=bw / 1e12))
                print(f"H={a.H:3d} T={T} R={R:4d} {a.layout} pdl={int(pdl)}  {t * 1e6:9.1f} us  "
                      f"floor {floor * 1e6:9.1f} us  floor/time {floor / t:.3f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
