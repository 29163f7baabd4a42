"""The reference's two emulated single roundings (a conv tap's fma, a gate k16 step) are single
roundings: inputs where a float64 sum rounded again to fp32 lands one ulp off (found by a
review; the values come from its search)."""

import pytest
import torch

from kda import reference
from kda.reference import reference_compute
from kda.testing import CaseSpec, make_case, make_config


def test_conv_tap_is_one_fma():
    # acc = b + s*w with s*w just above half an fp32 ulp of b: fma rounds up, a float64 sum
    # rounded again to fp32 rounds to b (a tie) and bf16(silu(.)) ends one bf16 ulp lower.
    cfg = make_config(1, 1, bias=True)
    a = make_case(CaseSpec(cfg, R=1, null_frac=0.0))
    c = 128                                            # k channel 0 of head 0
    a.conv_bias.zero_()
    a.conv_bias[c] = 1.2823691368103027
    a.conv_weight.zero_()
    a.conv_weight[1, 0, 0] = 5.868765029504175e-08     # tap 0 of the k part
    a.conv_state[int(a.state_indices[0]), c, 0] = 1.015625
    assert reference_compute(cfg, a).k_raw[0, 0, 0, 0].item() == 1.0078125


@pytest.mark.parametrize("gate_mode", [0, 1])
def test_gate_k16_step_is_rounded_once(gate_mode):
    # one k16 step: 1 + 2^-8 + 2^-24 + 2^-80 exactly -> fp32 1 + 2^-8 + 2^-23 -> bf16 1.0078125;
    # summed in float64 first (1 + 2^-8 + 2^-24, a tie) it rounds to 1 + 2^-8 and bf16 to 1.0.
    cfg = make_config(1, 1, gm=gate_mode)
    a = make_case(CaseSpec(cfg, R=1, null_frac=0.0))
    a.f_a.zero_()
    a.f_b.zero_()
    for j, e in enumerate([0, -4, -12, -40]):
        a.f_a[0, j] = 2.0 ** e
        a.f_b[0, j] = 2.0 ** e
    assert reference_compute(cfg, a).rg[0, 0, 0, 0].item() == 1.0078125


def test_to_f32_once_matches_exact_rounding_on_random_pairs():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(20000, generator=g, dtype=torch.float64)
    b = torch.randn(20000, generator=g, dtype=torch.float64) * 2.0 ** -30
    got = reference._to_f32_once(*reference._two_sum(a, b))
    from fractions import Fraction
    import numpy as np
    for i in range(0, 20000, 97):                      # exact rational check on a sample
        exact = Fraction(a[i].item()) + Fraction(b[i].item())
        lo = np.float32(float(exact))
        cands = [lo, np.nextafter(lo, np.float32(-np.inf)), np.nextafter(lo, np.float32(np.inf))]
        best = min(cands, key=lambda c: (abs(Fraction(float(c)) - exact),
                                         int(np.array(c).view(np.uint32)) & 1))
        assert got[i].item() == float(best), i


def _widened(args):
    """``args`` with the bf16 state pool copied into an fp32 one (the same values, NaN
    poison included)."""
    from kda.testing import clone_args
    c = clone_args(args)
    return c._replace(state=c.state.float())


@pytest.mark.parametrize("T,record", [(1, False), (3, False), (2, True)])
def test_bf16_state_is_widened_and_each_write_rounded_once(T, record):
    """A bf16 pool gives what the fp32 pool of the same values gives, with each state written
    rounded once to nearest even (T > 1: every token's write, the recurrence carrying the
    unrounded fp32 state), and the same out, window and fp32 records; pages no live write
    targets keep their bits."""
    from kda.reference import reference_step
    from kda.testing import bits_equal, clone_args
    cfg16 = make_config(2, T, record=record, bf16_state=True)
    cfg32 = make_config(2, T, record=record)
    a16 = make_case(CaseSpec(cfg16, R=6, seed=4))
    before = clone_args(a16)
    a32 = _widened(a16)
    reference_step(cfg16, a16)
    reference_step(cfg32, a32)
    assert a16.state.dtype == torch.bfloat16
    for name in ("out", "conv_state", "v_record", "kg_record"):
        assert bits_equal(getattr(a16, name), getattr(a32, name)), name
    fin = torch.isfinite(a32.state)              # (NaN poison: payload bits not carried)
    assert torch.equal(fin, torch.isfinite(a16.state.float()))
    # torch's cast: nearest even
    assert bits_equal(a16.state[fin], a32.state[fin].to(torch.bfloat16))
    if record:
        assert a16.v_record.dtype == torch.float32
        assert bits_equal(a16.state, before.state)
    written = ~(a16.state.view(torch.int16) == before.state.view(torch.int16)).all(-1).all(-1).all(-1)
    assert written.any() or record
    # each written page is the fp32 state after its token rounded once (not twice, not
    # truncated): a T > 1 write of token t equals bf16(fp32 state t) from the same recurrence
    res = reference_compute(cfg32, _widened(before))
    if T > 1 and not record:
        idx = before.state_indices.long()
        for r in range(idx.shape[0]):
            if not res.live[r]:
                continue
            for t in range(T):
                s = int(idx[r, t])
                # the last write to a slot lands (an aliasing source is read before any write)
                last = max(u for u in range(T) if int(idx[r, u]) == s)
                if 0 < s < a16.state.shape[0] and last == t:
                    assert bits_equal(a16.state[s], res.states[r, t].to(torch.bfloat16)), (r, t)


def test_bf16_state_rounds_to_nearest_even():
    """The written bf16 state is fp32 rounded to nearest, ties to even (torch's cast); a
    truncating cast would differ on these values."""
    x = torch.tensor([1 + 2 ** -8 + 2 ** -10, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -7 + 2 ** -9)])
    got = x.to(torch.bfloat16).float()
    assert got.tolist() == [1 + 2 ** -7, 1.0, 1 + 2 ** -6, -(1 + 2 ** -7)]


@pytest.mark.parametrize("cs32", [False, True])
@pytest.mark.parametrize("T", [1, 3])
def test_window_copies_keep_nan_bits(T, cs32):
    """The rewritten window holds copies (the contract, section 3): a NaN in the history or in
    x keeps its sign and payload bits (torch's CPU gather and fp32 round trip of bf16 made
    every one 0xffff; a breaker's trial), in a bf16 and an fp32 conv cache."""
    from kda.reference import reference_step
    cfg = make_config(1, T, cs32=cs32)
    a = make_case(CaseSpec(cfg, R=1, seed=5, null_frac=0.0))
    nans = torch.tensor([0xFFC1 - 65536, 0x7F81, 0x7FC0], dtype=torch.int16).view(torch.bfloat16)
    a.x[0, :3] = nans
    slot = int(a.state_indices.view(-1)[0])
    off = 0 if T == 1 else min(max(int(a.num_accepted_tokens[0]), 1), T) - 1   # clamped
    a.conv_state[slot, :3, off + 1] = nans.to(a.conv_state.dtype)
    want_hist = a.conv_state[slot, :3, off + 1].clone()
    want_x = nans.to(a.conv_state.dtype)
    reference_step(cfg, a)
    bits = {2: torch.int16, 4: torch.int32}[a.conv_state.element_size()]
    assert torch.equal(a.conv_state[slot, :3, 0].contiguous().view(bits), want_hist.view(bits))
    assert torch.equal(a.conv_state[slot, :3, 2].contiguous().view(bits), want_x.view(bits))
