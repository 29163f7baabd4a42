"""GPU tests of what is specific to the ``cuda`` backend's kernel, against
:func:`kda.reference.reference_step` (the cross-backend matrix is tests/conformance/).

* the T builds that the conformance matrix (T = 1, 2, 5, 8) does not reach;
* the builds for rows of x / output_gate / f_a that are not 16-byte aligned (an engine's
  packed projection: 8-, 4- and 2-byte rows), at every T, with many items per CTA;
* the item schedule: each CTA walks a static head-major range, then takes items from an atomic
  counter pair that the built step keeps per CUDA stream and every launch leaves at zero; three
  launches back to back under programmatic dependent launch, shapes with many items per CTA
  (ranges that cross heads, so the T=1 build restages the f_b rows), dead first items, fewer
  items than CTAs; two streams at once; bit repeatability while the counter hands items to
  different CTAs from run to run.

Skipped without an sm_90 GPU (failed instead under ``--kda-require-backends``). On the GPU
machine::

    python3 -m pytest tests/backends/cuda -v
"""

import pytest
import torch

from kda.reference import reference_step
from kda.testing import CaseSpec, bits_equal, clone_args, compare_step, make_case, make_config


@pytest.fixture(autouse=True)
def _require_cuda_backend(require_available):
    """Skip without an sm_90 GPU; fail instead under --kda-require-backends (the GPU machine)."""
    require_available("cuda")


DEV = torch.device("cuda")


def _step(cfg):
    from kda.backends.cuda import BACKEND
    reasons = BACKEND.unsupported(cfg, DEV)
    assert not reasons, reasons
    return BACKEND.build(cfg, DEV)


def _counters_are_zero(step):
    return all(c.tolist()[:2] == [0, 0] for c in step.counters.newest().values())


# the T builds outside the conformance matrix's T = 1, 2, 5, 8
OTHER_T = [
    CaseSpec(make_config(3, 3, "SD", gm=1), R=5),
    CaseSpec(make_config(2, 4, "DS", bf16_weights=True), R=4),
    CaseSpec(make_config(2, 6, "SD", lb=-5.0, extra_window=1), R=3),
    CaseSpec(make_config(2, 7, "DS", gm=1, bias=True), R=3),
    # the bf16-state builds of the same T
    CaseSpec(make_config(3, 3, "DS", lb=-5.0, bf16_state=True), R=5),
    CaseSpec(make_config(2, 4, "SD", gm=1, bias=True, bf16_state=True), R=4, null_frac=0.3),
    CaseSpec(make_config(2, 6, "DS", record=True, bf16_state=True), R=3),
    CaseSpec(make_config(2, 7, "SD", bf16_weights=True, bf16_state=True), R=3, padded=True),
]


@pytest.mark.parametrize("spec", OTHER_T, ids=[c.id for c in OTHER_T])
def test_other_T_builds(spec):
    cfg = spec.cfg
    args = make_case(spec, DEV)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(cfg, expected)
    _step(cfg)(args)
    torch.cuda.synchronize()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


# x / output_gate / f_a rows 8-, 4- or 2-byte aligned (kda.backend.row_bytes): the narrow
# builds, at every T, the T=1 one (f_b staged) across heads
ROW_CASES = [
    CaseSpec(make_config(4, 1, beta_act=True), R=300, packed=True, null_frac=0.2),
    CaseSpec(make_config(2, 2, "DS", gm=1), R=40, packed=True),
    CaseSpec(make_config(3, 3, lb=-5.0, bias=True), R=30, packed=True, offset_rows=True),
    CaseSpec(make_config(4, 4, "DS", beta_act=True, cs32=True), R=20, packed=True),
    CaseSpec(make_config(1, 5, record=True, beta_act=True), R=50, packed=True),
    CaseSpec(make_config(2, 6, bf16_weights=True), R=20, offset_rows=True),
    CaseSpec(make_config(2, 7, "DS", bias=True), R=20, packed=True),
    CaseSpec(make_config(3, 8, "DS", record=True), R=12, packed=True, offset_rows=True),
    CaseSpec(make_config(4, 1, bf16_state=True), R=300, packed=True, null_frac=0.2),
    CaseSpec(make_config(3, 5, "DS", beta_act=True, bf16_state=True), R=30, offset_rows=True),
]


@pytest.mark.parametrize("spec", ROW_CASES, ids=[c.id for c in ROW_CASES])
def test_row_builds(spec):
    """Three steps back to back on the narrow build of the case's rows == the reference x3."""
    from kda.backend import row_bytes
    cfg = spec.cfg
    args = make_case(spec, DEV)
    assert row_bytes(args) < 16
    before = clone_args(args)
    expected = clone_args(args)
    step = _step(cfg)
    for _ in range(3):
        step(args)
        reference_step(cfg, expected)
    torch.cuda.synchronize()
    assert _counters_are_zero(step)
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


# (An H200 has 132 SMs, 264 resident CTAs. T=1 walks 0.8 of each CTA's share as a static range
# first, T >= 2 takes every item after a CTA's first from the counter.)
SCHEDULE_CASES = [
    CaseSpec(make_config(32, 1), R=128, null_frac=0.1),            # 4096 items: ranges of 12
    CaseSpec(make_config(4, 1, "DS", lb=-5.0, gm=1, bias=True), R=300, null_frac=0.3),
    CaseSpec(make_config(12, 1, "SD", gm=1, bias=True, cs32=True, bf16_weights=True), R=90,
             padded=True),                                          # ranges cross heads
    CaseSpec(make_config(8, 1, record=True, bias=True), R=100, null_frac=0.2),
    CaseSpec(make_config(32, 1), R=64, null_frac=0.5, seed=5),     # dead first items
    CaseSpec(make_config(4, 1), R=6, null_frac=0.0),               # fewer items than CTAs
    CaseSpec(make_config(32, 5, "SD", gm=1), R=64, null_frac=0.1),
    CaseSpec(make_config(16, 8, "DS", record=True), R=20),
    CaseSpec(make_config(2, 3, "DS"), R=5, null_frac=0.0),
    CaseSpec(make_config(32, 1, bf16_state=True), R=128, null_frac=0.1),
    CaseSpec(make_config(32, 5, "SD", gm=1, bf16_state=True), R=64, null_frac=0.1),
]


@pytest.mark.parametrize("spec", SCHEDULE_CASES, ids=[c.id for c in SCHEDULE_CASES])
def test_back_to_back_steps(spec):
    """Three steps on one pool with no host sync between them: each launch reads the previous
    launch's pages and windows (everything after its griddepcontrol.wait), and the last CTA of
    each launch leaves the counters at zero for the next (asserted after the third)."""
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
    assert len(step.counters.newest()) == 1 and _counters_are_zero(step)
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


def test_schedule_on_two_streams():
    """One built step launched on two streams at once: each stream gets its own counter pair,
    so both steps stay right."""
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
    assert len(step.counters.newest()) == 2 and _counters_are_zero(step)
    # two steps per pool: compare against the reference applied twice
    for (args, expected, before), spec in zip(runs, specs):
        reference_step(spec.cfg, expected)
        errors = compare_step(args, expected, before)
        assert not errors, "\n".join(errors)


@pytest.mark.parametrize("spec", [CaseSpec(make_config(32, 5, "DS", gm=1, bias=True), R=33),
                                  CaseSpec(make_config(32, 1, "SD", bias=True), R=200)],
                         ids=lambda s: s.id)
def test_repeatable(spec):
    """Two runs on the same inputs give bit-identical results although the counter hands the
    items to other CTAs from run to run (no races, no dependence on the CTA)."""
    a1 = make_case(spec, DEV)
    a2 = clone_args(a1)
    step = _step(spec.cfg)
    step(a1)
    step(a2)
    torch.cuda.synchronize()
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a1, name), getattr(a2, name)), name
