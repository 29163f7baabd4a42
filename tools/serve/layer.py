"""One Kimi-Linear KDA layer as a server runs it: projections, the fused decode op, o_proj.

The decode path calls :class:`kda.KdaDecode` (the backend chosen by ``--kda_backend`` /
``$KDA_BACKEND`` / auto). The prefill and the end-to-end check use fla-core 0.6.0 instead:
on a GPU its chunked kernels (``chunk_kda`` with the gate and the q/k L2 norm in kernel,
``rms_norm_gated``), on the CPU its pure-PyTorch pieces (``naive_kda_gate`` /
``naive_kda_lowerbound_gate``, ``naive_recurrent_kda``, ``rms_norm_ref``). The short conv of
the sequence path is ``torch.nn.functional.conv1d`` in both cases.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

import kda
from kda.config import HEAD_DIM as D
from kda.config import KdaConfig


@dataclasses.dataclass
class SeqResult:
    """fla-core over a whole sequence: per-token layer outputs and the caches it leaves."""

    layer_out: torch.Tensor      # [P, hidden] bf16
    state: torch.Tensor          # [H, D(v), D(k)] fp32 (V-major, as the op stores it)
    window: torch.Tensor         # [3*dim, 3] raw x of the last 3 tokens (zeros before the start)


class KdaLayer:
    """A KDA layer over heads [head0, head0 + H) of a checkpoint (H = the heads on this GPU).

    Args:
      params: short name -> tensor, as :func:`tools.serve.checkpoint.load_layer` returns.
      cfg: the decode op's static configuration (num_heads = H).
      head0: first head of this GPU's slice (tensor parallel rank * H).
      device: where the layer runs.
      backend: decode backend name (None: flag / env / auto).
    """

    def __init__(self, params, cfg: KdaConfig, head0: int, device: torch.device,
                 backend: Optional[str] = None):
        H, dim = cfg.num_heads, cfg.dim
        total = params["A_log"].numel()
        if head0 + H > total:
            raise ValueError(f"heads [{head0}, {head0 + H}) are outside the checkpoint's {total} heads")
        sl = slice(head0 * D, (head0 + H) * D)
        self.cfg, self.device = cfg, device

        def own(t, dtype=torch.bfloat16):
            """A copy of ``t`` on the device in ``dtype`` (a checkpoint in another float dtype
            is cast): memory of its own, aligned as torch allocates, not the file's (safetensors
            aligns its data to 8 bytes, the op wants f_b at 16)."""
            return t.to(device=device, dtype=dtype, copy=True).contiguous()

        self.hidden = params["q_proj.weight"].shape[1]
        self.w_qkv = own(torch.cat([params[f"{p}_proj.weight"][sl] for p in "qkv"]))  # [3dim, hidden]
        self.w_fa = own(params["f_a_proj.weight"])                                       # [128, hidden]
        self.w_b = own(params["b_proj.weight"][head0:head0 + H])                         # [H, hidden]
        self.w_ga = own(params["g_a_proj.weight"])
        self.w_gb = own(params["g_b_proj.weight"][sl])                                    # [dim, 128]
        self.w_o = own(params["o_proj.weight"][:, sl])                                    # [hidden, dim]
        conv = torch.stack([params[f"{p}_conv1d.weight"][sl, 0, :] for p in "qkv"])     # [3, dim, 4]
        self.conv_weight = own(conv.permute(0, 2, 1), torch.float32)                     # [3, 4, dim]
        self.f_b = own(params["f_b_proj.weight"][sl])
        self.A_log = own(params["A_log"].reshape(-1)[head0:head0 + H], torch.float32)
        self.dt_bias = own(params["dt_bias"][sl], torch.float32)
        self.norm_weight = own(params["o_norm.weight"], torch.float32)
        self.op = kda.KdaDecode(cfg, device=device, backend=backend)
        assert self.conv_weight.shape == (3, 4, dim)

    # ---- projections (what the model does around the op) -----------------------------------
    def project(self, h: torch.Tensor):
        """hidden [N, hidden] bf16 -> (x [N, 3dim], f_a [N, 128], beta [N, H], output_gate [N, dim])."""
        x = h @ self.w_qkv.t()
        f_a = h @ self.w_fa.t()
        beta = h @ self.w_b.t()
        gate = (h @ self.w_ga.t()) @ self.w_gb.t()
        return x.contiguous(), f_a.contiguous(), beta.contiguous(), gate.contiguous()

    def decode(self, h, conv_state, state, state_indices, num_accepted_tokens=None, out=None,
               op=None):
        """One decode / verify step for a padded batch; returns (layer_out [N, hidden], op out)."""
        x, f_a, beta, gate = self.project(h)
        o = (op or self.op)(x, self.conv_weight, None, conv_state, f_a, self.f_b, beta, self.A_log,
                            self.dt_bias, state, state_indices, gate, self.norm_weight,
                            num_accepted_tokens=num_accepted_tokens, out=out)
        return o @ self.w_o.t(), o

    # ---- fla-core over a whole sequence ------------------------------------------------------
    def sequence(self, h: torch.Tensor) -> SeqResult:
        """Run the layer over a whole sequence h [P, hidden] from empty caches with fla-core."""
        cfg = self.cfg
        H, dim, P = cfg.num_heads, cfg.dim, h.shape[0]
        x, f_a, beta, gate = self.project(h)
        w = self.conv_weight.permute(0, 2, 1).reshape(3 * dim, 1, 4)
        xs = F.pad(x.float().t()[None], (3, 0))                               # zero history
        y = F.silu(F.conv1d(xs, w, None, groups=3 * dim))[0].t().to(torch.bfloat16)  # [P, 3dim]
        q, k, v = (t.reshape(1, P, H, D) for t in y.split(dim, dim=1))
        rg = (f_a @ self.f_b.t()).reshape(1, P, H, D)
        if self.device.type == "cuda":
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            from fla.ops.kda import chunk_kda
            o, S = chunk_kda(q, k, v, rg.float(), beta.reshape(1, P, H).float(), scale=cfg.scale,
                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             A_log=self.A_log, dt_bias=self.dt_bias,
                             lower_bound=cfg.lower_bound, safe_gate=cfg.lower_bound is not None)
            out = rms_norm_gated(o.reshape(P * H, D), gate.reshape(P * H, D), self.norm_weight,
                                 None, activation="sigmoid", eps=cfg.norm_eps)
        else:
            from fla.modules.norm.layernorm_gated import rms_norm_ref
            from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
            from fla.ops.kda.naive import naive_recurrent_kda
            if cfg.lower_bound is None:
                g = naive_kda_gate(rg[0], self.A_log, self.dt_bias)
            else:
                g = naive_kda_lowerbound_gate(rg[0], self.A_log, self.dt_bias, cfg.lower_bound)
            qn = q.float() * torch.rsqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6)
            kn = k.float() * torch.rsqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6)
            o, S = naive_recurrent_kda(qn, kn, v, g[None], torch.sigmoid(beta.float()).reshape(1, P, H),
                                       scale=cfg.scale, output_final_state=True)
            o = o.to(torch.bfloat16)
            out = rms_norm_ref(o.reshape(P * H, D), self.norm_weight, None, eps=cfg.norm_eps)
            out = (out.float() * torch.sigmoid(gate.reshape(P * H, D).float())).to(torch.bfloat16)
        out = out.reshape(P, dim).to(torch.bfloat16)
        window = F.pad(x.t(), (3, 0))[:, -3:]                                 # [3dim, 3]
        return SeqResult(layer_out=out @ self.w_o.t(), state=S[0].transpose(-1, -2).float(),
                         window=window)
