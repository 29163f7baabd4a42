"""Hostile and edge inputs, for every backend: each has its documented behaviour.

* null / pad / out-of-range slot ids at every position of a row -> dead items or skipped writes
* num_accepted_tokens outside 1..T -> clamped
* two requests naming the same slot -> their results are unspecified, everyone else's exact
* all-zero q/k rows, extreme gate / beta / output-gate logits -> finite, as the reference
* NaN in one request's inputs -> does not reach any other request
* slot offsets past 2**31 elements (a contiguous pool, and an engine's pages with a slot pitch
  larger than the state), more than 65,535 items -> correct (GPU-scale, see marks)
"""

import pytest
import torch

from kda.config import KdaConfig
from kda.reference import reference_step
from kda.testing import CaseSpec, bits_equal, call_public, clone_args, compare_step, make_case

CFG_T = KdaConfig(num_heads=2, T=3, window=5)




def _check(args, cfg, backend, before=None):
    before = before or clone_args(args)
    expected = clone_args(before)
    reference_step(cfg, expected)
    call_public(args, cfg, backend)
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


def test_null_ids_at_every_position(backend_name, kda_device, require_backend):
    require_backend(backend_name, CFG_T, kda_device)
    a = make_case(CaseSpec(CFG_T, R=8, null_frac=0.0, alias=False, seed=21), kda_device)
    idx = a.state_indices.cpu()
    slots = a.state.shape[0]
    nacc = torch.tensor([1, 2, 3, 3, 2, 1, 3, 2], dtype=torch.int32)
    idx[0, 0] = 0          # dead conv slot (src = idx[0, 0] too)
    idx[1, 1] = -1         # dead source (a = 2)
    idx[2, 0] = slots      # conv slot past the pool, live-looking source
    idx[3, 1] = 0          # skipped write of token 1, live
    idx[4, 2] = -1         # skipped write of token 2, live
    idx[5, 1] = slots + 7  # skipped write past the pool, live
    idx[6, 0] = -1         # dead conv slot with a live source (a = 3)
    a.state_indices.copy_(idx)
    a.num_accepted_tokens.copy_(nacc)
    # the random case only filled the live sources' pages: fill every slot named above
    state = a.state
    for s in idx.flatten().tolist():
        if 0 < s < slots:
            state[s].normal_()
            a.conv_state[s].copy_(torch.randn(a.conv_state[s].shape).to(a.conv_state.dtype))
    _check(a, CFG_T, backend_name)


def test_accepted_counts_are_clamped(backend_name, kda_device, require_backend):
    require_backend(backend_name, CFG_T, kda_device)
    a = make_case(CaseSpec(CFG_T, R=4, null_frac=0.0, alias=False, seed=22), kda_device)
    for s in a.state_indices.flatten().tolist():
        a.state[s].normal_()
        a.conv_state[s].copy_(torch.randn(a.conv_state[s].shape).to(a.conv_state.dtype))
    b = clone_args(a)
    a.num_accepted_tokens.copy_(torch.tensor([0, -5, 4, 1000], dtype=torch.int32))
    b.num_accepted_tokens.copy_(torch.tensor([1, 1, 3, 3], dtype=torch.int32))
    call_public(a, CFG_T, backend_name)
    call_public(b, CFG_T, backend_name)
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a, name), getattr(b, name)), name


def test_shared_slot_across_requests_leaves_others_exact(backend_name, kda_device, require_backend):
    cfg = KdaConfig(num_heads=2)
    require_backend(backend_name, cfg, kda_device)
    a = make_case(CaseSpec(cfg, R=6, null_frac=0.0, seed=23), kda_device)
    before = clone_args(a)
    idx = a.state_indices
    shared = int(idx[0])
    idx[3] = shared                       # requests 0 and 3 name the same slot
    before.state_indices.copy_(idx)
    others = [r for r in range(6) if r not in (0, 3)]
    expected = clone_args(before)
    reference_step(cfg, expected)
    call_public(a, cfg, backend_name)
    for r in others:
        s = int(idx[r])
        assert torch.allclose(a.out[r].float().cpu(), expected.out[r].float().cpu(), atol=2e-2, rtol=2e-2)
        assert torch.allclose(a.state[s].cpu(), expected.state[s].cpu(), atol=1e-3, rtol=1e-3)
    # the shared slot holds finite values; nothing else changed
    assert torch.isfinite(a.state[shared]).all()
    assert torch.isfinite(a.out[[0, 3]].float()).all()
    touched = {int(s) for s in idx.tolist()}
    for s in range(a.state.shape[0]):
        if s not in touched:
            assert bits_equal(a.state[s], before.state[s]), s


def test_zero_qk_and_extreme_logits_stay_finite(backend_name, kda_device, require_backend):
    for lb in (None, -5.0):
        cfg = KdaConfig(num_heads=2, T=2, window=4, lower_bound=lb, has_conv_bias=True)
        require_backend(backend_name, cfg, kda_device)
        a = make_case(CaseSpec(cfg, R=6, null_frac=0.0, seed=24), kda_device)
        dim = cfg.dim
        # request 0: q and k rows and their history all zero (conv bias zero for them too)
        a.x[0:2, : 2 * dim] = 0
        a.conv_bias[: 2 * dim] = 0
        s0 = int(a.state_indices[0, 0])
        a.conv_state[s0, : 2 * dim] = 0
        # requests 1-3: gate logits around the softplus threshold and far beyond
        a.f_a[2:4] = 20.0
        a.f_a[4:6] = -1e4 / 128
        a.f_a[6:8] = 1e4 / 128
        a.beta[2:4] = 1e4
        a.beta[4:6] = -1e4
        a.output_gate[6:8] = -1e4
        a.output_gate[8:10] = 1e4
        a.dt_bias[:128] = 20.0
        before = clone_args(a)
        _check(a, cfg, backend_name, before)
        assert torch.isfinite(a.out.float()).all()


def test_nan_input_does_not_leak(backend_name, kda_device, require_backend):
    cfg = KdaConfig(num_heads=2, T=2, window=4)
    require_backend(backend_name, cfg, kda_device)
    a = make_case(CaseSpec(cfg, R=5, null_frac=0.0, seed=25), kda_device)
    a.x[2:4] = float("nan")                 # request 1's tokens
    a.f_a[2:4] = float("nan")
    expected = clone_args(a)
    reference_step(cfg, expected)
    call_public(a, cfg, backend_name)
    rows = [0, 1, 4, 5, 6, 7, 8, 9]
    assert torch.equal(torch.isnan(a.out[rows].float()), torch.zeros_like(a.out[rows], dtype=torch.bool))
    assert torch.allclose(a.out[rows].float(), expected.out[rows].float(), atol=2e-2, rtol=2e-2)
    for r in (0, 2, 3, 4):
        s = int(a.state_indices[r, 0])
        assert torch.isfinite(a.state[s]).all()


def _check_high_slots(cfg, backend_name, kda_device, state, conv_state, expected_pools, seed):
    """A 4-request step on slots near the end of a pool too large for 32-bit offsets: the
    requests' pages and windows are copied into slots ``[-1, -2, 131073, 5]``, the step runs
    in place, and the pools ``expected_pools()`` returns (copies, as ``(state, conv_state)``)
    get the reference step."""
    small = make_case(CaseSpec(cfg, R=4, null_frac=0.0, seed=seed), kda_device)
    slots = state.shape[0]
    high = torch.tensor([slots - 1, slots - 2, 131_073, 5], dtype=torch.int32, device=kda_device)
    for i, s in enumerate(high.tolist()):
        state[s] = small.state[int(small.state_indices[i])]
        conv_state[s] = small.conv_state[int(small.state_indices[i])]
    assert int(high[0]) * state.stride(0) > 2 ** 31
    a = small._replace(state=state, conv_state=conv_state, state_indices=high)
    exp_st, exp_cs = expected_pools()
    exp_args = a._replace(state=exp_st, conv_state=exp_cs, out=torch.empty_like(a.out))
    reference_step(cfg, exp_args)
    call_public(a, cfg, backend_name)
    assert torch.allclose(a.out.float(), exp_args.out.float(), atol=2e-2, rtol=2e-2)
    for s in high.tolist():
        assert torch.allclose(state[s], exp_st[s], atol=1e-3, rtol=1e-3), s
        assert torch.equal(conv_state[s], exp_cs[s]), s


@pytest.mark.bigmem
def test_slot_offsets_past_2_pow_31(backend_name, kda_device, require_backend):
    """A pool of 131,100 single-head slots: slot * 16384 passes 2**31 elements (8 GiB)."""
    if kda_device.type != "cuda":
        pytest.skip("GPU-scale case (8 GiB pool); runs on the GPU machine")
    cfg = KdaConfig(num_heads=1)
    require_backend(backend_name, cfg, kda_device)
    slots = 131_100
    state = torch.empty(slots, 1, 128, 128, device=kda_device)
    conv_state = torch.zeros(slots, 3, 384, dtype=torch.bfloat16, device=kda_device).transpose(1, 2)
    _check_high_slots(cfg, backend_name, kda_device, state, conv_state,
                      lambda: (state.clone(), conv_state.clone()), seed=26)


@pytest.mark.bigmem
def test_more_items_than_a_65535_grid(backend_name, kda_device, require_backend):
    if kda_device.type != "cuda":
        pytest.skip("GPU-scale case (70,000 items); runs on the GPU machine")
    cfg = KdaConfig(num_heads=2)
    require_backend(backend_name, cfg, kda_device)
    R = 35_000                                    # 70,000 items
    a = make_case(CaseSpec(cfg, R=R, null_frac=0.0, alias=False, seed=27), kda_device)
    _check(a, cfg, backend_name)


@pytest.mark.bigmem
def test_engine_pages_past_2_pow_31(backend_name, kda_device, require_backend):
    """An engine's paged pool, each slot's page its conv window then its state page (slot
    pitch 16,960 floats, larger than H*128*128), 131,100 single-head slots (8.9 GB): the state
    offsets of the high slots pass 2**31 elements (and 2**32 bytes)."""
    if kda_device.type != "cuda":
        pytest.skip("GPU-scale case (8.9 GB pool); runs on the GPU machine")
    cfg = KdaConfig(num_heads=1)
    require_backend(backend_name, cfg, kda_device)
    slots = 131_100
    cs_bytes = 3 * cfg.dim * cfg.window * 2
    page = cs_bytes + 128 * 128 * 4

    def views(raw):
        cs = torch.as_strided(raw.view(torch.bfloat16), (slots, 3 * cfg.dim, cfg.window),
                              (page // 2, 1, 3 * cfg.dim))
        st = torch.as_strided(raw.view(torch.float32), (slots, 1, 128, 128),
                              (page // 4, 128 * 128, 128, 1), cs_bytes // 4)
        return st, cs

    raw = torch.zeros(slots * page, dtype=torch.uint8, device=kda_device)
    state, conv_state = views(raw)
    _check_high_slots(cfg, backend_name, kda_device, state, conv_state,
                      lambda: views(raw.clone()), seed=28)
    assert not raw[page * (slots - 3):page * (slots - 2)].any()   # a slot nobody named
