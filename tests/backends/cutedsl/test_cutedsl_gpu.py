"""The CuTe DSL kernels on a GPU: against the reference, and wide vs stream bit for bit.

Skipped without CUDA. On the GPU machine run (from the repository root):

    python3 -m pytest -q tests/backends/cutedsl/test_cutedsl_gpu.py --kda-require-backends

Checks, per kernel (``cutedsl`` = stream, ``cutedsl_wide`` = wide):
  * every written buffer against :func:`kda.reference.reference_step` with
    :func:`kda.testing.compare_step` (NaN poison wherever nothing may be read or written,
    windows exact, dead items exact zeros, everything else untouched), on configurations
    covering T in {1, 2, 5, 8}, both conv layouts, both gates, gate_mode 0/1, conv bias,
    record mode, fp32 conv state, bf16 weights, padded strides, null slots, aliasing, and
    batches large enough that each CTA walks several items (at T=1 and T=2 by default; at
    T >= 3 the default is one item per CTA, and the grid-size test runs the persistent grid);
  * wide and stream produce bit-identical out / state / conv_state / records, and so do
    the streamed kernel's persistent grid and smaller-range grids (KDA_CUTEDSL_ITEMS_PER_CTA);
  * three chained steps on the same buffers (programmatic dependent launch back to back);
  * CUDA-graph capture and replay; the public ``kda.kda_decode`` path;
  * slot offsets beyond 2**31 elements (64-bit addressing).
"""

import pytest
import torch

from kda.config import KdaConfig
from kda.reference import reference_compute, reference_step
from kda.testing import (CaseSpec, args_to, bits_equal, clone_args, compare_step, make_case,
                         rel_err)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

bf16, f32 = torch.bfloat16, torch.float32
KINDS = ("cutedsl", "cutedsl_wide")

SPECS = [
    CaseSpec(KdaConfig(num_heads=4, T=1, window=3), R=5, seed=1),
    CaseSpec(KdaConfig(num_heads=4, T=2, window=4, conv_layout="DS", lower_bound=-5.0,
                       gate_mode=1, has_conv_bias=True), R=6, seed=2),
    CaseSpec(KdaConfig(num_heads=8, T=5, window=7, gate_mode=1, record=True), R=4, seed=3),
    CaseSpec(KdaConfig(num_heads=1, T=8, window=12, conv_layout="DS", conv_state_dtype=f32,
                       conv_weight_dtype=bf16, norm_weight_dtype=bf16), R=7, seed=4),
    CaseSpec(KdaConfig(num_heads=12, T=5, window=7, lower_bound=-5.0), R=3, padded=True, seed=5),
    CaseSpec(KdaConfig(num_heads=16, T=8, window=10, record=True, conv_state_dtype=f32,
                       has_conv_bias=True, lower_bound=-2.0), R=3, padded=True, seed=6),
    CaseSpec(KdaConfig(num_heads=32, T=1, window=3), R=40, seed=7),
    CaseSpec(KdaConfig(num_heads=96, T=2, window=5, conv_layout="DS", gate_mode=1), R=9, seed=8),
    CaseSpec(KdaConfig(num_heads=32, T=5, window=7, has_conv_bias=True), R=24, padded=True,
             seed=9),
    CaseSpec(KdaConfig(num_heads=8, T=1, window=6, conv_layout="DS", record=True,
                       lower_bound=-1.0, gate_mode=1), R=12, null_frac=0.5, seed=10),
]

_steps = {}


def _step(name, cfg, device, require_backend):
    backend = require_backend(name, cfg, device)
    key = (name, cfg, str(device))
    if key not in _steps:
        _steps[key] = backend.build(cfg, device)
    return _steps[key]


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
@pytest.mark.parametrize("name", KINDS)
def test_matches_reference(name, spec, device, require_backend):
    cfg = spec.cfg
    step = _step(name, cfg, device, require_backend)
    args = make_case(spec, device)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(cfg, expected)
    step(args)
    torch.cuda.synchronize()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)
    exact = reference_compute(cfg, args_to(before, device), "float64")
    live = exact.live.repeat_interleave(cfg.T)
    if live.any():
        e_backend = rel_err(args.out[live], exact.out[live])
        e_ref = rel_err(expected.out[live], exact.out[live])
        assert e_backend <= 1.5 * e_ref + 1e-3, (e_backend, e_ref)


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_wide_and_stream_bit_identical(spec, device, require_backend):
    cfg = spec.cfg
    stream = _step("cutedsl", cfg, device, require_backend)
    wide = _step("cutedsl_wide", cfg, device, require_backend)
    a1 = make_case(spec, device)
    a2 = clone_args(a1)
    stream(a1)
    wide(a2)
    torch.cuda.synchronize()
    for buf in ("out", "state", "conv_state", "v_record", "kg_record"):
        assert bits_equal(getattr(a1, buf), getattr(a2, buf)), f"{buf} differs between kernels"


#: Shapes for the grid-size test: (spec, items per CTA) pairs whose grid differs from the
#: persistent one on an H100 / H200 (132 SMs, 264 resident CTAs; asserted in the test).
GRID_CASES = [
    (SPECS[6], 3), (SPECS[6], 4),           # T=1, 1280 items: 427 / 320 CTAs
    (SPECS[8], 1), (SPECS[8], 2),           # T=5, 768 items: 768 / 384 CTAs
    (CaseSpec(KdaConfig(num_heads=32, T=2, window=4, conv_layout="DS", record=True), R=24,
              null_frac=0.3, seed=11), 1),  # records, null slots: 768 CTAs
]


@pytest.mark.parametrize("spec,items_per_cta", GRID_CASES,
                         ids=[f"{s.id}-k{k}" for s, k in GRID_CASES])
def test_stream_grid_size_changes_nothing(spec, items_per_cta, device, require_backend,
                                          monkeypatch):
    """The streamed kernel's grid size (KDA_CUTEDSL_ITEMS_PER_CTA) only moves items between
    CTAs: results with at most k items per CTA are bit-identical to the persistent grid's
    (0: each of the 2 * SMs CTAs walks ~items / CTAs items, prefetching the next one)."""
    from kda.backend import stream_grid
    cfg = spec.cfg
    items = spec.R * cfg.num_heads
    resident = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    assert stream_grid(items, resident, items_per_cta) != stream_grid(items, resident, 0)
    steps = []
    for value in (0, items_per_cta):
        monkeypatch.setenv("KDA_CUTEDSL_ITEMS_PER_CTA", str(value))
        steps.append(require_backend("cutedsl", cfg, device).build(cfg, device))
        assert steps[-1].items_per_cta == value
    a1 = make_case(spec, device)
    a2 = clone_args(a1)
    steps[0](a1)
    steps[1](a2)
    torch.cuda.synchronize()
    for buf in ("out", "state", "conv_state", "v_record", "kg_record"):
        assert bits_equal(getattr(a1, buf), getattr(a2, buf)), f"{buf} differs"


FB_SPECS = [CaseSpec(KdaConfig(num_heads=32, T=1, window=3), R=128, null_frac=0.1, seed=21),
            CaseSpec(KdaConfig(num_heads=12, T=1, window=6, conv_layout="DS", lower_bound=-5.0,
                               gate_mode=1, has_conv_bias=True, record=True,
                               conv_state_dtype=torch.float32), R=9, null_frac=0.3, seed=22),
            CaseSpec(KdaConfig(num_heads=3, T=1, window=3), R=1, seed=23)]


@pytest.mark.parametrize("items_per_cta", [0, 4])
@pytest.mark.parametrize("spec", FB_SPECS, ids=[s.id for s in FB_SPECS])
def test_stream_fb_smem(spec, items_per_cta, device, require_backend, monkeypatch):
    """The streamed kernel's T=1 build with head-major items and f_b staged in shared memory
    (KDA_CUTEDSL_FB_SMEM=1), on the persistent grid and on 4 items per CTA: against the
    reference, and bit-identical to the build without it and to the wide kernel, three
    back-to-back steps on one pool, null slots and records included."""
    cfg = spec.cfg
    monkeypatch.setenv("KDA_CUTEDSL_ITEMS_PER_CTA", str(items_per_cta))
    steps = []
    for value in ("1", "0"):
        monkeypatch.setenv("KDA_CUTEDSL_FB_SMEM", value)
        steps.append(require_backend("cutedsl", cfg, device).build(cfg, device))
        assert steps[-1].ks.fb_smem == (value == "1")
    steps.append(require_backend("cutedsl_wide", cfg, device).build(cfg, device))
    args = [make_case(spec, device)]
    before = clone_args(args[0])
    expected = clone_args(args[0])
    args += [clone_args(args[0]), clone_args(args[0])]
    for _ in range(3):
        for step, a in zip(steps, args):
            step(a)
        reference_step(cfg, expected)
    torch.cuda.synchronize()
    errors = compare_step(args[0], expected, before)
    assert not errors, "\n".join(errors)
    for other in args[1:]:
        for buf in ("out", "state", "conv_state", "v_record", "kg_record"):
            assert bits_equal(getattr(args[0], buf), getattr(other, buf)), f"{buf} differs"


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("T", [1, 5])
def test_chained_steps(name, T, device, require_backend):
    """Three steps launched back to back on the same buffers (PDL chain) == reference x3."""
    spec = CaseSpec(KdaConfig(num_heads=32, T=T, window=T + 2), R=20, seed=11 + T)
    cfg = spec.cfg
    step = _step(name, cfg, device, require_backend)
    args = make_case(spec, device)
    before = clone_args(args)
    expected = clone_args(args)
    for _ in range(3):
        reference_step(cfg, expected)
    for _ in range(3):
        step(args)
    torch.cuda.synchronize()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", KINDS)
def test_cuda_graph(name, device, require_backend):
    spec = CaseSpec(KdaConfig(num_heads=32, T=1, window=3), R=1, null_frac=0.0, seed=21)
    cfg = spec.cfg
    step = _step(name, cfg, device, require_backend)
    eager = make_case(spec, device)
    graphed = clone_args(eager)
    step(eager)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(graphed)                        # captured, not run
    g.replay()
    torch.cuda.synchronize()
    for buf in ("out", "state", "conv_state"):
        assert bits_equal(getattr(graphed, buf), getattr(eager, buf)), buf
    # replay time (informative; the benchmark reports it precisely)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(20):
        g.replay()
    ev[0].record()
    for _ in range(200):
        g.replay()
    ev[1].record()
    torch.cuda.synchronize()
    us = ev[0].elapsed_time(ev[1]) * 1e3 / 200
    print(f"\n{name}: CUDA-graph replay of one R=1 T=1 H=32 step: {us:.2f} us")
    assert us < 50.0


def test_public_entry_point(device, require_backend):
    import kda

    spec = CaseSpec(KdaConfig(num_heads=8, T=2, window=4), R=5, seed=31)
    cfg = spec.cfg
    require_backend("cutedsl", cfg, device)
    args = make_case(spec, device)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(cfg, expected)
    out = kda.kda_decode(
        args.x, args.conv_weight, args.conv_bias, args.conv_state, args.f_a, args.f_b,
        args.beta, args.A_log, args.dt_bias, args.state, args.state_indices, args.output_gate,
        args.norm_weight, num_accepted_tokens=args.num_accepted_tokens, scale=cfg.scale,
        norm_eps=cfg.norm_eps, lower_bound=cfg.lower_bound, gate_mode=cfg.gate_mode,
        out=args.out, backend="cutedsl")
    torch.cuda.synchronize()
    assert out.data_ptr() == args.out.data_ptr()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


def _relocate(args, small_slots, big_slots):
    """Copy of ``args`` whose slot-indexed buffers have ``big_slots`` slots (NaN below the
    original ones, which move to the top) and whose valid slot ids are shifted accordingly."""
    off = big_slots - small_slots

    def grow(t):
        if t is None:
            return None
        flat = torch.full((big_slots * t.stride(0),), float("nan"), dtype=t.dtype, device=t.device)
        big = flat.as_strided((big_slots,) + tuple(t.shape[1:]), t.stride())
        big[off:].copy_(t)
        return big

    idx = args.state_indices.long()
    moved = torch.where((idx > 0) & (idx < small_slots), idx + off,
                        torch.where(idx >= small_slots, torch.full_like(idx, big_slots), idx))
    return args._replace(state=grow(args.state), conv_state=grow(args.conv_state),
                         v_record=grow(args.v_record), kg_record=grow(args.kg_record),
                         state_indices=moved.to(torch.int32)), off


@pytest.mark.parametrize("name", KINDS)
def test_slot_offsets_beyond_2_31(name, device, require_backend):
    """state[slot] at slot * slot_stride > 2**31 elements (an ~8.6 GiB state pool)."""
    if torch.cuda.get_device_properties(device).total_memory < 40 * (1 << 30):
        pytest.skip("needs a GPU with >= 40 GiB")
    spec = CaseSpec(KdaConfig(num_heads=32, T=2, window=4), R=3, null_frac=0.0, seed=41)
    cfg = spec.cfg
    step = _step(name, cfg, device, require_backend)
    small = make_case(spec, device)
    before = clone_args(small)
    expected = clone_args(small)
    reference_step(cfg, expected)
    n = small.state.shape[0]
    big_slots = (1 << 31) // small.state.stride(0) + n + 2
    big, off = _relocate(small, n, big_slots)
    assert (off + 1) * big.state.stride(0) > (1 << 31)
    step(big)
    torch.cuda.synchronize()
    view = big._replace(state=big.state[off:], conv_state=big.conv_state[off:],
                        state_indices=small.state_indices)
    errors = compare_step(view, expected, before)
    assert not errors, "\n".join(errors)
    assert torch.isnan(big.state[:off]).all() and torch.isnan(big.conv_state[:off]).all()


def test_compile_time_is_recorded(device, require_backend):
    from kda.backends.cutedsl import compile_seconds
    from kda.backends.cutedsl.cache import COMPILE_LOG

    _step("cutedsl", SPECS[0].cfg, device, require_backend)
    assert COMPILE_LOG and compile_seconds() > 0
    for rec in COMPILE_LOG:
        print(f"{rec.kind:6s} {rec.tag:48s} {rec.source:8s} {rec.seconds:6.2f} s")
