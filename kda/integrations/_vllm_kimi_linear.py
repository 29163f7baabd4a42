"""The vLLM plugin's Kimi-Linear layer (imports vLLM; see kda.integrations.vllm)."""

from __future__ import annotations

import torch
from einops import rearrange
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

from kda.integrations import vllm as plugin
from kda.integrations._vllm_layer import KdaLayerMixin

# vLLM's ``_forward`` body without its decorator: our ``_kda_forward`` carries the
# decorator, so the fallback must not open a second eager segment inside it.
_vllm_forward_body = getattr(KimiGatedDeltaNetAttention._forward, "__wrapped__",
                             KimiGatedDeltaNetAttention._forward)


class KdaKimiGatedDeltaNetAttention(KdaLayerMixin, KimiGatedDeltaNetAttention):
    """vLLM's Kimi-Linear KDA layer whose decode / verify batches run :class:`kda.KdaDecode`.

    See :mod:`kda.integrations.vllm`. Constructed by vLLM in place of
    ``KimiGatedDeltaNetAttention(config, vllm_config, prefix)``.

    Raises:
      kda.KdaBackendError: at construction, an unknown ``kda_fused_decode_backend`` /
        ``$KDA_BACKEND`` value (the message lists the valid ones).
    """

    kda_model = "Kimi-Linear"

    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        # Before anything is registered under ``prefix``: an unknown value fails here.
        backend, source = plugin.backend_choice(getattr(vllm_config, "additional_config", None))
        super().__init__(config, vllm_config, prefix)
        self._kda_init(backend, source)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        """(conv state, recurrent state) dtypes, honoring ``--mamba-ssm-cache-dtype``.

        As ``KimiLinearForCausalLM.get_mamba_state_dtype_from_config`` computes them (vLLM
        0.33's layer leaves the ssm dtype out, so its pool stays fp32 whatever the setting).

        Raises:
          ValueError: the layer has no model or cache config (as vLLM's method).
        """
        if self.model_config is None or self.cache_config is None:
            raise ValueError("model_config and cache_config must be set")
        return MambaStateDtypeCalculator.kda_state_dtype(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype,
            self.cache_config.mamba_ssm_cache_dtype)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._kda_off():
            return super().forward(hidden_states, positions)
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
