"""The benchmark harness every ``//tools/bench`` target uses.

What one cell measures: one decode step of H heads x R requests x T tokens, all live, on a
state pool much larger than the L2 (``pool_gib``, default 8 GiB on a GPU) with ``sets``
rotating random slot sets, so every timed step reads its pages from HBM. GPU timings are the
median over CUDA-event timed replays of one CUDA graph that runs one step per slot set back
to back, divided by the number of steps (eager launches if capture fails, recorded as such);
the copy bandwidth is measured in the same process (a device-to-device copy of
``copy_gib``, bytes read + written), and the floor of a cell is
``kda.testing.step_bytes / copy bandwidth``. On the CPU the cells are wall-clock medians and
say so: they are not GPU timings.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import time
from typing import Callable, List

import torch

from kda.config import GATE_RANK, HEAD_DIM as D
from kda.config import KdaArgs, KdaConfig
from kda.testing import step_bytes


@dataclasses.dataclass
class Cell:
    """One measured (backend, H, R, T) cell."""

    backend: str
    H: int
    R: int
    T: int
    gate: str
    layout: str
    time_us: float
    floor_us: float
    frac: float
    bytes: int
    mode: str
    iters: int
    note: str = ""
    state_dtype: str = "fp32"


def copy_bandwidth(device: torch.device, gib: float = 2.0, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of ``iters``."""
    n = int(gib * (1 << 30)) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            e.synchronize()
            t = s.elapsed_time(e) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            t = time.perf_counter() - t0
        if i >= 3:
            times.append(t)
    return 2 * n * 4 / statistics.median(times)


class Workload:
    """A state pool, its conv cache, random operands and ``sets`` rotating slot sets.

    ``hot``: every request of a set names the same slot (set i: slot i + 1), so a step's
    state traffic stays in L2: the time is the kernel's compute / latency bound, not HBM's
    (the requests race on their shared pages; the results are not meaningful, the timing is).

    Attributes:
      cfg, R: the configuration and batch.
      args: KdaArgs whose state_indices / num_accepted_tokens are those of set 0.
      indices, accepted: per set, the slot ids [R] or [R, T] and accepted counts [R] (T>1).
    """

    def __init__(self, cfg: KdaConfig, R: int, device: torch.device, pool_gib: float,
                 sets: int, seed: int = 0, hot: bool = False):
        self.cfg, self.R, self.device = cfg, R, device
        H, T, dim, L = cfg.num_heads, cfg.T, cfg.dim, cfg.window
        g = torch.Generator().manual_seed(seed)
        per_set = R * T
        page = D * D * torch.empty((), dtype=cfg.state_dtype).element_size()
        slots = max(per_set + 1, int(pool_gib * (1 << 30)) // (H * page))
        self.slots = slots
        state = torch.empty(slots, H, D, D, dtype=cfg.state_dtype, device=device)
        state.normal_(0, 0.5, generator=None)
        if cfg.conv_layout == "SD":
            conv_state = torch.randn(slots, L, 3 * dim, device=device).to(cfg.conv_state_dtype).transpose(1, 2)
        else:
            conv_state = torch.randn(slots, 3 * dim, L, device=device).to(cfg.conv_state_dtype)
        N = R * T

        def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

        self.indices, self.accepted = [], []
        for i in range(sets):
            ids = (torch.randperm(slots - 1, generator=g)[:per_set] + 1).to(torch.int32)
            if hot:      # every request of set i on slot i + 1: H pages, resident in L2
                ids = torch.full_like(ids, i + 1)
            self.indices.append((ids if T == 1 else ids.view(R, T)).contiguous().to(device))
            self.accepted.append(torch.randint(1, T + 1, (R,), generator=g, dtype=torch.int32).to(device)
                                 if T > 1 else None)
        self.args = KdaArgs(
            x=rnd(N, 3 * dim), conv_weight=rnd(3, 4, dim, dtype=cfg.conv_weight_dtype, scale=0.5),
            conv_bias=rnd(3 * dim, dtype=torch.float32, scale=0.1) if cfg.has_conv_bias else None,
            conv_state=conv_state, f_a=rnd(N, GATE_RANK), f_b=rnd(dim, GATE_RANK, scale=GATE_RANK ** -0.5),
            beta=rnd(N, H), A_log=torch.log(torch.rand(H, generator=g) * 15 + 1).to(device),
            dt_bias=rnd(dim, dtype=torch.float32), state=state, state_indices=self.indices[0],
            num_accepted_tokens=self.accepted[0], output_gate=rnd(N, dim),
            norm_weight=rnd(D, dtype=cfg.norm_weight_dtype, scale=0.1) + 1,
            out=torch.empty(N, dim, dtype=torch.bfloat16, device=device),
            v_record=torch.empty(slots, H, T, D, device=device) if cfg.record else None,
            kg_record=torch.empty(slots, H, T, 2 * D, dtype=torch.bfloat16, device=device) if cfg.record else None)

    def args_for(self, i: int) -> KdaArgs:
        return self.args._replace(state_indices=self.indices[i], num_accepted_tokens=self.accepted[i])


def _median_time(fns: List[Callable[[], None]], device: torch.device, iters: int, warmup: int,
                 mode: str):
    """(median seconds, mode used) of calling fns round-robin; mode graph|eager on CUDA."""
    K = len(fns)
    for i in range(warmup):
        fns[i % K]()
    if device.type != "cuda":
        ts = []
        for i in range(iters):
            t0 = time.perf_counter()
            fns[i % K]()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts), "cpu-wall"
    torch.cuda.synchronize()
    # One timed unit = the K steps (one per slot set) back to back. In graph mode they are
    # captured into ONE graph, as a server captures a whole decode step: the launch gaps
    # between kernels are the device's, not the host's. Before the timed loop the stream is
    # held by a sleep kernel so that the host queues every unit ahead of the device and no
    # event brackets host time (with one event pair per single-kernel replay, the host's
    # replay cost, ~16 us, was measured instead of small kernels).
    def chain():
        for f in fns:
            f()
    runner = chain
    used = "eager"
    if mode in ("graph", "auto"):
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                chain()                # warm up on the side stream before capture
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                chain()
            runner = gr.replay
            used = f"graph of {K} steps"
        except Exception as e:  # noqa: BLE001 - fall back to eager, record why
            if mode == "graph":
                raise
            used = f"eager (graph capture failed: {type(e).__name__})"
            torch.cuda.synchronize()
    units = max(1, iters // K)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(units)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(units)]
    runner()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)      # ~25 ms at ~2 GHz: the host queues the units meanwhile
    for i in range(units):
        starts[i].record()
        runner()
        ends[i].record()
    torch.cuda.synchronize()
    ts = [s.elapsed_time(e) / 1e3 / K for s, e in zip(starts, ends)]
    return statistics.median(ts), used


def measure(name: str, make_step: Callable[[Workload], Callable[[int], None]], wl: Workload,
            copy_bw: float, iters: int, warmup: int, mode: str) -> Cell:
    """Time ``make_step(wl)(set_index)`` over the workload's rotating sets."""
    step = make_step(wl)
    fns = [(lambda i=i: step(i)) for i in range(len(wl.indices))]
    t, used = _median_time(fns, wl.device, iters, warmup, mode)
    nbytes = step_bytes(wl.cfg, wl.R)
    floor = nbytes / copy_bw
    return Cell(backend=name, H=wl.cfg.num_heads, R=wl.R, T=wl.cfg.T, gate=wl.cfg.gate,
                state_dtype="bf16" if wl.cfg.state_dtype == torch.bfloat16 else "fp32",
                layout=wl.cfg.conv_layout, time_us=t * 1e6, floor_us=floor * 1e6,
                frac=floor / t, bytes=nbytes, mode=used, iters=iters)


def backend_step(name: str) -> Callable[[Workload], Callable[[int], None]]:
    """make_step for one of our backends, through the public object form (KdaDecode)."""
    import kda

    def make(wl: Workload):
        op = kda.KdaDecode(wl.cfg, device=wl.device, backend=name)

        def step(i):
            op(**wl.args_for(i)._asdict())
        return step
    return make


def peer_step(name: str) -> Callable[[Workload], Callable[[int], None]]:
    """make_step for a peer of :mod:`tools.bench.peers`."""
    from tools.bench import peers

    def make(wl: Workload):
        fn = peers.make_peer(name, wl.cfg, wl.args)
        return lambda i: fn(wl.indices[i], wl.accepted[i])
    return make


def git_commit() -> str:
    """The commit the results name: ``$KDA_COMMIT`` (set by whoever ships the tree to a machine
    without .git), else git's short HEAD, else "unknown"."""
    if os.environ.get("KDA_COMMIT"):     # set by whoever ships the tree to a machine without .git
        return os.environ["KDA_COMMIT"]
    try:
        root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.dirname(os.path.dirname(
            os.path.dirname(os.path.abspath(__file__))))
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"
