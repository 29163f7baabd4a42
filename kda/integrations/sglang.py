"""SGLang adapter: Kimi-Linear's KDA decode batches through :class:`kda.KdaDecode`.

Read against SGLang 0.5.23 (the newest release on PyPI when written; file paths below are
inside the wheel, ``python/sglang/...`` in SGLang's repository).

Why not SGLang's kernel-backend ``decode``
-----------------------------------------
SGLang's linear-attention kernel interface is ``LinearAttnKernelBase.decode`` in
``sglang/srt/layers/attention/linear/kernels/kernel_backend.py``::

    decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices,
           query_start_loc, **kwargs) -> torch.Tensor

(``KDAKernelDispatcher.decode`` in ``.../linear/kda_backend.py`` adds ``lower_bound=None``
before ``**kwargs``). Its caller, ``KDAAttnBackend.forward_decode`` (same file), hands it:

* ``q``, ``k``, ``v``: ``[1, N, H, 128]`` bf16, *after* the short conv + SiLU. The conv has
  already run, in ``forward_decode`` itself (``causal_conv1d_update`` on
  ``conv_states.transpose(-1, -2)``), and it has already rewritten the conv window.
* ``a``: ``[N, H*128]`` bf16, the forget gate *already projected*: ``f_b_proj(f_a)``, computed
  in ``KimiDeltaAttention.forward_qkvbfg_fused`` (``sglang/srt/models/kimi_linear.py``) by
  ``fused_fg_b_proj``; the kernel adds ``dt_bias`` and applies ``-exp(A_log) * softplus``
  (or ``lower_bound * sigmoid(exp(A_log) * x)`` when ``lower_bound`` is set).
* ``b``: ``[1, N, H]`` bf16 raw beta logits (the kernel applies the sigmoid).
* ``A_log`` ``[1, 1, H, 1]`` fp32, ``dt_bias`` ``[H*128]`` fp32, ``ssm_states`` the layer's
  ``temporal`` pool ``[slots, H, 128(v), 128(k)]`` (fp32, or bf16 with
  ``--mamba-ssm-dtype bfloat16`` / ``SGLANG_MAMBA_SSM_DTYPE``), ``cache_indices`` ``[N]`` int32 (slot 0 is SGLang's reserved padding slot),
  ``query_start_loc`` ``[N + 1]`` int32 (``arange``: one token per request).

and gets back ``[1, N, H, 128]`` bf16 *before* the output norm: ``KimiDeltaAttention.forward``
applies ``o_norm`` (a sigmoid-gated RMSNorm, ``FusedRMSNormGated``) with ``g_b_proj(g_a)``
afterwards. So at ``decode`` the op's fused conv, gate projection and norm cannot be applied
to SGLang's tensors as they are: the conv input and window are gone (the op would convolve
the convolved values again), the low-rank ``f_a`` is gone (``a`` is ``f_a @ f_b^T``, rank 128
per row of ``H*128`` channels, and the op takes the two factors), and the caller normalizes
the result. ``KDAAttnBackend.forward_decode(layer, forward_batch, mixed_qkv, a, b)`` does get
the pre-conv ``mixed_qkv`` and the conv cache, but still the projected gate, and its result
still goes through ``o_norm`` in the model.

Where it fits, and what this module provides
--------------------------------------------
The op fits one level up, in ``KimiDeltaAttention.forward``, where ``f_a``, the output gate
and ``o_norm`` are all at hand. :func:`forward_decode` stands in for, together:

* ``KDAAttnBackend.forward_decode`` (conv update, recurrence, state writes, and its
  ``_track_mamba_state_decode`` call for the prefix cache), reached from the model through
  ``RadixLinearAttention.forward`` -> ``HybridLinearAttnBackend.forward`` for batches whose
  ``logical_forward_mode.is_decode()``;
* the ``f_b`` half of ``fused_fg_b_proj`` (the op computes ``f_a @ f_b^T`` itself);
* ``o_norm`` (the op writes the gated-RMSNorm output).

It returns ``[N, H*128]`` bf16, what SGLang passes to ``o_proj`` after
``core_attn_out.squeeze(0).flatten(-2)``. :func:`decode_step` is the same mapping on plain
tensors (SGLang's layouts, no SGLang objects), for tests and other call sites.

Wiring (SGLang has no out-of-tree hook at this level: its kernel choice,
``--linear-attn-decode-backend``, is a closed list, and its general plugins
(``sglang.srt.plugins`` entry points, ``HookRegistry``) could only patch the model's
``forward`` wholesale, so no plugin is installed). An engine engineer edits
``KimiDeltaAttention.forward`` in ``sglang/srt/models/kimi_linear.py``, for the fused
projection path (``do_fuse_qkvbfg and not no_kda_lora``)::

    import kda
    from sglang.srt.model_executor.forward_context import get_attn_backend
    from kda.integrations import sglang as kda_sglang

    if self.do_fuse_qkvbfg and not self.no_kda_lora \\
            and getattr(self, "_kda_refused", None) is None \\
            and not forward_batch.forward_mode.is_idle() \\
            and forward_batch.logical_forward_mode.is_decode():
        qkv, beta, fg_a = torch.split(self.fused_qkvbfg_a_proj(hidden_states),
                                      self.split_sizes, dim=-1)
        w = self.fused_fg_b_proj.weight                  # [2, H*128, 128]: f_b, g_b
        try:
            out = kda_sglang.forward_decode(
                get_attn_backend().linear_attn_backend, self.attn, forward_batch, qkv,
                fg_a[:, :self.head_dim], beta, f_b=w[0],
                output_gate=torch.nn.functional.linear(fg_a[:, self.head_dim:], w[1]),
                norm_weight=self.o_norm.weight, norm_eps=self.o_norm.eps)
            return self.o_proj(out)[0]
        except kda.KdaArgumentError as e:   # nothing written: SGLang's path runs the batch
            self._kda_refused = e           # (a layer or pool the op does not serve)
    # ... SGLang's body unchanged for every other batch

Every tensor is SGLang's own: the q|k|v, beta and ``f_a`` column slices of the packed
projection (strided views, no copy), the layer's conv cache (``conv[0]``,
``[slots, 3, 3*H*128]``, passed to the op as its ``.transpose(-1, -2)`` view: the op's "SD"
layout, window 3), its ``temporal`` state pool and ``forward_metadata.mamba_cache_indices``.
Nothing is read from the device on the host and the op never synchronizes, so SGLang's
decode CUDA graphs capture it (SGLang's capture runs each batch size eagerly first, which
builds and validates the step). The conv weight ``[3*H*128, 4]`` is re-laid out once to the
op's ``[3, 4, H*128]`` fp32 and cached on the layer (``layer._kda_sglang``), keyed on the
weight tensor's identity: ``RadixLinearAttention.refresh_conv_weights`` (a new tensor) is
seen, but code that rewrites ``layer.conv_weights`` in place after the first decode step
must call :func:`reload_weights`. One :class:`kda.KdaDecode` per layer per configuration is
built on first use and reused; the backend is ``kda_backend=``, else ``$KDA_BACKEND``, else
``auto`` (:mod:`kda.registry`).

What it does not cover (SGLang's own path stays, by not calling it, or by the
:class:`kda.KdaArgumentError` it raises before writing anything):

* prefill / extend, and speculative verify (``forward_extend`` -> ``target_verify``): SGLang
  verifies into per-draft scratch buffers (``intermediate_ssm``,
  ``intermediate_conv_window``) and commits the accepted state afterwards
  (``update_mamba_state_after_mtp_verify``), which is not the op's
  ``state_indices [R, T]`` + ``num_accepted_tokens`` protocol; only the FlashInfer
  fused-accept path (``accept_lens_pool``) is close to it;
* Ling-V3 / BailingMoeV3 layers built with ``no_kda_lora`` (a full-rank forget gate: no
  ``f_a``) and quantized layers (``quant_config`` set: unfused, possibly quantized
  ``f_b_proj``);
* a recurrent state other than fp32 or bf16, head dims other than 128, conv kernels other
  than 4, GQA (``num_q_heads != num_v_heads``);
* ReplaySSM (``--enable-linear-replayssm`` or ``--enable-linear-replayssm-spec``: the pool
  then holds the ``replayssm_d`` / ``_k`` / ``_g`` rings, and SGLang's decode records each
  step there, folding the rings into the states only when they wrap; what SGLang's
  ``forward_decode`` routes on is ``replayssm_d`` being set): :func:`forward_decode` refuses
  it, naming the flags;
* Kimi-K3 (``kimi_k3.py``), which already has SGLang's own fused decode
  (``kda_fused_decode``, reached through the ``layer._k3_*`` hand-off);
* SGLang's CPU / NPU / HIP kernel variants (``sgl_kernel`` AMX conv layout, NPU conv layout).

Numerics differ from SGLang's path only where the contract's rounding points differ: the
padding slot 0 and pad id -1 are dead items for the op (zeros out, nothing written), while
SGLang computes them (their rows are discarded either way).

Tests: tests/integrations/test_sglang.py (a PyTorch transcription of SGLang's decode path and
kda's reference, in the default suite) and, against the real SGLang 0.5.23 on a CPU (its pool,
forward batch, metadata and ``RadixLinearAttention`` objects, its ``forward_decode`` and
kernels in Triton's interpreter), ``tools/sglang/run_tests.sh``. This module never imports SGLang (it reads attributes of the
objects it is given); ``import kda`` never imports this module.
"""

from __future__ import annotations

import inspect
import numbers
import threading
from typing import Optional

import torch

#: The SGLang release this adapter was written against.
SGLANG_VERSION = "0.5.23"

#: The argument of :func:`forward_decode` that sets each :class:`kda.KdaConfig` field.
CONFIG_SOURCES = {"window": "conv_states", "conv_state_dtype": "conv_states",
                  "state_dtype": "ssm_states", "norm_weight_dtype": "norm_weight",
                  "lower_bound": "layer", "has_conv_bias": "layer", "num_heads": "layer"}

#: :func:`decode_step`'s default for ``norm_eps`` and ``lower_bound``: the step's value, or
#: without a step the op's default (1e-5, the softplus gate).
AS_STEP = type("AsStep", (), {"__repr__": lambda self: "AS_STEP"})()

_lock = threading.RLock()


def conv_weight(conv_weights: torch.Tensor) -> torch.Tensor:
    """SGLang's conv weight (``RadixLinearAttention.conv_weights``) in the op's layout.

    Args:
      conv_weights: ``[3*dim, 4]`` (q|k|v channels, tap last; SGLang keeps it fp32), or the
        ``[3*dim, 1, 4]`` parameter it is a view of.

    Returns:
      A new ``[3, 4, dim]`` fp32 contiguous tensor (a weight, built once per layer).

    Raises:
      kda.KdaArgumentError: ``conv_weights`` is not ``[3*dim, 4]`` with dim a multiple of 128.
    """
    import kda
    from kda.config import CONV_TAPS
    from kda.errors import KdaArgumentError
    w = conv_weights.detach()
    if w.dim() == 3 and w.shape[1] == 1:
        w = w[:, 0]
    if w.dim() != 2 or w.shape[1] != CONV_TAPS or w.shape[0] % (3 * kda.HEAD_DIM):
        raise KdaArgumentError(
            "conv_weights", f"expected SGLang's [3*H*{kda.HEAD_DIM}, {CONV_TAPS}] conv "
            f"weight, got {list(conv_weights.shape)}")
    dim = w.shape[0] // 3
    return w.to(torch.float32).reshape(3, dim, CONV_TAPS).transpose(1, 2).contiguous()


def decode_step(mixed_qkv: torch.Tensor, f_a: torch.Tensor, b: torch.Tensor, *,
                conv_weight: torch.Tensor, conv_bias: Optional[torch.Tensor],
                A_log: torch.Tensor, dt_bias: torch.Tensor, conv_states: torch.Tensor,
                ssm_states: torch.Tensor, cache_indices: torch.Tensor, f_b: torch.Tensor,
                output_gate: torch.Tensor, norm_weight: torch.Tensor,
                norm_eps=AS_STEP, lower_bound=AS_STEP,
                out: Optional[torch.Tensor] = None, step=None,
                backend: Optional[str] = None) -> torch.Tensor:
    """One KDA decode step (T = 1) on tensors in SGLang 0.5.23's layouts; returns ``out``.

    Shapes: H heads on this rank, D = 128, dim = H*D, N requests (one token each).

    Args:
      mixed_qkv: ``[N, 3*dim]`` bf16, q|k|v *before* the conv (the ``qkv`` split of
        ``fused_qkvbfg_a_proj``'s output; a strided column slice is fine).
      f_a: ``[N, 128]`` bf16, the ``f_a`` half of the ``fg_a`` split (SGLang's ``a`` is
        ``f_a @ f_b^T``; the op forms it).
      b: ``[1, N, H]`` (as SGLang passes it) or ``[N, H]`` bf16 raw beta logits.
      conv_weight: ``[3, 4, dim]`` fp32 from :func:`conv_weight`.
      conv_bias: ``[3*dim]`` fp32 (``RadixLinearAttention.bias``) or None (Kimi-Linear).
      A_log: ``[1, 1, H, 1]`` (SGLang's parameter) or ``[H]`` fp32.
      dt_bias: ``[dim]`` fp32.
      conv_states: the layer's conv cache as SGLang stores it, ``[slots, 3, 3*dim]`` bf16
        (``mamba2_layer_cache(layer_id).conv[0]``); its window is rewritten in place.
      ssm_states: the layer's state pool ``[slots, H, 128(v), 128(k)]`` fp32 or bf16
        (``.temporal``); updated in place (bf16: each page widened to fp32, each state written
        rounded once to nearest even).
      cache_indices: ``[N]`` int32 slot per request (``forward_metadata.mamba_cache_indices``);
        ids <= 0 (SGLang's padding slot 0, pad id -1) and >= slots are dead items: zero
        output rows, nothing written.
      f_b: ``[dim, 128]`` bf16 (``fused_fg_b_proj.weight[0]``).
      output_gate: ``[N, dim]`` bf16 logits (``g_b_proj(g_a)``, SGLang's ``g_proj_states``).
      norm_weight: ``[128]`` bf16 or fp32 (``o_norm.weight``).
      norm_eps: ``o_norm.eps`` (default 1e-5); with ``step``, its configuration's (a value
        given must equal it).
      lower_bound: ``layer.lower_bound`` (None: Kimi-Linear's softplus gate; the default);
        with ``step``, its configuration's (a value given must equal it).
      out: ``[N, dim]`` bf16 to write into (for CUDA graphs); allocated when None.
      step: a :class:`kda.KdaDecode` built for this configuration (reused across steps, and
        validated on its first call per argument metadata); None runs
        :func:`kda.kda_decode`, which validates every call.
      backend: the kda backend name when ``step`` is None (default ``$KDA_BACKEND``, else
        ``auto``); None with a step (its backend was chosen when it was built).

    Returns:
      ``out`` ``[N, dim]`` bf16: the gated-RMSNorm output, what SGLang feeds ``o_proj``.

    Raises:
      kda.KdaArgumentError: a bad argument, named (SGLang's name where the mapping checks it:
        ``conv_states``, ``A_log``, ``b``; else the op's name: ``x`` for ``mixed_qkv``,
        ``conv_state``, ``state`` for ``ssm_states``, ``state_indices`` for
        ``cache_indices``, ``beta`` for ``b``; ``norm_eps``, ``lower_bound`` or ``backend``
        given with a step that holds another value). Nothing has been written.
      kda.KdaBackendError: as :func:`kda.kda_decode`.

    Nothing is copied: ``conv_states.transpose(-1, -2)`` is the op's "SD" conv layout
    ``[slots, 3*dim, 3]`` (strides ``[9*dim, 1, 3*dim]``), ``A_log`` and ``b`` are views.
    """
    import kda
    from kda.errors import KdaArgumentError
    if step is not None:
        for name, given in (("norm_eps", norm_eps), ("lower_bound", lower_bound)):
            if given is AS_STEP:
                continue
            held = getattr(step.cfg, name)
            if not _same_scalar(given, held):
                raise KdaArgumentError(name, f"expected the step's {held!r} (its KdaConfig."
                                             f"{name}) or nothing, got {given!r}")
        if backend is not None:
            raise KdaArgumentError("backend", f"expected None with a step (its backend, "
                                              f"{step.backend_name!r}, was chosen when it was "
                                              f"built), got {backend!r}")
    if cache_indices.dim() != 1:
        raise KdaArgumentError("cache_indices", "expected [N] int32, one token per request "
                               f"(the adapter serves decode, T = 1), got shape "
                               f"{list(cache_indices.shape)}")
    if conv_states.dim() != 3:
        raise KdaArgumentError("conv_states", "expected SGLang's per-layer KDA conv cache "
                               f"[slots, 3, 3*dim], got {list(conv_states.shape)}")
    if A_log.dim() != 1:
        if A_log.dim() != 4 or A_log.shape[0] != 1 or A_log.shape[1] != 1 \
                or A_log.shape[3] != 1:
            raise KdaArgumentError("A_log", f"expected [1, 1, H, 1] or [H], got "
                                   f"{list(A_log.shape)}")
        A_log = A_log.view(-1) if A_log.is_contiguous() else A_log.reshape(-1)
    if b.dim() == 3:
        if b.shape[0] != 1:
            raise KdaArgumentError("b", f"expected [1, N, H] or [N, H], got {list(b.shape)}")
        b = b[0]
    conv_state = conv_states.transpose(-1, -2)
    args = (mixed_qkv, conv_weight, conv_bias, conv_state, f_a, f_b, b, A_log, dt_bias,
            ssm_states, cache_indices, output_gate, norm_weight)
    if step is not None:
        return step(*args, out=out)
    return kda.kda_decode(*args, out=out, norm_eps=1e-5 if norm_eps is AS_STEP else norm_eps,
                          lower_bound=None if lower_bound is AS_STEP else lower_bound,
                          backend=backend)


def _same_scalar(given, held) -> bool:
    """Whether ``given`` is the configuration's ``held`` (None, or the same number)."""
    if given is None or held is None:
        return given is held
    return isinstance(given, numbers.Real) and not isinstance(given, bool) \
        and float(given) == float(held)


def forward_decode(attn_backend, layer, forward_batch, mixed_qkv: torch.Tensor,
                   f_a: torch.Tensor, b: torch.Tensor, *, f_b: torch.Tensor,
                   output_gate: torch.Tensor, norm_weight: torch.Tensor,
                   norm_eps: float = 1e-5, out: Optional[torch.Tensor] = None,
                   kda_backend: Optional[str] = None) -> torch.Tensor:
    """Stand-in for SGLang 0.5.23's ``KDAAttnBackend.forward_decode`` plus the ``f_b`` gate
    projection and ``o_norm`` of ``KimiDeltaAttention.forward``, for one decode batch.

    Same leading parameters as ``KDAAttnBackend.forward_decode(self, layer, forward_batch,
    mixed_qkv, a, b)``, except that the gate arrives as its low-rank factor ``f_a`` (SGLang's
    ``a`` is ``f_b_proj(f_a)``) and the factors and norm inputs follow as keywords.

    Args:
      attn_backend: SGLang's ``KDAAttnBackend`` (``get_attn_backend().linear_attn_backend``);
        read: ``req_to_token_pool.mamba2_layer_cache(layer.layer_id)`` (``.conv[0]``,
        ``.temporal``), ``forward_metadata.mamba_cache_indices``; called afterwards, as
        SGLang's ``forward_decode`` does: ``_track_mamba_state_decode`` (prefix-cache
        snapshots; with ``layer.layer_id`` where it takes one, as 0.5.23's does).
      layer: the ``RadixLinearAttention`` (``KimiDeltaAttention.attn``): ``layer_id``,
        ``conv_weights``, ``bias``, ``A_log``, ``dt_bias``, ``lower_bound``, head counts and
        dims are read; the re-laid-out conv weight and the ``KdaDecode`` steps are cached on
        it as ``layer._kda_sglang``.
      forward_batch: SGLang's ``ForwardBatch`` of a decode batch
        (``logical_forward_mode.is_decode()``); passed on to ``_track_mamba_state_decode``.
      mixed_qkv, f_a, b, f_b, output_gate, norm_weight, norm_eps, out: as
        :func:`decode_step`.
      kda_backend: kda backend name (default ``$KDA_BACKEND``, else ``auto``), used when the
        layer's step for this configuration is first built.

    Returns:
      ``[N, H*128]`` bf16, the normed output, for ``o_proj``.

    Raises:
      kda.KdaArgumentError: the layer or batch is not one the op serves (named: ``layer``
        for head dims / GQA / its gate's lower bound, ``conv_weights`` for conv taps other
        than 4, ``ssm_states`` for a pool neither fp32 nor bf16, ``conv_states`` /
        ``norm_weight`` for their dtypes, ``forward_batch`` for a non-decode batch,
        ``attn_backend`` for a pool with SGLang's ReplaySSM rings), or the op refuses an
        argument. Raised before anything is written, so SGLang's own path can still run the
        batch.
      kda.KdaBackendError: the named backend cannot serve it (at the first step).
    """
    import kda
    from kda.errors import KdaArgumentError

    mode = getattr(forward_batch, "logical_forward_mode", None)
    if mode is None:
        mode = getattr(forward_batch, "forward_mode", None)
    if mode is None:
        raise KdaArgumentError("forward_batch", "expected SGLang's ForwardBatch, with "
                               "logical_forward_mode or forward_mode, got a "
                               f"{type(forward_batch).__name__} with neither")
    if not mode.is_decode():
        raise KdaArgumentError("forward_batch", f"not a decode batch ({mode}); SGLang's "
                               "forward_extend serves it")
    D = kda.HEAD_DIM
    H = layer.num_v_heads
    if (layer.head_q_dim, layer.head_k_dim, layer.head_v_dim) != (D, D, D) \
            or layer.num_q_heads != H or layer.num_k_heads != H:
        raise KdaArgumentError(
            "layer", f"the op serves H q = k = v heads of dim {D}; this layer has "
            f"{layer.num_q_heads}/{layer.num_k_heads}/{layer.num_v_heads} heads of dim "
            f"{layer.head_q_dim}/{layer.head_k_dim}/{layer.head_v_dim}")
    cache = attn_backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    if getattr(cache, "replayssm_d", None) is not None:
        # what SGLang's own forward_decode routes on: its decode then appends to the rings
        raise KdaArgumentError(
            "attn_backend", "expected a pool without ReplaySSM rings, got one with them "
            "(--enable-linear-replayssm or --enable-linear-replayssm-spec): SGLang's decode "
            "then records each step in the replayssm_d / _k / _g rings, folded into the "
            "states only when they wrap, which the op does not do; SGLang's forward_decode "
            "serves it")
    conv_states, ssm_states = cache.conv[0], cache.temporal
    if ssm_states.dtype not in (torch.float32, torch.bfloat16):
        raise KdaArgumentError("ssm_states", f"the op keeps fp32 or bf16 states; SGLang's pool "
                               f"is {ssm_states.dtype} (--mamba-ssm-dtype)")
    cache_indices = attn_backend.forward_metadata.mamba_cache_indices
    track = getattr(attn_backend, "_track_mamba_state_decode", None)
    if track is None:
        raise KdaArgumentError("attn_backend", "expected SGLang's KDAAttnBackend, with "
                               "_track_mamba_state_decode (the prefix cache's snapshots), got "
                               f"a {type(attn_backend).__name__} without it")
    with_layer_id = _takes_layer_id(track)      # (known before anything is written)

    state = _layer_state(layer)
    try:
        cfg = kda.KdaConfig(
            num_heads=H, T=1, window=conv_states.shape[-2], conv_layout="SD",
            lower_bound=layer.lower_bound, has_conv_bias=layer.bias is not None,
            norm_eps=norm_eps, conv_state_dtype=conv_states.dtype,
            conv_weight_dtype=torch.float32, norm_weight_dtype=norm_weight.dtype,
            state_dtype=ssm_states.dtype)
    except KdaArgumentError as e:       # named as SGLang's argument that sets the field
        raise KdaArgumentError(CONFIG_SOURCES.get(e.arg, e.arg),
                               f"{e.message} (KdaConfig.{e.arg})") from None
    key = (cfg, mixed_qkv.device, kda_backend)
    step = state["steps"].get(key)
    if step is None:
        step = kda.KdaDecode(cfg, device=mixed_qkv.device, backend=kda_backend)
        state["steps"][key] = step
    out = decode_step(mixed_qkv, f_a, b, conv_weight=_conv_weight_of(layer, state),
                      conv_bias=layer.bias, A_log=layer.A_log, dt_bias=layer.dt_bias,
                      conv_states=conv_states, ssm_states=ssm_states,
                      cache_indices=cache_indices, f_b=f_b, output_gate=output_gate,
                      norm_weight=norm_weight, out=out, step=step)
    track(forward_batch, conv_states, ssm_states, cache_indices,
          *((layer.layer_id,) if with_layer_id else ()))
    return out


_track_takes_layer_id: dict = {}


def _takes_layer_id(track) -> bool:
    """Whether SGLang's ``_track_mamba_state_decode`` takes the layer id: 0.5.23's takes
    ``layer_id`` after ``cache_indices``, other versions of the file the first four only
    (read once per function)."""
    f = getattr(track, "__func__", track)
    got = _track_takes_layer_id.get(f)
    if got is None:
        try:
            params = list(inspect.signature(track).parameters.values())
        except (TypeError, ValueError):     # no signature to read: pass it, as 0.5.23 takes
            got = True
        else:
            got = len(params) >= 5 or any(p.kind == p.VAR_POSITIONAL or p.name == "layer_id"
                                          for p in params)
        with _lock:
            _track_takes_layer_id[f] = got
    return got


def reload_weights(layer) -> None:
    """Re-lay out ``layer.conv_weights`` now (after rewriting it in place)."""
    state = _layer_state(layer)
    with _lock:
        state["conv_weight"] = None
    _conv_weight_of(layer, state)


def _layer_state(layer) -> dict:
    state = getattr(layer, "_kda_sglang", None)
    if state is None:
        with _lock:
            state = getattr(layer, "_kda_sglang", None)
            if state is None:
                state = {"conv_weight": None, "conv_weight_of": None, "steps": {}}
                layer._kda_sglang = state
    return state


def _conv_weight_of(layer, state: dict) -> torch.Tensor:
    w = layer.conv_weights
    # Identity, not value: refresh_conv_weights installs a new tensor; an in-place rewrite
    # needs reload_weights (reading values would synchronize).
    ident = (id(w), w.data_ptr(), w.device)
    if state["conv_weight"] is None or state["conv_weight_of"] != ident:
        with _lock:
            state["conv_weight"] = conv_weight(w)
            state["conv_weight_of"] = ident
    return state["conv_weight"]
