"""The reference against code nobody here wrote: fla-core 0.6.0's pure-PyTorch KDA pieces.

The independent path: the conv through ``torch.nn.functional.conv1d`` over [history, x], the
L2 norm as the contract writes it, the gate through fla's ``naive_kda_gate`` /
``naive_kda_lowerbound_gate``, the recurrence through fla's ``naive_recurrent_kda`` (K-major
state, so the transpose is checked too) one token at a time, and the norm through fla's
``rms_norm_ref`` times sigmoid(output gate). Our float64 mode must agree to fp32 precision
(fla computes in fp32); our bf16 mode to bf16 precision.
"""

import pytest
import torch
import torch.nn.functional as F

from kda.config import KdaConfig
from kda.reference import reference_compute
from kda.testing import CaseSpec, make_case, rel_err

fla_naive = pytest.importorskip("fla.ops.kda.naive")
fla_gate = pytest.importorskip("fla.ops.kda.gate")
fla_norm = pytest.importorskip("fla.modules.norm.layernorm_gated")

D = 128


def independent(cfg: KdaConfig, a):
    """One decode step from fla-core pieces; returns (out [R*T, dim], states [R, T, H, V, K], live)."""
    H, T, dim = cfg.num_heads, cfg.T, cfg.dim
    R = a.state_indices.shape[0]
    slots = a.state.shape[0]
    idx = a.state_indices.long().view(R, -1)
    nacc = a.num_accepted_tokens.long().clamp(1, T) if T > 1 else torch.ones(R, dtype=torch.long)
    src = idx[torch.arange(R), nacc - 1]
    cslot = idx[:, 0]
    live = (src > 0) & (src < slots) & (cslot > 0) & (cslot < slots)
    out = torch.zeros(R, T, dim, dtype=torch.float64)
    states = torch.zeros(R, T, H, D, D, dtype=torch.float64)
    for r in torch.nonzero(live)[:, 0].tolist():
        off = int(nacc[r]) - 1
        hist = a.conv_state[cslot[r], :, off:off + 3].double()               # [3dim, 3]
        xr = a.x.view(R, T, 3 * dim)[r].double().t()                         # [3dim, T]
        seq = torch.cat([hist, xr], 1)[None]                                   # [1, 3dim, T+3]
        w = a.conv_weight.double().permute(0, 2, 1).reshape(3 * dim, 1, 4)
        b = a.conv_bias.double() if a.conv_bias is not None else None
        y = F.silu(F.conv1d(seq, w, b, groups=3 * dim))[0].t()                # [T, 3dim]
        q, k, v = y.view(T, 3, H, D).unbind(1)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        rg = (a.f_a.view(R, T, 128)[r].double() @ a.f_b.double().t()).view(T, H, D)
        if cfg.lower_bound is None:
            g = fla_gate.naive_kda_gate(rg, a.A_log.double(), a.dt_bias.double(), torch.float64)
        else:
            g = fla_gate.naive_kda_lowerbound_gate(rg, a.A_log.double(), a.dt_bias.double(),
                                                   cfg.lower_bound, torch.float64)
        beta = torch.sigmoid(a.beta.view(R, T, H)[r].double())
        S = a.state[src[r]].double().transpose(-1, -2)[None]                   # K-major [1,H,K,V]
        o = torch.zeros(T, H, D, dtype=torch.float64)
        for t in range(T):
            ot, S = fla_naive.naive_recurrent_kda(
                q[t][None, None], k[t][None, None], v[t][None, None], g[t][None, None],
                beta[t][None, None], scale=cfg.scale, initial_state=S, output_final_state=True)
            o[t] = ot[0, 0].double()
            states[r, t] = S[0].transpose(-1, -2).double()
        normed = fla_norm.rms_norm_ref(o, a.norm_weight.double(), None, eps=cfg.norm_eps)
        gate = torch.sigmoid(a.output_gate.view(R, T, H, D)[r].double())
        out[r] = (normed * gate).reshape(T, dim)
    return out.view(R * T, dim), states, live


CFGS = [
    KdaConfig(num_heads=2),
    KdaConfig(num_heads=3, lower_bound=-5.0, has_conv_bias=True, conv_layout="DS"),
    KdaConfig(num_heads=2, T=3, window=6, lower_bound=-2.5),
    KdaConfig(num_heads=1, T=5, window=7, conv_layout="DS", has_conv_bias=True),
]


@pytest.mark.parametrize("cfg", CFGS, ids=[c.short() for c in CFGS])
def test_reference_matches_fla(cfg):
    a = make_case(CaseSpec(cfg, R=4, seed=11))
    ref_out, states, live = independent(cfg, a)
    assert live.any()
    rows = live.repeat_interleave(cfg.T)
    exact = reference_compute(cfg, a, "float64")
    e_out = rel_err(exact.out[rows], ref_out[rows])
    assert e_out < 2e-5, e_out                    # fla runs in fp32
    if cfg.T > 1:
        assert rel_err(exact.states[live], states[live]) < 2e-5
    else:
        assert rel_err(exact.states[live, 0], states[live, 0]) < 2e-5
    rounded = reference_compute(cfg, a, "bf16")
    e_bf16 = rel_err(rounded.out[rows].double(), ref_out[rows])
    assert 1e-4 < e_bf16 < 2e-2, e_bf16           # the rounding points are really there
    assert rel_err(rounded.states[live], states[live]) < 2e-2
