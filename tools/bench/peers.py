"""The peers every benchmark runs beside our backends, measured in the same process.

* ``fla_recurrent``: fla-core 0.6.0 ``fused_recurrent_kda_fwd`` alone: the recurrence with the
  gate, the q/k L2 norm and the beta sigmoid in kernel, on the V-first paged state, in place
  (per-token writes and ``num_accepted_tokens`` for T > 1). Its inputs are the conv outputs
  and the raw gate, i.e. the work before it is not counted.
* ``fla_unfused``: the whole step as separate fla-core / torch launches: fla's
  ``causal_conv1d_update`` (a contiguous per-batch conv cache of 4 taps, no paging, so
  slightly favourable to the peer), the f_b GEMM (``torch.matmul``), ``fused_recurrent_kda_fwd``
  and fla's ``rms_norm_gated`` with the sigmoid gate.
* ``touch`` / ``touch_rows32`` (:mod:`tools.bench.touch`): only the step's state traffic (read
  the source page, write it to every write slot), no math: the ceiling a fused step can reach
  on the same pages.
* ``touch_ring`` (:mod:`tools.bench.touch_ring`): the same traffic through the streamed CuTe
  DSL kernels' pipeline (persistent CTAs, a bulk-copy ring of value-row units), no math: the
  ceiling of that pipeline.

The fla peers need a CUDA device and fla-core, the Triton touch peers a CUDA device and Triton
(or Triton's interpreter on the CPU), ``touch_ring`` an sm_90 device and CuTe DSL;
:func:`available` says why not otherwise.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kda.config import HEAD_DIM as D
from kda.config import KdaArgs, KdaConfig

PEERS = ("fla_recurrent", "fla_unfused", "touch", "touch_rows32", "touch_ring")


def available(name: str, device: torch.device) -> Optional[str]:
    """None when peer ``name`` can run on ``device``, else why not."""
    if name == "touch_ring":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
            return "touch_ring runs on an sm_90+ GPU (bulk copies, mbarriers)"
        from kda.backends.cutedsl.backend import import_cutedsl
        return import_cutedsl()
    if name.startswith("touch"):
        from kda.backends.triton.backend import interpreter_enabled
        if device.type != "cuda" and not interpreter_enabled():
            return "the touch peers run on CUDA (or on the CPU with TRITON_INTERPRET=1)"
        return None
    if device.type != "cuda":
        return "the fla-core peers run on CUDA only"
    try:
        import fla.ops.kda.fused_recurrent  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"fla-core not importable: {type(e).__name__}: {e}"
    return None


def make_peer(name: str, cfg: KdaConfig, args: KdaArgs) -> Callable[[torch.Tensor, Optional[torch.Tensor]], None]:
    """A step function ``fn(state_indices, num_accepted_tokens)`` for peer ``name``.

    The peer works on ``args``' state pool (V-first, in place) and operands; the slot ids come
    per call so that the benchmark can rotate slot sets.

    Raises:
      ValueError: ``name`` is not one of :data:`PEERS`.
    """
    if name == "touch_ring":
        from tools.bench.touch_ring import make_touch_ring
        return make_touch_ring(cfg, args)
    if name.startswith("touch"):
        from tools.bench.touch import make_touch
        return make_touch(name, cfg, args)
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    H, T, dim = cfg.num_heads, cfg.T, cfg.dim
    N = args.x.shape[0]
    R = N // T
    # post-conv q, k, v and the raw gate as the recurrence-only peer consumes them
    qkv = args.x.reshape(R, T, 3, H, D)
    q, k, v = (qkv[:, :, i].contiguous() for i in range(3))
    rg = (args.f_a @ args.f_b.t()).reshape(R, T, H, D)
    beta = args.beta.reshape(R, T, H).contiguous()
    o_buf = torch.empty(R, T, H, D, dtype=torch.bfloat16, device=args.x.device)

    def recurrence(q, k, v, g, state_indices, num_accepted):
        fused_recurrent_kda_fwd(
            q=q, k=k, v=v, g=g, beta=beta, A_log=args.A_log, dt_bias=args.dt_bias,
            initial_state=args.state, scale=cfg.scale, inplace_final_state=True,
            state_v_first=True, ssm_state_indices=state_indices,
            num_accepted_tokens=num_accepted, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=cfg.lower_bound, out=o_buf)

    if name == "fla_recurrent":
        def step(state_indices, num_accepted):
            recurrence(q, k, v, rg, state_indices, num_accepted)
        return step

    if name != "fla_unfused":
        raise ValueError(f"unknown peer {name!r}; valid: {PEERS}")
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    conv_w = args.conv_weight.float().permute(0, 2, 1).reshape(3 * dim, 4).contiguous()
    cache = torch.randn(R, 3 * dim, 4, dtype=torch.bfloat16, device=args.x.device)
    x = args.x.reshape(R, T, 3 * dim)
    gate = args.output_gate.reshape(N * H, D)

    def step(state_indices, num_accepted):
        ys = [causal_conv1d_update(x[:, t], cache, weight=conv_w, activation="silu")[0]
              for t in range(T)]
        y = torch.stack(ys, 1).reshape(R, T, 3, H, D)
        g = (args.f_a @ args.f_b.t()).reshape(R, T, H, D)
        yq, yk, yv = (y[:, :, i].contiguous() for i in range(3))
        recurrence(yq, yk, yv, g, state_indices, num_accepted)
        rms_norm_gated(o_buf.reshape(N * H, D), gate, args.norm_weight, None,
                       activation="sigmoid", eps=cfg.norm_eps)
    return step
