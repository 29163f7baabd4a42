"""The SGLang adapter (kda/integrations/sglang.py) against the real SGLang 0.5.23, on a CPU.

Run with ``tools/sglang/run_tests.sh``: it builds an isolated virtual environment with
sglang==0.5.23 (no GPU packages) and runs this file. Without SGLang every test here is skipped.

SGLang's own decode path runs for real: ``KDAAttnBackend.forward_decode``
(sglang/srt/layers/attention/linear/kda_backend.py) is called unbound on a stand-in ``self``
that holds what it reads (the pool's ``mamba2_layer_cache``, ``forward_metadata``, a
``KDAKernelDispatcher`` with SGLang's ``TritonKDAKernel``), so its own conv update
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
import types

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
from test_sglang import (D, live_rows, new_inputs, run_adapter, sglang_decode,  # noqa: E402
                         sglang_layer, within)

from sglang.kernels.ops.attention.fla.fused_norm_gate import rms_norm_gated  # noqa: E402
from sglang.srt.layers.attention.linear import kda_backend  # noqa: E402
from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel  # noqa: E402


@triton.jit
def _exp(x):
    return tl.exp(x)


# SGLang's fla ``op`` module binds ``exp = tl.exp`` at import time (off CUDA); the packed
# decode's module calls that alias, which Triton's interpreter rejects ("did you forget
# @triton.jit"), so the module's alias becomes a jit function of the same maths.
from sglang.kernels.ops.attention.fla import fused_recurrent as _fused_recurrent  # noqa: E402
if _fused_recurrent.exp is tl.exp:
    _fused_recurrent.exp = _exp


def sglang_step(s, packed: bool):
    """SGLang's own decode of one batch on ``s``'s pools; returns the ``o_proj`` input."""
    N, H = s.N, s.H
    # KimiDeltaAttention.forward_qkvbfg_fused: forget_gate, g_proj_states = fused_fg_b_proj(
    # fg_a.view(-1, 2, 128).transpose(0, 1)) = torch.bmm(input, weight.transpose(-1, -2))
    fg_a = torch.cat([s.f_a, s.g_a], dim=-1)
    forget_gate, g_proj_states = torch.bmm(fg_a.view(-1, 2, D).transpose(0, 1),
                                           s.fg_b_weight.transpose(-1, -2))
    backend = object.__new__(kda_backend.KDAAttnBackend)
    backend.req_to_token_pool = types.SimpleNamespace(
        mamba2_layer_cache=lambda lid: types.SimpleNamespace(
            conv=[s.pools_conv[lid]], temporal=s.pools_temporal[lid], replayssm_d=None,
            replayssm_k=None, replayssm_g=None))
    backend.forward_metadata = types.SimpleNamespace(
        query_start_loc=torch.arange(N + 1, dtype=torch.int32),
        mamba_cache_indices=s.cache_indices)
    dispatcher = object.__new__(kda_backend.KDAKernelDispatcher)
    dispatcher.decode_kernel = TritonKDAKernel()
    dispatcher.supports_packed_decode = packed
    dispatcher.supports_packed_decode_safe_gate = packed
    backend.kernel_dispatcher = dispatcher
    backend._track_mamba_state_decode = lambda *args: None
    layer = types.SimpleNamespace(
        layer_id=s.layer_id, num_q_heads=H, num_k_heads=H, num_v_heads=H, head_q_dim=D,
        head_k_dim=D, head_v_dim=D, q_dim=H * D, k_dim=H * D, v_dim=H * D,
        conv_weights=s.conv_weights, bias=s.bias, A_log=s.A_log, dt_bias=s.dt_bias,
        lower_bound=s.lower_bound)
    # KimiDeltaAttention.forward: the decode path keeps forget_gate [N, dim], beta [1, N, H]
    o = kda_backend.KDAAttnBackend.forward_decode(backend, layer, None, s.qkv, forget_gate,
                                                  s.beta)
    # o_norm(core_attn_out, g_proj_states.unflatten(-1, (-1, 128))), then squeeze / flatten
    y = rms_norm_gated(o, g_proj_states.unflatten(-1, (-1, D)), s.norm_weight, None,
                       "sigmoid", eps=s.norm_eps)
    return y.squeeze(0).flatten(-2)


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
    with rne_casts():
        for step in range(2):
            if step:
                new_inputs(t, 200 + step)
                new_inputs(s, 200 + step)
            out = run_adapter(t)
            ref = sglang_step(s, packed)
            compare(t, s, out, ref, f"step {step}")


@pytest.mark.parametrize("case", CASES[:2], ids=["softplus", "lower_bound"])
def test_transcription_matches_sglang(case):
    """The default suite's baseline (test_sglang.sglang_decode) is SGLang's path."""
    t, s = sglang_layer(**case), sglang_layer(**case)
    with rne_casts():
        ref = sglang_step(s, packed=False)
    out = sglang_decode(t, t.conv_states, t.ssm_states)
    compare(t, s, out, ref, "transcription")


def test_truncation_is_what_differs():
    t, s = sglang_layer(H=8, N=4), sglang_layer(H=8, N=4)
    out = run_adapter(t)
    ref = sglang_step(s, packed=False)         # the interpreter's truncating casts
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
