"""The vLLM plugin (kda/integrations/vllm.py) against the real vLLM package, on a CPU.

Run with ``tools/vllm/run_tests.sh``: it builds an isolated virtual environment per tested
vLLM version (``plugin.TESTED_VLLM_VERSIONS``: 0.33.0 and 0.34.0) and runs this file in each.
Where the versions differ, the tests follow the installed one (noted at each). Without vLLM
every test here is skipped.

How vLLM runs here. Each model's KDA layer is built for real (``KimiGatedDeltaNetAttention``,
``KimiK3DeltaAttention``, ``Glm5NextLinearAttention``; small hidden size, the per-rank head
counts of the real checkpoints at TP 8 and TP 1, random weights) under a real ``VllmConfig``
(a ``ModelConfig`` read from a config.json written here, the ``CacheConfig`` with the state
dtype, an n-gram ``SpeculativeConfig`` for verify). Its caches come from vLLM's own cache-spec
path (``layer.get_kv_cache_spec`` -> one raw int8 page per slot, padded -> vLLM's
``bind_kv_cache_to_layers``); its metadata from vLLM's own builders (``GDNAttentionMetadata
Builder`` for Kimi-Linear and GLM-5-Next, ``KimiK3KDAMetadataBuilder`` for Kimi-K3) from a
``CommonAttentionMetadata``, FULL-graph staging included where the builder stages on a CPU.
The layer's ``forward`` runs under vLLM's forward context; vLLM's Triton kernels (conv update,
packed decode, fused recurrent verify, gated RMSNorm) run in Triton's CPU interpreter, which
needs:

* ``CUDA_VISIBLE_DEVICES=""`` and ``TRITON_INTERPRET=1`` before vLLM is imported (else vLLM's
  Triton import check finds no driver and replaces every kernel with a placeholder);
* vLLM's platform then is ``UnspecifiedPlatform`` (not ``cpu``: vLLM's CPU platform swaps the
  conv update for a C++ op that its CUDA wheel does not ship);
* a single-process gloo "distributed" init (the layer asks for its TP rank);
* a rebinding of ``exp`` / ``log`` in vLLM's two ``fused_recurrent`` modules to jit functions
  (the modules alias ``tl.exp`` at import time, which the interpreter rejects);
* Triton 3.8 (3.6's interpreter fails on the varlen conv update of the verify path);
* GLM-5-Next's package ``__init__`` imports its multimodal model, whose image processor needs
  torchvision, which has no CPU build for this torch here: when torchvision does not import,
  ``vllm.models.glm5next`` is entered as a package whose ``__init__`` is not run, and its real
  ``common/kda.py`` and kernels are imported from it.

The comparison baseline is vLLM's own path on the same layer instance (``kda_enabled=False``:
the plugin's ``forward`` then is ``super().forward``), on copies of the same caches.

vLLM's breakable CUDA graphs (its default for all four architectures the plugin serves) run
here through vLLM's own ``BreakableCUDAGraphWrapper`` and ``BreakableCUDAGraphCapture``, with
``torch.cuda.CUDAGraph`` replaced by ``CpuGraph``, which keeps a CUDA graph's contract on a
CPU: capture records the ATen ops of a segment on the tensors they ran on, replay runs them
again writing each result into the tensor the op produced at capture (allocations are not
redone). So a captured segment reads, at replay, the memory it read at capture, as on a GPU.

Rounding: Triton's interpreter casts fp32 to bf16 by truncation, not round-to-nearest-even as
Triton does on a GPU, so in the interpreter vLLM's kernels round their conv output y, o, the
normed output and a bf16 state toward zero. ``rne_casts`` patches that one cast to round to
nearest even; the step comparisons run under it and then meet kda.testing's tolerances
(states: 1e-5 + 1e-4 relative; a bf16 state also kda.testing's rule that at most
``BF16_STATE_DIFFER_FRAC`` of its written elements differ at all, which a truncating cast
fails). ``test_state_difference_is_the_interpreters_truncation`` shows what the unpatched
interpreter gives and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import types

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable: tools/vllm/run_tests.sh installs each tested vLLM "
                "into an isolated venv and runs these tests", allow_module_level=True)

# Before vLLM (and its Triton kernels) are imported; this file runs vLLM on the CPU only.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kda  # noqa: E402
from kda.errors import KdaArgumentError  # noqa: E402
from kda.integrations import vllm as plugin  # noqa: E402
from kda.testing import BF16_STATE_DIFFER_FRAC, TOLERANCES, Tolerance  # noqa: E402
from tests.integrations.triton_rne import rne_casts  # noqa: E402

VLLM_VERSION = plugin.vllm_version()

D = 128
HIDDEN = 256           # the layers' hidden size (the op never sees it; small keeps GEMMs cheap)
SLOTS = 16
PAGE_PAD = 48          # bytes past the states in each page: slot pitches larger than the states
ENTRY_POINT = "kda.integrations.vllm:register"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


GLM_SHELL = """
import importlib, importlib.machinery, importlib.util, os, sys
try:
    import torchvision  # noqa: F401
except Exception:
    models = importlib.import_module("vllm.models")
    name = "vllm.models.glm5next"
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [os.path.join(models.__path__[0], "glm5next")]
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    models.glm5next = pkg
"""


def glm_package_shell() -> None:
    """Enter ``vllm.models.glm5next`` without running its ``__init__`` when torchvision does
    not import (see the module docstring); a no-op where it does."""
    if "vllm.models.glm5next" not in sys.modules:
        exec(GLM_SHELL, {})


@pytest.fixture(scope="module")
def env():
    return init_vllm()


def init_vllm() -> bool:
    """A single-process gloo TP group, the interpreter workarounds, the plugin registered and
    the three layer modules imported (their classes registered by the plugin's import hook).
    (The ``env`` fixture; a plain function for the subprocess of the logging test.)"""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (init_distributed_environment,
                                                 initialize_model_parallel,
                                                 model_parallel_is_initialized)
    glm_package_shell()
    plugin.register()
    import vllm.models.glm5next.common.kda  # noqa: F401
    import vllm.models.glm5next.nvidia.ops.third_party.kda.fused_recurrent as glm_fr
    import vllm.models.kimi_k3.nvidia.kda  # noqa: F401
    import vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent as fr

    fr.exp, fr.log = _exp, _log       # interpreter only: see the module docstring
    glm_fr.exp = _exp
    if not model_parallel_is_initialized():
        vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{port}",
                                         backend="gloo")
            initialize_model_parallel(1, 1)
    return True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A local checkpoint folder with a Kimi-Linear config.json (vLLM's ModelConfig reads it;
    the layers get their own configs)."""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
    d = tmp_path_factory.mktemp("kimi")
    c = KimiLinearConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                         rms_norm_eps=1e-5, linear_attn_config={
                             "head_dim": D, "num_heads": 8, "short_conv_kernel_size": 4,
                             "kda_layers": [1], "full_attn_layers": []})
    c.architectures = ["KimiLinearForCausalLM"]
    c.save_pretrained(str(d))
    return str(d)


_configs: dict = {}


def vllm_config(model_dir, ssm_dtype="auto", num_spec=0, backend="reference", adaptive=False,
                recoverssm=False, full_graphs=False):
    """A real VllmConfig: bf16 ModelConfig, CacheConfig(mamba_ssm_cache_dtype), an n-gram
    speculative config with ``num_spec`` tokens, the plugin's setting (None: not given), FULL
    CUDA graphs (so vLLM's builders stage their decode metadata)."""
    key = (model_dir, ssm_dtype, num_spec, backend, adaptive, recoverssm, full_graphs)
    if key in _configs:
        return _configs[key]
    from vllm.config import (CacheConfig, CUDAGraphMode, DeviceConfig, ModelConfig,
                             ParallelConfig, SpeculativeConfig, VllmConfig)
    mc = ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16")
    pc = ParallelConfig()
    sc = None
    if num_spec:
        sc = SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec,
                               target_model_config=mc, target_parallel_config=pc,
                               prompt_lookup_max=3, prompt_lookup_min=1)
    cc = CacheConfig(mamba_ssm_cache_dtype=ssm_dtype, enable_prefix_caching=False)
    extra = {} if backend is None else {plugin.CONFIG_KEY: backend}
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"), cache_config=cc,
                    parallel_config=pc, speculative_config=sc, additional_config=extra)
    if adaptive:       # set after validation, which wants FULL CUDA graphs for it
        vc.speculative_config.enable_adaptive_verification = True
    if recoverssm:
        vc.cache_config.use_replayssm = True
        vc.cache_config.use_kda_recoverssm = True
    if full_graphs:
        vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    _configs[key] = vc
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


# ---- the three models ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelCase:
    """One vLLM KDA model: its per-rank head counts at TP 8 and TP 1, its layer and builder."""

    name: str
    tp8: int
    tp1: int

    def vllm_class(self):
        m = plugin.MODELS[self.name]
        return getattr(importlib.import_module(m.vllm_module), m.vllm_class)

    def builder_class(self):
        if self.name == "Kimi-K3":
            from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadataBuilder
            return KimiK3KDAMetadataBuilder
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
        return GDNAttentionMetadataBuilder

    def hf_config(self, H: int, lower_bound=None):
        """The layer's config: Kimi-Linear (Kimi-Linear-48B: 32 heads), Kimi-K3 (full-rank
        output gate, bounded gate -5, 96 heads), GLM-5-Next (bounded gate -5, 64 heads)."""
        if self.name == "GLM-5-Next":
            from transformers import Glm5NextTextConfig
            return Glm5NextTextConfig(hidden_size=HIDDEN, num_hidden_layers=1,
                                      linear_head_dim=D, linear_num_heads=H,
                                      linear_conv_kernel_dim=4,
                                      linear_lower_bound=-5.0 if lower_bound is None
                                      else lower_bound)
        from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
        lin = {"head_dim": D, "num_heads": H, "short_conv_kernel_size": 4, "kda_layers": [1],
               "full_attn_layers": []}
        if self.name == "Kimi-K3":
            lin.update(use_full_rank_gate=True,
                       gate_lower_bound=-5.0 if lower_bound is None else lower_bound)
        elif lower_bound is not None:
            lin["gate_lower_bound"] = lower_bound
        return KimiLinearConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                                rms_norm_eps=1e-5, linear_attn_config=lin)


KIMI = ModelCase("Kimi-Linear", tp8=4, tp1=32)
K3 = ModelCase("Kimi-K3", tp8=12, tp1=96)
GLM = ModelCase("GLM-5-Next", tp8=8, tp1=64)
MODEL_CASES = [KIMI, K3, GLM]


def construct(vc, model: ModelCase, H: int, lower_bound=None):
    """vLLM's layer class called as vLLM's model builds it (default dtype bf16: bf16
    projections and o_norm weight, fp32 conv / A_log / dt_bias)."""
    from vllm.config import set_current_vllm_config
    with set_current_vllm_config(vc):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return model.vllm_class()(model.hf_config(H, lower_bound), vc,
                                      prefix=f"model.layers.{next(_prefixes)}.self_attn")
        finally:
            torch.set_default_dtype(old)


def bind(vc, layer, page):
    """vLLM's binding of one layer's raw pages (``bind_kv_cache_to_layers``)."""
    from vllm.v1.worker.utils import bind_kv_cache_to_layers
    bind_kv_cache_to_layers({layer.prefix: page}, {layer.prefix: layer})


def make_layer(vc, model: ModelCase, H: int, seed: int = 0, lower_bound=None):
    """A layer with random weights and caches from vLLM's cache spec; returns (layer, raw
    pages ``[SLOTS, 1, 1, page bytes + PAGE_PAD]`` int8)."""
    layer = construct(vc, model, H, lower_bound)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if n == "A_log":
                r = torch.rand(p.shape, generator=g) * 2 - 1
            elif n == "o_norm.weight":
                r = 1 + 0.1 * r
            elif n.endswith("conv1d.weight"):
                r = 0.5 * r
            elif n != "dt_bias":
                r = r / p.shape[-1] ** 0.5
            p.copy_(r)
    spec = layer.get_kv_cache_spec(vc)
    raw = torch.randint(-128, 128, (SLOTS, 1, 1, spec.page_size_bytes + PAGE_PAD),
                        dtype=torch.int8, generator=g)
    bind(vc, layer, raw)
    conv_state, state = layer.kv_cache[:2]
    conv_state.copy_(torch.randn(conv_state.shape, generator=g))
    state.copy_(0.1 * torch.randn(state.shape, generator=g))
    layer.process_weights_after_loading(torch.bfloat16)      # as vLLM's loader calls it
    return layer, raw


# ---- metadata from vLLM's own builders -----------------------------------------------------

def build_md(vc, model: ModelCase, layer, block_table, query_lens, accepted=None, drafts=None,
             prefilling=None, context=10):
    """``builder.build(0, CommonAttentionMetadata(...), num_accepted_tokens, drafts)`` of the
    model's own metadata builder, on the CPU (pinned memory off: there is no accelerator)."""
    import vllm.utils.torch_utils as tu
    import vllm.v1.attention.backends.utils as bu
    from vllm.v1.attention.backend import CommonAttentionMetadata
    R = block_table.shape[0]
    lens = torch.tensor(query_lens, dtype=torch.int32)
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    seq = lens + context
    if prefilling is None:
        prefilling = [False] * R
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=R,
        num_actual_tokens=int(qsl[-1]), max_query_len=int(lens.max()), max_seq_len=int(seq.max()),
        block_table_tensor=block_table, slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.long),
        is_prefilling=torch.tensor(prefilling), seq_lens_cpu_upper_bound=seq.clone())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tu, "PIN_MEMORY", False, raising=False)
        mp.setattr(bu, "PIN_MEMORY", False, raising=False)
        builder = model.builder_class()(layer.get_kv_cache_spec(vc), [layer.prefix], vc,
                                        torch.device("cpu"))
        return builder.build(0, cm, num_accepted_tokens=accepted,
                             num_decode_draft_tokens_cpu=drafts)


def decode_md(vc, model, layer, block_table):
    R = block_table.shape[0]
    return build_md(vc, model, layer, block_table, [1] * R)


def verify_md(vc, model, layer, block_table, accepted, query_lens):
    lens = torch.tensor(query_lens, dtype=torch.int32)
    return build_md(vc, model, layer, block_table, query_lens, accepted=accepted,
                    drafts=lens - 1)


def step(vc, layer, raw, md, hs, use_kda=True):
    """One forward of ``layer`` on a copy of ``raw``; returns (y, core, pages after, path).
    ``core`` is o_proj's input (the normed attention output)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    page = raw.clone()
    bind(vc, layer, page)
    layer.kda_enabled = use_kda
    cap = {}
    hook = layer.o_proj.register_forward_pre_hook(
        lambda m, a: cap.__setitem__("core", a[0].clone()))
    try:
        with torch.no_grad(), set_current_vllm_config(vc), \
                set_forward_context({layer.prefix: md}, vc):
            y = layer(hs, torch.zeros(hs.shape[0], dtype=torch.long))
    finally:
        hook.remove()
        layer.kda_enabled = True
    return y, cap["core"], page, layer.kda_last_path


def views(vc, layer, page):
    """(conv cache, state pool, padding bytes) of a raw page tensor, as vLLM binds them."""
    bind(vc, layer, page)
    conv_state, state = layer.kv_cache[:2]
    end = conv_state[0].numel() * conv_state.element_size() + state[0].numel() * state.element_size()
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


def assert_states_close(state, state_v, slots):
    """The written state pages: fp32 within kda.testing's state tolerance; bf16 within one
    bf16 ulp and, the contract's rounding rule (round to nearest even, once), at most
    ``BF16_STATE_DIFFER_FRAC`` of the elements different at all."""
    a, e = state[slots], state_v[slots]
    if state.dtype == torch.bfloat16:
        assert_close("state", a.float(), e.float(), TOLERANCES["state_bf16"])
        differ = float((a.view(torch.int16) != e.view(torch.int16)).double().mean())
        assert differ <= BF16_STATE_DIFFER_FRAC, (
            f"state: {differ:.2%} of the written bf16 elements differ from vLLM's (allowed "
            f"{BF16_STATE_DIFFER_FRAC:.0%}: rounded other than to nearest even?)")
    else:
        assert_close("state", a, e, TOLERANCES["state"])


def report(label, core, core_v, state, state_v):
    """One line on how far the op's step is from vLLM's (shown with pytest -s)."""
    dc, ds = (core.float() - core_v.float()).abs(), (state.float() - state_v.float()).abs()
    print(f"\n{label}: out max |diff| {float(dc.max()):.3g} ({int((dc > 0).sum())} of "
          f"{dc.numel()} elements differ), state max |diff| {float(ds.max()):.3g}")


def hidden(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def dtype_of(name):
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def kimi_prefill_stores_into_bf16() -> bool:
    """vLLM 0.34's Kimi-Linear prefill stores into a bf16 pool (``scatter_states``), 0.33's
    cannot (the plugin then refuses a bf16 pool at construction)."""
    from kda.integrations import _vllm_kimi_linear
    return _vllm_kimi_linear.PREFILL_STORES_INTO_BF16


@pytest.fixture
def plugin_log(caplog):
    """The plugin's log records from now on (its "once" memory cleared: this test's first
    time), read from the plugin's logger itself, whatever vLLM's logger propagates."""
    logger = logging.getLogger(plugin.LOGGER_NAME)
    old = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.addHandler(caplog.handler)
    logger.propagate = False            # else caplog's handler on the root sees them twice
    caplog.clear()
    saved = set(plugin._logged)
    plugin._logged.clear()
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(old[0])
        logger.propagate = old[1]
        plugin._logged.update(saved)


def messages(log, text: str):
    return [r.getMessage() for r in log.records if text in r.getMessage()]


# ---- the plugin loader and the class swap ----------------------------------------------------

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
    for name, m in plugin.MODELS.items():
        assert op_registry_oot[m.vllm_class] is plugin.layer_class(name)


def test_vllm_loader_registers_the_layers_in_a_fresh_process():
    """In a process where nothing registered the plugin by hand: vLLM's loader, twice;
    Kimi-Linear's class at once, Kimi-K3's and GLM-5-Next's when vLLM imports their module."""
    code = GLM_SHELL + (
        "import vllm.plugins as vp\n"
        "from vllm.model_executor.custom_op import op_registry_oot as r\n"
        "assert 'KimiGatedDeltaNetAttention' not in r\n"
        "vp.load_general_plugins()\n"
        "first = r['KimiGatedDeltaNetAttention']\n"
        "vp.plugins_loaded = False\n"
        "vp.load_general_plugins()\n"
        "assert r['KimiGatedDeltaNetAttention'] is first\n"
        "assert 'KimiK3DeltaAttention' not in r and 'Glm5NextLinearAttention' not in r\n"
        "assert 'vllm.models.kimi_k3.nvidia.kda' not in sys.modules\n"
        "from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention\n"
        "from vllm.models.glm5next.common.kda import Glm5NextLinearAttention\n"
        "for c in (first, r['KimiK3DeltaAttention'], r['Glm5NextLinearAttention']):\n"
        "    print(c.__module__ + '.' + c.__qualname__)\n"
        "assert issubclass(r['KimiK3DeltaAttention'], KimiK3DeltaAttention)\n"
        "assert issubclass(r['Glm5NextLinearAttention'], Glm5NextLinearAttention)\n")
    env_ = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    env_.pop("VLLM_PLUGINS", None)
    res = subprocess.run([sys.executable, "-c", code], env=env_, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-3:] == [
        "kda.integrations._vllm_kimi_linear.KdaKimiGatedDeltaNetAttention",
        "kda.integrations._vllm_kimi_k3.KdaKimiK3DeltaAttention",
        "kda.integrations._vllm_glm5next.KdaGlm5NextLinearAttention"]


def test_k3_is_not_replaced_where_vllm_builds_another_class(env, monkeypatch, plugin_log):
    """On ROCm vLLM builds ``vllm.models.kimi_k3.amd``'s class of the same name: the plugin
    must not register its NVIDIA subclass for that name there."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.platforms import current_platform
    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: True)
    monkeypatch.delitem(op_registry_oot, "KimiK3DeltaAttention")
    plugin._register_model(plugin.MODELS["Kimi-K3"])
    assert "KimiK3DeltaAttention" not in op_registry_oot
    assert messages(plugin_log, "Kimi-K3's layer is not replaced")


@pytest.mark.parametrize("model", MODEL_CASES, ids=lambda m: m.name)
def test_constructing_vllms_layer_yields_ours(env, model_dir, model):
    layer = construct(vllm_config(model_dir), model, model.tp8)
    assert type(layer) is plugin.layer_class(model.name)
    assert isinstance(layer, model.vllm_class())
    assert layer.kda_backend == "reference" and layer.kda_enabled


# ---- the state dtype through vLLM's cache-spec path ------------------------------------------

@pytest.mark.parametrize("model", MODEL_CASES, ids=lambda m: m.name)
@pytest.mark.parametrize("ssm", ["auto", "float32", "bfloat16"])
def test_ssm_cache_dtype_reaches_the_cache(env, model_dir, model, ssm):
    """``--mamba-ssm-cache-dtype`` gives the pool the dtype the model class computes:
    vLLM's own ``get_kv_cache_spec`` and binding, no dtype set by hand (vLLM's Kimi-Linear
    layer alone reports fp32 for bfloat16). Under vLLM 0.33 Kimi-Linear with bfloat16 is
    refused instead (``test_kimi_linear_bf16_pool``)."""
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM
    vc = vllm_config(model_dir, ssm_dtype=ssm)
    if model is KIMI and ssm == "bfloat16" and not kimi_prefill_stores_into_bf16():
        with pytest.raises(KdaArgumentError, match="--mamba-ssm-cache-dtype"):
            make_layer(vc, model, model.tp8)
        return
    want = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[ssm]
    layer, _ = make_layer(vc, model, model.tp8)
    spec = layer.get_kv_cache_spec(vc)
    assert spec.dtypes == (torch.bfloat16, want)
    assert tuple(spec.dtypes) == tuple(KimiLinearForCausalLM.get_mamba_state_dtype_from_config(vc))
    assert layer.kv_cache[1].dtype == want


# ---- decode and verify steps against vLLM's own path -----------------------------------------

# Each model: H as at TP 8 and at TP 1, both conv layouts and both state dtypes, paired so that
# every value of each appears with every value of the others at least once across decode and
# verify.
STEP_CASES = [(m, H, layout, sd) for m in MODEL_CASES
              for H, layout, sd in [(m.tp8, "SD", "fp32"), (m.tp8, "DS", "bf16"),
                                    (m.tp1, "SD", "bf16"), (m.tp1, "DS", "fp32")]]


def step_id(c):
    m, H, layout, sd = c
    return f"{m.name}-H{H}-{layout}-{sd}"


def expected_path_matches(vc, model, layer, raw, md, hs, touched, label, live_rows=None,
                          dead_rows=(), written=None, conv_touched=None):
    """Run the op and vLLM's path on copies of ``raw``; check out, y, conv windows, states,
    untouched slots and padding bytes."""
    with rne_casts():
        y, core, page, path = step(vc, layer, raw, md, hs)
        y_v, core_v, page_v, path_v = step(vc, layer, raw, md, hs, use_kda=False)
    conv, state, pad = views(vc, layer, page)
    conv_v, state_v, pad_v = views(vc, layer, page_v)
    conv0, state0, pad0 = views(vc, layer, raw.clone())
    assert path == "kda", path
    assert path_v.startswith("vllm: disabled")
    rows = torch.arange(core.shape[0]) if live_rows is None else torch.tensor(live_rows)
    report(label, core[rows], core_v[rows], state, state_v)
    assert_close("out", core[rows], core_v[rows], TOLERANCES["out"])
    assert_close("y", y[rows], y_v[rows], TOLERANCES["out"])
    if len(dead_rows):
        dead = torch.tensor(dead_rows)
        assert torch.equal(core[dead], torch.zeros_like(core[dead]))
    assert torch.equal(conv, conv_v), "conv windows must be bit-identical"
    written = sorted(touched if written is None else written)
    assert_states_close(state, state_v, written)
    untouched = [s for s in range(SLOTS) if s not in written]
    assert torch.equal(state[untouched].view(torch.uint8), state0[untouched].view(torch.uint8))
    keep = [s for s in range(SLOTS) if s not in (touched if conv_touched is None else conv_touched)]
    assert torch.equal(conv[keep], conv0[keep])
    assert not torch.equal(state[written].float(), state0[written].float())
    assert torch.equal(pad, pad0) and torch.equal(pad_v, pad0)
    return layer


def skip_refused(model, sd):
    """Kimi-Linear on a bf16 pool is refused under vLLM 0.33 (``test_kimi_linear_bf16_pool``)."""
    if model is KIMI and sd == "bf16" and not kimi_prefill_stores_into_bf16():
        pytest.skip(f"vLLM {VLLM_VERSION}: Kimi-Linear on a bf16 pool is refused at "
                    "construction (test_kimi_linear_bf16_pool)")


@pytest.mark.parametrize("case", STEP_CASES, ids=step_id)
def test_decode_step_matches_vllm(env, model_dir, case):
    model, H, layout, sd = case
    skip_refused(model, sd)
    vc = vllm_config(model_dir, ssm_dtype={"fp32": "float32", "bf16": "bfloat16"}[sd])
    # a 2-column block table (so [:, 0] is a strided column) and a null-block request
    table = torch.tensor([[5, 11], [0, 0], [2, 12], [9, 13]], dtype=torch.int32)
    hs = hidden(table.shape[0])
    with conv_layout(layout):
        layer, raw = make_layer(vc, model, H)
        md = decode_md(vc, model, layer, table)
        assert layer.kv_cache[1].dtype == dtype_of(sd)
        # the layout asked for: SD stores [slots, L, 3*dim], DS [slots, 3*dim, L]
        assert layer.kv_cache[0].shape[-1 if layout == "SD" else -2] == 3 * H * D
        expected_path_matches(vc, model, layer, raw, md, hs, touched={5, 2, 9},
                              label=f"decode {step_id(case)}", live_rows=[0, 2, 3],
                              dead_rows=[1])
    (cfg, obj), = layer.kda_steps.items()
    assert (cfg.num_heads, cfg.T, cfg.window, cfg.conv_layout, cfg.state_dtype) == (
        H, 1, 3, layout, dtype_of(sd))
    assert cfg.lower_bound == (None if model is KIMI else -5.0)


@pytest.mark.parametrize("case", STEP_CASES, ids=step_id)
def test_verify_step_matches_vllm(env, model_dir, case):
    model, H, layout, sd = case
    skip_refused(model, sd)
    T = 3
    vc = vllm_config(model_dir, ssm_dtype={"fp32": "float32", "bf16": "bfloat16"}[sd],
                     num_spec=T - 1)
    # block table wider than T (prefix-caching style): [:, :T] is not contiguous. Requests:
    # accepted 2; a dead request (null source slot); accepted 3 with a write slot aliasing
    # the source
    table = torch.tensor([[5, 6, 7, 14], [0, 0, 0, 0], [9, 10, 9, 15]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 3], dtype=torch.int32)
    hs = hidden(table.shape[0] * T, seed=2)
    with conv_layout(layout):
        layer, raw = make_layer(vc, model, H)
        md = verify_md(vc, model, layer, table, acc, [T] * 3)
        assert layer.kv_cache[0].shape[-2 if layout == "SD" else -1] == T + 2     # window
        expected_path_matches(vc, model, layer, raw, md, hs, touched={5, 9},
                              label=f"verify T=3 {step_id(case)}",
                              live_rows=[0, 1, 2, 6, 7, 8], dead_rows=[3, 4, 5],
                              written={5, 6, 7, 9, 10})
    (cfg, _), = layer.kda_steps.items()
    assert (cfg.T, cfg.window) == (T, T + 2)


@pytest.mark.parametrize("model", [KIMI, GLM], ids=lambda m: m.name)
def test_full_graph_staging_pads_with_null_blocks(env, model_dir, model):
    """With FULL CUDA graphs vLLM's GDN builder stages the slot table and accepted counts
    into its persistent buffers; a zero-token padding request gets the null block and
    accepted count 1: a dead item for the op, as for vLLM's kernels."""
    T = 2
    vc = vllm_config(model_dir, num_spec=T - 1, full_graphs=True)
    table = torch.tensor([[5, 6, 14], [9, 10, 15], [3, 4, 13]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 2], dtype=torch.int32)
    layer, raw = make_layer(vc, model, model.tp8, seed=3)
    md = build_md(vc, model, layer, table, [T, T, 0], accepted=acc,
                  drafts=torch.tensor([T - 1, T - 1, -1]))
    assert md.spec_state_indices_tensor.is_contiguous()        # the staging buffer
    hs = hidden(2 * T, seed=4)
    expected_path_matches(vc, model, layer, raw, md, hs, touched={5, 9},
                          label=f"verify staged {model.name}", written={5, 6, 9, 10})


@pytest.mark.parametrize("model", MODEL_CASES, ids=lambda m: m.name)
def test_decode_of_a_spec_configured_layer_matches_vllm(env, model_dir, model):
    """A pure-decode batch of a layer configured for speculation (window 3 + num_spec): vLLM's
    T=1 conv update rewrites positions 0..2 only, as the op does; both leave the rest."""
    vc = vllm_config(model_dir, num_spec=2)
    table = torch.tensor([[5, 6, 7], [2, 3, 4]], dtype=torch.int32)
    layer, raw = make_layer(vc, model, model.tp8, seed=7)
    md = decode_md(vc, model, layer, table)
    assert md.num_spec_decodes == 0
    expected_path_matches(vc, model, layer, raw, md, hidden(2, seed=8), touched={5, 2},
                          label=f"decode, window 5, {model.name}")
    (cfg, _), = layer.kda_steps.items()
    assert (cfg.T, cfg.window) == (1, 5)


def test_kimi_linear_bounded_gate_matches_vllm(env, model_dir):
    """Kimi-Linear with ``gate_lower_bound`` in its config: the op's bounded gate."""
    vc = vllm_config(model_dir)
    table = torch.tensor([[5], [2], [9]], dtype=torch.int32)
    layer, raw = make_layer(vc, KIMI, KIMI.tp8, seed=21, lower_bound=-3.0)
    md = decode_md(vc, KIMI, layer, table)
    expected_path_matches(vc, KIMI, layer, raw, md, hidden(3, seed=22), touched={5, 2, 9},
                          label="decode, Kimi-Linear bounded gate")
    (cfg, _), = layer.kda_steps.items()
    assert cfg.lower_bound == -3.0


def test_state_difference_is_the_interpreters_truncation(env, model_dir):
    """Without ``rne_casts`` the states differ by up to ~1e-2. Cause: the interpreter truncates
    every fp32 -> bf16 cast of vLLM's kernels, among them the conv output y, which feeds the
    state update (k, v); about half of y's elements land one bf16 ulp toward zero. Shown here:
    vLLM's conv output with the truncating cast is its round-to-nearest output moved toward
    zero by at most one ulp (never away); with round-to-nearest it equals the op's (the
    reference's k exactly), and the states then agree to kda.testing's state tolerance (the
    decode test)."""
    if not interpreter_truncates():
        pytest.skip("this Triton's interpreter rounds fp32 -> bf16 to nearest: nothing to show")
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from kda.config import KdaArgs
    from kda.reference import reference_compute
    H = 8
    vc = vllm_config(model_dir)
    layer, raw = make_layer(vc, KIMI, H, seed=3)
    table = torch.tensor([[5], [2], [9], [7]], dtype=torch.int32)
    md = decode_md(vc, KIMI, layer, table)
    hs = hidden(4, seed=4)
    y, core, page, path = step(vc, layer, raw, md, hs)
    y_v, core_v, page_v, _ = step(vc, layer, raw, md, hs, use_kda=False)   # truncating
    assert path == "kda"
    _, state, _ = views(vc, layer, page)
    _, state_v, _ = views(vc, layer, page_v)
    d = (state - state_v).abs()
    print(f"\nstate |op - vLLM (truncating interpreter)|: max {float(d.max()):.3g}, "
          f"relative {float(d.norm() / state_v.norm()):.3g}")
    assert float(d.max()) < 0.05                      # the bound seen: ~9e-3 at |S| ~ 1

    dim = H * D
    with torch.no_grad():
        x, beta, f_a = layer.in_proj_qkvgfab(hs)[0].split([3 * dim, H, D], -1)
        conv_state0, state0 = views(vc, layer, raw.clone())[:2]
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


# ---- other batches and setups fall back to vLLM's path ---------------------------------------

def assert_falls_back(vc, layer, raw, md, hs, reason: str, log=None):
    """The plugin leaves this batch on vLLM's path (its path starts with ``reason``): output
    and pages bit-identical to vLLM's own run, no KdaDecode built; the reason logged once
    over two calls (``log``: the ``plugin_log`` fixture)."""
    if log is not None:
        log.clear()
        plugin._logged.clear()           # "once per process": this test's first time
    y, _, page, path = step(vc, layer, raw, md, hs)
    step(vc, layer, raw, md, hs)
    y_v, _, page_v, _ = step(vc, layer, raw, md, hs, use_kda=False)
    assert path.startswith(reason), path
    assert torch.equal(y, y_v) and torch.equal(page, page_v)
    assert not layer.kda_steps
    if log is not None:
        why = path[len("vllm: "):]
        assert len(messages(log, why)) == 1, [r.getMessage() for r in log.records]


def stand_in_prefill_kernels(monkeypatch, model, calls):
    """vLLM's prefill kernels do not run on a CPU (``gather_initial_states`` and
    ``scatter_states`` (GLM-5-Next; Kimi-Linear from vLLM 0.34) assert a CUDA / XPU tensor;
    ``causal_conv1d_fn``'s grid callback takes Triton's interpreter handles for torch
    tensors): recording stand-ins where the model's ``_forward`` looks them up, the same for
    both runs of a test. The chunk kernel's stand-in returns its final state in fp32, as the
    real one does whatever the pool's dtype (fla's ``chunk_gated_delta_rule_fwd_h``); the
    ``scatter_states`` stand-in converts it to the pool's dtype as the real Triton store does.
    (GLM-5-Next's ``_cast_sigmoid`` is a torch.compile'd ``x.float().sigmoid()``: called as
    that, without Inductor.)"""
    import vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn as kimi
    import vllm.models.glm5next.common.kda as glm
    import vllm.models.kimi_k3.nvidia.kda as k3
    import vllm.models.kimi_k3.nvidia.ops.third_party.kda as kda_ops

    def conv_fn(x, weight, bias, activation=None, conv_states=None, has_initial_state=None,
                cache_indices=None, query_start_loc=None, metadata=None):
        calls.append(("conv", x.clone()))
        return torch.nn.functional.silu(x.float() * weight[:, -1:]).to(x.dtype)

    def gather(state, indices, has_initial_state):
        calls.append(("gather", indices.clone(), has_initial_state.clone()))
        got = state[indices.long()].clone()
        return torch.where(has_initial_state.view(-1, 1, 1, 1), got, torch.zeros_like(got))

    def chunk(q, k, v, raw_g, initial_state=None, cu_seqlens=None, **kwargs):
        beta = kwargs["raw_beta"] if "raw_beta" in kwargs else kwargs["beta"]
        calls.append(("chunk", raw_g.clone(), beta.clone(), cu_seqlens.clone()))
        o = (v.float() * torch.sigmoid(raw_g.float())
             * torch.sigmoid(beta.float())[..., None]).to(q.dtype)
        return o, initial_state.float() + 1.0          # fp32, as fla's chunk kernel

    # the module whose globals _forward reads, and where it finds the chunk kernel
    mod, chunk_mod = {"Kimi-Linear": (kimi, kda_ops), "Kimi-K3": (k3, kda_ops),
                      "GLM-5-Next": (glm, glm)}[model.name]
    monkeypatch.setattr(mod, "causal_conv1d_fn", conv_fn)
    monkeypatch.setattr(mod, "gather_initial_states", gather)
    monkeypatch.setattr(chunk_mod, "chunk_kda_with_fused_gate", chunk)

    def scatter(state, new, indices):       # asserts a CUDA tensor
        calls.append(("scatter", new.clone(), indices.clone()))
        state[indices.long()] = new.to(state.dtype)

    if hasattr(mod, "scatter_states"):      # GLM-5-Next; Kimi-Linear from vLLM 0.34
        monkeypatch.setattr(mod, "scatter_states", scatter)
    if model is GLM:
        monkeypatch.setattr(glm, "_cast_sigmoid", lambda x: x.float().sigmoid())


@pytest.mark.parametrize("model", MODEL_CASES, ids=lambda m: m.name)
def test_prefill_and_mixed_batches_fall_back(env, model_dir, model, monkeypatch, plugin_log):
    """A plain decode (slot 5, has state) and a prefill of 4 tokens (slot 2, fresh): the batch
    reaches vLLM's own prefill code with the same tensors (g1 = f_b_proj(f_a) included) and
    gives the same result, bit for bit (vLLM's prefill kernels are stood in for, see
    ``stand_in_prefill_kernels``)."""
    vc = vllm_config(model_dir)
    layer, raw = make_layer(vc, model, model.tp8, seed=5)
    calls = []
    stand_in_prefill_kernels(monkeypatch, model, calls)
    table = torch.tensor([[5], [2]], dtype=torch.int32)
    md = build_md(vc, model, layer, table, [1, 4], prefilling=[False, True], context=0)
    hs = hidden(5, seed=6)
    y, core, page, path = step(vc, layer, raw, md, hs)
    ours, calls[:] = list(calls), []
    y_v, core_v, page_v, _ = step(vc, layer, raw, md, hs, use_kda=False)
    assert path == "vllm: prefill or mixed batch", path
    assert "chunk" in [c[0] for c in ours] and "gather" in [c[0] for c in ours]
    assert len(ours) == len(calls) and all(
        a[0] == b[0] and all(torch.equal(u, w) for u, w in zip(a[1:], b[1:]))
        for a, b in zip(ours, calls))
    assert torch.equal(y, y_v) and torch.equal(core, core_v) and torch.equal(page, page_v)
    assert not torch.equal(page, raw)
    assert not layer.kda_steps
    assert messages(plugin_log, "prefill or mixed batch")


@pytest.mark.parametrize("model", MODEL_CASES, ids=lambda m: m.name)
def test_ragged_verify_batch_falls_back(env, model_dir, model, plugin_log):
    T = 3
    vc = vllm_config(model_dir, num_spec=T - 1)
    layer, raw = make_layer(vc, model, model.tp8, seed=9)
    table = torch.tensor([[5, 6, 7], [9, 10, 11]], dtype=torch.int32)
    # a request that drafted nothing: 1 token
    md = verify_md(vc, model, layer, table, torch.tensor([2, 1], dtype=torch.int32), [3, 1])
    assert_falls_back(vc, layer, raw, md, hidden(4, seed=10), "vllm: ragged speculative batch",
                      plugin_log)


def test_k3_plain_decodes_beside_speculative_ones_fall_back(env, model_dir, plugin_log):
    """Kimi-K3's builder keeps one-token decodes of requests that are not speculative apart
    (GDN's reclassifies them as prefills)."""
    T = 2
    vc = vllm_config(model_dir, num_spec=T - 1)
    layer, raw = make_layer(vc, K3, K3.tp8, seed=11)
    table = torch.tensor([[5, 6], [9, 10]], dtype=torch.int32)
    md = build_md(vc, K3, layer, table, [T, 1], accepted=torch.tensor([1, 1], dtype=torch.int32),
                  drafts=torch.tensor([T - 1, -1]))
    assert (md.num_spec_decodes, md.num_decodes, md.num_prefills) == (1, 1, 0)
    assert_falls_back(vc, layer, raw, md, hidden(T + 1, seed=12),
                      "vllm: plain decodes beside speculative decodes", plugin_log)


@pytest.mark.parametrize("model", MODEL_CASES, ids=lambda m: m.name)
def test_adaptive_verification_keeps_verify_on_vllms_path(env, model_dir, model, plugin_log):
    """Adaptive verification trims each request's drafts on the device: the host's query
    lengths are upper bounds (Kimi-K3's builder; from vLLM 0.34 also the GDN builder of
    Kimi-Linear and GLM-5-Next, which then supports device/host query-length mismatches)."""
    T = 2
    vc = vllm_config(model_dir, num_spec=T - 1, adaptive=True)
    layer, raw = make_layer(vc, model, model.tp8, seed=13)
    table = torch.tensor([[5, 6], [9, 10]], dtype=torch.int32)
    md = verify_md(vc, model, layer, table, torch.tensor([2, 1], dtype=torch.int32), [T, T])
    assert_falls_back(vc, layer, raw, md, hidden(2 * T, seed=14),
                      "vllm: adaptive verification", plugin_log)


def test_k3_recoverssm_keeps_the_layer_on_vllms_path(env, model_dir, plugin_log):
    """RecoverSSM (``--use-replayssm`` with speculation): every call runs vLLM's own
    ``forward`` (here a pure-decode batch, its packed decode kernel)."""
    vc = vllm_config(model_dir, num_spec=1, recoverssm=True)
    layer, raw = make_layer(vc, K3, K3.tp8, seed=15)
    assert layer.use_recoverssm
    table = torch.tensor([[5, 6], [9, 10]], dtype=torch.int32)
    md = decode_md(vc, K3, layer, table)
    assert_falls_back(vc, layer, raw, md, hidden(2, seed=16), "vllm: ReplaySSM / RecoverSSM",
                      plugin_log)


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_k3_auto_keeps_vllms_flashinfer_kernels(env, model_dir, kind):
    """With ``auto``, batches for which vLLM chose its FlashInfer kernels (SM100 family) stay
    vLLM's. (The choice is set by hand here: FlashInfer does not run on a CPU.)"""
    vc = vllm_config(model_dir, num_spec=0 if kind == "decode" else 1, backend="auto")
    layer, raw = make_layer(vc, K3, K3.tp8, seed=17)
    table = torch.tensor([[5, 6], [9, 10]], dtype=torch.int32)
    if kind == "decode":
        md = decode_md(vc, K3, layer, table)
        layer.kda_decode_backend = "flashinfer"
    else:
        md = verify_md(vc, K3, layer, table, torch.tensor([1, 2], dtype=torch.int32), [2, 2])
        layer.kda_spec_decode_backend = "flashinfer"
    why = layer._kda_batch(md)
    assert isinstance(why, str) and why.startswith("auto keeps FlashInfer's"), why
    layer._kda_init("reference", "--additional-config")      # a named backend runs the op
    assert not isinstance(layer._kda_batch(md), str)


@pytest.mark.parametrize("model", MODEL_CASES, ids=lambda m: m.name)
def test_setting_vllm_keeps_the_model_on_vllms_path(env, model_dir, model):
    vc = vllm_config(model_dir, backend="vllm")
    layer, raw = make_layer(vc, model, model.tp8, seed=19)
    assert not layer.kda_enabled
    md = decode_md(vc, model, layer, torch.tensor([[5], [2]], dtype=torch.int32))
    y, _, page, path = step(vc, layer, raw, md, hidden(2, seed=20), use_kda=layer.kda_enabled)
    assert path.startswith("vllm: disabled") and "'vllm'" in path
    assert not layer.kda_steps


def test_glm_lower_bound_outside_the_contract_stays_on_vllms_path(env, model_dir, plugin_log):
    """GLM-5-Next with a gate bound the op's contract refuses (< -5): vLLM's path, logged."""
    vc = vllm_config(model_dir)
    layer, raw = make_layer(vc, GLM, GLM.tp8, seed=23, lower_bound=-8.0)
    md = decode_md(vc, GLM, layer, torch.tensor([[5], [2]], dtype=torch.int32))
    assert_falls_back(vc, layer, raw, md, hidden(2, seed=24),
                      "vllm: the op refuses this layer's setup: lower_bound", plugin_log)


def test_quantized_f_b_proj_keeps_the_layer_on_vllms_path(env, model_dir):
    vc = vllm_config(model_dir)
    layer, _ = make_layer(vc, K3, K3.tp8, seed=25)
    layer.f_b_proj.quant_method = object()        # what a quantized linear carries instead
    assert layer._kda_layer_reason() == "quantized f_b_proj"


def test_one_kdadecode_per_layer_and_configuration(env, model_dir):
    vc = vllm_config(model_dir)
    layer, raw = make_layer(vc, KIMI, 8, seed=13)
    step(vc, layer, raw, decode_md(vc, KIMI, layer, torch.tensor([[5], [2]], dtype=torch.int32)),
         hidden(2, seed=14))
    built = dict(layer.kda_steps)
    md3 = decode_md(vc, KIMI, layer, torch.tensor([[5], [2], [3]], dtype=torch.int32))
    step(vc, layer, raw, md3, hidden(3, seed=15))                      # another batch size
    assert len(built) == 1 and layer.kda_steps == built
    (cfg, obj), = built.items()
    assert (cfg.num_heads, cfg.T, cfg.window, cfg.conv_layout) == (8, 1, 3, "SD")
    assert obj.backend_name == "reference"


# ---- what the op replaces, where it does not run, and the log ----------------------------------

def test_k3_auto_keeps_vllms_native_fused_decode(env, model_dir, monkeypatch, plugin_log):
    """Kimi-K3 where vLLM chose its native CUDA ``fused_kda_decode`` (SM90 / SM10x / SM12x, an
    fp32 pool, no speculation: set by hand here, with the buffers vLLM then allocates, and a
    recording stand-in for the CUDA op): ``auto`` keeps it, logged once by name."""
    from vllm import _custom_ops
    vc = vllm_config(model_dir, backend="auto")
    layer, raw = make_layer(vc, K3, K3.tp8, seed=51)
    layer.kda_decode_backend = "native"
    D3 = layer.local_projection_size
    layer.decode_conv1d_weight = layer._kda_relayout_conv_weight().view(3, 4, D3)
    layer.decode_norm_weight = layer.o_norm.weight.float()
    ran = []

    def fused_kda_decode(**kw):
        ran.append(kw["state_indices"].clone())
        kw["out"].zero_()

    monkeypatch.setattr(_custom_ops, "fused_kda_decode", fused_kda_decode, raising=False)
    md = decode_md(vc, K3, layer, torch.tensor([[5], [2]], dtype=torch.int32))
    for _ in range(2):
        _, _, _, path = step(vc, layer, raw, md, hidden(2, seed=52))
    assert path.startswith("vllm: auto keeps vLLM's native CUDA fused_kda_decode"), path
    assert len(ran) == 2 and not layer.kda_steps
    assert len(messages(plugin_log, "auto keeps vLLM's native CUDA fused_kda_decode")) == 1


def test_a_named_backend_replacing_a_native_kernel_says_so(env, model_dir, plugin_log):
    """A backend named in the setting replaces vLLM's native kernel too, and the log names
    the kernel it replaces and the backend that runs instead (once)."""
    vc = vllm_config(model_dir, backend="reference")
    layer, raw = make_layer(vc, K3, K3.tp8, seed=53)
    layer.kda_decode_backend = "native"
    md = decode_md(vc, K3, layer, torch.tensor([[5], [2]], dtype=torch.int32))
    for _ in range(2):
        _, _, _, path = step(vc, layer, raw, md, hidden(2, seed=54))
    assert path == "kda"
    (msg,) = messages(plugin_log, "in place of")
    assert "Kimi-K3 pure-decode batches run kda.KdaDecode (backend reference)" in msg
    assert "vLLM's native CUDA fused_kda_decode (kda_decode_backend 'native')" in msg


@pytest.mark.parametrize("model", MODEL_CASES, ids=lambda m: m.name)
def test_auto_without_a_gpu_backend_stays_on_vllms_path(env, model_dir, model, plugin_log):
    """The default setting on a platform with no GPU backend of kda (here the CPU; vLLM's CPU
    or XPU platform alike): ``auto`` would find only the PyTorch reference; the layer stays
    on vLLM's path instead (bit-identical to it), with one warning naming the setting."""
    vc = vllm_config(model_dir, backend=None)
    layer, raw = make_layer(vc, model, model.tp8, seed=55)
    assert layer.kda_backend == "auto"
    md = decode_md(vc, model, layer, torch.tensor([[5], [2]], dtype=torch.int32))
    assert_falls_back(vc, layer, raw, md, hidden(2, seed=56),
                      "vllm: auto found no GPU backend of kda for cpu", plugin_log)
    (warning,) = [r for r in plugin_log.records if r.levelno == logging.WARNING]
    assert "auto found no GPU backend" in warning.getMessage()
    assert plugin.CONFIG_KEY in warning.getMessage()


@pytest.mark.parametrize("explicit", [False, True], ids=["default", "named"])
def test_an_untested_vllm_version_keeps_vllms_path_unless_asked(env, model_dir, explicit,
                                                               monkeypatch, plugin_log):
    """Under a vLLM version outside TESTED_VLLM_VERSIONS: one warning; the default setting
    keeps every layer on vLLM's path, a setting given runs the op."""
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.99.0")
    vc = vllm_config(model_dir, backend="reference" if explicit else None)
    for _ in range(2):
        layer, raw = make_layer(vc, KIMI, KIMI.tp8, seed=57)
    md = decode_md(vc, KIMI, layer, torch.tensor([[5], [2]], dtype=torch.int32))
    path = step(vc, layer, raw, md, hidden(2, seed=58), use_kda=layer.kda_enabled)[3]
    assert path == "kda" if explicit else path.startswith("vllm: disabled"), path
    (warning,) = [r.getMessage() for r in plugin_log.records if r.levelno == logging.WARNING]
    assert "vLLM 0.99.0" in warning and "0.33.0, 0.34.0" in warning


def test_a_layer_on_vllms_path_is_vllms(env, model_dir, monkeypatch, plugin_log):
    """Under an untested vLLM with the default setting (every layer on vLLM's path) the
    subclass is vLLM's layer: its state dtypes are vLLM's own class's (vLLM's Kimi-Linear
    layer keeps an fp32 pool under --mamba-ssm-cache-dtype bfloat16; no refusal under 0.33
    either), and on any layer a forward call with arguments the plugin does not know runs
    vLLM's path (found by an integrator's trial with a newer vLLM's signature)."""
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import (
        KimiGatedDeltaNetAttention)
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.99.0")
    layer = construct(vllm_config(model_dir, ssm_dtype="bfloat16", backend=None), KIMI,
                      KIMI.tp8)
    assert not layer.kda_enabled
    assert layer.get_state_dtype() == KimiGatedDeltaNetAttention.get_state_dtype(layer)
    named = construct(vllm_config(model_dir, backend="reference"), KIMI, KIMI.tp8)
    assert named.kda_enabled and named._kda_off((), {"output": None})
    assert named.kda_last_path.startswith("vllm: forward called with arguments"), \
        named.kda_last_path
    assert "['output']" in named.kda_last_path


LOG_LINE = re.compile(r"\(\S+ pid=\d+\) (INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d "
                      r"\[\S+:\d+\] vLLM plugin: ")


def test_the_plugin_logs_into_vllms_log():
    """In a fresh process whose logging vLLM configured as its engine does
    (``vllm.logger.configure_logging``: a handler on the ``vllm`` logger, which does not
    propagate), the plugin's lines come out through vLLM's handler, in vLLM's format, once
    each: the class replaced, the setting, the reason the layer stays on vLLM's path (a
    warning, once over two batches)."""
    code = GLM_SHELL + (
        "import torch\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig(log_level='INFO'))\n"
        "import tests.integrations.test_vllm as t\n"
        "t.init_vllm()\n"
        "d = t.tempfile.mkdtemp()\n"
        "from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig\n"
        "c = KimiLinearConfig(hidden_size=t.HIDDEN, num_hidden_layers=1, num_attention_heads=4,"
        " linear_attn_config={'head_dim': 128, 'num_heads': 8, 'short_conv_kernel_size': 4,"
        " 'kda_layers': [1], 'full_attn_layers': []})\n"
        "c.architectures = ['KimiLinearForCausalLM']\n"
        "c.save_pretrained(d)\n"
        "vc = t.vllm_config(d, backend=None)\n"
        "layer, raw = t.make_layer(vc, t.KIMI, 4)\n"
        "md = t.decode_md(vc, t.KIMI, layer, torch.tensor([[5], [2]], dtype=torch.int32))\n"
        "for _ in range(2):\n"
        "    path = t.step(vc, layer, raw, md, t.hidden(2))[3]\n"
        "print('PATH', path, flush=True)\n")
    env_ = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1",
                VLLM_LOGGING_STREAM="ext://sys.stdout", VLLM_CONFIGURE_LOGGING="1")
    for var in ("VLLM_PLUGINS", "KDA_BACKEND", "VLLM_LOGGING_CONFIG_PATH"):
        env_.pop(var, None)
    res = subprocess.run([sys.executable, "-c", code], env=env_, capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if "vLLM plugin: " in ln]
    assert lines and all(LOG_LINE.search(ln) for ln in lines), (lines, res.stderr[-3000:])
    assert "vLLM plugin" not in res.stderr, res.stderr[-3000:]
    for text in ("KimiGatedDeltaNetAttention (Kimi-Linear) -> ",
                 "KDA fused decode backend 'auto' (from default)",
                 "auto found no GPU backend"):
        found = [ln for ln in lines if text in ln]
        assert len(found) == 1, (text, lines)
    assert [ln for ln in lines if "WARNING" in ln and "no GPU backend" in ln]
    assert "PATH vllm: auto found no GPU backend" in res.stdout, res.stdout[-3000:]


# ---- Kimi-Linear on a bf16 pool ----------------------------------------------------------------

@pytest.mark.parametrize("setting", ["reference", "vllm"])
def test_kimi_linear_bf16_pool(env, model_dir, setting, monkeypatch):
    """``--mamba-ssm-cache-dtype bfloat16`` gives Kimi-Linear a bf16 pool (the subclass
    honors it), with the op on and with the setting ``vllm``. Under vLLM 0.34 every kind of
    batch is served on it, one after the other on the same pages: a prefill, a verify beside
    a prefill, a uniform verify, a pure decode (each on the path it should take; vLLM's prefill
    kernels stood in for, the chunk kernel's final state fp32 as the real one's, stored
    through vLLM's ``scatter_states``), the stored states are the chunk kernel's rounded to
    bf16. Under vLLM 0.33, whose prefill cannot store into a bf16 pool, the layer is refused
    at construction (startup), the error naming the flag, what is expected and what was
    given: never a crash at the first prefill."""
    T = 3
    vc = vllm_config(model_dir, ssm_dtype="bfloat16", num_spec=T - 1, backend=setting)
    if not kimi_prefill_stores_into_bf16():
        with pytest.raises(KdaArgumentError) as e:
            construct(vc, KIMI, KIMI.tp8)
        assert e.value.arg == "--mamba-ssm-cache-dtype", str(e.value)
        assert "'bfloat16'" in str(e.value) and "float32" in str(e.value)
        assert VLLM_VERSION in str(e.value)
        return
    layer, raw = make_layer(vc, KIMI, KIMI.tp8, seed=41)
    calls = []
    stand_in_prefill_kernels(monkeypatch, KIMI, calls)
    page = raw.clone()
    bind(vc, layer, page)
    state = layer.kv_cache[1]
    assert state.dtype == torch.bfloat16
    on = setting != "vllm"

    def run(md, n, seed):
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context
        calls.clear()
        with torch.no_grad(), set_current_vllm_config(vc), \
                set_forward_context({layer.prefix: md}, vc):
            y = layer(hidden(n, seed=seed), torch.zeros(n, dtype=torch.long))
        assert bool(torch.isfinite(y.float()).all())
        return layer.kda_last_path

    # a prefill of 4 tokens into the fresh slot 2: its final state (0 + 1, fp32) stored bf16
    md = build_md(vc, KIMI, layer, torch.tensor([[2, 12, 13]], dtype=torch.int32), [4],
                  prefilling=[True], context=0)
    assert run(md, 4, 42) == ("vllm: prefill or mixed batch" if on else
                              "vllm: disabled (kda_enabled=False; "
                              f"{plugin.CONFIG_KEY}='vllm')")
    (_, stored, _), = [c for c in calls if c[0] == "scatter"]
    assert stored.dtype == torch.float32
    assert torch.equal(state[2], torch.ones_like(state[2]))
    # a verify of slot 2's request beside a prefill into slot 9 (vLLM's verify kernel runs)
    md = build_md(vc, KIMI, layer, torch.tensor([[2, 12, 13], [9, 14, 15]], dtype=torch.int32),
                  [T, 4], accepted=torch.tensor([1, 1], dtype=torch.int32),
                  drafts=torch.tensor([T - 1, -1]), prefilling=[False, True], context=0)
    assert (md.num_spec_decodes, md.num_prefills) == (1, 1)
    assert run(md, T + 4, 43).startswith("vllm: ")
    assert torch.equal(state[9], torch.ones_like(state[9]))
    # a uniform verify, then a pure decode: the op's path when it is on
    table = torch.tensor([[2, 12, 13], [9, 14, 15]], dtype=torch.int32)
    md = verify_md(vc, KIMI, layer, table, torch.tensor([2, 1], dtype=torch.int32), [T, T])
    path = run(md, 2 * T, 44)
    assert path == "kda" if on else path.startswith("vllm: disabled"), path
    md = decode_md(vc, KIMI, layer, torch.tensor([[12], [9]], dtype=torch.int32))
    path = run(md, 2, 45)
    assert path == "kda" if on else path.startswith("vllm: disabled"), path
    assert state.dtype == torch.bfloat16 and bool(torch.isfinite(state.float()).all())


# ---- vLLM's breakable CUDA graphs ------------------------------------------------------------

class CpuGraph:
    """``torch.cuda.CUDAGraph``'s contract on a CPU, for vLLM's breakable-graph machinery.

    ``capture_begin`` .. ``capture_end`` record every ATen op run in between, with the tensors
    it ran on and the tensors it produced (kept alive, as a graph's memory pool keeps its
    blocks). ``replay`` runs the recorded ops again on the same tensors and writes each new
    result into the tensor the op produced at capture (an op that returns a view or writes in
    place already lands there); allocations are not redone. So, as on a GPU, a replayed
    segment reads and writes exactly the memory it did at capture, and a tensor allocated
    outside the captured segments (in an eager segment) is never seen by them.
    """

    ALLOCATIONS = ("empty.memory_format", "empty_strided.default", "empty_like.default",
                   "new_empty.default", "new_empty_strided.default")

    def __init__(self, *args, **kwargs):
        self.ops = []
        self._mode = None

    def capture_begin(self, *args, **kwargs):
        from torch.utils._python_dispatch import TorchDispatchMode
        ops = self.ops

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                ops.append((func, args, kwargs or {}, out))
                return out

        self._mode = Record()
        self._mode.__enter__()

    def capture_end(self):
        self._mode.__exit__(None, None, None)
        self._mode = None

    def replay(self):
        for func, args, kwargs, out in self.ops:
            if str(func.name()).split("::")[-1] in self.ALLOCATIONS:
                continue
            new = func(*args, **kwargs)
            olds = out if isinstance(out, (tuple, list)) else (out,)
            news = new if isinstance(new, (tuple, list)) else (new,)
            for o, n in zip(olds, news):
                if isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor) \
                        and n.data_ptr() != o.data_ptr():
                    o.copy_(n)


@pytest.fixture
def cpu_graphs(monkeypatch):
    """vLLM's breakable-graph capture and replay on a CPU: ``torch.cuda.CUDAGraph`` is
    :class:`CpuGraph`; vLLM's weak references (a CUDA op of its ``_C`` extension) are plain
    aliases of the same memory; no graph pool handle; the pre-capture cache flush, which
    needs an accelerator, does nothing."""
    import vllm.compilation.breakable_cudagraph as bcg
    from vllm.platforms import current_platform

    def alias(t):
        return t.view_as(t) if isinstance(t, torch.Tensor) else t

    def alias_all(ts):
        return type(ts)(alias(t) for t in ts) if isinstance(ts, (tuple, list)) else alias(ts)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", CpuGraph)
    monkeypatch.setattr(bcg, "weak_ref_tensor", alias)
    monkeypatch.setattr(bcg, "weak_ref_tensors", alias_all)
    monkeypatch.setattr(type(current_platform), "graph_pool_handle", lambda self: None,
                        raising=False)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    return bcg


BREAKABLE_CASES = [(m, kind) for m in MODEL_CASES for kind in ("decode", "mixed")]


@pytest.mark.parametrize("case", BREAKABLE_CASES, ids=lambda c: f"{c[0].name}-{c[1]}")
def test_breakable_cuda_graph_replays_the_next_batch(env, model_dir, case, cpu_graphs,
                                                     monkeypatch):
    """vLLM's ``BreakableCUDAGraphWrapper`` (vLLM's default for Kimi-Linear, Kimi-K3 and
    GLM-5-Next) captures the layer on one batch and replays it on the next batch of the same
    size (new hidden states copied into the static input, new metadata in the forward
    context, as vLLM's runner does): the replayed output and pages equal an eager run of the
    two batches, bit for bit. "decode": the op's path (a pure decode; PIECEWISE, as when it
    runs beside graphs of other sizes); "mixed": vLLM's path (a plain decode beside a
    prefill; vLLM's prefill kernels stood in for). The layer's eager segment must write the
    buffer its caller allocated: ``o_proj``'s captured segment reads that address."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import BatchDescriptor, set_forward_context
    model, kind = case
    vc = vllm_config(model_dir)
    layer, raw = make_layer(vc, model, model.tp8, seed=31)
    if kind == "mixed":
        stand_in_prefill_kernels(monkeypatch, model, [])
        tables = [torch.tensor([[5], [2]], dtype=torch.int32),
                  torch.tensor([[9], [3]], dtype=torch.int32)]
        mds = [build_md(vc, model, layer, t, [1, 4], prefilling=[False, True], context=0)
               for t in tables]
        path = "vllm: prefill or mixed batch"
    else:
        tables = [torch.tensor([[5], [2], [9], [7], [4]], dtype=torch.int32),
                  torch.tensor([[3], [9], [2], [11], [6]], dtype=torch.int32)]
        mds = [decode_md(vc, model, layer, t) for t in tables]
        path = "kda"
    hss = [hidden(5, seed=32), hidden(5, seed=33)]
    positions = torch.zeros(5, dtype=torch.long)

    def forward(md, hs, mode=CUDAGraphMode.NONE, wrapper=None):
        with torch.no_grad(), set_current_vllm_config(vc), \
                set_forward_context({layer.prefix: md}, vc, cudagraph_runtime_mode=mode,
                                    batch_descriptor=BatchDescriptor(num_tokens=5)):
            return (wrapper or layer)(hs, positions)

    eager_page = raw.clone()
    bind(vc, layer, eager_page)
    forward(mds[0], hss[0])
    want = forward(mds[1], hss[1]).clone()
    assert layer.kda_last_path == path, layer.kda_last_path

    page = raw.clone()
    bind(vc, layer, page)
    wrapper = cpu_graphs.BreakableCUDAGraphWrapper(layer, vc)
    static = hss[0].clone()
    forward(mds[0], static, CUDAGraphMode.PIECEWISE, wrapper)        # capture
    (entry,) = wrapper.entries.values()
    assert entry.capture.num_eager_breaks == 1 and entry.capture.num_graphs == 2
    static.copy_(hss[1])
    got = forward(mds[1], static, CUDAGraphMode.PIECEWISE, wrapper)   # replay
    assert layer.kda_last_path == path, layer.kda_last_path
    assert torch.equal(page, eager_page), "the replayed eager segment wrote other pages"
    assert torch.equal(got, want), (
        "the replayed output is not the new batch's: o_proj's captured segment read a "
        f"buffer the eager segment did not write (max diff {(got - want).abs().max():.3g})")


# ---- the setting -----------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODEL_CASES, ids=lambda m: m.name)
def test_unknown_value_fails_at_construction_listing_the_values(env, model_dir, model,
                                                                monkeypatch):
    with pytest.raises(kda.KdaBackendError) as e:
        construct(vllm_config(model_dir, backend="fastest"), model, model.tp8)
    for name in kda.registry.CHOICES + ("vllm",):
        assert repr(name) in str(e.value) or name in str(e.value)
    assert "fastest" in str(e.value) and plugin.CONFIG_KEY in str(e.value)
    # $KDA_BACKEND when the key is absent; vLLM's own kda_decode_backend key is not ours
    monkeypatch.setenv("KDA_BACKEND", "nope")
    vc2 = vllm_config(model_dir, backend=None)
    with pytest.raises(kda.KdaBackendError, match="KDA_BACKEND"):
        construct(vc2, model, model.tp8)
    monkeypatch.delenv("KDA_BACKEND")
    assert construct(vc2, model, model.tp8).kda_backend == "auto"


def test_backend_choice_is_logged_once(plugin_log):
    for _ in range(3):
        assert plugin.backend_choice({plugin.CONFIG_KEY: "cutedsl_wide"}) == (
            "cutedsl_wide", f"--additional-config {plugin.CONFIG_KEY}")
    assert len(messages(plugin_log, "cutedsl_wide")) == 1
