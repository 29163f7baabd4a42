"""The SGLang adapter (kda/integrations/sglang.py) on SGLang 0.5.23's tensor layouts, without SGLang.

Runs in the default suite: nothing here imports SGLang. SGLang's decode path cannot run here
as it is (its kernels are Triton kernels for a GPU; they run on a CPU only in Triton's
interpreter with SGLang and its import-time dependencies installed, which
``tools/sglang/run_tests.sh`` does for ``test_sglang_package.py``). So the baseline here is
``sglang_decode``, a PyTorch transcription of what SGLang 0.5.23 computes for one Kimi-Linear
decode batch, written from its source (each step cites the file and function), plus kda's
``reference`` backend called directly on the op's native layouts:

* the adapter's output, state pool and conv pool after 1-3 steps equal the transcription's
  within kda.testing's tolerances (the conv window exactly), for the live requests;
* they equal kda's reference run on re-laid-out copies bit for bit (so the mapping, not just
  the numerics, is right);
* the SGLang pools are updated in place (no copies): other layers' pages and SGLang's padding
  slot 0 stay bit-identical;
* ``forward_decode`` reads the caches and slot table where SGLang keeps them, calls the
  backend's ``_track_mamba_state_decode`` as SGLang's ``forward_decode`` does, and caches the
  conv-weight re-layout and the step per layer;
* bad arguments raise ``KdaArgumentError`` naming them.

The transcription itself is checked against SGLang's own kernels in
``test_sglang_package.py`` (manual).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import kda
from kda.errors import KdaArgumentError
from kda.integrations import sglang as adapter
from kda.testing import TOLERANCES

D = 128
LAYERS = 2           # KDA layers in the pool; the step runs on layer 1
SLOTS = 12           # SGLang allocates size + 1 slots; slot 0 is its padding slot


# ---- SGLang's layouts, built by hand -------------------------------------------------------

def sglang_layer(H: int, N: int, *, seed: int = 0, lower_bound=None, bias: bool = False,
                 norm_dtype=torch.bfloat16, pad_rows: int = 1, ssm_dtype=torch.float32,
                 pad_id: int = 0):
    """The tensors SGLang 0.5.23 hands a Kimi-Linear KDA layer's decode, in its layouts.

    * Packed projection: ``KimiDeltaAttention.forward_qkvbfg_fused``
      (sglang/srt/models/kimi_linear.py) splits ``fused_qkvbfg_a_proj``'s output
      ``[N, 3*dim + H + 2*128]`` into qkv ``[N, 3*dim]``, beta ``[N, H]`` and fg_a
      ``[N, 256]`` (f_a | g_a): column slices, row pitch ``385*H + 256``.
    * ``fused_fg_b_proj`` (``ColumnParallelBatchedLinear``, sglang/srt/layers/linear.py):
      weight ``[2, dim, 128]`` (f_b, g_b); forget gate and g_proj_states are its bmm.
    * Conv weight: ``qkv_conv1d.weight`` fp32 ``[3*dim, 1, 4]``; the layer keeps
      ``.squeeze(1)`` ``[3*dim, 4]`` (``KimiDeltaAttention.__init__``). A_log
      ``[1, 1, H, 1]`` fp32, dt_bias ``[dim]`` fp32, o_norm weight ``[128]``.
    * Pools: ``MambaPool.__init__`` (sglang/srt/mem_cache/memory_pool.py) allocates conv
      ``[layers, size + 1, *shape.conv[0]]`` and temporal ``[layers, size + 1, *shape.temporal]``;
      ``KimiLinearStateShape.create`` (sglang/srt/configs/mamba_utils.py) makes the conv
      shape ``(K-1, 3*dim)`` = ``(3, 3*dim)`` and the temporal ``(H, 128, 128)`` (V-major, the
      decode kernel indexes ``o_v * K + o_k``). ``mamba2_layer_cache(layer).conv[0]`` and
      ``.temporal`` are the per-layer slices.
    * Slot table: ``MambaAttnBackendBase._forward_metadata``
      (sglang/srt/layers/attention/hybrid_linear_attn_backend.py) gathers
      ``forward_metadata.mamba_cache_indices`` int32 ``[bs]``; CUDA-graph padding rows carry
      the reserved padding slot 0 (``pad_id=0``); SGLang's kernels also take the pad id -1
      (``pad_id=-1``), a row they skip.
    """
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    dim = H * D
    pitch = 3 * dim + H + 2 * D
    fused = randn(N, pitch)
    qkv, beta, fg_a = torch.split(fused, [3 * dim, H, 2 * D], dim=-1)
    fg_b_weight = randn(2, dim, D, scale=D ** -0.5)
    conv_param = (torch.randn(3 * dim, 1, 4, generator=g) * 0.5).float()
    pools_conv = randn(LAYERS, SLOTS, 3, 3 * dim)
    pools_temporal = (torch.randn(LAYERS, SLOTS, H, D, D, generator=g) * 0.05).to(ssm_dtype)
    live = torch.randperm(SLOTS - 1, generator=g)[: N - pad_rows].to(torch.int32) + 1
    cache_indices = torch.cat([live, torch.full((pad_rows,), pad_id, dtype=torch.int32)])
    t = types.SimpleNamespace(
        H=H, N=N, dim=dim, fused=fused, qkv=qkv, beta=beta.unsqueeze(0),  # b: [1, N, H]
        f_a=fg_a[:, :D], g_a=fg_a[:, D:], fg_b_weight=fg_b_weight,
        conv_param=conv_param, conv_weights=conv_param.squeeze(1),
        bias=(torch.randn(3 * dim, generator=g) * 0.1).float() if bias else None,
        A_log=(torch.rand(1, 1, H, 1, generator=g) * 2 - 1).float(),
        dt_bias=(torch.randn(dim, generator=g) * 0.5).float(),
        lower_bound=lower_bound,
        norm_weight=(1 + torch.randn(D, generator=g) * 0.1).to(norm_dtype), norm_eps=1e-5,
        pools_conv=pools_conv, pools_temporal=pools_temporal, layer_id=1,
        cache_indices=cache_indices)
    t.conv_states = pools_conv[t.layer_id]
    t.ssm_states = pools_temporal[t.layer_id]
    # g_proj_states, as the wiring computes it (SGLang: the g half of fused_fg_b_proj's bmm)
    t.output_gate = F.linear(t.g_a, fg_b_weight[1])
    return t


def new_inputs(t, seed: int):
    """Fresh projection rows for the next step (same pools, same slots)."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(t.N, t.fused.shape[1], generator=g).to(torch.bfloat16)
    qkv, beta, fg_a = torch.split(fused, [3 * t.dim, t.H, 2 * D], dim=-1)
    t.fused, t.qkv, t.beta, t.f_a, t.g_a = fused, qkv, beta.unsqueeze(0), fg_a[:, :D], fg_a[:, D:]
    t.output_gate = F.linear(t.g_a, t.fg_b_weight[1])


# ---- SGLang 0.5.23's decode, transcribed ---------------------------------------------------

def sglang_decode(t, conv_states, ssm_states):
    """What SGLang computes for one decode batch; updates the two pools like SGLang does.

    Returns ``[N, dim]``, the input of ``o_proj``. Steps, in SGLang's order:
    """
    H, dim, N = t.H, t.dim, t.N
    idx = t.cache_indices.long()
    # 1. Gate: KimiDeltaAttention.forward_qkvbfg_fused -> fused_fg_b_proj (bmm, bf16 out).
    a = F.linear(t.f_a, t.fg_b_weight[0])                           # [N, dim] bf16
    # 2. Conv: KDAAttnBackend.forward_decode -> causal_conv1d_update(mixed_qkv,
    #    conv_states.transpose(-1, -2), conv_weights, bias, activation="silu",
    #    conv_state_indices=cache_indices) (sglang/kernels/ops/mamba/causal_conv1d_triton.py):
    #    fp32 taps over [window, x], SiLU, cast to the activation dtype; the window shifts by
    #    one and takes x; rows with the pad id -1 are skipped (slot 0 is processed).
    cs = conv_states.transpose(-1, -2)                               # [slots, 3*dim, 3]
    w = t.conv_weights.float()                                       # [3*dim, 4]
    qkv = torch.empty(N, 3 * dim, dtype=torch.bfloat16)
    for n in range(N):
        s = int(idx[n])
        if s == -1:
            continue
        win = cs[s].float()                                          # [3*dim, 3]
        seq = torch.cat([win, t.qkv[n].float()[:, None]], dim=1)    # [3*dim, 4]
        acc = (seq * w).sum(dim=1)
        if t.bias is not None:
            acc = acc + t.bias
        qkv[n] = F.silu(acc).to(torch.bfloat16)
        cs[s, :, :2] = cs[s, :, 1:].clone()
        cs[s, :, 2] = t.qkv[n].to(cs.dtype)
    q, k, v = (x.float().view(N, H, D) for x in qkv.split(dim, dim=-1))
    # 3. Recurrence: TritonKDAKernel.decode -> fused_sigmoid_gating_delta_rule_update(
    #    is_kda=True, use_qk_l2norm_in_kernel=True, softplus threshold 20)
    #    (sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py); the packed
    #    decode the CUDA build selects computes the same.
    x = a.float().view(N, H, D) + t.dt_bias.view(H, D)
    A = t.A_log.view(H, 1).exp()
    if t.lower_bound is None:
        g = -A * torch.where(x <= 20.0, torch.log1p(torch.exp(x)), x)
    else:
        g = t.lower_bound * torch.sigmoid(A * x)
    beta = torch.sigmoid(t.beta[0].float())                          # [N, H]
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o = torch.zeros(N, H, D, dtype=torch.bfloat16)
    for n in range(N):
        s = int(idx[n])
        h = ssm_states[s].float().clone() if s >= 0 else torch.zeros(H, D, D)  # [H, V, K]
        h = h * g[n].exp()[:, None, :]
        u = beta[n][:, None] * (v[n] - (h * k[n][:, None, :]).sum(-1))
        h = h + u[:, :, None] * k[n][:, None, :]
        o[n] = (h * q[n][:, None, :]).sum(-1).to(torch.bfloat16)
        if s >= 0:
            ssm_states[s] = h
    # 4. Output norm: KimiDeltaAttention.forward -> o_norm (FusedRMSNormGated, activation
    #    "sigmoid"; sglang/kernels/ops/attention/fla/fused_norm_gate.py), per head over 128.
    of = o.float()
    y = of * torch.rsqrt((of * of).mean(-1, keepdim=True) + t.norm_eps)
    y = y * t.norm_weight.float() * torch.sigmoid(t.output_gate.float().view(N, H, D))
    return y.to(torch.bfloat16).view(N, dim)


def run_adapter(t, out=None, step=None, **kw):
    """decode_step on ``t``'s tensors: with the layer's eps and gate and the reference backend
    (``kw`` overrides), or with ``step`` and only the arguments in ``kw``."""
    if step is None:
        kw = {"norm_eps": t.norm_eps, "lower_bound": t.lower_bound, "backend": "reference", **kw}
    return adapter.decode_step(
        t.qkv, t.f_a, t.beta, conv_weight=adapter.conv_weight(t.conv_weights),
        conv_bias=t.bias, A_log=t.A_log, dt_bias=t.dt_bias, conv_states=t.conv_states,
        ssm_states=t.ssm_states, cache_indices=t.cache_indices, f_b=t.fg_b_weight[0],
        output_gate=t.output_gate, norm_weight=t.norm_weight, out=out, step=step, **kw)


def within(actual, expected, tol) -> str:
    """'' when |a - e| <= atol + rtol*|e| for all but tol.frac of the elements and the loose
    bound holds for all; else what failed."""
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    bad = (err > tol.atol + tol.rtol * e.abs()).double().mean().item()
    loose = int((err > tol.loose_atol + tol.loose_rtol * e.abs()).sum())
    if torch.isnan(a).any() or bad > tol.frac or loose:
        return f"{bad:.2%} beyond tolerance, {loose} beyond the loose bound, max {err.max():.3g}"
    return ""


def live_rows(t):
    return (t.cache_indices > 0).nonzero().flatten()


def check_step(t, s, out, step):
    """Decode step ``step`` of the op on ``t`` (its output ``out``) against SGLang's on its
    copy ``s``: the live rows' output and pages within tolerance, their windows exact,
    padding rows zeros."""
    ref = sglang_decode(s, s.conv_states, s.ssm_states)
    rows = live_rows(t)
    slots = t.cache_indices[rows].long()
    assert not (msg := within(out[rows].float(), ref[rows].float(), TOLERANCES["out"])), \
        f"step {step}: out {msg}"
    tol = TOLERANCES["state_bf16" if t.ssm_states.dtype == torch.bfloat16 else "state"]
    assert not (msg := within(t.ssm_states[slots].float(), s.ssm_states[slots].float(), tol)), \
        f"step {step}: state {msg}"
    assert torch.equal(t.conv_states[slots], s.conv_states[slots]), f"step {step}: window"
    assert (out[t.cache_indices <= 0] == 0).all(), "padding rows are dead items (zeros)"


# ---- tests ---------------------------------------------------------------------------------

CASES = [
    dict(H=8, N=5),                                    # Kimi-Linear-48B at TP 4
    dict(H=8, N=4, lower_bound=-5.0),                  # bounded ("safe") gate
    dict(H=16, N=3, bias=True, norm_dtype=torch.float32),
    dict(H=4, N=3),                                    # TP 8: row pitch 1796, 8-byte rows
    dict(H=8, N=5, ssm_dtype=torch.bfloat16),          # --mamba-ssm-dtype bfloat16
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_matches_sglang_transcription(case):
    t = sglang_layer(**case)
    s = sglang_layer(**case)           # SGLang's copy of the same pools
    for step in range(3):
        if step:
            new_inputs(t, 100 + step)
            new_inputs(s, 100 + step)
        check_step(t, s, run_adapter(t), step)


def test_mapping_is_bit_exact_against_the_reference_on_native_layouts():
    t = sglang_layer(H=8, N=6, bias=True, pad_rows=2)
    # The op's native arguments, as copies: conv cache [slots, 3*dim, 3] dim-first ("DS"),
    # A_log [H], beta [N, H], contiguous x / f_a.
    conv_native = t.conv_states.transpose(-1, -2).contiguous()
    state_native = t.ssm_states.clone()
    want = kda.kda_decode(
        t.qkv.contiguous(), adapter.conv_weight(t.conv_param), t.bias, conv_native,
        t.f_a.contiguous(), t.fg_b_weight[0].clone(), t.beta[0].contiguous(),
        t.A_log.flatten().clone(), t.dt_bias, state_native, t.cache_indices.clone(),
        t.output_gate, t.norm_weight, norm_eps=t.norm_eps, backend="reference")
    got = run_adapter(t)
    assert torch.equal(got, want)
    assert torch.equal(t.ssm_states, state_native)
    assert torch.equal(t.conv_states, conv_native.transpose(-1, -2))


def test_pools_updated_in_place_and_nothing_else():
    t = sglang_layer(H=8, N=4)
    before_conv, before_temporal = t.pools_conv.clone(), t.pools_temporal.clone()
    out = torch.full((t.N, t.dim), float("nan"), dtype=torch.bfloat16)
    got = run_adapter(t, out=out)
    assert got.data_ptr() == out.data_ptr()
    slots = t.cache_indices[t.cache_indices > 0].long()
    other = torch.ones(SLOTS, dtype=torch.bool)
    other[slots] = False
    # the step wrote the layer's pages of the live slots, in SGLang's own pool tensors ...
    assert not torch.equal(t.pools_temporal[1, slots], before_temporal[1, slots])
    assert not torch.equal(t.pools_conv[1, slots], before_conv[1, slots])
    # ... and nothing else: other layers, other slots, SGLang's padding slot 0
    assert torch.equal(t.pools_temporal[0], before_temporal[0])
    assert torch.equal(t.pools_conv[0], before_conv[0])
    assert torch.equal(t.pools_temporal[1, other], before_temporal[1, other])
    assert torch.equal(t.pools_conv[1, other], before_conv[1, other])
    assert other[0]


def test_conv_weight_relayout():
    t = sglang_layer(H=8, N=2)
    w = adapter.conv_weight(t.conv_weights)
    assert w.shape == (3, 4, t.dim) and w.dtype == torch.float32 and w.is_contiguous()
    # op: conv_weight[p, j, c] multiplies window position j of channel p*dim + c
    assert torch.equal(w[2, 3, 5], t.conv_weights[2 * t.dim + 5, 3])
    assert torch.equal(w[1, 0, 7], t.conv_weights[t.dim + 7, 0])
    assert torch.equal(adapter.conv_weight(t.conv_param), w)
    with pytest.raises(KdaArgumentError) as e:
        adapter.conv_weight(torch.zeros(3 * t.dim, 3))
    assert e.value.arg == "conv_weights"


@pytest.mark.parametrize("what,arg", [
    ("conv_states", "conv_states"), ("A_log", "A_log"), ("b", "b"),
    ("ssm_dtype", "state"), ("indices", "state_indices")])
def test_errors_name_the_argument(what, arg):
    H = 8
    t = sglang_layer(H=H, N=3)
    if what == "conv_states":
        t.conv_states = t.conv_states.flatten(1)
    elif what == "A_log":
        t.A_log = t.A_log.view(1, H, 1)
    elif what == "b":
        t.beta = t.beta.expand(2, -1, -1)
    elif what == "ssm_dtype":
        t.ssm_states = t.ssm_states.half()         # (fp32 and bf16 pools are served)
    elif what == "indices":
        t.cache_indices = t.cache_indices.long()      # SGLang: int32
    before = (t.conv_states.clone(), t.ssm_states.clone())
    with pytest.raises(KdaArgumentError) as e:
        run_adapter(t)
    assert e.value.arg == arg, str(e.value)
    assert torch.equal(t.conv_states, before[0]) and torch.equal(t.ssm_states, before[1])


# ---- forward_decode on duck-typed SGLang objects -------------------------------------------

class _Mode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def __repr__(self):
        return "DECODE" if self.decode else "EXTEND"


def sglang_objects(t, decode=True, replayssm=False):
    """The attributes forward_decode reads, shaped as SGLang 0.5.23 holds them:
    ``KDAAttnBackend.req_to_token_pool.mamba2_layer_cache(layer_id)`` -> ``.conv`` (list),
    ``.temporal``, ``.replayssm_d`` (None unless ReplaySSM allocated its rings: what SGLang's
    ``forward_decode`` routes on); ``.forward_metadata.mamba_cache_indices``;
    ``RadixLinearAttention``'s fields (sglang/srt/layers/radix_linear_attention.py)."""
    tracked = []
    ring = torch.zeros(LAYERS, SLOTS, t.H, 16, D) if replayssm else None
    pool = types.SimpleNamespace(mamba2_layer_cache=lambda lid: types.SimpleNamespace(
        conv=[t.pools_conv[lid]], temporal=t.pools_temporal[lid],
        replayssm_d=None if ring is None else ring[lid]))
    backend = types.SimpleNamespace(
        req_to_token_pool=pool,
        forward_metadata=types.SimpleNamespace(mamba_cache_indices=t.cache_indices),
        _track_mamba_state_decode=lambda *a: tracked.append(a))
    layer = types.SimpleNamespace(
        layer_id=t.layer_id, num_q_heads=t.H, num_k_heads=t.H, num_v_heads=t.H,
        head_q_dim=D, head_k_dim=D, head_v_dim=D, conv_weights=t.conv_weights, bias=t.bias,
        A_log=t.A_log, dt_bias=t.dt_bias, lower_bound=t.lower_bound)
    batch = types.SimpleNamespace(logical_forward_mode=_Mode(decode))
    return backend, layer, batch, tracked


def call_forward_decode(t, backend, layer, batch):
    return adapter.forward_decode(
        backend, layer, batch, t.qkv, t.f_a, t.beta, f_b=t.fg_b_weight[0],
        output_gate=t.output_gate, norm_weight=t.norm_weight, norm_eps=t.norm_eps,
        kda_backend="reference")


FORWARD_CASES = [dict(), dict(lower_bound=-5.0), dict(ssm_dtype=torch.bfloat16),
                 dict(lower_bound=-3.0, ssm_dtype=torch.bfloat16, pad_id=-1)]


def case_id(c):
    return "-".join(f"{k}{v}" for k, v in c.items()) or "softplus"


@pytest.mark.parametrize("case", FORWARD_CASES, ids=case_id)
def test_forward_decode_matches_sglang_transcription(case):
    """``forward_decode`` on SGLang's objects, both gates (the layer's ``lower_bound``), fp32
    and bf16 pools, padding rows (slot 0, pad id -1): SGLang's results for the live rows,
    zeros for the dead ones, and no page written but the live slots' (SGLang writes its
    padding slot 0 too; rows it discards)."""
    t = sglang_layer(H=8, N=5, pad_rows=2, **case)
    s = sglang_layer(H=8, N=5, pad_rows=2, **case)
    before = (t.pools_conv.clone(), t.pools_temporal.clone())
    backend, layer, batch, _ = sglang_objects(t)
    for step in range(2):
        if step:
            new_inputs(t, 300 + step)
            new_inputs(s, 300 + step)
        out = call_forward_decode(t, backend, layer, batch)
        check_step(t, s, out, step)
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[t.cache_indices[live_rows(t)].long()] = False
    assert torch.equal(t.pools_temporal[:, others], before[1][:, others])
    assert torch.equal(t.pools_conv[:, others], before[0][:, others])
    assert torch.equal(t.pools_temporal[0], before[1][0])


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
def test_forward_decode_reads_sglang_caches_and_tracks(ssm_dtype, lower_bound):
    t = sglang_layer(H=8, N=4, ssm_dtype=ssm_dtype, lower_bound=lower_bound)
    s = sglang_layer(H=8, N=4, ssm_dtype=ssm_dtype, lower_bound=lower_bound)
    backend, layer, batch, tracked = sglang_objects(t)
    out = call_forward_decode(t, backend, layer, batch)
    ref = run_adapter(s)
    assert torch.equal(out, ref)
    assert torch.equal(t.pools_temporal, s.pools_temporal)
    assert torch.equal(t.pools_conv, s.pools_conv)
    (cfg, _, _), = layer._kda_sglang["steps"]
    assert cfg.lower_bound == lower_bound and cfg.state_dtype == ssm_dtype
    # SGLang's forward_decode ends with _track_mamba_state_decode(forward_batch, conv_states,
    # ssm_states, cache_indices, layer_id); so must the stand-in.
    (args,) = tracked
    assert args[0] is batch and args[3] is t.cache_indices and args[4] == t.layer_id
    assert args[1].data_ptr() == t.pools_conv[1].data_ptr()
    assert args[2].data_ptr() == t.pools_temporal[1].data_ptr()


def test_forward_decode_caches_per_layer_and_sees_new_conv_weights():
    t = sglang_layer(H=8, N=3)
    backend, layer, batch, _ = sglang_objects(t)
    call_forward_decode(t, backend, layer, batch)
    state = layer._kda_sglang
    w0 = state["conv_weight"]
    (step,) = state["steps"].values()
    assert isinstance(step, kda.KdaDecode) and step.backend_name == "reference"
    call_forward_decode(t, backend, layer, batch)
    assert state["conv_weight"] is w0 and list(state["steps"].values()) == [step]
    # RadixLinearAttention.refresh_conv_weights installs a new tensor: re-laid out
    layer.conv_weights = t.conv_weights * 2
    call_forward_decode(t, backend, layer, batch)
    assert torch.equal(state["conv_weight"], w0 * 2)
    # an in-place rewrite needs reload_weights
    layer.conv_weights.mul_(0.5)
    adapter.reload_weights(layer)
    assert torch.equal(state["conv_weight"], w0)


@pytest.mark.parametrize("what,arg", [("extend", "forward_batch"), ("fp16 pool", "ssm_states"),
                                      ("gqa", "layer"), ("head dim", "layer"),
                                      ("replayssm", "attn_backend")])
def test_forward_decode_refuses_what_it_does_not_serve(what, arg):
    t = sglang_layer(H=8, N=3)
    if what == "fp16 pool":
        t.pools_temporal = t.pools_temporal.to(torch.float16)
    backend, layer, batch, tracked = sglang_objects(t, decode=what != "extend",
                                                    replayssm=what == "replayssm")
    if what == "gqa":
        layer.num_q_heads = layer.num_k_heads = 4
    elif what == "head dim":
        layer.head_v_dim = 64
    before = (t.pools_conv.clone(), t.pools_temporal.clone())
    with pytest.raises(KdaArgumentError) as e:
        call_forward_decode(t, backend, layer, batch)
    assert e.value.arg == arg, str(e.value)
    if what == "replayssm":
        assert "--enable-linear-replayssm" in str(e.value)
    assert not tracked
    assert torch.equal(t.pools_conv, before[0]) and torch.equal(t.pools_temporal, before[1])


def test_import_kda_does_not_import_the_adapter():
    import subprocess
    import sys
    code = ("import sys, kda; assert 'kda.integrations.sglang' not in sys.modules; "
            "assert 'sglang' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- what an SGLang integrator's trial found ------------------------------------------------

def _step_for(t, **over):
    cfg = kda.KdaConfig(num_heads=t.H, window=t.conv_states.shape[-2], lower_bound=t.lower_bound,
                        norm_eps=t.norm_eps, norm_weight_dtype=t.norm_weight.dtype,
                        state_dtype=t.ssm_states.dtype, **over)
    return kda.KdaDecode(cfg, backend="reference")


@pytest.mark.parametrize("kw,arg", [(dict(lower_bound=-5.0), "lower_bound"),
                                    (dict(norm_eps=0.5), "norm_eps"),
                                    (dict(backend="cuda"), "backend")])
def test_decode_step_refuses_scalars_its_step_does_not_hold(kw, arg):
    """With ``step``, a lower bound, norm eps or backend other than the step's was dropped
    silently (a bounded-gate layer then ran the softplus gate); now named, nothing written.
    The step's own values, or none, run."""
    t = sglang_layer(H=4, N=3)
    step = _step_for(t)
    before = (t.conv_states.clone(), t.ssm_states.clone())
    with pytest.raises(KdaArgumentError) as e:
        run_adapter(t, step=step, **kw)
    assert e.value.arg == arg, str(e.value)
    assert torch.equal(t.conv_states, before[0]) and torch.equal(t.ssm_states, before[1])
    s = sglang_layer(H=4, N=3)
    ref = run_adapter(s)
    out = run_adapter(t, step=step, lower_bound=None, norm_eps=t.norm_eps)
    assert torch.equal(out, ref) and torch.equal(t.ssm_states, s.ssm_states)


def test_decode_step_names_2d_cache_indices():
    t = sglang_layer(H=4, N=2)
    t.cache_indices = t.cache_indices[:, None].expand(2, 2).contiguous()
    with pytest.raises(KdaArgumentError) as e:
        run_adapter(t)
    assert e.value.arg == "cache_indices", str(e.value)


def test_forward_decode_calls_a_four_argument_track_without_the_layer_id():
    """SGLang files whose ``_track_mamba_state_decode`` takes (forward_batch, conv_states,
    ssm_states, cache_indices) only: called so (the layer id raised a TypeError after the
    pools were written); a backend without it is refused before anything is written."""
    t = sglang_layer(H=4, N=3)
    backend, layer, batch, _ = sglang_objects(t)
    tracked = []

    def track(forward_batch, conv_states, ssm_states, cache_indices):
        tracked.append(cache_indices)
    backend._track_mamba_state_decode = track
    call_forward_decode(t, backend, layer, batch)
    assert len(tracked) == 1 and tracked[0] is t.cache_indices
    del backend._track_mamba_state_decode
    before = (t.pools_conv.clone(), t.pools_temporal.clone())
    with pytest.raises(KdaArgumentError) as e:
        call_forward_decode(t, backend, layer, batch)
    assert e.value.arg == "attn_backend", str(e.value)
    assert torch.equal(t.pools_conv, before[0]) and torch.equal(t.pools_temporal, before[1])


@pytest.mark.parametrize("what,arg", [("no mode", "forward_batch"),
                                      ("fp16 conv pool", "conv_states"),
                                      ("fp16 norm weight", "norm_weight")])
def test_forward_decode_names_sglang_arguments(what, arg):
    """A batch object without either forward mode passed silently; the dtype refusals of
    the configuration named KdaConfig fields (conv_state_dtype, norm_weight_dtype)."""
    t = sglang_layer(H=4, N=3)
    if what == "fp16 conv pool":
        t.pools_conv = t.pools_conv.to(torch.float16)
    backend, layer, batch, tracked = sglang_objects(t)
    if what == "no mode":
        batch = types.SimpleNamespace()
    if what == "fp16 norm weight":
        t.norm_weight = t.norm_weight.to(torch.float16)
    before = (t.pools_conv.clone(), t.pools_temporal.clone())
    with pytest.raises(KdaArgumentError) as e:
        call_forward_decode(t, backend, layer, batch)
    assert e.value.arg == arg, str(e.value)
    assert not tracked
    assert torch.equal(t.pools_conv, before[0]) and torch.equal(t.pools_temporal, before[1])
