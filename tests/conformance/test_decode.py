"""Every backend against the reference on fresh random inputs across the contract's matrix.

Each case: draw inputs with NaN poison wherever nothing may be read or written, run the
backend through the public entry point, run the reference on a copy, and check with
:func:`kda.testing.compare_step`: outputs, states, windows (exact) and records within
tolerance, dead items' rows exact zeros, every other buffer element bit-for-bit untouched,
no NaN. A float64 run anchors the error: the backend may not be much further from the exact
function than the reference is. Every case and every test here runs with each state pool
dtype of ``--kda-state-dtypes`` (fp32 and bf16).
"""

import dataclasses

import pytest
import torch

from kda.reference import reference_compute, reference_step
from kda.testing import (CaseSpec, args_to, bits_equal, call_public, clone_args, compare_step,
                         expected_after, make_case, make_config, rel_err)
from tests.conformance.cases import STATE_DTYPES, cases
from tests.conftest import state_dtypes_of


def pytest_generate_tests(metafunc):  # noqa: D103 - pytest hook
    if "spec" in metafunc.fixturenames:
        cs = cases(metafunc.config.getoption("--kda-matrix"), state_dtypes_of(metafunc.config))
        metafunc.parametrize("spec", cs, ids=[c.id for c in cs])
    if "state_dtype" in metafunc.fixturenames:
        metafunc.parametrize("state_dtype", state_dtypes_of(metafunc.config))


def _with_state(spec: CaseSpec, state_dtype: str) -> CaseSpec:
    return dataclasses.replace(spec, cfg=dataclasses.replace(
        spec.cfg, state_dtype=STATE_DTYPES[state_dtype]))




def test_matches_reference(backend_name, spec, kda_device, require_backend):
    cfg = spec.cfg
    require_backend(backend_name, cfg, kda_device)
    args = make_case(spec, kda_device)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(cfg, expected)
    out = call_public(args, cfg, backend_name)
    assert out.data_ptr() == args.out.data_ptr()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)

    # error anchor: distance to the exact (float64, unrounded) function
    exact = reference_compute(cfg, args_to(before, kda_device), "float64")
    live = exact.live.repeat_interleave(cfg.T)
    if live.any():
        e_backend = rel_err(args.out[live], exact.out[live])
        e_ref = rel_err(expected.out[live], exact.out[live])
        assert e_backend <= 1.5 * e_ref + 1e-3, (e_backend, e_ref)


def test_repeatable(backend_name, state_dtype, kda_device, require_backend):
    """Two runs on the same inputs give bit-identical results (no races). Not under Triton's
    CPU interpreter, which runs a launch's programs one after another: there is no race to
    find, and the buffers a build keeps between launches are reused by
    test_three_steps_back_to_back (the same build at T = 3), against the reference."""
    from kda.backends.triton.backend import interpreter_enabled
    from tests.conformance.cases import ci_cases
    spec = _with_state(ci_cases()[7], state_dtype)
    cfg = spec.cfg
    require_backend(backend_name, cfg, kda_device)
    if backend_name == "triton" and kda_device.type == "cpu" and interpreter_enabled():
        pytest.skip("Triton's interpreter runs programs one at a time: no race to find")
    a1 = make_case(spec, kda_device)
    a2 = clone_args(a1)
    call_public(a1, cfg, backend_name)
    call_public(a2, cfg, backend_name)
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a1, name), getattr(a2, name)), name


def test_three_steps_back_to_back(backend_name, state_dtype, kda_device, require_backend):
    """Three steps launched back to back on the same buffers (no host sync between them; on
    the GPU a PDL chain) equal three reference steps: each step reads what the last wrote."""
    spec = _with_state(CaseSpec(make_config(2, 3, "DS", lb=-5.0), R=3, seed=5), state_dtype)
    cfg = spec.cfg
    require_backend(backend_name, cfg, kda_device)
    args = make_case(spec, kda_device)
    before, expected = expected_after(cfg, args, steps=3)
    for _ in range(3):
        call_public(args, cfg, backend_name)
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


def test_out_in_an_engine_buffer(backend_name, kda_device, require_backend):
    """``out`` as an engine hands it: the first N rows of its [1, N_max, H, 128] attention
    output buffer viewed as [N, H*128], beside the packed projection's rows and an activated
    beta; the buffer's rows past N are left alone. (With an fp32 state pool only: what is
    checked is where ``out`` is written, which the pool's dtype does not touch.)"""
    spec = CaseSpec(make_config(4, 2, beta_act=True), R=3, packed=True, seed=41)
    cfg = spec.cfg
    require_backend(backend_name, cfg, kda_device)
    args = make_case(spec, kda_device)
    N = args.x.shape[0]
    buf = torch.full((1, N + 5, cfg.num_heads, 128), float("nan"), dtype=torch.bfloat16,
                     device=kda_device)
    args = args._replace(out=buf[0, :N].view(N, cfg.dim))
    before, expected = expected_after(cfg, args)
    out = call_public(args, cfg, backend_name)
    assert out.data_ptr() == buf.data_ptr()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)
    assert torch.isnan(buf[0, N:].float()).all()
