"""vLLM plugin: Kimi-Linear's KDA decode and speculative-verify batches through :class:`kda.KdaDecode`.

Install this distribution next to vLLM 0.33 and vLLM loads :func:`register` from the
``vllm.general_plugins`` entry point (pyproject.toml) in every process. ``register`` replaces
vLLM's ``KimiGatedDeltaNetAttention`` (the KDA layer of ``KimiLinearForCausalLM``, also used
by ``AliceAIForCausalLM``) by a subclass, :class:`KdaKimiGatedDeltaNetAttention`, through
vLLM's ``PluggableLayer.register_oot``: constructing vLLM's class then yields the subclass.

What the subclass changes
-------------------------
* ``forward`` runs vLLM's projections as vLLM does, except that it keeps ``f_a`` instead of
  projecting it through ``f_b_proj`` (the op fuses that low-rank GEMM), and hands the slices of
  the packed projection output to ``_kda_forward``, which, like vLLM's ``_forward``, is
  decorated ``@eager_break_during_capture`` and writes into the caller's ``core_attn_out``
  buffer in place: under vLLM's breakable CUDA graphs it is an eager segment (replayed with
  weak references to the same buffers, deciding its path from the forward context each
  replay); in FULL mode it is captured like vLLM's (FULL graphs hold uniform decode batches).
* In ``_kda_forward``, a **pure-decode batch** (no spec config in the metadata, no prefills,
  T=1, conv window 3) and a **uniform speculative-verify batch** (no prefills or plain
  decodes, every request ``T = num_spec + 1`` tokens) run one :class:`kda.KdaDecode` on the
  engine's own tensors: the q|k|v, beta and f_a slices of the packed projection (strided views,
  no copy), ``f_b_proj.weight``, the conv cache (SD: vLLM's ``.transpose(-1, -2)`` view, DS:
  as is), the state pool (fp32, or bf16 with ``--mamba-ssm-cache-dtype bfloat16``: the op
  widens each page to fp32 and rounds each state written once to nearest even), the slot
  table (null block 0) and ``num_accepted_tokens``. The op writes the gated-RMSNorm output
  straight into ``core_attn_out``, so ``o_norm`` is skipped for those rows. Rows past
  ``num_actual_tokens`` are left as vLLM leaves them (unused).
* **Every other batch** (prefills, mixed batches, ragged spec batches, a plain decode batch of
  a layer configured for speculative decoding, whose window vLLM shifts differently from the
  op; see below) computes ``f_b_proj(f_a)`` and calls vLLM's own ``_forward`` body unchanged,
  as does every call of a layer whose setup the op does not serve: a recurrent state other
  than fp32 / bf16, a quantized ``f_b_proj``, ReplaySSM / RecoverSSM
  (``cache_config.use_replayssm``), a non-bf16 model, arguments the op's validation refuses
  (logged as a warning), ROCm unless a backend is named (the op's GPU backends target NVIDIA GPUs), and ``auto`` on a GPU
  where it finds only the PyTorch ``reference`` backend. The first reason per layer is logged
  once (logger ``"kda"``).
* Nothing is copied except where vLLM hands a non-contiguous slot table (see
  ``_slot_table``); nothing is read from the device on the host; the op never synchronizes.
  The conv weight ``[3*dim, 1, 4]`` is re-laid out once to the op's ``[3, 4, dim]`` fp32
  (in ``process_weights_after_loading``, which vLLM's loader calls after loading and
  reloading weights, else lazily on first use) and cached on the layer; code that rewrites
  ``conv1d.weight`` in place without vLLM's loader must call
  ``layer.process_weights_after_loading()`` after it. One ``KdaDecode`` per layer per
  configuration (T, window, conv layout, dtypes) is built on first use (vLLM's warm-up runs,
  before CUDA-graph capture) and reused.

Why plain decode of a spec-configured layer falls back: with ``num_spec > 0`` the conv window
holds ``L = 3 + num_spec`` positions. vLLM's T=1 conv update reads positions 0..2 and then
shifts the whole window left by one (x lands at position L-1); the op's contract
(docs/contract.md section 2) rewrites positions 0..2 only (x lands at position 2). The
outputs agree but the windows would not, so such batches stay on vLLM's path.

Choosing the backend
--------------------
``--additional-config '{"kda_fused_decode_backend": "<name>"}'``, else ``$KDA_BACKEND``, else
``auto``; ``<name>`` is one of :data:`kda.registry.CHOICES`. The choice and where it came
from are logged once per process on the standard-library logger ``"kda"`` (INFO); an unknown
name raises at layer construction (model build, i.e. at startup) listing the valid names.
The key is deliberately not vLLM's ``kda_decode_backend``: vLLM 0.33's Kimi-K3 layer reads
that key (also set by its ``--kda-decode-backend`` flag) and accepts only its own values
(auto / native / flashinfer / triton), so a value of ours there would make K3 models fail and
its ``triton`` would be ambiguous.

Kimi-K3 (``KimiK3DeltaAttention``) is not replaced: its layer is swappable by class name, but
not cleanly. Its ``forward`` differs from Kimi-Linear's in ways an override would have to
re-implement and track across releases: under CUDA-graph capture it computes the in-projection
and the ``f_b`` GEMM together on an auxiliary stream (``run_kda_projection_overlap``), so
``f_a`` never exists as a tensor; it has its own metadata class (RecoverSSM records,
``spec_token_start``), a fused GEMM + reduce-scatter ``o_proj``, FP8 block-quantized
projections, and its own decode-kernel choice (vLLM's native fused CUDA decode and FlashInfer,
selected by ``kda_decode_backend``), which already fuse conv, gate, recurrence and norm for
K3's head counts.

Environment: vLLM 0.33.0. Tests: ``tools/vllm/run_tests.sh`` (tests/integrations/test_vllm.py).
This module imports vLLM only inside functions, so ``import kda.integrations.vllm`` works
without vLLM; ``import kda`` never imports this module.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Tuple

#: The ``--additional-config`` key that picks the backend.
CONFIG_KEY = "kda_fused_decode_backend"
#: vLLM's name of the class replaced (the ``op_registry_oot`` key: the class's ``__name__``).
VLLM_CLASS = "KimiGatedDeltaNetAttention"

_log = logging.getLogger("kda")
_lock = threading.RLock()
_registered = False
_layer_class = None
_logged: set = set()


def _log_once(key, level: int, msg: str, *args) -> None:
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    _log.log(level, msg, *args)


def backend_choice(additional_config=None) -> Tuple[str, str]:
    """The backend name the plugin asks :class:`kda.KdaDecode` for, and where it came from.

    Order: ``additional_config[CONFIG_KEY]`` (vLLM's ``--additional-config``), then
    ``$KDA_BACKEND``, then ``"auto"``. Logs the choice once per process (logger ``"kda"``).

    Raises:
      kda.KdaBackendError: the name is not one of :data:`kda.registry.CHOICES` (the message
        lists them).
    """
    from kda import registry
    if isinstance(additional_config, dict) and additional_config.get(CONFIG_KEY) is not None:
        name, source = additional_config[CONFIG_KEY], f"--additional-config {CONFIG_KEY}"
    elif os.environ.get(registry.ENV_VAR, "").strip():
        name, source = os.environ[registry.ENV_VAR].strip(), f"${registry.ENV_VAR}"
    else:
        name, source = "auto", "default"
    registry.check_choice(name, source)
    _log_once(("choice", name, source), logging.INFO,
              "vLLM plugin: KDA fused decode backend %r (from %s). Pure-decode and uniform "
              "speculative-verify batches of vLLM's Kimi-Linear KDA layers run kda.KdaDecode; "
              "every other batch runs vLLM's own path.", name, source)
    return name, source


def register() -> None:
    """The ``vllm.general_plugins`` entry point: replace vLLM's Kimi-Linear KDA layer class.

    Idempotent: a second call in a process (vLLM loads general plugins once per process, but
    tests and manual calls may repeat it) finds the class in vLLM's ``op_registry_oot`` and
    does nothing. When another plugin already registered a replacement for the class, that
    one is kept and a warning is logged.
    """
    global _registered
    with _lock:
        if _registered:
            return
        from vllm.model_executor.custom_op import op_registry_oot
        from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import (
            KimiGatedDeltaNetAttention)
        cls = layer_class()
        current = op_registry_oot.get(VLLM_CLASS)
        if current is None:
            KimiGatedDeltaNetAttention.register_oot(cls)
        elif current is not cls and not getattr(current, "_kda_plugin", False):
            _log.warning("vLLM plugin: %s is already replaced by %s.%s; the KDA plugin leaves it",
                         VLLM_CLASS, current.__module__, current.__qualname__)
        _registered = True
    _log_once(("registered",), logging.INFO,
              "vLLM plugin: %s -> %s.%s", VLLM_CLASS, __name__, cls.__qualname__)


def layer_class():
    """The subclass of vLLM's ``KimiGatedDeltaNetAttention`` (built on first call; needs vLLM)."""
    global _layer_class
    with _lock:
        if _layer_class is None:
            _layer_class = _build_layer_class()
        return _layer_class


def __getattr__(name):
    # ``kda.integrations.vllm.KdaKimiGatedDeltaNetAttention`` (e.g. for pickling by reference)
    if name == "KdaKimiGatedDeltaNetAttention":
        return layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_layer_class():
    import torch
    from einops import rearrange
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import (
        KimiGatedDeltaNetAttention)
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    import kda
    from kda.errors import KdaArgumentError

    # vLLM's ``_forward`` body without its decorator: our ``_kda_forward`` carries the
    # decorator, so the fallback must not open a second eager segment inside it.
    vllm_forward_body = getattr(KimiGatedDeltaNetAttention._forward, "__wrapped__",
                                KimiGatedDeltaNetAttention._forward)

    class KdaKimiGatedDeltaNetAttention(KimiGatedDeltaNetAttention):
        """vLLM's Kimi-Linear KDA layer whose decode / verify batches run :class:`kda.KdaDecode`.

        See the module docstring. Attributes for inspection: ``kda_backend`` (the requested
        name), ``kda_enabled`` (False: always vLLM's path), ``kda_last_path`` ("kda" or
        "vllm: <reason>", the path of the last call), ``kda_steps`` ({KdaConfig: KdaDecode}).
        """

        _kda_plugin = True

        def __init__(self, config, vllm_config, prefix: str = "") -> None:
            # Before anything is registered under ``prefix``: an unknown name fails here.
            backend, source = backend_choice(getattr(vllm_config, "additional_config", None))
            super().__init__(config, vllm_config, prefix)
            self.kda_backend: str = backend
            self._kda_backend_named = source != "default"
            self.kda_enabled: bool = True
            self.kda_last_path: Optional[str] = None
            self.kda_steps: dict = {}
            self._kda_conv_weight: Optional[torch.Tensor] = None
            self._kda_refused: dict = {}      # KdaConfig -> reason the op refused it

        # ---- weights -------------------------------------------------------------------
        def process_weights_after_loading(self, act_dtype=None) -> None:
            """Called by vLLM's loader after (re)loading weights: re-lay out the conv weight."""
            parent = getattr(super(), "process_weights_after_loading", None)
            if parent is not None:
                parent(act_dtype)
            self._kda_conv_weight = self._kda_relayout_conv_weight()

        def _kda_relayout_conv_weight(self) -> torch.Tensor:
            # [3*dim, 1, 4] (q|k|v channels, tap last) -> [3, 4, dim] fp32 contiguous
            w = self.conv1d.weight.detach()
            dim = self.local_projection_size
            return w.view(3, dim, w.shape[-1]).permute(0, 2, 1).to(torch.float32).contiguous()

        # ---- forward -------------------------------------------------------------------
        def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            if not self.kda_enabled:
                self.kda_last_path = "vllm: disabled (kda_enabled=False)"
                return super().forward(hidden_states, positions)
            # vLLM's forward up to f_b_proj, which the op fuses (it takes f_a).
            num_tokens = hidden_states.size(0)
            projected = self.in_proj_qkvgfab(hidden_states)[0]
            dim, H, D = self.local_projection_size, self.local_num_heads, self.head_dim
            if self.use_full_rank_gate:
                sizes = [3 * dim, dim, D, H] + ([self.in_proj_padding] if self.in_proj_padding
                                                 else [])
                mixed_qkv, g_proj_states, f_a, beta = projected.split(sizes, dim=-1)[:4]
            else:
                mixed_qkv, beta, f_a = projected.split([3 * dim, H, D], dim=-1)
                g_proj_states = self.g_b_proj(self.g_a_proj(hidden_states)[0])[0]
            core_attn_out = torch.empty((1, num_tokens, H, D), dtype=hidden_states.dtype,
                                        device=hidden_states.device)
            self._kda_forward(mixed_qkv=mixed_qkv, f_a=f_a, g_proj_states=g_proj_states,
                              beta=beta, core_attn_out=core_attn_out)
            core_attn_out = rearrange(core_attn_out, "1 n h d -> n (h d)")
            return self.o_proj(core_attn_out)[0]

        @eager_break_during_capture
        def _kda_forward(self, mixed_qkv: torch.Tensor, f_a: torch.Tensor,
                         g_proj_states: torch.Tensor, beta: torch.Tensor,
                         core_attn_out: torch.Tensor) -> None:
            """Writes ``core_attn_out`` in place: the op's normed output, or vLLM's path."""
            why = self._kda_try_step(mixed_qkv, f_a, g_proj_states, beta, core_attn_out)
            if why is None:
                self.kda_last_path = "kda"
                return
            self.kda_last_path = f"vllm: {why}"
            # vLLM's path, exactly as its forward would have called it.
            g1 = rearrange(self.f_b_proj(f_a)[0], "n (h d) -> 1 n h d", d=self.head_dim)
            g2 = rearrange(g_proj_states, "... (h d) -> ... h d", d=self.head_dim)
            vllm_forward_body(self, mixed_qkv=mixed_qkv, g1=g1, g2=g2, beta=beta.unsqueeze(0),
                              core_attn_out=core_attn_out)

        # ---- the op's path -------------------------------------------------------------
        def _kda_static_reason(self, mixed_qkv, conv_state, state) -> Optional[str]:
            """Why this layer's setup is not the op's (None when it is). Host metadata only."""
            if current_platform.is_rocm() and not self._kda_backend_named:
                return ("ROCm: the op's GPU backends are built for NVIDIA GPUs (name one with "
                        f"{CONFIG_KEY} to try anyway)")
            cache = self.cache_config
            if cache is not None and (getattr(cache, "use_replayssm", False)
                                      or getattr(cache, "use_kda_recoverssm", False)):
                return "ReplaySSM / RecoverSSM"
            if self.head_dim != kda.HEAD_DIM or self.conv_size != 4:
                return f"head_dim {self.head_dim} / conv size {self.conv_size} (op: 128 / 4)"
            if mixed_qkv.dtype != torch.bfloat16:
                return f"activations in {mixed_qkv.dtype} (op: bf16)"
            if state.dtype not in (torch.float32, torch.bfloat16):
                return f"recurrent state in {state.dtype} (op: fp32 or bf16)"
            if conv_state.dtype not in (torch.bfloat16, torch.float32):
                return f"conv state in {conv_state.dtype} (op: bf16 or fp32)"
            fb = self.f_b_proj
            if not isinstance(getattr(fb, "quant_method", None), UnquantizedLinearMethod) \
                    or fb.weight.dtype != torch.bfloat16:
                return "quantized f_b_proj"
            norm = self.o_norm
            if getattr(norm, "activation", None) != "sigmoid" or norm.weight is None \
                    or norm.weight.dtype not in (torch.bfloat16, torch.float32):
                return "o_norm is not a sigmoid-gated RMSNorm with a bf16/fp32 weight"
            bias = self.conv1d.bias
            if bias is not None and bias.dtype != torch.float32:
                return f"conv bias in {bias.dtype} (op: fp32)"
            return None

        def _kda_try_step(self, mixed_qkv, f_a, g_proj_states, beta, core_attn_out
                          ) -> Optional[str]:
            """Run the op when the batch and layer are its; else return why not (nothing
            written then). Reads host-side metadata only."""
            attn_metadata = get_forward_context().attn_metadata
            if attn_metadata is None:
                return "no attention metadata (profile / warm-up run)"
            m = attn_metadata.get(self.prefix) if isinstance(attn_metadata, dict) else None
            if not isinstance(m, GDNAttentionMetadata):
                return "no GDN metadata for this layer"
            conv_state, state = self.kv_cache[0], self.kv_cache[1]
            # Same view as vLLM's _forward: the SD cache [slots, L, 3*dim] becomes
            # [slots, 3*dim, L] with strides [s, 1, 3*dim]; DS is already [slots, 3*dim, L].
            if not is_conv_state_dim_first():
                conv_state = conv_state.transpose(-1, -2)
            why = self._kda_static_reason(mixed_qkv, conv_state, state)
            if why is not None:
                _log_once(("static", self.prefix, why), logging.INFO,
                          "vLLM plugin: %s stays on vLLM's path: %s", self.prefix, why)
                return why

            N = m.num_actual_tokens
            if m.num_prefills != 0:
                return "prefill or mixed batch"
            if m.spec_sequence_masks is None:
                # pure decode (vLLM's "pure-decode non-spec batch" branch)
                T, nacc = 1, None
                if conv_state.shape[-1] != 3:
                    return (f"plain decode with a conv window of {conv_state.shape[-1]} "
                            f"(num_spec={self.num_spec}): vLLM shifts the whole window")
                idx = m.non_spec_state_indices_tensor
                if idx is None or idx.dim() != 1 or idx.shape[0] < N:
                    return "no slot table for every token row"
                idx = idx[:N]
            else:
                # speculative verify: only when every request has T = num_spec + 1 rows
                T = self.num_spec + 1
                if m.num_decodes != 0:
                    return "plain decodes beside spec decodes"
                if m.uniform_spec_sequence_length != T \
                        or m.num_spec_decode_tokens != m.num_spec_decodes * T:
                    return f"ragged speculative batch (not every request has {T} tokens)"
                idx, nacc = m.spec_state_indices_tensor, m.num_accepted_tokens
                if N % T != 0 or idx is None or nacc is None or idx.dim() != 2 \
                        or idx.shape[1] != T:
                    return "speculative metadata not [R, T] for every token row"
                R = N // T
                # Rows past num_spec_decodes exist only in FULL-graph staging, where vLLM
                # fills them with the null block and accepted count 1 (gdn_attn.py).
                if idx.shape[0] < R or nacc.shape[0] < R:
                    return "speculative slot table shorter than the token rows"
                idx, nacc = idx[:R], nacc[:R]
                if not nacc.is_contiguous():
                    nacc = nacc.contiguous()
            if N == 0:
                return None
            idx = self._slot_table(idx)

            dim = self.local_projection_size
            x, beta, f_a = mixed_qkv[:N], beta[:N], f_a[:N]
            gate = g_proj_states[:N]
            out = core_attn_out.view(core_attn_out.shape[1], dim)[:N]
            cfg = kda.KdaConfig(
                num_heads=self.local_num_heads, T=T, window=conv_state.shape[-1],
                conv_layout="SD" if conv_state.stride(-2) == 1 else "DS",
                lower_bound=self.gate_lower_bound, has_conv_bias=self.conv1d.bias is not None,
                norm_eps=float(self.o_norm.eps), conv_state_dtype=conv_state.dtype,
                conv_weight_dtype=torch.float32, norm_weight_dtype=self.o_norm.weight.dtype,
                state_dtype=state.dtype)
            if cfg in self._kda_refused:
                return self._kda_refused[cfg]
            step = self.kda_steps.get(cfg)
            if step is None:
                # Built once per (layer, configuration); a backend that cannot serve it
                # (an explicitly named one on the wrong GPU) raises here, at warm-up.
                step = kda.KdaDecode(cfg, device=x.device, backend=self.kda_backend)
                if (x.device.type == "cuda" and self.kda_backend == "auto"
                        and step.backend_name == "reference"):
                    why = ("auto found no GPU backend for this GPU (only the PyTorch "
                           "reference, slower than vLLM's kernels)")
                    self._kda_refused[cfg] = why
                    _log.warning("vLLM plugin: %s stays on vLLM's path for %s: %s",
                                 self.prefix, cfg.short(), why)
                    return why
                self.kda_steps[cfg] = step
            if self._kda_conv_weight is None or self._kda_conv_weight.device != x.device:
                self._kda_conv_weight = self._kda_relayout_conv_weight()
            try:
                step(x, self._kda_conv_weight, self.conv1d.bias, conv_state, f_a,
                     self.f_b_proj.weight, beta, self.A_log, self.dt_bias, state, idx, gate,
                     self.o_norm.weight, num_accepted_tokens=nacc, out=out)
            except KdaArgumentError as e:
                # Validation runs before anything is written: vLLM's path is still exact.
                why = f"the op refused the arguments: {e}"
                self._kda_refused[cfg] = why
                _log.warning("vLLM plugin: %s stays on vLLM's path for %s: %s", self.prefix,
                             cfg.short(), e)
                return why
            return None

        @staticmethod
        def _slot_table(idx: torch.Tensor) -> torch.Tensor:
            # vLLM hands column slices of its block table (``block_table[:, 0]`` for decode,
            # ``block_table[:n, :num_spec + 1]`` for verify): non-contiguous whenever the
            # table is wider (spec decoding, prefix caching). The op wants a contiguous
            # int32 table, so only then is it copied (R or R*T int32 on the device; the
            # FULL-graph staging buffers are already contiguous and are used as they are).
            if idx.dtype != torch.int32:
                idx = idx.to(torch.int32)
            return idx if idx.is_contiguous() else idx.contiguous()

    KdaKimiGatedDeltaNetAttention.__module__ = __name__
    KdaKimiGatedDeltaNetAttention.__qualname__ = "KdaKimiGatedDeltaNetAttention"
    return KdaKimiGatedDeltaNetAttention
