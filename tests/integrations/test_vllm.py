"""The vLLM plugin (kda/integrations/vllm.py) against the real vLLM 0.33.0 package, on a CPU.

Run with ``tools/vllm/run_tests.sh``: it builds an isolated virtual environment with
vllm==0.33.0 and runs this file. Without vLLM every test here is skipped.

How vLLM runs here. vLLM's Kimi-Linear layer is built for real (``KimiGatedDeltaNetAttention``
with random weights at Kimi-Linear-48B's per-rank shapes: hidden 2304, H = 8 (TP 4) or 4 (TP 8)
heads), its caches bound through its own ``bind_kv_cache`` (one raw int8 page per slot, padded),
and its ``forward`` called under vLLM's forward context with ``GDNAttentionMetadata`` as vLLM's
metadata builder lays it out (slot tables as column slices of a block table, FULL-graph-style
padding rows with the null block). Its Triton kernels (conv update, packed decode, fused
recurrent verify, chunked prefill, gated RMSNorm) run in Triton's CPU interpreter, which needs:

* ``CUDA_VISIBLE_DEVICES=""`` and ``TRITON_INTERPRET=1`` before vLLM is imported (else vLLM's
  Triton import check finds no driver and replaces every kernel with a placeholder);
* vLLM's platform then is ``UnspecifiedPlatform`` (not ``cpu``: vLLM's CPU platform swaps the
  conv update for a C++ op that its CUDA wheel does not ship);
* a single-process gloo "distributed" init (the layer asks for its TP rank);
* a rebinding of ``exp`` / ``log`` in vLLM's ``fused_recurrent`` module to jit functions (the
  module aliases ``tl.exp`` at import time, which the interpreter rejects);
* Triton 3.8 (3.6's interpreter fails on the varlen conv update of the verify path).

The comparison baseline is vLLM's own path on the same layer instance (``kda_enabled=False``:
the plugin's ``forward`` then is ``super().forward``), on copies of the same caches.

Rounding: Triton's interpreter casts fp32 to bf16 by truncation, not round-to-nearest-even as
Triton does on a GPU, so in the interpreter vLLM's kernels round their conv output y, o and
the normed output toward zero. ``rne_casts`` patches that one cast to round to nearest
even; the step comparisons run under it and then meet kda.testing's tolerances (states: 1e-5 +
1e-4 relative). ``test_state_difference_is_the_interpreters_truncation`` shows what the
unpatched interpreter gives (the ~9e-3 state difference first measured) and why.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import itertools
import logging
import os
import socket
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable: tools/vllm/run_tests.sh installs vllm==0.33.0 into an "
                "isolated venv and runs these tests", allow_module_level=True)

# Before vLLM (and its Triton kernels) are imported; this file runs vLLM on the CPU only.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kda  # noqa: E402
from kda.integrations import vllm as plugin  # noqa: E402
from kda.testing import TOLERANCES, Tolerance  # noqa: E402
from tests.integrations.triton_rne import rne_casts  # noqa: E402

D = 128
HIDDEN = 2304          # Kimi-Linear-48B's hidden size
SLOTS = 16
PAGE_PAD = 48          # bytes past the states in each page: slot pitches larger than the states
ENTRY_POINT = "kda.integrations.vllm:register"
_prefixes = itertools.count()


# ---- environment ---------------------------------------------------------------------------

@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _log(x):
    return tl.log(x)


@triton.jit
def _cast_bf16(x_ptr, y_ptr):
    offs = tl.arange(0, 2)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))


@pytest.fixture(scope="module")
def env():
    """vLLM's config, a single-process gloo TP group, the interpreter workaround, the plugin."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (init_distributed_environment,
                                                 initialize_model_parallel,
                                                 model_parallel_is_initialized)
    import vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent as fr

    fr.exp, fr.log = _exp, _log       # interpreter only: see the module docstring

    vc = VllmConfig(device_config=DeviceConfig(device="cpu"),
                    additional_config={plugin.CONFIG_KEY: "reference"})
    if not model_parallel_is_initialized():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{port}",
                                         backend="gloo")
            initialize_model_parallel(1, 1)
    plugin.register()
    return vc


@contextlib.contextmanager
def conv_layout(layout: str):
    """vLLM's conv-cache layout ("SD" default, "DS" via VLLM_SSM_CONV_STATE_LAYOUT), for
    layers built and run inside."""
    from vllm.model_executor.layers.mamba import mamba_utils
    old = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = layout
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        assert mamba_utils.is_conv_state_dim_first() == (layout == "DS")
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
        else:
            os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = old
        mamba_utils.get_conv_state_layout.cache_clear()


def interpreter_truncates() -> bool:
    """Whether Triton's interpreter casts fp32 -> bf16 toward zero (measured)."""
    x = torch.tensor([1 + 2 ** -8 + 2 ** -10, -(1 + 2 ** -8 + 2 ** -10)])   # RNE: +-(1 + 2^-7)
    y = torch.empty(2, dtype=torch.bfloat16)
    _cast_bf16[(1,)](x, y)
    return y.float().abs().tolist() == [1.0, 1.0]


# ---- a real layer --------------------------------------------------------------------------

def vllm_layer_cls():
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import (
        KimiGatedDeltaNetAttention)
    return KimiGatedDeltaNetAttention


def kimi_config(H: int):
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
    return KimiLinearConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=32, rms_norm_eps=1e-5,
        linear_attn_config={"head_dim": D, "num_heads": H, "short_conv_kernel_size": 4,
                            "kda_layers": [1], "full_attn_layers": []})


def construct(vc, H: int):
    """``KimiGatedDeltaNetAttention(config, vllm_config, prefix)`` as vLLM's model builds it
    (default dtype bf16: bf16 projections and o_norm weight, fp32 conv / A_log / dt_bias)."""
    from vllm.config import set_current_vllm_config
    with set_current_vllm_config(vc):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return vllm_layer_cls()(kimi_config(H), vc,
                                    prefix=f"model.layers.{next(_prefixes)}.self_attn")
        finally:
            torch.set_default_dtype(old)


def make_layer(vc, H: int, num_spec: int = 0, seed: int = 0, state_dtype=torch.float32):
    """A layer with random weights and bound caches; returns (layer, the raw page tensor)."""
    layer = construct(vc, H)
    # num_spec comes from vLLM's speculative config (a drafter model); the layer only uses it
    # for its cache shape (window 3 + num_spec) and, in the plugin, for T = num_spec + 1.
    layer.num_spec = num_spec
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if n == "A_log":
                r = torch.rand(p.shape, generator=g) * 2 - 1
            elif n == "o_norm.weight":
                r = 1 + 0.1 * r
            elif n == "conv1d.weight":
                r = 0.5 * r
            elif n != "dt_bias":
                r = r / p.shape[-1] ** 0.5
            p.copy_(r)
    # vLLM's bind_kv_cache needs the dtypes the model config would give (none here).
    layer.get_state_dtype = lambda: (torch.bfloat16, state_dtype)
    (conv_shape, state_shape) = layer.get_state_shape()
    conv_bytes = int(np.prod(conv_shape)) * 2
    state_bytes = int(np.prod(state_shape)) * torch.tensor([], dtype=state_dtype).element_size()
    raw = torch.randint(-128, 128, (SLOTS, 1, 1, conv_bytes + state_bytes + PAGE_PAD),
                        dtype=torch.int8, generator=g)
    layer.bind_kv_cache(raw)
    conv_state, state = layer.kv_cache
    conv_state.copy_(torch.randn(conv_state.shape, generator=g))
    state.copy_(0.1 * torch.randn(state.shape, generator=g))
    layer.process_weights_after_loading(torch.bfloat16)      # as vLLM's loader calls it
    return layer, raw


# ---- metadata as vLLM's GDN builder lays it out --------------------------------------------

def decode_md(block_table: torch.Tensor):
    """Pure decode: ``non_spec_state_indices_tensor = block_table[:, 0]`` (gdn_attn.py)."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    R = block_table.shape[0]
    return GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=R, num_decode_tokens=R,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=R,
        non_spec_state_indices_tensor=block_table[:, 0],
        non_spec_query_start_loc=torch.arange(R + 1, dtype=torch.int32))


def verify_md(block_table: torch.Tensor, accepted: torch.Tensor, T: int, n_real: int,
              query_lens=None):
    """Spec-only batch: ``spec_state_indices_tensor = block_table[:, :T]``; requests past
    ``n_real`` are FULL-graph padding (null block, accepted 1, zero query length)."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    R = block_table.shape[0]
    lens = list(query_lens) if query_lens is not None else [T] * n_real
    lens += [0] * (R - n_real)
    qsl = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    n_tok = sum(lens)
    uniform = lens[0] if all(v == lens[0] for v in lens[:n_real]) else None
    return GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=n_real, num_spec_decode_tokens=n_tok,
        num_actual_tokens=R * T if query_lens is None else n_tok,
        spec_state_indices_tensor=block_table[:, :T], spec_query_start_loc=qsl,
        spec_sequence_masks=torch.arange(R) < n_real, num_accepted_tokens=accepted,
        spec_token_indx=torch.arange(n_tok, dtype=torch.int32),
        non_spec_token_indx=torch.empty(0, dtype=torch.int32),
        uniform_spec_sequence_length=uniform)


def mixed_md(slots, query_lens, has_state):
    """No spec config, one plain decode and prefills: vLLM runs every token through its
    chunked prefill path."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata
    qsl = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32)
    nd = sum(1 for v in query_lens if v == 1)
    import vllm.utils.torch_utils as tu
    import vllm.v1.attention.backends.utils as bu
    with pytest.MonkeyPatch.context() as mp:     # no pinned memory without an accelerator
        mp.setattr(tu, "PIN_MEMORY", False)
        mp.setattr(bu, "PIN_MEMORY", False, raising=False)
        nums_dict, batch_ptr, offs = compute_causal_conv1d_metadata(qsl,
                                                                    device=torch.device("cpu"))
    return GDNAttentionMetadata(
        num_prefills=len(query_lens) - nd, num_prefill_tokens=sum(query_lens) - nd,
        num_decodes=nd, num_decode_tokens=nd, num_spec_decodes=0, num_spec_decode_tokens=0,
        num_actual_tokens=sum(query_lens), has_initial_state=torch.tensor(has_state),
        non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32),
        non_spec_query_start_loc=qsl, nums_dict=nums_dict, batch_ptr=batch_ptr,
        token_chunk_offset_ptr=offs)


def step(vc, layer, raw, md, hs, use_kda=True):
    """One forward of ``layer`` on a copy of ``raw``; returns (y, core, raw after, path).
    ``core`` is o_proj's input (the normed attention output)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    page = raw.clone()
    layer.bind_kv_cache(page)
    layer.kda_enabled = use_kda
    cap = {}
    hook = layer.o_proj.register_forward_pre_hook(lambda m, a: cap.__setitem__("core", a[0].clone()))
    try:
        with torch.no_grad(), set_current_vllm_config(vc), \
                set_forward_context({layer.prefix: md}, vc):
            y = layer(hs, torch.zeros(hs.shape[0], dtype=torch.long))
    finally:
        hook.remove()
        layer.kda_enabled = True
    return y, cap["core"], page, layer.kda_last_path


def views(layer, page):
    """(conv cache, state pool, padding bytes) of a raw page tensor, as the layer binds them."""
    layer.bind_kv_cache(page)
    conv_state, state = layer.kv_cache
    end = conv_state[0].numel() * 2 + state[0].numel() * state.element_size()
    return conv_state, state, page.view(SLOTS, -1)[:, end:]


def assert_close(name, actual, expected, tol: Tolerance):
    """kda.testing's rule: all but ``tol.frac`` of the elements within atol + rtol*|e|, all
    within the loose bound, no NaN where the expected value is finite."""
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    assert not bool((torch.isnan(a) & ~torch.isnan(e)).any()), f"{name}: NaN"
    bad = err > tol.atol + tol.rtol * e.abs()
    loose = err > tol.loose_atol + tol.loose_rtol * e.abs()
    assert float(bad.double().mean()) <= tol.frac and not bool(loose.any()), (
        f"{name}: {int(bad.sum())} of {bad.numel()} elements beyond atol={tol.atol} "
        f"rtol={tol.rtol} (allowed {tol.frac:.0%}), {int(loose.sum())} beyond the loose bound; "
        f"max err {float(err.max()):.3g}")


def report(label, core, core_v, state, state_v):
    """One line on how far the op's step is from vLLM's (shown with pytest -s)."""
    dc, ds = (core.float() - core_v.float()).abs(), (state - state_v).abs()
    print(f"\n{label}: out max |diff| {float(dc.max()):.3g} ({int((dc > 0).sum())} of "
          f"{dc.numel()} elements differ), state max |diff| {float(ds.max()):.3g}")


def hidden(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# ---- (a), (b): the plugin loader and the class swap ----------------------------------------

def test_entry_point_is_discovered_and_loaded_by_vllm(env, monkeypatch):
    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
           if e.value == ENTRY_POINT]
    assert [e.name for e in eps] == ["kda"], "pip install -e . puts the entry point in the metadata"
    import vllm.plugins as vp
    from vllm.model_executor.custom_op import op_registry_oot
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    funcs = vp.load_plugins_by_group(vp.DEFAULT_PLUGINS_GROUP)   # what load_general_plugins runs
    assert funcs["kda"] is plugin.register
    for _ in range(2):                                           # loading twice is harmless
        monkeypatch.setattr(vp, "plugins_loaded", False)
        vp.load_general_plugins()
        funcs["kda"]()
    assert op_registry_oot[plugin.VLLM_CLASS] is plugin.layer_class()


def test_vllm_loader_registers_the_layer_in_a_fresh_process():
    """In a process where nothing registered the plugin by hand: vLLM's loader, twice."""
    code = (
        "import vllm.plugins as vp\n"
        "from vllm.model_executor.custom_op import op_registry_oot as r\n"
        "assert 'KimiGatedDeltaNetAttention' not in r\n"
        "vp.load_general_plugins()\n"
        "first = r['KimiGatedDeltaNetAttention']\n"
        "vp.plugins_loaded = False\n"
        "vp.load_general_plugins()\n"
        "assert r['KimiGatedDeltaNetAttention'] is first\n"
        "print(first.__module__ + '.' + first.__qualname__)\n")
    env_ = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    env_.pop("VLLM_PLUGINS", None)
    res = subprocess.run([sys.executable, "-c", code], env=env_, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == \
        "kda.integrations.vllm.KdaKimiGatedDeltaNetAttention"


def test_constructing_vllms_layer_yields_ours(env):
    layer = construct(env, 8)
    assert type(layer) is plugin.layer_class()
    assert isinstance(layer, vllm_layer_cls())
    assert layer.kda_backend == "reference"


# ---- (c): one decode step and one verify step against vLLM's own path ----------------------

@pytest.mark.parametrize("H,layout", [(8, "SD"), (4, "SD"), (8, "DS")])
def test_decode_step_matches_vllm(env, H, layout):
    # a 2-column block table (so [:, 0] is a strided column), a null-block request, and a
    # FULL-graph padding row (null block) at the end
    table = torch.tensor([[5, 11], [0, 0], [2, 12], [9, 13], [0, 0]], dtype=torch.int32)
    md = decode_md(table)
    hs = hidden(table.shape[0])
    with conv_layout(layout), rne_casts():
        layer, raw = make_layer(env, H)
        y, core, page, path = step(env, layer, raw, md, hs)
        y_v, core_v, page_v, path_v = step(env, layer, raw, md, hs, use_kda=False)
        conv, state, pad = views(layer, page)
        conv_v, state_v, pad_v = views(layer, page_v)
        conv0, state0, pad0 = views(layer, raw.clone())
    assert path_v.startswith("vllm: disabled")
    # the layout asked for: SD stores [slots, L, 3*dim], DS [slots, 3*dim, L]
    assert conv.shape[-1 if layout == "SD" else -2] == 3 * H * D
    # H=4: the packed projection's row pitch is 385*H + 128 = 1668 elements (8-byte rows)
    assert path == "kda"
    report(f"decode H={H} {layout}", core, core_v, state, state_v)
    assert_close("out", core, core_v, TOLERANCES["out"])
    assert_close("y", y, y_v, TOLERANCES["out"])
    dead = torch.tensor([1, 4])
    assert torch.equal(core[dead], torch.zeros_like(core[dead]))
    assert torch.equal(core_v[dead], torch.zeros_like(core_v[dead]))
    assert torch.equal(conv, conv_v), "conv windows must be bit-identical"
    assert_close("state", state, state_v, TOLERANCES["state"])
    touched = sorted({5, 2, 9})
    untouched = [s for s in range(SLOTS) if s not in touched]
    assert torch.equal(state[untouched], state0[untouched])
    assert torch.equal(conv[untouched], conv0[untouched])
    assert not torch.equal(state[touched], state0[touched])
    assert torch.equal(pad, pad0) and torch.equal(pad_v, pad0)


@pytest.mark.parametrize("H,layout", [(8, "SD"), (4, "SD"), (8, "DS")])
def test_verify_step_matches_vllm(env, H, layout):
    T = 3
    # block table wider than T (prefix-caching style): [:, :T] is not contiguous. Requests:
    # accepted 2; a dead request (null source slot); accepted 3 with a write slot aliasing the
    # source; a FULL-graph padding request (null blocks, accepted 1, no tokens).
    table = torch.tensor([[5, 6, 7, 14], [0, 0, 0, 0], [9, 10, 9, 15], [0, 0, 0, 0]],
                         dtype=torch.int32)
    acc = torch.tensor([2, 1, 3, 1], dtype=torch.int32)
    md = verify_md(table, acc, T, n_real=3)
    hs = hidden(table.shape[0] * T, seed=2)
    with conv_layout(layout), rne_casts():
        layer, raw = make_layer(env, H, num_spec=T - 1)
        y, core, page, path = step(env, layer, raw, md, hs)
        y_v, core_v, page_v, _ = step(env, layer, raw, md, hs, use_kda=False)
        conv, state, pad = views(layer, page)
        conv_v, state_v, _ = views(layer, page_v)
        conv0, state0, pad0 = views(layer, raw.clone())
    assert path == "kda"
    live = torch.tensor([0, 1, 2, 6, 7, 8])
    report(f"verify T=3 H={H} {layout}", core[live], core_v[live], state, state_v)
    assert_close("out", core[live], core_v[live], TOLERANCES["out"])
    assert_close("y", y[live], y_v[live], TOLERANCES["out"])
    # dead and padding requests: all T rows zero here; vLLM zeroes the dead request's first
    # row and leaves the others unset
    dead = torch.tensor([3, 4, 5, 9, 10, 11])
    assert torch.equal(core[dead], torch.zeros_like(core[dead]))
    assert torch.equal(core_v[3], torch.zeros_like(core_v[3]))
    assert torch.equal(conv, conv_v), "conv windows must be bit-identical"
    assert_close("state", state, state_v, TOLERANCES["state"])
    written = [5, 6, 7, 9, 10]
    untouched = [s for s in range(SLOTS) if s not in written]
    assert torch.equal(state[untouched], state0[untouched])
    assert torch.equal(conv[[s for s in range(SLOTS) if s not in (5, 9)]],
                       conv0[[s for s in range(SLOTS) if s not in (5, 9)]])
    assert torch.equal(pad, pad0)


def test_state_difference_is_the_interpreters_truncation(env):
    """Without ``rne_casts`` the states differ by up to ~1e-2 (the difference first
    measured against vLLM on the CPU). Cause: the interpreter truncates every fp32 -> bf16
    cast of vLLM's kernels, among them the conv output y, which feeds the state update (k, v);
    about half of y's elements land one bf16 ulp toward zero. Shown here: vLLM's conv output
    with the truncating cast is its round-to-nearest output moved toward zero by at most one
    ulp (never away); with round-to-nearest it equals the op's (the reference's k exactly),
    and the states then agree to kda.testing's state tolerance (the decode test)."""
    if not interpreter_truncates():
        pytest.skip("this Triton's interpreter rounds fp32 -> bf16 to nearest: nothing to show")
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from kda.config import KdaArgs
    from kda.reference import reference_compute
    H = 8
    layer, raw = make_layer(env, H, seed=3)
    table = torch.tensor([[5], [2], [9], [7]], dtype=torch.int32)
    md = decode_md(table)
    hs = hidden(4, seed=4)
    y, core, page, path = step(env, layer, raw, md, hs)
    y_v, core_v, page_v, _ = step(env, layer, raw, md, hs, use_kda=False)   # truncating
    assert path == "kda"
    _, state, _ = views(layer, page)
    _, state_v, _ = views(layer, page_v)
    d = (state - state_v).abs()
    print(f"\nstate |op - vLLM (truncating interpreter)|: max {float(d.max()):.3g}, "
          f"relative {float(d.norm() / state_v.norm()):.3g}")
    assert float(d.max()) < 0.05                      # the bound seen: ~9e-3 at |S| ~ 1

    dim = H * D
    with torch.no_grad():
        x, beta, f_a = layer.in_proj_qkvgfab(hs)[0].split([3 * dim, H, D], -1)
        conv_state0, state0 = views(layer, raw.clone())[:2]
        w = layer.conv1d.weight.view(3 * dim, 4)
        idx = table[:, 0].contiguous()

        def vllm_conv():
            return causal_conv1d_update(x.contiguous(), conv_state0.clone().transpose(-1, -2), w,
                                        None, activation="silu", conv_state_indices=idx,
                                        out=torch.empty(4, 3 * dim, dtype=torch.bfloat16))
        y_trunc = vllm_conv().float()
        with rne_casts():
            y_rne = vllm_conv().float()
        gate = layer.g_b_proj(layer.g_a_proj(hs)[0])[0]
        args = KdaArgs(x, layer._kda_conv_weight, None, conv_state0.transpose(-1, -2), f_a,
                       layer.f_b_proj.weight, beta, layer.A_log, layer.dt_bias, state0, idx,
                       gate, layer.o_norm.weight, None, None, None, None)
        cfg = kda.KdaConfig(num_heads=H, norm_weight_dtype=torch.bfloat16)
        ref = reference_compute(cfg, args)
    k_ref = ref.k_raw[:, :, 0].reshape(4, dim)                 # the reference's conv output of k
    assert torch.equal(y_rne[:, dim:2 * dim], k_ref)
    moved = y_trunc != y_rne
    assert float(moved.double().mean()) > 0.3                 # about half the elements
    assert bool((y_trunc.abs()[moved] < y_rne.abs()[moved]).all()), "toward zero only"
    one_below = (y_rne.abs().to(torch.bfloat16).view(torch.int16) - 1).view(torch.bfloat16)
    assert torch.equal(y_trunc.abs()[moved], one_below.float()[moved]), "by one ulp"


# ---- (d): other batches fall back to vLLM's path --------------------------------------------

def test_prefill_and_mixed_batches_fall_back(env, monkeypatch):
    """vLLM's prefill kernels do not run on a CPU: ``gather_initial_states`` asserts a CUDA /
    XPU tensor, and ``causal_conv1d_fn``'s grid callback handles its arguments as torch
    tensors, which Triton's interpreter hands it as its own handles. So both runs here (with
    and without the plugin) use the same recording stand-ins for those three kernels
    (``chunk_kda_with_fused_gate`` too); what the test shows is the routing: a mixed batch
    reaches vLLM's own prefill code with the same tensors (g1 = f_b_proj(f_a) included) and
    gives the same result, bit for bit."""
    import vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn as kimi
    import vllm.models.kimi_k3.nvidia.ops.third_party.kda as kda_ops
    calls = []

    def conv_fn(x, weight, bias, activation=None, conv_states=None, has_initial_state=None,
                cache_indices=None, query_start_loc=None, metadata=None):
        calls.append(("conv", x.clone()))
        return torch.nn.functional.silu(x.float() * weight[:, -1:]).to(x.dtype)

    def gather(state, indices, has_initial_state):
        calls.append(("gather", indices.clone(), has_initial_state.clone()))
        got = state[indices.long()].clone()
        return torch.where(has_initial_state.view(-1, 1, 1, 1), got, torch.zeros_like(got))

    def chunk(q, k, v, raw_g, raw_beta, A_log, g_bias, lower_bound, initial_state,
              output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        calls.append(("chunk", raw_g.clone(), raw_beta.clone(), cu_seqlens.clone()))
        o = (v.float() * torch.sigmoid(raw_g.float())
             * torch.sigmoid(raw_beta.float())[..., None]).to(q.dtype)
        return o, initial_state + 1.0

    monkeypatch.setattr(kimi, "causal_conv1d_fn", conv_fn)
    monkeypatch.setattr(kimi, "gather_initial_states", gather)
    monkeypatch.setattr(kda_ops, "chunk_kda_with_fused_gate", chunk)
    layer, raw = make_layer(env, 8, seed=5)
    # a plain decode (slot 5, has state) and a prefill of 4 tokens (slot 2, fresh): vLLM sends
    # every token of such a batch through its chunked prefill path
    md = mixed_md([5, 2], [1, 4], [True, False])
    hs = hidden(5, seed=6)
    y, core, page, path = step(env, layer, raw, md, hs)
    ours, calls[:] = list(calls), []
    y_v, core_v, page_v, _ = step(env, layer, raw, md, hs, use_kda=False)
    assert path == "vllm: prefill or mixed batch"
    assert [c[0] for c in ours] == ["conv", "conv", "conv", "gather", "chunk"]
    assert len(ours) == len(calls) and all(
        a[0] == b[0] and all(torch.equal(u, w) for u, w in zip(a[1:], b[1:]))
        for a, b in zip(ours, calls))
    assert torch.equal(y, y_v) and torch.equal(core, core_v) and torch.equal(page, page_v)
    assert not torch.equal(page, raw)


def assert_falls_back(env, layer, raw, md, hs, reason: str):
    """The plugin leaves this batch on vLLM's path (its path starts with ``reason``): output
    and pages bit-identical to vLLM's own run."""
    y, _, page, path = step(env, layer, raw, md, hs)
    y_v, _, page_v, _ = step(env, layer, raw, md, hs, use_kda=False)
    assert path.startswith(reason), path
    assert torch.equal(y, y_v) and torch.equal(page, page_v)


def test_plain_decode_of_a_spec_layer_falls_back(env):
    # num_spec=2: window 5; vLLM's T=1 update shifts all 5 positions, the op's rewrites 0..2
    layer, raw = make_layer(env, 8, num_spec=2, seed=7)
    md = decode_md(torch.tensor([[5, 6, 7], [2, 3, 4]], dtype=torch.int32))
    hs = hidden(2, seed=8)
    assert_falls_back(env, layer, raw, md, hs, "vllm: plain decode with a conv window of 5")


def test_ragged_verify_batch_falls_back(env):
    T = 3
    layer, raw = make_layer(env, 4, num_spec=T - 1, seed=9)
    table = torch.tensor([[5, 6, 7], [9, 10, 11]], dtype=torch.int32)
    md = verify_md(table, torch.tensor([2, 1], dtype=torch.int32), T, n_real=2,
                   query_lens=[3, 1])       # a request that drafted nothing: 1 token
    hs = hidden(4, seed=10)
    assert_falls_back(env, layer, raw, md, hs, "vllm: ragged speculative batch")


def test_bf16_state_runs_the_op(env):
    """vLLM's bf16 recurrent state (--mamba-ssm-cache-dtype bfloat16) goes to the op, which
    agrees with vLLM's own kernels (round-to-nearest casts in the interpreter, as on a GPU):
    outputs as for fp32, each written page within one bf16 ulp for all but 1% of its
    elements, every other slot bit for bit."""
    md = decode_md(torch.tensor([[5], [0], [2]], dtype=torch.int32))
    hs = hidden(3, seed=12)
    with rne_casts():
        layer, raw = make_layer(env, 8, state_dtype=torch.bfloat16, seed=11)
        y, core, page, path = step(env, layer, raw, md, hs)
        y_v, core_v, page_v, _ = step(env, layer, raw, md, hs, use_kda=False)
        conv, state, _ = views(layer, page)
        conv_v, state_v, _ = views(layer, page_v)
        conv0, state0, _ = views(layer, raw.clone())
    assert path == "kda", path
    assert state.dtype == torch.bfloat16
    (cfg, _), = layer.kda_steps.items()
    assert cfg.state_dtype == torch.bfloat16
    assert_close("out", core, core_v, TOLERANCES["out"])
    assert_close("y", y, y_v, TOLERANCES["out"])
    assert torch.equal(conv, conv_v)
    assert_close("state", state[[5, 2]].float(), state_v[[5, 2]].float(),
                 TOLERANCES["state_bf16"])
    untouched = [s for s in range(SLOTS) if s not in (5, 2)]
    assert torch.equal(state[untouched].view(torch.int16), state0[untouched].view(torch.int16))


def test_one_kdadecode_per_layer_and_configuration(env):
    layer, raw = make_layer(env, 8, seed=13)
    md = decode_md(torch.tensor([[5], [2]], dtype=torch.int32))
    step(env, layer, raw, md, hidden(2, seed=14))
    built = dict(layer.kda_steps)
    md3 = decode_md(torch.tensor([[5], [2], [3]], dtype=torch.int32))    # another batch size
    step(env, layer, raw, md3, hidden(3, seed=15))
    assert len(built) == 1 and layer.kda_steps == built
    (cfg, obj), = built.items()
    assert (cfg.num_heads, cfg.T, cfg.window, cfg.conv_layout) == (8, 1, 3, "SD")
    assert obj.backend_name == "reference"


# ---- (e): backend choice ---------------------------------------------------------------------

def test_unknown_backend_fails_at_construction_listing_the_names(env, monkeypatch):
    from vllm.config import DeviceConfig, VllmConfig
    vc = VllmConfig(device_config=DeviceConfig(device="cpu"),
                    additional_config={plugin.CONFIG_KEY: "fastest"})
    with pytest.raises(kda.KdaBackendError) as e:
        construct(vc, 8)
    for name in kda.registry.CHOICES:
        assert name in str(e.value)
    assert "fastest" in str(e.value) and plugin.CONFIG_KEY in str(e.value)
    # $KDA_BACKEND when the key is absent; vLLM's own kda_decode_backend key is not ours
    monkeypatch.setenv("KDA_BACKEND", "nope")
    vc2 = VllmConfig(device_config=DeviceConfig(device="cpu"),
                     additional_config={"kda_decode_backend": "native"})
    with pytest.raises(kda.KdaBackendError, match="KDA_BACKEND"):
        construct(vc2, 8)
    monkeypatch.delenv("KDA_BACKEND")
    assert construct(vc2, 8).kda_backend == "auto"


def test_backend_choice_is_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="kda")
    for _ in range(3):
        assert plugin.backend_choice({plugin.CONFIG_KEY: "cutedsl_wide"}) == (
            "cutedsl_wide", f"--additional-config {plugin.CONFIG_KEY}")
    msgs = [r.getMessage() for r in caplog.records if "cutedsl_wide" in r.getMessage()]
    assert len(msgs) == 1, msgs
