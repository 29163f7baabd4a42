"""GPU correctness of the ``cuda`` backend against :func:`kda.reference.reference_step`.

Each case draws fresh inputs with :func:`kda.testing.make_case` (NaN poison wherever nothing
may be read or written, null slots 0 / -1 / out of range, dead conv slots, out-of-range
accepted counts, aliasing write slots, both conv layouts as real strided storage) and checks
every written buffer with :func:`kda.testing.compare_step`. Beyond the single step: two steps
back to back on the same pool (the programmatic-dependent-launch path must not race), bit
repeatability, CUDA-graph capture, and the public entry point.

Skipped without an sm_90 GPU (failed instead under ``--kda-require-backends``). On the GPU
machine::

    python3 -m pytest tests/backends/cuda -v
"""

import pytest
import torch

from kda.reference import reference_step
from kda.testing import CaseSpec, bits_equal, clone_args, compare_step, make_case, make_config


def _backend():
    from kda.backends.cuda import BACKEND
    return BACKEND


@pytest.fixture(autouse=True)
def _require_cuda_backend(require_available):
    """Skip without an sm_90 GPU; fail instead under --kda-require-backends (the GPU machine)."""
    require_available("cuda")


DEV = torch.device("cuda")




CASES = [
    # T=1: both layouts, both gates, both gate modes, bias, fp32 cache, bf16 weights, padding
    CaseSpec(make_config(4, 1), R=5),
    CaseSpec(make_config(4, 1, "DS", lb=-5.0, gm=1, bias=True), R=4),
    CaseSpec(make_config(2, 1, "DS", cs32=True, bf16_weights=True), R=3, padded=True),
    CaseSpec(make_config(12, 1, "SD", gm=1, extra_window=2, cs32=True), R=7, padded=True),
    CaseSpec(make_config(1, 1), R=1, null_frac=0.0),
    # T=5 (speculative verify): aliasing writes, skipped writes, clamped accepted counts
    CaseSpec(make_config(2, 5, "SD", lb=-5.0, gm=1), R=4),
    CaseSpec(make_config(2, 5, "DS", extra_window=3, bias=True), R=5),
    CaseSpec(make_config(3, 5, "DS", lb=-1.5, cs32=True), R=6, padded=True),
    # every other T instantiation
    CaseSpec(make_config(2, 2, "DS", lb=-1.5, bias=True), R=4, padded=True),
    CaseSpec(make_config(3, 3, "SD", gm=1), R=5),
    CaseSpec(make_config(2, 4, "DS", bf16_weights=True), R=4),
    CaseSpec(make_config(2, 6, "SD", lb=-5.0, extra_window=1), R=3),
    CaseSpec(make_config(2, 7, "DS", gm=1, bias=True), R=3),
    CaseSpec(make_config(1, 8, "SD", bias=True, cs32=True), R=3),
    CaseSpec(make_config(1, 8, "DS", lb=-5.0, gm=1, bf16_weights=True), R=3),
    # record mode
    CaseSpec(make_config(2, 1, record=True), R=3),
    CaseSpec(make_config(2, 5, "DS", record=True, bias=True), R=4),
    CaseSpec(make_config(2, 2, "SD", lb=-5.0, record=True, gm=1), R=3, padded=True),
    # all requests dead
    CaseSpec(make_config(4, 2), R=3, null_frac=1.0),
    # model shapes: many items per CTA (the persistent loop and its prefetch)
    CaseSpec(make_config(32, 1), R=128, null_frac=0.1),
    CaseSpec(make_config(32, 5, "SD", gm=1), R=64, null_frac=0.1),
    CaseSpec(make_config(12, 2, "DS", lb=-5.0), R=40),
    CaseSpec(make_config(96, 1, "SD", lb=-5.0, bias=True), R=9),
    CaseSpec(make_config(16, 8, "DS", record=True), R=20),
]


def _step(cfg):
    return _backend().build(cfg, DEV)


def _check(spec):
    cfg = spec.cfg
    reasons = _backend().unsupported(cfg, DEV)
    assert not reasons, reasons
    args = make_case(spec, DEV)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(cfg, expected)
    _step(cfg)(args)
    torch.cuda.synchronize()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("spec", CASES, ids=[c.id for c in CASES])
def test_matches_reference(spec):
    _check(spec)


@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("spec", [CaseSpec(make_config(4, 1), R=6, null_frac=0.0),
                                  CaseSpec(make_config(32, 1), R=64, null_frac=0.0),
                                  CaseSpec(make_config(32, 1), R=64, null_frac=0.5, seed=5),
                                  CaseSpec(make_config(2, 3, "DS"), R=5, null_frac=0.0)],
                         ids=lambda s: s.id)
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("early", ["0", "1"])
def test_back_to_back_steps(spec, pdl, schedule, early, monkeypatch):
    """Three steps on one pool with no host sync between them, under both item schedules: each
    launch must read the previous launch's pages and windows (everything after its
    griddepcontrol.wait), and the dynamic schedule's counters must be back at zero between
    launches that follow each other under PDL. early=1: with KDA_CUDA_EARLY_PARAMS and
    KDA_CUDA_EARLY_TRIGGER (weights requested before the wait, dependents released right
    after it; the case with null slots has CTAs whose first item is dead, whose head parameters
    are then staged for nothing and kept)."""
    monkeypatch.setenv("KDA_CUDA_PDL", pdl)
    monkeypatch.setenv("KDA_CUDA_SCHEDULE", schedule)
    monkeypatch.setenv("KDA_CUDA_EARLY_PARAMS", early)
    monkeypatch.setenv("KDA_CUDA_EARLY_TRIGGER", early)
    cfg = spec.cfg
    args = make_case(spec, DEV)
    before = clone_args(args)
    expected = clone_args(args)
    step = _step(cfg)
    for _ in range(3):
        step(args)
    for _ in range(3):
        reference_step(cfg, expected)
    torch.cuda.synchronize()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("env", [("KDA_CUDA_PREFETCH", "2"), ("KDA_CUDA_PREFETCH", "3")])
@pytest.mark.parametrize("spec", [CaseSpec(make_config(32, 1), R=40, null_frac=0.3),
                                  CaseSpec(make_config(8, 5, "DS", gm=1), R=40, null_frac=0.3)],
                         ids=lambda s: s.id)
def test_cache_hints_change_nothing(spec, env, monkeypatch):
    """The L2 prefetch (KDA_CUDA_PREFETCH, off by default; it runs under the static schedule
    only) is a cache hint only: results are bit-identical to the default's, null slots
    included."""
    monkeypatch.setenv("KDA_CUDA_SCHEDULE", "static")
    a_def = make_case(spec, DEV)
    a_alt = clone_args(a_def)
    _step(spec.cfg)(a_def)
    monkeypatch.setenv(*env)
    _step(spec.cfg)(a_alt)
    torch.cuda.synchronize()
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a_def, name), getattr(a_alt, name)), name


@pytest.mark.parametrize("items_per_cta", [1, 2, 3])
@pytest.mark.parametrize("spec", [CaseSpec(make_config(32, 1), R=40, null_frac=0.3),
                                  CaseSpec(make_config(8, 5, "DS", gm=1), R=128, null_frac=0.3),
                                  CaseSpec(make_config(16, 2, "SD", record=True), R=64)],
                         ids=lambda s: s.id)
def test_grid_size_changes_nothing(spec, items_per_cta, monkeypatch):
    """The grid size (KDA_CUDA_ITEMS_PER_CTA) only moves items between CTAs: at most 1 / 2 / 3
    items per CTA give bit-identical results to the persistent grid (0: each of the resident
    CTAs walks ~items / CTAs items, prefetching the next one), null slots and records
    included. The shapes are chosen so that both grids differ (asserted)."""
    from kda.backend import stream_grid
    items = spec.R * spec.cfg.num_heads
    resident = 2 * torch.cuda.get_device_properties(DEV).multi_processor_count
    assert stream_grid(items, resident, items_per_cta) != stream_grid(items, resident, 0)
    a0 = make_case(spec, DEV)
    a1 = clone_args(a0)
    monkeypatch.setenv("KDA_CUDA_ITEMS_PER_CTA", "0")
    _step(spec.cfg)(a0)
    monkeypatch.setenv("KDA_CUDA_ITEMS_PER_CTA", str(items_per_cta))
    _step(spec.cfg)(a1)
    torch.cuda.synchronize()
    for name in ("out", "state", "conv_state", "v_record", "kg_record"):
        assert bits_equal(getattr(a0, name), getattr(a1, name)), name


@pytest.mark.parametrize("spec", [CaseSpec(make_config(32, 1), R=40, null_frac=0.3),
                                  CaseSpec(make_config(8, 5, "DS", gm=1), R=128, null_frac=0.3),
                                  CaseSpec(make_config(16, 2, "SD", record=True), R=64),
                                  CaseSpec(make_config(3, 1), R=1)],
                         ids=lambda s: s.id)
@pytest.mark.parametrize("static_fraction", ["0", "0.5", "1"])
def test_schedules_agree(spec, static_fraction, monkeypatch):
    """The dynamic schedule (CTAs take items from an atomic counter, after a static range of
    KDA_CUDA_STATIC_FRACTION of their share) only moves items between CTAs: three
    back-to-back steps on one pool give bit-identical results to the static ranges, null
    slots and records included, and leave the counters at zero (the last CTA resets them, so
    the next launch starts from item 0)."""
    a0 = make_case(spec, DEV)
    a1 = clone_args(a0)
    monkeypatch.setenv("KDA_CUDA_SCHEDULE", "static")
    s0 = _step(spec.cfg)
    assert s0.counters is None
    monkeypatch.setenv("KDA_CUDA_SCHEDULE", "dynamic")
    monkeypatch.setenv("KDA_CUDA_STATIC_FRACTION", static_fraction)
    s1 = _step(spec.cfg)
    assert s1.static_fraction == float(static_fraction)
    for _ in range(3):
        s0(a0)
    for _ in range(3):
        s1(a1)
    torch.cuda.synchronize()
    assert [c.tolist() for c in s1.counters.newest().values()] == [[0, 0]]
    for name in ("out", "state", "conv_state", "v_record", "kg_record"):
        assert bits_equal(getattr(a0, name), getattr(a1, name)), name


# (R * H above the persistent grid of 2 CTAs per SM, 264 on an H200, except the last two: so
# under the static schedule the CTAs walk several items and cross head boundaries, where the
# rows are restaged, in every mode but the small cases)
FB_CASES = [CaseSpec(make_config(32, 1), R=128, null_frac=0.1),
            CaseSpec(make_config(4, 1, "DS", lb=-5.0, gm=1, bias=True), R=300, null_frac=0.3),
            CaseSpec(make_config(12, 1, "SD", gm=1, bias=True, cs32=True, bf16_weights=True), R=90,
                     padded=True),
            CaseSpec(make_config(8, 1, record=True, bias=True), R=100, null_frac=0.2),
            CaseSpec(make_config(12, 1, "SD", gm=1, bias=True, cs32=True, bf16_weights=True), R=9,
                     padded=True),
            CaseSpec(make_config(3, 1), R=1)]


@pytest.mark.parametrize("schedule", ["static", "dynamic", "dynamic:0.8"])
@pytest.mark.parametrize("spec", FB_CASES, ids=lambda s: s.id)
def test_fb_smem(spec, schedule, monkeypatch):
    """The T=1 build that stages each head's f_b rows in shared memory (KDA_CUDA_FB_SMEM=1;
    the conv bias then comes from global memory) against the reference, and bit-identical to
    the build that loads the fragments from L2, under both schedules (the dynamic one changes
    heads between most consecutive items, so the rows are restaged there), three back-to-back
    steps on one pool, null slots, bias and records included. ("dynamic:f": the dynamic
    schedule after static ranges of fraction f.)"""
    schedule, _, fraction = schedule.partition(":")
    monkeypatch.setenv("KDA_CUDA_SCHEDULE", schedule)
    monkeypatch.setenv("KDA_CUDA_STATIC_FRACTION", fraction or "0")
    cfg = spec.cfg
    a0 = make_case(spec, DEV)
    before = clone_args(a0)
    expected = clone_args(a0)
    a1 = clone_args(a0)
    monkeypatch.setenv("KDA_CUDA_FB_SMEM", "0")
    s0 = _step(cfg)
    monkeypatch.setenv("KDA_CUDA_FB_SMEM", "1")
    s1 = _step(cfg)
    assert (s0.fb_smem, s1.fb_smem) == (False, True)
    for _ in range(3):
        s0(a0)
        s1(a1)
        reference_step(cfg, expected)
    torch.cuda.synchronize()
    errors = compare_step(a1, expected, before)
    assert not errors, "\n".join(errors)
    for name in ("out", "state", "conv_state", "v_record", "kg_record"):
        assert bits_equal(getattr(a0, name), getattr(a1, name)), name


def test_dynamic_schedule_on_two_streams(monkeypatch):
    """One built step (dynamic schedule) launched on two streams at once: each stream gets its
    own counter pair, so both steps stay right."""
    monkeypatch.setenv("KDA_CUDA_SCHEDULE", "dynamic")
    specs = [CaseSpec(make_config(32, 3), R=96, seed=11), CaseSpec(make_config(32, 3), R=96, seed=12)]
    step = _step(specs[0].cfg)
    runs = []
    for spec in specs:
        args = make_case(spec, DEV)
        before, expected = clone_args(args), clone_args(args)
        reference_step(spec.cfg, expected)
        runs.append((args, expected, before))
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(2):     # the second round reuses both pairs
        for (args, _, _), st in zip(runs, streams):
            with torch.cuda.stream(st):
                step(args)
    torch.cuda.synchronize()
    assert len(step.counters.newest()) == 2
    assert all(c.tolist() == [0, 0] for c in step.counters.newest().values())
    # two steps per pool: compare against the reference applied twice
    for (args, expected, before), spec in zip(runs, specs):
        reference_step(spec.cfg, expected)
        errors = compare_step(args, expected, before)
        assert not errors, "\n".join(errors)


def test_repeatable():
    """Two runs on the same inputs give bit-identical results (no races)."""
    spec = CaseSpec(make_config(32, 5, "DS", gm=1, bias=True), R=33)
    a1 = make_case(spec, DEV)
    a2 = clone_args(a1)
    step = _step(spec.cfg)
    step(a1)
    step(a2)
    torch.cuda.synchronize()
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a1, name), getattr(a2, name)), name


def test_cuda_graph_capture():
    """The step captures into a CUDA graph (no host sync, no allocation) and replays right."""
    spec = CaseSpec(make_config(8, 2, "SD", lb=-5.0), R=12)
    cfg = spec.cfg
    args = make_case(spec, DEV)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(cfg, expected)
    step = _step(cfg)
    work = clone_args(args)
    step(work)  # build and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(args)
    # capture does not execute: args are still the inputs; restore them and replay
    for name in ("out", "state", "conv_state"):
        getattr(args, name).copy_(getattr(before, name))
    g.replay()
    torch.cuda.synchronize()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


def test_public_entry_point():
    """kda.kda_decode(..., backend="cuda") reaches this backend and writes ``out`` in place."""
    import kda
    spec = CaseSpec(make_config(4, 2, "DS", bias=True), R=6)
    cfg = spec.cfg
    args = make_case(spec, DEV)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(cfg, expected)
    out = kda.kda_decode(
        args.x, args.conv_weight, args.conv_bias, args.conv_state, args.f_a, args.f_b, args.beta,
        args.A_log, args.dt_bias, args.state, args.state_indices, args.output_gate,
        args.norm_weight, num_accepted_tokens=args.num_accepted_tokens, scale=cfg.scale,
        norm_eps=cfg.norm_eps, lower_bound=cfg.lower_bound, gate_mode=cfg.gate_mode,
        v_record=args.v_record, kg_record=args.kg_record, out=args.out, backend="cuda")
    torch.cuda.synchronize()
    assert out.data_ptr() == args.out.data_ptr()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)
