"""The CuTe DSL kernels on a GPU: what is specific to this backend.

Skipped without CUDA. On the GPU machine run (from the repository root):

    python3 -m pytest -q tests/backends/cutedsl/test_cutedsl_gpu.py --kda-require-backends

Correctness against the reference, CUDA graphs, the public entry points and 64-bit slot
offsets are the conformance suite's (``tests/conformance``). Here (``cutedsl`` = stream,
``cutedsl_wide`` = wide):
  * wide and stream produce bit-identical out / state / conv_state / records, on
    configurations covering T in {1, 2, 5, 8}, both conv layouts, both gates, gate_mode 0/1,
    conv bias, record mode, fp32 conv state, bf16 weights, padded strides, null slots,
    aliasing, and batches large enough that each CTA walks several items;
  * the streamed kernel's grid size only moves items between CTAs: the persistent grid and
    smaller-range grids give the same bits;
  * three chained steps on the same buffers (programmatic dependent launch back to back, the
    dependents' trigger after each CTA's last write) match three reference steps;
  * every compile / load is recorded.
"""

import pytest
import torch

from kda.config import KdaConfig
from kda.reference import reference_step
from kda.testing import CaseSpec, bits_equal, clone_args, compare_step, make_case

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
def test_stream_grid_size_changes_nothing(spec, items_per_cta, device, require_backend):
    """The streamed kernel's grid size only moves items between CTAs: results with at most k
    items per CTA (the launcher's ``items_per_cta``) are bit-identical to the persistent
    grid's (0: each of the 2 * SMs CTAs walks ~items / CTAs items)."""
    from kda.backend import stream_grid
    cfg = spec.cfg
    items = spec.R * cfg.num_heads
    resident = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    assert stream_grid(items, resident, items_per_cta) != stream_grid(items, resident, 0)
    steps = []
    for value in (0, items_per_cta):
        steps.append(require_backend("cutedsl", cfg, device).build(cfg, device))
        steps[-1].items_per_cta = value
    a1 = make_case(spec, device)
    a2 = clone_args(a1)
    steps[0](a1)
    steps[1](a2)
    torch.cuda.synchronize()
    for buf in ("out", "state", "conv_state", "v_record", "kg_record"):
        assert bits_equal(getattr(a1, buf), getattr(a2, buf)), f"{buf} differs"


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


def test_compile_time_is_recorded(device, require_backend):
    from kda.backends.cutedsl import compile_seconds
    from kda.backends.cutedsl.cache import COMPILE_LOG

    _step("cutedsl", SPECS[0].cfg, device, require_backend)
    assert COMPILE_LOG and compile_seconds() > 0
    for rec in COMPILE_LOG:
        print(f"{rec.kind:6s} {rec.tag:48s} {rec.source:8s} {rec.seconds:6.2f} s")
