"""What the vLLM plugin's three layer subclasses share (imports vLLM; see kda.integrations.vllm).

:class:`KdaLayerMixin` goes first in each subclass's bases, before vLLM's layer class. The
subclass supplies its ``forward`` (vLLM's projections, keeping ``f_a``, then
:meth:`KdaLayerMixin._kda_attention`), the model's pieces of the mapping
(:meth:`KdaLayerMixin._kda_conv_weight_rows`, ``_kda_lower_bound``, ``_kda_A_log``,
``_kda_vllm_kernels``, ...) and :meth:`KdaLayerMixin._kda_vllm_path`, the call of vLLM's own
``_forward`` body; the mixin decides per batch, from host metadata only, whether the op runs,
and runs it, in the eager segment :meth:`KdaLayerMixin._kda_forward`, which writes the
caller's buffer in place.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.platforms import current_platform
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

import kda
from kda.config import CONV_TAPS, HEAD_DIM
from kda.errors import KdaArgumentError, KdaBackendError
from kda.integrations import vllm as plugin
from kda.registry import describe


class Batch(NamedTuple):
    """The requests of one batch the op serves: ``R`` requests of ``T`` tokens (rows
    ``0 .. R*T-1``), their slot table (``[R]`` at T=1, else ``[R, T]``; int32, contiguous) and
    accepted counts (``[R]`` int32 at T>1, else None)."""

    T: int
    R: int
    state_indices: torch.Tensor
    num_accepted_tokens: Optional[torch.Tensor]


class VllmKernels(NamedTuple):
    """vLLM's kernels for one kind of batch of a layer: their names (as the log shows them),
    and whether they are one of vLLM's single-launch fused kernels, which ``auto`` keeps (no
    measurement of the op against them is recorded)."""

    names: str
    fused: bool


class KdaLayerMixin:
    """The op's path for a vLLM KDA layer; see :mod:`kda.integrations.vllm`.

    Attributes for inspection (set by :meth:`_kda_init`): ``kda_backend`` (the setting's
    value), ``kda_backend_source`` (where it came from), ``kda_enabled`` (False: every call
    runs vLLM's own ``forward``; False when the setting is ``"vllm"``), ``kda_last_path``
    ("kda" or "vllm: <reason>", the path of the last call), ``kda_steps``
    ({KdaConfig: KdaDecode}).
    """

    _kda_plugin = True
    #: The model's name in :data:`kda.integrations.vllm.MODELS` (set by each subclass).
    kda_model = ""

    # ---- set up ------------------------------------------------------------------------
    def _kda_init(self, backend: str, source: str) -> None:
        """Called at the end of the subclass's ``__init__`` with :func:`backend_choice`'s result."""
        self.kda_backend: str = backend
        self.kda_backend_source: str = source
        # a backend name (not auto, not vllm): it runs wherever the op can, tried anyway
        self._kda_backend_named = backend not in ("auto", plugin.VLLM_PATH)
        self.kda_enabled: bool = backend != plugin.VLLM_PATH
        self.kda_last_path: Optional[str] = None
        self.kda_steps: dict = {}
        self._kda_conv_weight: Optional[torch.Tensor] = None
        self._kda_refused: dict = {}        # KdaConfig -> why the op refused it
        self._kda_layer_why: Optional[str] = None
        self._kda_layer_checked = False

    # ---- weights -----------------------------------------------------------------------
    def process_weights_after_loading(self, act_dtype=None) -> None:
        """Called by vLLM's loader after (re)loading weights: re-lay out the conv weight (a
        layer on vLLM's path only drops the old one; it is laid out on first use)."""
        parent = getattr(super(), "process_weights_after_loading", None)
        if parent is not None:
            parent(act_dtype)
        self._kda_conv_weight = (self._kda_relayout_conv_weight()
                                 if getattr(self, "kda_enabled", True) else None)

    def _kda_relayout_conv_weight(self) -> torch.Tensor:
        # [3*dim, 4] (q|k|v channels, tap last) -> [3, 4, dim] fp32 contiguous
        w = self._kda_conv_weight_rows().detach()
        return (w.reshape(3, self.local_projection_size, w.shape[-1]).permute(0, 2, 1)
                .to(torch.float32).contiguous())

    # ---- the model's pieces (each subclass overrides what differs) ---------------------
    def _kda_conv_weight_rows(self) -> torch.Tensor:
        """The packed q|k|v conv weight as ``[3*dim, 4]`` (a view where vLLM keeps one)."""
        w = self.conv1d.weight
        return w.view(w.shape[0], w.shape[-1])

    def _kda_conv_bias(self) -> Optional[torch.Tensor]:
        return self.conv1d.bias

    def _kda_lower_bound(self) -> Optional[float]:
        return self.gate_lower_bound

    def _kda_A_log(self) -> torch.Tensor:
        return self.A_log

    def _kda_model_reason(self) -> Optional[str]:
        """Why this model's layer setup stays on vLLM's path (None: it does not)."""
        return None

    def _kda_vllm_kernels(self, T: int) -> VllmKernels:
        """vLLM's kernels for this layer's batches of ``T`` tokens per request (1: pure
        decode, else uniform verify) on vLLM's path: Kimi-Linear's, the default here."""
        return VllmKernels("vLLM's Triton causal_conv1d_update + "
                           + ("fused_recurrent_kda_packed_decode" if T == 1
                              else "fused_recurrent_kda"), fused=False)

    def _kda_decode_requests(self, m) -> int:
        """How many requests of a pure-decode batch vLLM's kernels serve (from its metadata)."""
        return m.num_actual_tokens

    def _kda_vllm_path(self, mixed_qkv, f_a, output_gate, beta, core_attn_out) -> None:
        """vLLM's own path for this batch, writing the normed output into ``core_attn_out``."""
        raise NotImplementedError

    # ---- the layer's setup -------------------------------------------------------------
    def _kda_off(self, args=(), kwargs=None) -> bool:
        """True when this call of the layer runs vLLM's own ``forward`` (sets
        ``kda_last_path``): the layer is disabled, or vLLM passed ``forward`` arguments beyond
        (hidden_states, positions) (``args``, ``kwargs``: a vLLM whose layer the plugin does
        not know), or its setup is not the op's (checked once; logged once per model and
        reason)."""
        if not self.kda_enabled:
            self.kda_last_path = ("vllm: disabled (kda_enabled=False; "
                                  f"{plugin.CONFIG_KEY}={self.kda_backend!r})")
            return True
        if args or kwargs:
            extra = f"{len(args)} more positional, keywords {sorted(kwargs or ())}"
            self.kda_last_path = ("vllm: forward called with arguments the plugin does not "
                                  f"know ({extra})")
            plugin.log_once(("forward-args", self.kda_model, extra), logging.WARNING,
                            "vLLM plugin: %s's forward was called with arguments the plugin "
                            "does not know (%s): vLLM's path runs.", self.kda_model, extra)
            return True
        if not self._kda_layer_checked:
            self._kda_layer_why = self._kda_layer_reason()
            self._kda_layer_checked = True
            if self._kda_layer_why is not None:
                plugin.log_once(("layer", self.kda_model, self._kda_layer_why), logging.INFO,
                                "vLLM plugin: %s layers with this setup (first: %s) stay on "
                                "vLLM's path: %s", self.kda_model, self.prefix,
                                self._kda_layer_why)
        if self._kda_layer_why is not None:
            self.kda_last_path = f"vllm: {self._kda_layer_why}"
            return True
        return False

    def _kda_layer_reason(self) -> Optional[str]:
        """Why this layer's setup is not the op's (None when it is). Host data only."""
        if current_platform.is_rocm() and not self._kda_backend_named:
            return ("ROCm: the op's GPU backends are built for NVIDIA GPUs (name one with "
                    f"{plugin.CONFIG_KEY} to try anyway)")
        cache = self.cache_config
        if cache is not None and (getattr(cache, "use_replayssm", False)
                                  or getattr(cache, "use_kda_recoverssm", False)):
            return "ReplaySSM / RecoverSSM (--use-replayssm)"
        if self.head_dim != HEAD_DIM or self.conv_size != CONV_TAPS:
            return (f"head_dim {self.head_dim} / conv size {self.conv_size} (op: "
                    f"{HEAD_DIM} / {CONV_TAPS})")
        model_dtype = getattr(self.model_config, "dtype", None)
        if model_dtype is not None and model_dtype != torch.bfloat16:
            return f"model dtype {model_dtype} (op: bf16 activations)"
        try:
            conv_dtype, state_dtype = tuple(self.get_state_dtype())[:2]
        except (ValueError, AttributeError) as e:
            return f"state dtypes unknown ({e})"
        if state_dtype not in (torch.float32, torch.bfloat16):
            return f"recurrent state in {state_dtype} (op: fp32 or bf16)"
        if conv_dtype not in (torch.bfloat16, torch.float32):
            return f"conv state in {conv_dtype} (op: bf16 or fp32)"
        fb = self.f_b_proj
        if not isinstance(getattr(fb, "quant_method", None), UnquantizedLinearMethod) \
                or fb.weight.dtype != torch.bfloat16:
            return "quantized f_b_proj"
        norm = self.o_norm
        if getattr(norm, "activation", None) != "sigmoid" or norm.weight is None \
                or norm.weight.dtype not in (torch.bfloat16, torch.float32):
            return "o_norm is not a sigmoid-gated RMSNorm with a bf16/fp32 weight"
        bias = self._kda_conv_bias()
        if bias is not None and bias.dtype != torch.float32:
            return f"conv bias in {bias.dtype} (op: fp32)"
        return self._kda_model_reason()

    # ---- one batch ---------------------------------------------------------------------
    def _kda_attention(self, hidden_states: torch.Tensor, mixed_qkv: torch.Tensor,
                       f_a: torch.Tensor, output_gate: torch.Tensor,
                       beta: torch.Tensor) -> torch.Tensor:
        """The layer's normed attention output ``[tokens, dim]`` (``o_proj``'s input) from the
        projection's slices: allocated here, in the caller's segment (captured under vLLM's
        breakable CUDA graphs, like vLLM's own ``forward``'s buffer), and written in place by
        the eager segment :meth:`_kda_forward`, so that what runs after it reads the address
        it had at capture."""
        num_tokens = hidden_states.size(0)
        core_attn_out = torch.empty((1, num_tokens, self.local_num_heads, self.head_dim),
                                    dtype=hidden_states.dtype, device=hidden_states.device)
        self._kda_forward(mixed_qkv=mixed_qkv, f_a=f_a, output_gate=output_gate, beta=beta,
                          core_attn_out=core_attn_out)
        return core_attn_out.view(num_tokens, self.local_num_heads * self.head_dim)

    @eager_break_during_capture
    def _kda_forward(self, mixed_qkv: torch.Tensor, f_a: torch.Tensor,
                     output_gate: torch.Tensor, beta: torch.Tensor,
                     core_attn_out: torch.Tensor) -> None:
        """Writes ``core_attn_out`` ``[1, tokens, H, D]`` in place: the op's normed output, or
        vLLM's path; returns nothing (an eager segment under vLLM's breakable CUDA graphs,
        re-run at every replay). ``mixed_qkv`` ``[tokens, 3*dim]``, ``f_a`` ``[tokens, 128]``,
        ``output_gate`` ``[tokens, dim]`` (logits), ``beta`` ``[tokens, H]`` (logits): the
        projection's slices, bf16."""
        why = self._kda_try_step(mixed_qkv, f_a, output_gate, beta, core_attn_out)
        if why is None:
            self.kda_last_path = "kda"
            return
        self.kda_last_path = f"vllm: {why}"
        # one key per model and reason: a reason already warned about is not repeated here
        plugin.log_once(("vllm path", self.kda_model, why), logging.INFO,
                        "vLLM plugin: %s: batches run vLLM's path: %s (first: %s)",
                        self.kda_model, why, self.prefix)
        self._kda_vllm_path(mixed_qkv, f_a, output_gate, beta, core_attn_out)

    def _kda_batch(self, m) -> "Batch | str":
        """The requests the op serves in this batch, or why it does not. Host metadata only:
        the counts vLLM's builder computed on the CPU, and tensor shapes."""
        if m.num_prefills != 0:
            return "prefill or mixed batch"
        if m.num_spec_decodes > 0:
            if m.num_decodes != 0:
                return "plain decodes beside speculative decodes"
            if getattr(self.speculative_config, "enable_adaptive_verification", False):
                return ("adaptive verification: each request's drafts are trimmed on the "
                        "device, so the host cannot tell a uniform batch")
            T, R = self.num_spec + 1, m.num_spec_decodes
            why = self._kda_kept_kernels(T)
            if why is not None:
                return why
            # every request has 1 .. num_spec + 1 tokens: the total says whether all have T
            if m.num_spec_decode_tokens != R * T:
                return f"ragged speculative batch (not every request has {T} tokens)"
            idx, nacc = m.spec_state_indices_tensor, m.num_accepted_tokens
            if idx is None or nacc is None or idx.dim() != 2 or idx.shape[1] != T \
                    or idx.shape[0] < R or nacc.dim() != 1 or nacc.shape[0] < R:
                return "speculative metadata not [R, T] slots and [R] accepted counts"
            if m.num_actual_tokens < R * T:
                return "fewer token rows than speculative tokens"
            nacc = nacc[:R]
            if nacc.dtype != torch.int32 or not nacc.is_contiguous():
                nacc = nacc.to(torch.int32).contiguous()
            return Batch(T, R, self._kda_slot_table(idx[:R]), nacc)
        why = self._kda_kept_kernels(1)
        if why is not None:
            return why
        R = self._kda_decode_requests(m)
        idx = m.non_spec_state_indices_tensor
        if idx is None or idx.dim() != 1 or idx.shape[0] < R or m.num_actual_tokens < R:
            return "no slot table for every decode row"
        return Batch(1, R, self._kda_slot_table(idx[:R]), None)

    def _kda_kept_kernels(self, T: int) -> Optional[str]:
        """Why ``auto`` keeps vLLM's kernels for batches of ``T`` tokens per request (one of
        vLLM's fused kernels), else None."""
        kernels = self._kda_vllm_kernels(T)
        if self._kda_backend_named or not kernels.fused:
            return None
        return (f"auto keeps {kernels.names}, against which no measurement of the op is "
                f"recorded; name a backend with {plugin.CONFIG_KEY} to run the op")

    def _kda_try_step(self, mixed_qkv, f_a, output_gate, beta, core_attn_out
                      ) -> Optional[str]:
        """Run the op when the batch is its; else return why not (nothing written then)."""
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            return "no attention metadata (profile / warm-up run)"
        m = attn_metadata.get(self.prefix) if isinstance(attn_metadata, dict) else None
        if not isinstance(m, GDNAttentionMetadata):
            return "no GDN metadata for this layer"
        if mixed_qkv.dtype != torch.bfloat16:
            return f"activations in {mixed_qkv.dtype} (op: bf16)"
        conv_state, state = self.kv_cache[0], self.kv_cache[1]
        # Same view as vLLM's _forward: the SD cache [slots, L, 3*dim] becomes
        # [slots, 3*dim, L] with strides [s, 1, 3*dim]; DS is already [slots, 3*dim, L].
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        batch = self._kda_batch(m)
        if isinstance(batch, str):
            return batch
        rows = batch.R * batch.T
        if rows == 0:
            return None
        dim = self.local_projection_size
        bias = self._kda_conv_bias()
        try:
            cfg = kda.KdaConfig(
                num_heads=self.local_num_heads, T=batch.T, window=conv_state.shape[-1],
                conv_layout="SD" if conv_state.stride(-2) == 1 else "DS",
                lower_bound=self._kda_lower_bound(), has_conv_bias=bias is not None,
                norm_eps=float(self.o_norm.eps), conv_state_dtype=conv_state.dtype,
                conv_weight_dtype=torch.float32, norm_weight_dtype=self.o_norm.weight.dtype,
                state_dtype=state.dtype)
        except KdaArgumentError as e:
            return f"the op refuses this layer's setup: {e}"
        if cfg in self._kda_refused:
            return self._kda_refused[cfg]
        step = self.kda_steps.get(cfg)
        if step is None:
            step = self._kda_build(cfg, batch.T, mixed_qkv.device)
            if isinstance(step, str):
                self._kda_refused[cfg] = step
                return step
            self.kda_steps[cfg] = step
        if self._kda_conv_weight is None or self._kda_conv_weight.device != mixed_qkv.device:
            self._kda_conv_weight = self._kda_relayout_conv_weight()
        out = core_attn_out.view(core_attn_out.shape[1], dim)[:rows]
        try:
            step(mixed_qkv[:rows], self._kda_conv_weight, bias, conv_state, f_a[:rows],
                 self.f_b_proj.weight, beta[:rows], self._kda_A_log(), self.dt_bias, state,
                 batch.state_indices, output_gate[:rows], self.o_norm.weight,
                 num_accepted_tokens=batch.num_accepted_tokens, out=out)
        except KdaArgumentError as e:
            # Validation runs before anything is written: vLLM's path is still exact.
            why = f"the op refused the arguments: {e}"
            self._kda_refused[cfg] = why
            plugin.log_once(("vllm path", self.kda_model, why), logging.WARNING,
                            "vLLM plugin: %s layers (first: %s) stay on vLLM's path for %s: %s",
                            self.kda_model, self.prefix, cfg.short(), why)
            return why
        return None

    def _kda_build(self, cfg, T: int, device: torch.device) -> "kda.KdaDecode | str":
        """This layer's step for ``cfg`` (built once, at vLLM's warm-up), or why the
        configuration stays on vLLM's path: ``auto`` finding no GPU backend for it (logged as a
        warning). A named backend that cannot serve it raises, at warm-up (startup).

        Raises:
          kda.KdaBackendError: the named backend cannot serve ``cfg`` on ``device``.
        """
        auto = self.kda_backend == "auto"
        try:
            step = kda.KdaDecode(cfg, device=device, backend=self.kda_backend)
        except KdaBackendError as e:
            if not auto:
                raise
            why = f"auto found no kda backend for this configuration ({e})"
        else:
            if not (auto and step.backend_name == "reference"):
                kind = "pure-decode" if T == 1 else f"uniform verify (T={T})"
                plugin.log_once(("replaces", self.kda_model, kind, self._kda_vllm_kernels(T),
                                 step.backend_name), logging.INFO,
                                "vLLM plugin: %s %s batches run kda.KdaDecode (backend %s) in "
                                "place of %s (first: %s, %s)", self.kda_model, kind,
                                describe(step.backend), self._kda_vllm_kernels(T).names,
                                self.prefix, cfg.short())
                return step
            where = "this GPU" if device.type == "cuda" else device.type
            why = (f"auto found no GPU backend of kda for {where} (only the PyTorch "
                   "reference, which is not for serving)")
        plugin.log_once(("vllm path", self.kda_model, why), logging.WARNING,
                        "vLLM plugin: %s layers (first: %s) stay on vLLM's path: %s; name a "
                        "backend with %s to run the op anyway", self.kda_model, self.prefix,
                        why, plugin.CONFIG_KEY)
        return why

    @staticmethod
    def _kda_slot_table(idx: torch.Tensor) -> torch.Tensor:
        # vLLM hands column slices of its block table (``block_table[:, 0]`` for decode,
        # ``block_table[:n, :num_spec + 1]`` for verify): non-contiguous whenever the
        # table is wider (spec decoding, prefix caching). The op wants a contiguous
        # int32 table, so only then is it copied (R or R*T int32 on the device; the
        # FULL-graph staging buffers are already contiguous and are used as they are).
        if idx.dtype != torch.int32:
            idx = idx.to(torch.int32)
        return idx if idx.is_contiguous() else idx.contiguous()
