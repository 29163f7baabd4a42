"""The conformance comparator catches each known trap: a test that cannot fail is a defect.

Each mutant is the reference with one planted fault of the kind the contract's "known traps"
lists (K-major state, missing bf16 rounding of o, eps on the mean, a stray write for a dead
item, a shifted window, NaN, nonzero dead rows, a skipped per-token write, the wrong gate).
:func:`kda.testing.compare_step` must report every one and pass the faithful reference.
"""

import dataclasses

import pytest
import torch

from kda import reference, testing
from kda.config import KdaConfig
from kda.reference import reference_step
from kda.testing import CaseSpec, clone_args, compare_step, make_case

@pytest.fixture(autouse=True, params=["whole", "one-slot-slices"])
def _slicing(request, monkeypatch):
    """Every check twice: buffers compared whole, and one dim-0 entry per slice (what the
    GPU-scale cases do with large pools): the verdicts must not depend on the slicing."""
    if request.param == "one-slot-slices":
        orig = testing._dim0_slices
        monkeypatch.setattr(testing, "_dim0_slices", lambda t: orig(t, elements=1))


CFG = KdaConfig(num_heads=2, T=1, window=3)
CFG_T = KdaConfig(num_heads=2, T=3, window=5)
CFG_REC = KdaConfig(num_heads=2, T=2, window=4, record=True)


def _run(cfg, mutate=None, spec_cfg=None, monkey=None):
    args = make_case(CaseSpec(spec_cfg or cfg, R=6, seed=3))
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(spec_cfg or cfg, expected)
    reference_step(cfg, args)
    if mutate:
        mutate(args, before)
    return compare_step(args, expected, before)


def test_faithful_reference_passes():
    for cfg in (CFG, CFG_T, CFG_REC):
        assert _run(cfg) == []


def _live_src(args):
    si = args.state_indices
    return int(si[(si > 0) & (si < args.state.shape[0])][0]) if si.dim() == 1 else None


def test_k_major_state_is_caught():
    def m(args, before):
        s = _live_src(args)
        args.state[s] = args.state[s].transpose(-1, -2).clone()
    assert any("state" in e for e in _run(CFG, m))


def test_o_not_rounded_is_caught(monkeypatch):
    orig = reference.reference_compute

    def no_o_rounding(cfg, args, precision="bf16"):
        res = orig(cfg, args, precision)
        exact = orig(cfg, args, "float64")
        # recompute out from the unrounded o of the float64 path, rounded once at the end
        res.out = exact.out.to(torch.bfloat16)
        return res
    monkeypatch.setattr(reference, "reference_compute", no_o_rounding)
    args = make_case(CaseSpec(CFG, R=8, seed=5, null_frac=0.0))
    before = clone_args(args)
    reference_step(CFG, args)
    monkeypatch.undo()
    expected = clone_args(before)
    reference_step(CFG, expected)
    errs = compare_step(args, expected, before)
    assert any(e.startswith("out:") for e in errs), errs


def test_wrong_l2_eps_is_caught(monkeypatch):
    monkeypatch.setattr(reference, "L2_NORM_EPS", 1e-6 * 128)   # eps scaled as if on the mean
    args = make_case(CaseSpec(CFG, R=6, seed=3))
    before = clone_args(args)
    # shrink q/k (inputs and history) so that the eps matters
    for a in (args, before):
        a.x.mul_(1e-3)
        a.conv_state.mul_(1e-3)
    reference_step(CFG, args)
    monkeypatch.undo()
    expected = clone_args(before)
    reference_step(CFG, expected)
    assert compare_step(args, expected, before)


def test_dead_item_write_is_caught():
    def m(args, before):
        args.state[0].fill_(0.5)        # slot 0 is the null slot: its poison must stay
    assert any("outside what the step may write" in e for e in _run(CFG, m))


def test_window_shift_is_caught():
    def m(args, before):
        cs = args.conv_state
        live = torch.isfinite(cs[:, 0, 0].float())
        s = int(torch.nonzero(live)[0])
        cs[s, :, 0] = cs[s, :, 1]
    assert any("conv_state" in e for e in _run(CFG, m))


def test_nan_output_is_caught():
    def m(args, before):
        live_rows = (args.out != 0).any(1)
        args.out[int(torch.nonzero(live_rows)[0])] = float("nan")
    assert any("NaN" in e for e in _run(CFG, m))


def test_nonzero_dead_row_is_caught():
    def m(args, before):
        dead = (args.out == 0).all(1)
        args.out[int(torch.nonzero(dead)[0]), 0] = 1e-6
    assert any("exact zeros" in e for e in _run(CFG, m))


def test_live_zero_is_held_to_the_tolerance():
    """An element of a live row that the reference sets to exactly zero is an ordinary value
    (within out's tolerance), not a dead row: dead rows come from the slot ids."""
    args = make_case(CaseSpec(CFG, R=6, seed=3))
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(CFG, expected)
    reference_step(CFG, args)
    row = int(torch.nonzero((expected.out != 0).any(1))[0])
    expected.out[row, 5] = 0.0
    args.out[row, 5] = 1e-4
    assert compare_step(args, expected, before) == []
    args.out[row, 5] = 0.5
    assert any(e.startswith("out:") for e in compare_step(args, expected, before))


def test_skipped_token_write_is_caught():
    def m(args, before):
        # undo the write of token 0 for every request (restore the poison)
        idx = args.state_indices[:, 0].long()
        ok = (idx > 0) & (idx < args.state.shape[0])
        for s in idx[ok].tolist():
            args.state[s] = before.state[s]
    errs = _run(CFG_T, m)
    assert any(e.startswith("state") for e in errs), errs


def test_wrong_gate_is_caught():
    bounded = dataclasses.replace(CFG, lower_bound=-5.0)
    errs = _run(bounded, spec_cfg=CFG)
    assert errs


def test_record_fault_is_caught():
    def m(args, before):
        vr = args.v_record
        finite = torch.isfinite(vr)
        vr[finite] = vr[finite] * 1.01
    assert any("v_record" in e for e in _run(CFG_REC, m))


CFG_BF16 = KdaConfig(num_heads=2, T=3, window=5, state_dtype=torch.bfloat16)


def _run_bf16(mutate=None):
    return _run(CFG_BF16, mutate)


def test_bf16_state_faithful_reference_passes():
    assert _run_bf16() == []
    assert _run(dataclasses.replace(CFG_BF16, T=1, window=3)) == []


def test_bf16_state_dead_page_write_is_caught():
    """One bit of a page no live item writes (poison) changed in a bf16 pool."""
    def m(args, before):
        bits = args.state.view(torch.int16)
        untouched = (bits == before.state.view(torch.int16)).flatten(1).all(1)
        s = int(untouched.nonzero()[0])
        bits[s, 0, 0, 0] ^= 1
    assert any("state" in e and "outside" in e for e in _run_bf16(m))


def _ulp_moves(args, before, every):
    """Move every ``every``-th written bf16 state element one ulp toward zero."""
    bits = args.state.view(torch.int16)
    changed = ~(bits == before.state.view(torch.int16)).flatten(1).all(1)
    page = bits[changed]
    flat = page.view(-1)
    sel = flat[::every]
    fin = torch.isfinite(sel.view(torch.bfloat16).float()) & (sel & 0x7FFF != 0)
    flat[::every] = torch.where(fin, sel - 1, sel)
    bits[changed] = page


def test_bf16_state_few_one_ulp_flips_pass():
    """An fp32 difference straddling a bf16 rounding boundary: one ulp on a few elements."""
    assert _run_bf16(lambda a, b: _ulp_moves(a, b, 50)) == []


def test_bf16_state_truncation_is_caught():
    """About half the elements one ulp toward zero (what a truncating cast does): every one
    within one ulp, but far too many differ."""
    errs = _run_bf16(lambda a, b: _ulp_moves(a, b, 2))
    assert any(e.startswith("state:") and "differ from the reference" in e for e in errs), errs


def test_bf16_state_beyond_one_ulp_is_caught():
    """5% of the elements two ulps off: beyond the one-ulp bound for more than 1%."""
    def m(args, before):
        _ulp_moves(args, before, 20)
        _ulp_moves(args, before, 20)
    errs = _run_bf16(m)
    assert any(e.startswith("state:") and "beyond atol" in e for e in errs), errs
