"""The Triton backend's host side: the launch policy and the step that follows it, the
registry entry, and (GPU only) CUDA-graph capture and the per-stream buffers.

On the CPU run with ``TRITON_INTERPRET=1`` (the Bazel target sets it); on a GPU run plainly.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kda.backends.triton import auto, policy  # noqa: E402
from kda.backends.triton import kda_decode as kd, kda_decode_chunked as kc  # noqa: E402
from kda.config import KdaConfig  # noqa: E402
from kda.testing import CaseSpec, bits_equal, clone_args, compare_step, make_case  # noqa: E402
from tests.backends.triton.helpers import INTERP, device  # noqa: E402

GPU = pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_interpreter_of_triton_3_9_is_refused_with_the_versions_that_work():
    from kda.backends.triton.backend import interpreter_refusal
    why = interpreter_refusal("3.9.0")
    assert why.startswith("Triton 3.9.0's CPU interpreter") and "3.6-3.8" in why
    for v in ("3.6.0", "3.7.1", "3.8.0", "3.10.0", "4.0.0", "dev"):
        assert interpreter_refusal(v) is None, v


def test_policy_names_every_build_once():
    """Every build of both kernels is one the policy can choose, and nothing else."""
    assert sorted(policy.builds()) == sorted({**kd.BUILDS, **kc.BUILDS})
    for rule in policy.SMALL_BATCH + policy.LARGE_BATCH:
        assert rule.reason.strip(), rule


def test_choose_follows_the_first_matching_row(monkeypatch):
    """choose() reads the tables in order, first match wins; a synthetic table, so that no
    measured choice is pinned here."""
    R_ = policy.Rule
    monkeypatch.setattr(policy, "SMALL_BATCH", (R_(None, 0.5, "a", "r"), R_(None, 1.0, "b", "r")))
    monkeypatch.setattr(policy, "LARGE_BATCH", (R_(1, 2, "c", "r"), R_(None, 1, "d", "r")))
    assert [policy.choose(1, n, 10) for n in (1, 5, 6, 9, 10, 19, 20, 500)] == \
        ["a", "a", "b", "b", "d", "d", "c", "c"]
    assert [policy.choose(2, n, 10) for n in (10, 20, 500)] == ["d", "d", "d"]


def test_auto_step_launches_the_chosen_build(monkeypatch):
    """AutoStep launches what the policy names for R * H items on its SM count: the item
    builds through its one ItemStep, each chunked build through its own ChunkedStep."""
    launched = []

    class Chunked:
        def __init__(self, cfg, device, build):
            self.build = build

        def __call__(self, args):
            launched.append(self.build.name)

    monkeypatch.setattr(kc, "ChunkedStep", Chunked)
    cfg = KdaConfig(num_heads=1, T=2, window=4)
    step = auto.AutoStep(cfg, "cpu")
    step.num_sms = 8
    step.item = lambda args, build: launched.append(build.name)
    args = make_case(CaseSpec(cfg, R=1), "cpu")
    sizes = (0, 1, 3, 5, 8, 31, 32, 40, 600)
    for R in sizes:
        step(args._replace(state_indices=torch.zeros(R, 2, dtype=torch.int32)))
    chosen = [policy.choose(2, R, 8) for R in sizes if R]     # R = 0 launches nothing
    assert launched == chosen
    assert sorted(step._chunked) == sorted({b for b in chosen if b in kc.BUILDS})


def test_importing_the_package_and_policy_needs_no_triton():
    code = ("import sys, kda.backends.triton, kda.backends.triton.policy; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_interpreter_switch_is_read_in_one_place(monkeypatch):
    """TRITON_INTERPRET is parsed once, by backend.interpreter_enabled (the kernels' modules
    import it from there); its values as Triton reads them."""
    import ast
    import pathlib

    from kda.backends.triton import backend, common
    here = pathlib.Path(backend.__file__).parent
    reads = [(p.name, n.lineno) for p in sorted(here.glob("*.py"))
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv")]
    assert [name for name, _ in reads] == ["backend.py"], reads
    assert common.interpreter_enabled is backend.interpreter_enabled
    for value, on in (("1", True), ("true", True), (" On ", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert backend.interpreter_enabled() is on, value
    monkeypatch.delenv("TRITON_INTERPRET")
    assert backend.interpreter_enabled() is False


def test_registry_entry():
    from kda.registry import get_backend
    dev = device()
    b = get_backend("triton")
    assert b.availability() is None
    assert b.unsupported(KdaConfig(num_heads=4, T=8, window=10), dev) == []
    assert any("T <= 8" in r for r in b.unsupported(KdaConfig(num_heads=4, T=9, window=11), dev))
    other = torch.device("cuda" if dev.type == "cpu" else "cpu")
    assert b.unsupported(KdaConfig(num_heads=4), other)
    assert isinstance(b.build(KdaConfig(num_heads=4), dev), auto.AutoStep)


def _steps(cfg, name):
    """A step function launching the build ``name`` only."""
    if name in kd.BUILDS:
        item = kd.ItemStep(cfg, "cuda")
        return lambda args: item(args, kd.BUILDS[name])
    return kc.ChunkedStep(cfg, "cuda", kc.BUILDS[name])


@GPU
@pytest.mark.parametrize("name", ["item_nv1", "item_nv4", "chunked", "chunked_w2_s3"])
def test_cuda_graph_capture(name):
    cfg = KdaConfig(num_heads=4, T=2, window=4)
    spec = CaseSpec(cfg, R=6, seed=9)
    eager = make_case(spec, "cuda")
    graphed = clone_args(eager)
    step = _steps(cfg, name)
    warm = clone_args(eager)
    step(warm)                                  # compile and grow the scratch outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(graphed)
    step(eager)
    g.replay()
    torch.cuda.synchronize()
    for n in ("out", "state", "conv_state"):
        assert bits_equal(getattr(eager, n), getattr(graphed, n)), n


@GPU
@pytest.mark.parametrize("name", ["item_nv2", "chunked"])
def test_buffers_of_a_stream_first_seen_in_capture(name, monkeypatch):
    """torch.cuda.graph captures on its own stream, which the eager warm-up never ran on: its
    scratch is made during capture (from the graph's pool) and its V-split counters are the
    spare zeroed by an eager step. Two graphs captured there share them; the second one
    replayed first, then both twice, match eager steps bit for bit (with counters made during
    capture, zeroed only by the first graph's fill node, B replayed first would read garbage)."""
    monkeypatch.setattr(kc, "_SCRATCH", {})
    cfg = KdaConfig(num_heads=2, T=2, window=4)
    step = _steps(cfg, name)
    step(make_case(CaseSpec(cfg, R=3, seed=18), "cuda"))       # compile (on the current stream)
    torch.cuda.synchronize()
    eager = [make_case(CaseSpec(cfg, R=r, seed=19 + r), "cuda") for r in (3, 2)]
    graphed = [clone_args(a) for a in eager]
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    for g, a in zip(graphs, graphed):
        with torch.cuda.graph(g):
            step(a)
    for i in (1, 0, 1, 0):
        step(eager[i])
        graphs[i].replay()
    torch.cuda.synchronize()
    for e, g in zip(eager, graphed):
        for n in ("out", "state", "conv_state"):
            assert bits_equal(getattr(e, n), getattr(g, n)), n


@GPU
@pytest.mark.parametrize("name", ["item_nv4", "chunked"])
def test_two_streams_at_once(name, monkeypatch):
    """One built step launched on two streams at once (as a server overlapping two
    micro-batches does): each stream has its own scratch (and counters), so both batches
    match the reference. The two launches of each round are held behind one event after a
    GPU sleep, so that they run at the same time (small grids: both fit on the GPU at once)."""
    from kda.reference import reference_step
    monkeypatch.setattr(kc, "_SCRATCH", {})
    cfg = KdaConfig(num_heads=4, T=2, window=4)
    if name in kd.BUILDS:
        owner = kd.ItemStep(cfg, "cuda")
        step = lambda args: owner(args, kd.BUILDS[name])  # noqa: E731
    else:
        owner = step = kc.ChunkedStep(cfg, "cuda", kc.BUILDS[name])
    runs = []
    for seed in (71, 72):
        args = make_case(CaseSpec(cfg, R=3, seed=seed), "cuda")
        before, expected = clone_args(args), clone_args(args)
        for _ in range(4):
            reference_step(cfg, expected)
        runs.append((args, expected, before))
    torch.cuda.synchronize()
    gate, streams = torch.cuda.Stream(), [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(4):
        ev = torch.cuda.Event()
        with torch.cuda.stream(gate):
            torch.cuda._sleep(20_000_000)            # ~10 ms: both launches queue behind it
            ev.record()
        for (args, _, _), st in zip(runs, streams):
            st.wait_event(ev)
            with torch.cuda.stream(st):
                step(args)
        for st in streams:
            gate.wait_stream(st)
    torch.cuda.synchronize()
    for args, expected, before in runs:
        errors = compare_step(args, expected, before)
        assert not errors, "\n".join(errors)
    bufs = []
    for st in streams:
        with torch.cuda.stream(st):
            bufs.append(owner.scratch)
    assert bufs[0].data_ptr() != bufs[1].data_ptr()
