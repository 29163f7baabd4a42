"""The vLLM plugin's Kimi-Linear layer (imports vLLM; see kda.integrations.vllm)."""

from __future__ import annotations

import torch
import vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn as _vllm_kimi
from einops import rearrange
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

from kda.errors import KdaArgumentError
from kda.integrations import vllm as plugin
from kda.integrations._vllm_layer import KdaLayerMixin

# vLLM's ``_forward`` body without its decorator: our ``_kda_forward`` carries the
# decorator, so the fallback must not open a second eager segment inside it.
_vllm_forward_body = getattr(KimiGatedDeltaNetAttention._forward, "__wrapped__",
                             KimiGatedDeltaNetAttention._forward)

#: Whether vLLM's Kimi-Linear prefill can store its chunk kernel's fp32 final state into a
#: bf16 pool. vLLM 0.34 stores it through ``scatter_states`` (a Triton store, which converts
#: to the pool's dtype); 0.33 by ``recurrent_state[indices] = last_recurrent_state``, which
#: raises on a bf16 pool ("Index put requires the source and destination dtypes match").
PREFILL_STORES_INTO_BF16 = hasattr(_vllm_kimi, "scatter_states")


def state_dtypes(model_config, cache_config) -> tuple[torch.dtype, torch.dtype]:
    """(conv state, recurrent state) dtypes of a Kimi-Linear layer, as
    ``KimiLinearForCausalLM.get_mamba_state_dtype_from_config`` computes them: the
    ``--mamba-ssm-cache-dtype`` setting (``cache_config.mamba_ssm_cache_dtype``) honored
    (vLLM's layer class leaves it out, so its pool stays fp32 whatever the setting)."""
    return MambaStateDtypeCalculator.kda_state_dtype(
        model_config.dtype, cache_config.mamba_cache_dtype, cache_config.mamba_ssm_cache_dtype)


class KdaKimiGatedDeltaNetAttention(KdaLayerMixin, KimiGatedDeltaNetAttention):
    """vLLM's Kimi-Linear KDA layer whose decode / verify batches run :class:`kda.KdaDecode`.

    See :mod:`kda.integrations.vllm`. Constructed by vLLM in place of
    ``KimiGatedDeltaNetAttention(config, vllm_config, prefix)``.

    Raises:
      kda.KdaBackendError: at construction, an unknown ``kda_fused_decode_backend`` /
        ``$KDA_BACKEND`` value (the message lists the valid ones).
      kda.KdaArgumentError: at construction, ``--mamba-ssm-cache-dtype bfloat16`` under a
        vLLM whose Kimi-Linear prefill cannot store into a bf16 pool (0.33; the error names
        the flag, what vLLM supports and what was given).
    """

    kda_model = "Kimi-Linear"

    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        # Before anything is registered under ``prefix``: an unknown value fails here.
        backend, source = plugin.backend_choice(getattr(vllm_config, "additional_config", None))
        # on vLLM's path under a vLLM the plugin was not tested with, the layer is vLLM's own,
        # its pool's dtype included (set before vLLM's __init__, which may ask for it)
        self._kda_passive = backend == plugin.VLLM_PATH and not plugin.tested_vllm()
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        if not self._kda_passive and not PREFILL_STORES_INTO_BF16 and mc is not None \
                and cc is not None \
                and state_dtypes(mc, cc)[1] == torch.bfloat16:
            raise KdaArgumentError(
                "--mamba-ssm-cache-dtype",
                f"expected float32 or auto for Kimi-Linear under vLLM "
                f"{plugin.vllm_version()}, got "
                f"{cc.mamba_ssm_cache_dtype!r}: a bf16 state pool fails "
                "at the first prefill there (vLLM's Kimi-Linear prefill stores the chunk "
                "kernel's fp32 final state into the pool without a cast). vLLM 0.34 stores it "
                "into a bf16 pool.")
        super().__init__(config, vllm_config, prefix)
        self._kda_init(backend, source)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        """(conv state, recurrent state) dtypes, honoring ``--mamba-ssm-cache-dtype``
        (:func:`state_dtypes`); on vLLM's path under an untested vLLM, vLLM's own layer's.

        Raises:
          ValueError: the layer has no model or cache config (as vLLM's method).
        """
        if self._kda_passive:
            return super().get_state_dtype()
        if self.model_config is None or self.cache_config is None:
            raise ValueError("model_config and cache_config must be set")
        return state_dtypes(self.model_config, self.cache_config)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, *args,
                **kwargs) -> torch.Tensor:
        if self._kda_off(args, kwargs):
            return super().forward(hidden_states, positions, *args, **kwargs)
        # vLLM's projections, keeping f_a (the op fuses f_b_proj)
        projected = self.in_proj_qkvgfab(hidden_states)[0]
        dim, H, D = self.local_projection_size, self.local_num_heads, self.head_dim
        if self.use_full_rank_gate:
            sizes = [3 * dim, dim, D, H] + ([self.in_proj_padding] if self.in_proj_padding
                                             else [])
            mixed_qkv, output_gate, f_a, beta = projected.split(sizes, dim=-1)[:4]
        else:
            mixed_qkv, beta, f_a = projected.split([3 * dim, H, D], dim=-1)
            output_gate = self.g_b_proj(self.g_a_proj(hidden_states)[0])[0]
        attn = self._kda_attention(hidden_states, mixed_qkv, f_a, output_gate, beta)
        return self.o_proj(attn)[0]

    def _kda_vllm_path(self, mixed_qkv, f_a, output_gate, beta, core_attn_out) -> None:
        # as vLLM's forward hands them to _forward, whose body ends with o_norm
        g1 = rearrange(self.f_b_proj(f_a)[0], "n (h d) -> 1 n h d", d=self.head_dim)
        g2 = rearrange(output_gate, "... (h d) -> ... h d", d=self.head_dim)
        _vllm_forward_body(self, mixed_qkv=mixed_qkv, g1=g1, g2=g2, beta=beta.unsqueeze(0),
                           core_attn_out=core_attn_out)
