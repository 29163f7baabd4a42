"""The vLLM plugin's GLM-5-Next layer (imports vLLM; see kda.integrations.vllm)."""

from __future__ import annotations

from typing import Optional

import torch
from vllm.models.glm5next.common.kda import Glm5NextLinearAttention

from kda.integrations import vllm as plugin
from kda.integrations._vllm_layer import KdaLayerMixin, VllmKernels

# vLLM's ``_forward`` body without its decorator (our ``_kda_forward`` carries it).
_vllm_forward_body = getattr(Glm5NextLinearAttention._forward, "__wrapped__",
                             Glm5NextLinearAttention._forward)


class KdaGlm5NextLinearAttention(KdaLayerMixin, Glm5NextLinearAttention):
    """vLLM's GLM-5-Next KDA layer (GLM-5.3-Flash's) whose decode / verify batches run
    :class:`kda.KdaDecode`.

    See :mod:`kda.integrations.vllm`. Constructed by vLLM in place of
    ``Glm5NextLinearAttention(config, vllm_config, prefix)``. On the op's path ``o_norm`` is
    the op's; on vLLM's path it runs inside the eager segment, after vLLM's ``_forward``.

    Raises:
      kda.KdaBackendError: at construction, an unknown ``kda_fused_decode_backend`` /
        ``$KDA_BACKEND`` value (the message lists the valid ones).
    """

    kda_model = "GLM-5-Next"

    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        backend, source = plugin.backend_choice(getattr(vllm_config, "additional_config", None))
        super().__init__(config, vllm_config, prefix)
        self._kda_init(backend, source)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, *args,
                **kwargs) -> torch.Tensor:
        if self._kda_off(args, kwargs):
            return super().forward(hidden_states, positions, *args, **kwargs)
        # vLLM's projections, keeping f_a (the op fuses f_b_proj)
        dim, H, D = self.local_projection_size, self.local_num_heads, self.head_dim
        projected = self.in_proj_qkvbfg_a(hidden_states)[0]
        qkv, beta, f_a, g_a = projected.split([3 * dim, H, D, D], dim=-1)
        output_gate = self.g_b_proj(g_a)[0]
        attn = self._kda_attention(hidden_states, qkv, f_a, output_gate, beta)
        return self.o_proj(attn)[0]

    # ---- the model's pieces ----------------------------------------------------------
    def _kda_convs(self) -> tuple:
        # vLLM 0.34: one merged q|k|v ``conv1d``; 0.33: ``q_conv1d``, ``k_conv1d``, ``v_conv1d``
        if hasattr(self, "conv1d"):
            return (self.conv1d,)
        return (self.q_conv1d, self.k_conv1d, self.v_conv1d)

    def _kda_conv_weight_rows(self) -> torch.Tensor:
        # [3*dim, 4] as vLLM's merged conv weight (0.33: its three [dim, 1, 4] weights stacked)
        rows = [c.weight.view(c.weight.shape[0], c.weight.shape[-1]) for c in self._kda_convs()]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _kda_conv_bias(self) -> Optional[torch.Tensor]:
        return self._kda_convs()[0].bias       # what vLLM's _forward passes (0.33: q's)

    def _kda_lower_bound(self) -> Optional[float]:
        return self.kda_lower_bound

    def _kda_A_log(self) -> torch.Tensor:
        return self.A_log.view(-1)          # [1, 1, H, 1] -> [H]

    def _kda_decode_requests(self, m) -> int:
        # vLLM's decode kernels take the first num_decodes slots and query starts
        return m.num_decodes

    def _kda_vllm_kernels(self, T: int) -> VllmKernels:
        return VllmKernels("vLLM's Triton causal_conv1d_update + fused_recurrent_kda",
                           fused=False)

    def _kda_model_reason(self) -> Optional[str]:
        if not self.kda_safe_gate or self.kda_lower_bound is None:
            return "no bounded gate (vLLM's GLM-5-Next kernels implement only the bounded one)"
        convs = self._kda_convs()
        if len(convs) == 3 and any(c.bias is not None for c in convs):
            return "conv biases (vLLM's GLM-5-Next path passes q_conv1d.bias for all channels)"
        return None

    def _kda_vllm_path(self, mixed_qkv, f_a, output_gate, beta, core_attn_out) -> None:
        # as vLLM's forward: _forward on the raw gate, then o_norm on the output gate
        H, D = self.local_num_heads, self.head_dim
        g1 = self.f_b_proj(f_a)[0].reshape(1, -1, H, D)
        _vllm_forward_body(self, qkv_proj_states=mixed_qkv, g1=g1, beta=beta.unsqueeze(0),
                           core_attn_out=core_attn_out)
        core_attn_out.copy_(self.o_norm(core_attn_out, output_gate.reshape(-1, H, D)))
