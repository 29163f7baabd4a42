"""The SGLang adapter (kda/integrations/sglang.py) against the real SGLang 0.5.23, on a CPU.

Run with ``tools/sglang/run_tests.sh``: it builds an isolated virtual environment with
sglang==0.5.23 (no GPU packages) and runs this file. Without SGLang every test here is skipped.

SGLang's own decode path runs for real, on SGLang's own objects: a ``HybridReqToTokenPool``
(its ``MambaPool`` pages, ``mamba2_layer_cache``), a decode ``ForwardBatch``, SGLang's
``ForwardMetadata`` with the slot table, a ``RadixLinearAttention`` holding the layer's
weights, and a ``KDAAttnBackend`` made without a model runner (``object.__new__``; the fields
``forward_decode`` reads set: the pool, the metadata, a ``KDAKernelDispatcher`` with SGLang's
``TritonKDAKernel``; its own ``_track_mamba_state_decode``). ``KDAAttnBackend.forward_decode``
(sglang/srt/layers/attention/linear/kda_backend.py) then runs its own conv update
(``causal_conv1d_update``), recurrence (``fused_sigmoid_gating_delta_rule_update``, or the
packed decode ``fused_recurrent_kda_packed_decode`` that CUDA builds select) and SGLang's
gated RMSNorm (``rms_norm_gated``, what ``o_norm`` calls) run in Triton's CPU interpreter
(``CUDA_VISIBLE_DEVICES=""``, ``TRITON_INTERPRET=1`` before SGLang is imported). The gate is
SGLang's ``ColumnParallelBatchedLinear.forward`` expression (``torch.bmm``) on the same
weight. The layouts come from test_sglang.py's ``sglang_layer`` (built by hand from SGLang's
source); ``test_layouts_are_sglangs`` checks them against SGLang's own shape helpers.

Rounding: Triton's interpreter casts fp32 to bf16 by truncation where a GPU rounds to nearest
even, so SGLang's conv output, o and normed output come out up to an ulp low here;
``rne_casts`` makes that one cast round to nearest even for the comparisons, which then meet
kda.testing's tolerances (``test_truncation_is_what_differs`` shows the unpatched gap).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import os
import sys

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not importable: tools/sglang/run_tests.sh installs sglang==0.5.23 "
                "into an isolated venv and runs these tests", allow_module_level=True)

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kda.integrations import sglang as adapter  # noqa: E402
from kda.testing import TOLERANCES  # noqa: E402
from tests.integrations.triton_rne import rne_casts  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_sglang import (D, LAYERS, SLOTS, live_rows, new_inputs, run_adapter,  # noqa: E402
                         sglang_decode, sglang_layer, within)

from sglang.kernels.ops.attention.fla.fused_norm_gate import rms_norm_gated  # noqa: E402
from sglang.srt.configs.mamba_utils import (KimiLinearCacheParams,  # noqa: E402
                                            KimiLinearStateShape, Mamba2StateDType)
from sglang.srt.layers.attention.linear import kda_backend  # noqa: E402
from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel  # noqa: E402
from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata  # noqa: E402
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

from kda.errors import KdaArgumentError  # noqa: E402


@triton.jit
def _exp(x):
    return tl.exp(x)


# SGLang's fla ``op`` module binds ``exp = tl.exp`` at import time (off CUDA); the packed
# decode's module calls that alias, which Triton's interpreter rejects ("did you forget
# @triton.jit"), so the module's alias becomes a jit function of the same maths.
from sglang.kernels.ops.attention.fla import fused_recurrent as _fused_recurrent  # noqa: E402
if _fused_recurrent.exp is tl.exp:
    _fused_recurrent.exp = _exp


def sglang_objects(t, packed: bool = False, replayssm: bool = False):
    """SGLang's own objects for ``t``'s layer and batch: (KDAAttnBackend, RadixLinearAttention,
    ForwardBatch). The pool is a real ``HybridReqToTokenPool`` whose pages start as ``t``'s;
    ``t``'s pool tensors are rebound to the pool's, so the comparisons read SGLang's pages.
    ``replayssm``: the pool allocates ReplaySSM's rings (``--enable-linear-replayssm``)."""
    N, H = t.N, t.H
    params = KimiLinearCacheParams(
        shape=KimiLinearStateShape.create(tp_world_size=1, num_heads=H, head_dim=D),
        dtype=Mamba2StateDType(conv=t.pools_conv.dtype, temporal=t.pools_temporal.dtype),
        layers=list(range(LAYERS)))
    pool = HybridReqToTokenPool(
        size=SLOTS - 1, mamba_size=SLOTS - 1, mamba_spec_state_size=0, max_context_len=64,
        device="cpu", enable_memory_saver=False, cache_params=params,
        mamba_layer_ids=list(range(LAYERS)), enable_mamba_extra_buffer=False,
        enable_linear_replayssm=replayssm)
    cache = pool.mamba_pool.mamba_cache
    cache.conv[0].copy_(t.pools_conv)
    cache.temporal.copy_(t.pools_temporal)
    t.pools_conv, t.pools_temporal = cache.conv[0], cache.temporal
    t.conv_states, t.ssm_states = t.pools_conv[t.layer_id], t.pools_temporal[t.layer_id]
    backend = object.__new__(kda_backend.KDAAttnBackend)
    backend.req_to_token_pool = pool
    backend.forward_metadata = ForwardMetadata(
        query_start_loc=torch.arange(N + 1, dtype=torch.int32),
        mamba_cache_indices=t.cache_indices)
    dispatcher = object.__new__(kda_backend.KDAKernelDispatcher)
    dispatcher.decode_kernel = TritonKDAKernel()
    dispatcher.supports_packed_decode = packed
    dispatcher.supports_packed_decode_safe_gate = packed
    backend.kernel_dispatcher = dispatcher
    layer = RadixLinearAttention(
        t.layer_id, H, H, H, D, D, D, conv_weights=t.conv_weights, bias=t.bias,
        A_log=t.A_log, dt_bias=t.dt_bias, lower_bound=t.lower_bound)
    batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=N,
                         input_ids=torch.zeros(N, dtype=torch.long),
                         req_pool_indices=torch.arange(N), seq_lens=torch.full((N,), 8),
                         out_cache_loc=torch.zeros(N, dtype=torch.long), seq_lens_sum=8 * N)
    return backend, layer, batch


def sglang_step(s, objects):
    """SGLang's own decode of one batch on ``objects`` (:func:`sglang_objects` of ``s``);
    returns the ``o_proj`` input."""
    backend, layer, batch = objects
    # KimiDeltaAttention.forward_qkvbfg_fused: forget_gate, g_proj_states = fused_fg_b_proj(
    # fg_a.view(-1, 2, 128).transpose(0, 1)) = torch.bmm(input, weight.transpose(-1, -2))
    fg_a = torch.cat([s.f_a, s.g_a], dim=-1)
    forget_gate, g_proj_states = torch.bmm(fg_a.view(-1, 2, D).transpose(0, 1),
                                           s.fg_b_weight.transpose(-1, -2))
    # KimiDeltaAttention.forward: the decode path keeps forget_gate [N, dim], beta [1, N, H]
    o = kda_backend.KDAAttnBackend.forward_decode(backend, layer, batch, s.qkv, forget_gate,
                                                  s.beta)
    # o_norm(core_attn_out, g_proj_states.unflatten(-1, (-1, 128))), then squeeze / flatten
    y = rms_norm_gated(o, g_proj_states.unflatten(-1, (-1, D)), s.norm_weight, None,
                       "sigmoid", eps=s.norm_eps)
    return y.squeeze(0).flatten(-2)


def adapter_step(t, objects):
    """The adapter's ``forward_decode`` on SGLang's objects (the wiring's arguments)."""
    backend, layer, batch = objects
    return adapter.forward_decode(
        backend, layer, batch, t.qkv, t.f_a, t.beta, f_b=t.fg_b_weight[0],
        output_gate=t.output_gate, norm_weight=t.norm_weight, norm_eps=t.norm_eps,
        kda_backend="reference")


def compare(t, s, out, ref, label):
    rows = live_rows(t)
    slots = t.cache_indices[rows].long()
    msg = within(out[rows].float(), ref[rows].float(), TOLERANCES["out"])
    assert not msg, f"{label}: out {msg}"
    tol = TOLERANCES["state_bf16" if t.ssm_states.dtype == torch.bfloat16 else "state"]
    msg = within(t.ssm_states[slots].float(), s.ssm_states[slots].float(), tol)
    assert not msg, f"{label}: state {msg}"
    assert torch.equal(t.conv_states[slots], s.conv_states[slots]), f"{label}: conv window"


CASES = [dict(H=8, N=4), dict(H=8, N=3, lower_bound=-5.0), dict(H=4, N=3),
         dict(H=16, N=3, bias=True, norm_dtype=torch.float32),
         dict(H=8, N=4, ssm_dtype=torch.bfloat16)]         # --mamba-ssm-dtype bfloat16


@pytest.mark.parametrize("packed", [False, True], ids=["decode", "packed_decode"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_adapter_matches_sglang(case, packed):
    t, s = sglang_layer(**case), sglang_layer(**case)
    objects = sglang_objects(s, packed)
    with rne_casts():
        for step in range(2):
            if step:
                new_inputs(t, 200 + step)
                new_inputs(s, 200 + step)
            out = run_adapter(t)
            ref = sglang_step(s, objects)
            compare(t, s, out, ref, f"step {step}")


# both gates, fp32 and bf16 pools, padding rows with SGLang's padding slot 0 or pad id -1
FORWARD_CASES = [dict(), dict(lower_bound=-5.0), dict(ssm_dtype=torch.bfloat16),
                 dict(lower_bound=-5.0, ssm_dtype=torch.bfloat16, pad_id=-1)]


@pytest.mark.parametrize("packed", [False, True], ids=["decode", "packed_decode"])
@pytest.mark.parametrize("case", FORWARD_CASES,
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "softplus")
def test_forward_decode_matches_sglang(case, packed):
    """``forward_decode`` (what the wiring in KimiDeltaAttention.forward calls) on SGLang's
    own objects against SGLang's own ``forward_decode`` + ``o_norm`` on a copy: the live
    rows within kda.testing's tolerances, conv windows exact, the padding rows dead items
    (zeros, no page written: SGLang writes its padding slot 0, rows it discards)."""
    t = sglang_layer(H=8, N=5, pad_rows=2, **case)
    s = sglang_layer(H=8, N=5, pad_rows=2, **case)
    ours, theirs = sglang_objects(t), sglang_objects(s, packed)
    before = (t.pools_conv.clone(), t.pools_temporal.clone())
    with rne_casts():
        for step in range(2):
            if step:
                new_inputs(t, 400 + step)
                new_inputs(s, 400 + step)
            out = adapter_step(t, ours)
            ref = sglang_step(s, theirs)
            compare(t, s, out, ref, f"step {step}")
            assert (out[t.cache_indices <= 0] == 0).all(), "padding rows are dead items"
    slots = t.cache_indices[live_rows(t)].long()
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(t.pools_temporal[:, others], before[1][:, others])
    assert torch.equal(t.pools_conv[:, others], before[0][:, others])
    (cfg, _, _), = ours[1]._kda_sglang["steps"]
    assert cfg.lower_bound == t.lower_bound and cfg.state_dtype == t.ssm_states.dtype


def test_forward_decode_refuses_replayssm():
    """A pool with ReplaySSM's rings (SGLang's decode then appends to them, not to the
    states): refused before anything is written, naming the flags."""
    t = sglang_layer(H=8, N=3)
    backend, layer, batch = sglang_objects(t, replayssm=True)
    assert backend.req_to_token_pool.mamba2_layer_cache(t.layer_id).replayssm_d is not None
    before = (t.pools_conv.clone(), t.pools_temporal.clone())
    with pytest.raises(KdaArgumentError) as e:
        adapter_step(t, (backend, layer, batch))
    assert e.value.arg == "attn_backend" and "--enable-linear-replayssm" in str(e.value)
    assert torch.equal(t.pools_conv, before[0]) and torch.equal(t.pools_temporal, before[1])


@pytest.mark.parametrize("case", CASES[:2], ids=["softplus", "lower_bound"])
def test_transcription_matches_sglang(case):
    """The default suite's baseline (test_sglang.sglang_decode) is SGLang's path."""
    t, s = sglang_layer(**case), sglang_layer(**case)
    with rne_casts():
        ref = sglang_step(s, sglang_objects(s))
    out = sglang_decode(t, t.conv_states, t.ssm_states)
    compare(t, s, out, ref, "transcription")


def test_truncation_is_what_differs():
    t, s = sglang_layer(H=8, N=4), sglang_layer(H=8, N=4)
    out = run_adapter(t)
    ref = sglang_step(s, sglang_objects(s))         # the interpreter's truncating casts
    rows = live_rows(t)
    diff = (out[rows].float() - ref[rows].float())
    assert torch.equal(t.conv_states[t.cache_indices[rows].long()],
                       s.conv_states[s.cache_indices[rows].long()])
    assert diff.mean() > 0, "truncation rounds SGLang's bf16 results toward zero"


def test_interfaces_are_the_documented_ones():
    assert importlib.metadata.version("sglang") == adapter.SGLANG_VERSION
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase
    params = list(inspect.signature(LinearAttnKernelBase.decode).parameters)
    assert params == ["self", "q", "k", "v", "a", "b", "A_log", "dt_bias", "ssm_states",
                      "cache_indices", "query_start_loc", "kwargs"]
    params = list(inspect.signature(kda_backend.KDAAttnBackend.forward_decode).parameters)
    assert params == ["self", "layer", "forward_batch", "mixed_qkv", "a", "b", "kwargs"]


def test_layouts_are_sglangs():
    from sglang.srt.configs.mamba_utils import KimiLinearStateShape
    shape = KimiLinearStateShape.create(tp_world_size=4, num_heads=32, head_dim=D)
    t = sglang_layer(H=8, N=2)
    assert [tuple(t.conv_states.shape[1:])] == shape.conv        # (K-1, 3*dim)
    assert tuple(t.ssm_states.shape[1:]) == shape.temporal       # (H, V, K)
