"""``auto``'s table is the ranking its measurement gives, per T and batch size; the fallback
covers every backend; a choice that depends on the batch size dispatches per call."""

import collections
import json
import os
from types import SimpleNamespace

import pytest
import torch

from kda import auto, registry
from kda.backend import Backend
from kda.config import KdaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_table_matches_its_measurement():
    with open(os.path.join(ROOT, auto.SOURCE)) as f:
        cells = json.load(f)["cells"]
    times = collections.defaultdict(dict)
    for c in cells:
        if c["backend"] in registry.BACKEND_NAMES and not c.get("note"):
            times[(c["T"], c["R"])][c["backend"]] = c["time_us"]
    measured = {(T, R) for T, rows in auto.MEASURED.items() for R in rows}
    assert measured == set(times), sorted(set(times) ^ measured)
    for (T, R), by_backend in times.items():
        assert auto.MEASURED[T][R] == tuple(sorted(by_backend, key=by_backend.get)), (T, R)


def test_orders():
    assert auto.auto_order(KdaConfig(num_heads=4), torch.device("cpu")) == ["reference"]
    for T in (1, 3, 8):
        cfg = KdaConfig(num_heads=4, T=T, window=T + 2)
        for batch in (None, 1, 7, 16, 17, 100, 4096):
            order = auto.auto_order(cfg, torch.device("cuda"), batch)
            assert sorted(order) == sorted(registry.BACKEND_NAMES)
            assert order[-1] == "reference"
        # nearest measured R on a log scale, ties to the smaller: 16 is as near 8 as 32
        assert auto.auto_order(cfg, torch.device("cuda"), 16)[0] == "cutedsl_wide"
        assert auto.auto_order(cfg, torch.device("cuda"), 17)[0] == "cuda"
        assert auto.auto_order(cfg, torch.device("cuda"))[0] == "cuda"


class _Fake(Backend):
    def __init__(self, name, runs):
        self.name, self.description, self._runs = name, "fake", runs

    def probe(self):
        return None

    def build(self, cfg, device):
        return lambda args: self._runs.append((self.name, args.state_indices.shape[0]))


def _resolved_on_fake_gpu(monkeypatch, serves):
    runs = []
    fakes = {n: _Fake(n, runs) for n in registry.BACKEND_NAMES}
    monkeypatch.setattr(registry, "get_backend", lambda n: fakes[n])
    monkeypatch.setattr(registry, "unsupported_reasons",
                        lambda n, cfg, dev: [] if n in serves else ["not here"])
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    return registry.resolve(KdaConfig(num_heads=4), torch.device("cuda")), runs


def test_batch_dependent_choice_dispatches_per_call(monkeypatch):
    backend, runs = _resolved_on_fake_gpu(monkeypatch, set(registry.BACKEND_NAMES))
    assert isinstance(backend, auto.BatchAuto) and backend.name == "auto"
    assert {r: b.name for r, b in backend.picks.items()} == {
        1: "cutedsl_wide", 8: "cutedsl_wide", 32: "cuda", 128: "cuda", 512: "cuda"}
    step = backend.build(KdaConfig(num_heads=4), torch.device("cuda"))
    for R in (1, 16, 17, 300, 16):
        step(SimpleNamespace(state_indices=torch.zeros(R, 1)))
    assert runs == [("cutedsl_wide", 1), ("cutedsl_wide", 16), ("cuda", 17), ("cuda", 300),
                    ("cutedsl_wide", 16)]
    assert [step.backend_for(R) for R in (1, 16, 17)] == ["cutedsl_wide", "cutedsl_wide", "cuda"]


def test_one_choice_for_every_batch_is_that_backend(monkeypatch):
    # without cutedsl_wide and cuda: cutedsl is first at every measured R
    backend, _ = _resolved_on_fake_gpu(monkeypatch, {"cutedsl", "triton", "reference"})
    assert backend.name == "cutedsl" and not isinstance(backend, auto.BatchAuto)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_on_the_gpu_switches_backend_by_batch_and_captures_graphs(monkeypatch):
    """On the GPU: ``auto`` built once serves batches on both sides of its switch, each
    against the reference, eagerly and replayed from CUDA graphs captured per batch size."""
    from kda.reference import reference_step
    from kda.testing import CaseSpec, clone_args, compare_step, make_case, make_config

    monkeypatch.delenv("KDA_BACKEND", raising=False)
    cfg = make_config(4, 1)
    dev = torch.device("cuda")
    backend = registry.resolve(cfg, dev)
    step = backend.build(cfg, dev)
    used = set()
    for R in (4, 64):
        used.add(getattr(step, "backend_for", lambda r: backend.name)(R))
        for graph in (False, True):
            args = make_case(CaseSpec(cfg, R=R, seed=R + graph), dev)
            before, expected = clone_args(args), clone_args(args)
            reference_step(cfg, expected)
            if graph:
                warm = clone_args(before)
                step(warm)                       # compile / first use outside the capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step(args)
                g.replay()
            else:
                step(args)
            torch.cuda.synchronize()
            errors = compare_step(args, expected, before)
            assert not errors, f"R={R} graph={graph}: " + "\n".join(errors)
    avail = {n for n, why, _ in registry.status() if why is None}
    if {"cutedsl_wide", "cuda"} <= avail:
        assert isinstance(backend, auto.BatchAuto) and used == {"cutedsl_wide", "cuda"}
