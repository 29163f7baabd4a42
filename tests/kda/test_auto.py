"""``auto``'s table is the ranking its measurement gives, per T and batch size; the fallback
covers every backend; a choice that depends on the batch size dispatches per call."""

import collections
import json
import os
from types import SimpleNamespace

import pytest
import torch

import kda
from kda import auto, registry
from kda.backend import Backend
from kda.config import KdaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _source_cells(sd):
    """The cells of the runs :data:`auto.SOURCE` names for state dtype ``sd``."""
    cells = []
    for path in auto.SOURCE[sd]:
        with open(os.path.join(ROOT, path)) as f:
            cells += json.load(f)["cells"]
    return cells


def test_table_matches_its_measurement():
    """Each state dtype's table is the ranking of its own cells in its own runs."""
    assert set(auto.SOURCE) == set(auto.MEASURED) == {"fp32", "bf16"}
    for sd in auto.SOURCE:
        times = collections.defaultdict(dict)
        for c in _source_cells(sd):
            if (c["backend"] in registry.BACKEND_NAMES and not c.get("note")
                    and c["H"] == auto.TABLE_HEADS and c.get("state_dtype", "fp32") == sd):
                times[(c["T"], c["R"])][c["backend"]] = c["time_us"]
        measured = {(T, R) for T, rows in auto.MEASURED[sd].items() for R in rows}
        assert measured == set(times), (sd, sorted(set(times) ^ measured))
        for (T, R), by_backend in times.items():
            assert auto.MEASURED[sd][T][R] == auto.rank(by_backend), (sd, T, R)


def test_rank_moves_cutedsl_into_the_place_of_its_wide_kernel():
    """By time, except that ``cutedsl`` takes ``cutedsl_wide``'s place where that was faster;
    the backends between them keep their order."""
    assert auto.rank({"cuda": 3.0, "cutedsl": 2.0, "cutedsl_wide": 1.0}) == ("cutedsl", "cutedsl_wide", "cuda")
    t = {"cuda": 2.0, "cutedsl_wide": 1.0, "cutedsl": 3.0, "triton": 4.0}
    assert auto.rank(t) == ("cutedsl", "cutedsl_wide", "cuda", "triton")
    t = {"triton": 0.5, "cutedsl_wide": 1.0, "cuda": 2.0, "cutedsl": 3.0}
    assert auto.rank(t) == ("triton", "cutedsl", "cutedsl_wide", "cuda")
    assert auto.rank({"cutedsl": 1.0, "cutedsl_wide": 2.0, "cuda": 0.5}) == ("cuda", "cutedsl", "cutedsl_wide")
    assert auto.rank({"cutedsl_wide": 1.0, "cuda": 2.0}) == ("cutedsl_wide", "cuda")


def test_cutedsl_runs_wide_wherever_the_measurement_put_wide_ahead():
    """:func:`auto.rank` ranks ``cutedsl`` ahead of ``cutedsl_wide``: justified only if, in
    every cell of the source runs where ``cutedsl_wide`` was faster than ``cutedsl`` by more
    than the runs' repeatability (0.5%), ``cutedsl``'s policy now names the wide kernel
    (on the runs' GPU, an H200 of 132 SMs)."""
    from kda.backends.cutedsl import policy

    for sd in auto.SOURCE:
        times = collections.defaultdict(dict)
        for c in _source_cells(sd):
            times[(c["H"], c["T"], c["R"])][c["backend"]] = c["time_us"]
        for (H, T, R), t in times.items():
            if {"cutedsl", "cutedsl_wide"} <= set(t) and t["cutedsl_wide"] * 1.005 < t["cutedsl"]:
                assert policy.default_axes(R * H, T, sd == "bf16", H, 132) == policy.WIDE, \
                    (sd, H, T, R)


def test_the_state_dtype_picks_the_table(monkeypatch):
    """A bf16 pool's order comes from the bf16 table, an fp32 pool's from the fp32 table."""
    monkeypatch.setattr(auto, "MEASURED", {"fp32": {1: {8: ("cuda",)}}, "bf16": {1: {8: ("triton",)}}})
    gpu = torch.device("cuda")
    assert auto.auto_order(KdaConfig(num_heads=32), gpu, 8)[0] == "cuda"
    assert auto.auto_order(KdaConfig(num_heads=32, state_dtype=torch.bfloat16), gpu, 8)[0] == "triton"


#: A fixed table for the tests of the mechanism (the real one follows its measurement):
#: cutedsl_wide first up to R=8, cuda from R=32, at every T.
_WIDE = ("cutedsl_wide", "cutedsl", "cuda", "triton")
_CUDA = ("cuda", "cutedsl_wide", "cutedsl", "triton")
SYNTHETIC = {sd: {T: {1: _WIDE, 8: _WIDE, 32: _CUDA, 128: _CUDA, 512: _CUDA} for T in (1, 2, 5)}
             for sd in ("fp32", "bf16")}


@pytest.fixture(autouse=True)
def synthetic_table(request, monkeypatch):
    """Every test but the table's own (and the README's account of it on other GPUs) runs on
    :data:`SYNTHETIC`, so none pins a measurement."""
    if request.node.originalname not in ("test_table_matches_its_measurement",
                                         "test_the_state_dtype_picks_the_table",
                                         "test_auto_on_a_gpu_other_than_the_h200"):
        monkeypatch.setattr(auto, "MEASURED", SYNTHETIC)


def test_orders():
    assert auto.auto_order(KdaConfig(num_heads=4), torch.device("cpu")) == ["reference"]
    for T in (1, 3, 8):
        cfg = KdaConfig(num_heads=32, T=T, window=T + 2)
        for batch in (None, 1, 7, 16, 17, 100, 4096):
            order = auto.auto_order(cfg, torch.device("cuda"), batch)
            assert sorted(order) == sorted(registry.BACKEND_NAMES)
            assert order[-1] == "reference"
        # nearest measured R on a log scale, ties to the smaller: 16 is as near 8 as 32
        assert auto.auto_order(cfg, torch.device("cuda"), 16)[0] == "cutedsl_wide"
        assert auto.auto_order(cfg, torch.device("cuda"), 17)[0] == "cuda"
        assert auto.auto_order(cfg, torch.device("cuda"))[0] == "cuda"


class _Fake(Backend):
    def __init__(self, name, runs, builds, fail=False):
        self.name, self.description = name, "fake"
        self._runs, self._builds, self._fail = runs, builds, fail

    def probe(self):
        return None

    def build(self, cfg, device):
        self._builds.append(self.name)
        if self._fail:
            raise RuntimeError(f"{self.name} does not compile here")
        return lambda args: self._runs.append((self.name, args.state_indices.shape[0]))


@pytest.fixture
def fake_gpu(monkeypatch):
    """registry.resolve on a pretend CUDA device whose backends are fakes: returns
    make(serves=..., fail=...) -> (runs, builds) logs; the registry's step cache starts empty."""
    monkeypatch.setattr(registry, "_steps", {})
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    runs, builds = [], []

    def make(serves=registry.BACKEND_NAMES, fail=()):
        fakes = {n: _Fake(n, runs, builds, n in fail) for n in registry.BACKEND_NAMES}
        monkeypatch.setattr(registry, "get_backend", lambda n: fakes[n])
        monkeypatch.setattr(registry, "unsupported_reasons",
                            lambda n, cfg, dev: [] if n in serves else ["not here"])
        return runs, builds
    return make


def _args(R):
    return SimpleNamespace(state_indices=torch.zeros(R, 1))


def test_batch_dependent_choice_dispatches_per_call(fake_gpu):
    runs, builds = fake_gpu()
    cfg = KdaConfig(num_heads=32)
    backend = registry.resolve(cfg, torch.device("cuda"))
    assert isinstance(backend, auto.BatchAuto) and backend.name == "auto"
    assert {r: c[0].name for r, c in backend.candidates.items()} == {
        1: "cutedsl_wide", 8: "cutedsl_wide", 32: "cuda", 128: "cuda", 512: "cuda"}
    step = backend.build(cfg, torch.device("cuda"))
    assert sorted(builds) == ["cuda", "cutedsl_wide"]           # both built up front, once
    for R in (1, 16, 17, 300, 16):
        step(_args(R))
    assert runs == [("cutedsl_wide", 1), ("cutedsl_wide", 16), ("cuda", 17), ("cuda", 300),
                    ("cutedsl_wide", 16)]
    assert [step.backend_for(R) for R in (1, 16, 17)] == ["cutedsl_wide", "cutedsl_wide", "cuda"]


def test_batch_counts_in_items_of_the_table(fake_gpu):
    """The table was measured at H=32: at H=4 a batch of 128 requests is 512 items, like 16
    requests at H=32."""
    fake_gpu()
    cfg = KdaConfig(num_heads=4)
    assert auto.auto_order(cfg, torch.device("cuda"), 128)[0] == "cutedsl_wide"
    assert auto.auto_order(cfg, torch.device("cuda"), 129)[0] == "cuda"
    backend = registry.resolve(cfg, torch.device("cuda"))
    step = backend.build(cfg, torch.device("cuda"))
    assert [step.backend_for(R) for R in (128, 129)] == ["cutedsl_wide", "cuda"]
    assert backend.description == "by batch size: cutedsl_wide for R <= 128, cuda above"


def test_a_candidate_that_fails_to_build_falls_back(fake_gpu, caplog):
    runs, builds = fake_gpu(fail={"cuda"})
    cfg = KdaConfig(num_heads=32)
    step = registry.resolve(cfg, torch.device("cuda")).build(cfg, torch.device("cuda"))
    assert builds.count("cuda") == 1                          # tried once, not per batch size
    step(_args(64))
    row = auto.MEASURED["fp32"][1][auto.table_batch(cfg, 64)]            # R=64: the R=32 / 128 row
    nxt = row[row.index("cuda") + 1]                              # its runner-up after cuda
    assert runs == [(nxt, 64)] and step.backend_for(64) == nxt
    assert step.backend_for(4) == "cutedsl_wide"


def test_nothing_builds_raises(fake_gpu):
    fake_gpu(serves={"cutedsl_wide", "cuda"}, fail={"cutedsl_wide", "cuda"})
    cfg = KdaConfig(num_heads=32)
    backend = registry.resolve(cfg, torch.device("cuda"))
    with pytest.raises(kda.KdaBackendError, match="no KDA backend builds"):
        backend.build(cfg, torch.device("cuda"))


def test_kda_decode_shares_candidate_steps_and_names_them(fake_gpu, monkeypatch):
    """Through the public class: the candidates are built through the shared step cache (an
    explicit choice of the same backend reuses the build), and backend_for names what runs."""
    import kda
    _, builds = fake_gpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = KdaConfig(num_heads=32)
    step = kda.KdaDecode(cfg, device="cuda:0")
    explicit = kda.KdaDecode(cfg, device="cuda:0", backend="cuda")
    assert step.backend_name == "auto" and explicit.backend_name == "cuda"
    assert sorted(builds) == ["cuda", "cutedsl_wide"]
    assert explicit._step is step._step.steps["cuda"]
    assert [step.backend_for(R) for R in (8, 64)] == ["cutedsl_wide", "cuda"]
    assert explicit.backend_for(8) == "cuda"


def test_one_choice_for_every_batch_is_that_backend(fake_gpu):
    # without cutedsl_wide and cuda: cutedsl is first at every measured R
    fake_gpu(serves={"cutedsl", "triton", "reference"})
    backend = registry.resolve(KdaConfig(num_heads=4), torch.device("cuda"))
    assert backend.name == "cutedsl" and not isinstance(backend, auto.BatchAuto)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_on_the_gpu_switches_backend_by_batch_and_captures_graphs(monkeypatch):
    """On the GPU: ``auto`` built once serves batches on both sides of its switch, each
    against the reference, eagerly and replayed from CUDA graphs captured per batch size."""
    from kda.reference import reference_step
    from kda.testing import CaseSpec, clone_args, compare_step, make_case, make_config

    monkeypatch.delenv("KDA_BACKEND", raising=False)
    monkeypatch.setattr(auto, "MEASURED", SYNTHETIC)
    cfg = make_config(8, 1)          # H=8: cutedsl_wide up to 64 requests (512 items)
    dev = torch.device("cuda")
    backend = registry.resolve(cfg, dev)
    step = backend.build(cfg, dev)
    used = set()
    for R in (4, 96):
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
    if torch.cuda.get_device_capability(dev) == (9, 0):    # both candidates serve sm_90
        why = {n: w for n, w, _ in registry.status() if n in ("cutedsl_wide", "cuda")}
        assert not any(why.values()), why
        assert isinstance(backend, auto.BatchAuto) and used == {"cutedsl_wide", "cuda"}


@pytest.mark.parametrize("capability,picked", [
    ((9, 0), "cutedsl"),          # H100 and H200: the H200's table
    ((10, 0), "cutedsl"),         # cuda is built for 9.0 only; cutedsl's check takes >= 9.0
    ((12, 0), "cutedsl"),
    ((8, 9), "triton"),           # below 9.0: neither CuTe DSL backend nor cuda
    ((8, 0), "triton"),
    ((7, 5), "reference"),        # triton needs 8.0 (bf16 MMA)
])
def test_auto_on_a_gpu_other_than_the_h200(monkeypatch, capability, picked):
    """What the README says ``auto`` does on another GPU: the H200's table, each row's first
    backend whose own check takes this GPU's compute capability (every backend installed
    here), for both state dtypes and both measured T."""
    from kda.backend import Backend

    monkeypatch.delenv("KDA_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(Backend, "availability", lambda self: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for sd in (torch.float32, torch.bfloat16):
        for T in (1, 4):
            cfg = KdaConfig(num_heads=32, T=T, state_dtype=sd)
            assert registry.resolve(cfg, torch.device("cuda", 0)).name == picked, (sd, T)
