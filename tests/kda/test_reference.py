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
