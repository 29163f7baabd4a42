"""The vLLM plugin's Kimi-K3 layer (imports vLLM; see kda.integrations.vllm)."""

from __future__ import annotations

import torch
from einops import rearrange
from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

from kda.integrations import vllm as plugin
from kda.integrations._vllm_layer import KdaLayerMixin, VllmKernels

# vLLM's ``_forward`` body without its decorator (our ``_kda_forward`` carries it).
_vllm_forward_body = getattr(KimiK3DeltaAttention._forward, "__wrapped__",
                             KimiK3DeltaAttention._forward)


class KdaKimiK3DeltaAttention(KdaLayerMixin, KimiK3DeltaAttention):
    """vLLM's Kimi-K3 KDA layer whose decode / verify batches run :class:`kda.KdaDecode`.

    See :mod:`kda.integrations.vllm`. Constructed by vLLM in place of
    ``KimiK3DeltaAttention(config, vllm_config, prefix, aux_stream, run_gemm_rs_ar)``.

    Raises:
      kda.KdaBackendError: at construction, an unknown ``kda_fused_decode_backend`` /
        ``$KDA_BACKEND`` value (the message lists the valid ones).
    """

    kda_model = "Kimi-K3"

    def __init__(self, config, vllm_config, prefix: str = "", *args, **kwargs) -> None:
        backend, source = plugin.backend_choice(getattr(vllm_config, "additional_config", None))
        super().__init__(config, vllm_config, prefix, *args, **kwargs)
        self._kda_init(backend, source)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, *args,
                **kwargs) -> torch.Tensor:
        if self._kda_off(args, kwargs):
            return super().forward(hidden_states, positions, *args, **kwargs)
        # vLLM's in-projection without its capture-time overlap with the f_b GEMM: the op
        # fuses that GEMM (vLLM's path computes it in the eager segment)
        dim, H, D = self.local_projection_size, self.local_num_heads, self.head_dim
        projected = self.in_proj_qkvgfab(hidden_states)[0]
        sizes = [3 * dim, dim, D, H] + ([self.in_proj_padding] if self.in_proj_padding else [])
        mixed_qkv, output_gate, f_a, beta = projected.split(sizes, dim=-1)[:4]
        attn = self._kda_attention(hidden_states, mixed_qkv, f_a, output_gate, beta)
        if self.gemm_rs_ar is not None and self.gemm_rs_ar.should_run(attn):
            return self.gemm_rs_ar.apply(attn, self.o_proj)
        return self.o_proj(attn)[0]

    def _kda_vllm_kernels(self, T: int) -> VllmKernels:
        # vLLM's choice, made at its layer's construction from its kda_decode_backend /
        # kda_spec_decode_backend keys and the GPU
        if T == 1:
            if self.kda_decode_backend == "native":
                return VllmKernels("vLLM's native CUDA fused_kda_decode (kda_decode_backend "
                                   "'native')", fused=True)
            if self.kda_decode_backend == "flashinfer":
                return VllmKernels("FlashInfer's fused_kda_decode (kda_decode_backend "
                                   "'flashinfer')", fused=True)
        elif self.kda_spec_decode_backend == "flashinfer":
            return VllmKernels("FlashInfer's packed_fused_kda_decode (kda_spec_decode_backend "
                               "'flashinfer')", fused=True)
        return super()._kda_vllm_kernels(T)

    def _kda_vllm_path(self, mixed_qkv, f_a, output_gate, beta, core_attn_out) -> None:
        # as vLLM's forward (outside capture) hands them to _forward, whose body ends with
        # o_norm
        g1 = rearrange(self.f_b_proj(f_a)[0], "n (h d) -> 1 n h d", d=self.head_dim)
        g2 = rearrange(output_gate, "... (h d) -> ... h d", d=self.head_dim)
        _vllm_forward_body(self, mixed_qkv=mixed_qkv, g1=g1, g2=g2, beta=beta.unsqueeze(0),
                           core_attn_out=core_attn_out)
