"""The PyTorch reference of the fused KDA decode step: it defines the project's numerics.

Every formula here is section 2 of the contract (``docs/contract.md``); the bf16 rounding
points are those of its section 3 (conv output y, raw gate rg, recurrence output o, out;
and with a bf16 state pool each state written: the page is widened to fp32 when loaded, the
recurrence runs in fp32, and a state is rounded to bf16 (nearest even) only where it is
stored, so a T > 1 step carries the unrounded fp32 state from one token to the next).
It is vectorized over requests and heads (no Python loop over items; one loop over the T
tokens) and never reads device-side values on the host, so it also runs on a GPU and under
CUDA-graph capture.

Two precisions:

* ``"bf16"`` (default): the contract exactly. FP32 everywhere except the four bf16 rounding
  points. The conv taps are fused multiply-adds: the float64 product of two fp32 values is
  exact, the float64 sum with the accumulator keeps its exact rounding error (TwoSum), and
  the exact result is rounded once to fp32 (:func:`_to_f32_once`: round to odd in float64,
  then to nearest in fp32, which equals one correct rounding since 53 >= 24 + 2 bits;
  Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
  rounding to odd", IEEE TC 2008). The gate projection follows ``gate_mode``'s accumulation
  order: each 16-wide step's products (bf16 x bf16, exact in float64) are summed with
  compensation (Neumaier: exact error of every addition, the errors summed in float64) and
  rounded once to fp32 the same way, as a tensor-core k16 step does, and the steps are
  chained in fp32 in the mode's order. (The compensated sum is exact unless the 15 addition
  errors themselves span more than ~37 binary orders of magnitude; a plain float64 sum then
  fp32 rounding rounded twice and was off by one ulp on crafted inputs.)
* ``"float64"``: the same math in float64 with no bf16 rounding anywhere, for error
  analysis (how far is a backend, and the reference itself, from the exact function).

Entry points: :func:`reference_step` (a backend step function: writes in place) and
:func:`reference_compute` (functional: returns every result without touching the inputs).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from kda.config import GATE_RANK, HEAD_DIM, L2_NORM_EPS, KdaArgs, KdaConfig

D = HEAD_DIM


@dataclasses.dataclass
class ReferenceResult:
    """Everything one step produces, before it is written to the caller's buffers.

    Shapes (R requests, T tokens, H heads): ``out`` [R*T, H*D]; ``live`` [R] bool;
    ``new_window`` [R, 3*dim, T+2] (positions 0..T+1 of the rewritten window, in the conv
    cache's dtype: copies of its history and of x);
    ``states`` [R, T, H, D, D] (state after each token, fp32: before the bf16 rounding of a
    bf16 pool's store, which :func:`reference_step` applies); ``u`` [R, H, T, D];
    ``k_raw`` [R, H, T, D] (conv output of k, before the L2 norm); ``rg`` [R, H, T, D] (raw
    gate before dt_bias); ``src``, ``conv_slot`` [R] int64. Dtypes are float32 (float64 in
    float64 mode), ``out`` is bf16 in bf16 mode.
    """

    out: torch.Tensor
    live: torch.Tensor
    src: torch.Tensor
    conv_slot: torch.Tensor
    new_window: torch.Tensor
    states: torch.Tensor
    u: torch.Tensor
    k_raw: torch.Tensor
    rg: torch.Tensor


def _two_sum(a: torch.Tensor, b: torch.Tensor):
    """(s, err) with s = fl(a + b) and s + err == a + b exactly (float64; Knuth's TwoSum)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _to_f32_once(s: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """fp32 round-to-nearest-even of the exact value ``s + err`` (float64, ``s = fl(s + err)``).

    ``s`` is first replaced by the exact value rounded to odd in float64 (the neighbour with an
    odd last bit when ``err`` is nonzero), then rounded to fp32: one correct rounding (see the
    module docstring for the source)."""
    odd = (s.contiguous().view(torch.int64) & 1) == 1
    away = torch.nextafter(s, torch.where(err > 0, torch.full_like(s, float("inf")),
                                          torch.full_like(s, float("-inf"))))
    return torch.where((err != 0) & ~odd, away, s).float()


def _k16_steps(fb: torch.Tensor, fa: torch.Tensor) -> torch.Tensor:
    """The 8 k16 steps of the gate projection, each summed with compensation and rounded once
    to fp32. fb [1, H, 1, D, 8, 16], fa [R, 1, T, 1, 8, 16] (float64, bf16 values) ->
    [R, H, T, D, 8] fp32. On the CPU the requests go in chunks of ~2 MB per temporary (the
    ~50 passes over them then stay in cache); the chunking does not change any value."""
    R = fa.shape[0]
    per = fb.shape[1] * fa.shape[2] * fb.shape[3] * 8
    step = R if fa.device.type != "cpu" else max(1, (1 << 18) // per)
    outs = []
    for r0 in range(0, R, step):
        a_ = fa[r0:r0 + step]
        s = fb[..., 0] * a_[..., 0]
        comp = torch.zeros_like(s)
        for j in range(1, 16):
            s, e = _two_sum(s, fb[..., j] * a_[..., j])
            comp = comp + e
        outs.append(_to_f32_once(*_two_sum(s, comp)))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def liveness(state_indices: torch.Tensor, num_accepted: Optional[torch.Tensor], num_slots: int):
    """Which slots a request reads, by the contract's liveness rule (section 6).

    Args:
      state_indices: int [R] (T = 1) or [R, T] (verify) slot ids; any integer dtype.
      num_accepted: int [R] accepted counts, required with a 2-D ``state_indices`` (clamped
        to 1..T here), ignored (may be None) with a 1-D one.
      num_slots: the pool's slot count (ids outside 1..num_slots-1 are dead).

    Returns:
      (src, conv_slot, off, live): int64 [R] source state slot, conv window slot, window
      offset a-1 (0 for T = 1), and bool [R] ``0 < src < num_slots and 0 < conv_slot <
      num_slots``. Device-side only (nothing is read on the host).
    """
    idx = state_indices.long()
    if idx.dim() == 1:
        src = idx
        conv_slot = idx
        off = torch.zeros_like(idx)
    else:
        T = idx.shape[1]
        a = num_accepted.long().clamp(1, T)
        src = idx.gather(1, (a - 1)[:, None])[:, 0]
        conv_slot = idx[:, 0]
        off = a - 1
    live = (src > 0) & (src < num_slots) & (conv_slot > 0) & (conv_slot < num_slots)
    return src, conv_slot, off, live


@torch.no_grad()
def reference_compute(cfg: KdaConfig, args: KdaArgs, precision: str = "bf16") -> ReferenceResult:
    """Compute one decode step functionally (inputs untouched).

    Args:
      cfg: the static configuration (validated).
      args: the step's tensors (validated; ``out``/records are not read).
      precision: "bf16" (the contract's numerics) or "float64" (no rounding, float64 math).

    Returns:
      A :class:`ReferenceResult`.

    Raises:
      ValueError: on an unknown ``precision``.
    """
    if precision not in ("bf16", "float64"):
        raise ValueError(f"precision: expected 'bf16' or 'float64', got {precision!r}")
    exact = precision == "float64"
    ft = torch.float64 if exact else torch.float32

    def rnd(t: torch.Tensor) -> torch.Tensor:
        """A bf16 rounding point (identity in float64 mode)."""
        return t if exact else t.to(torch.bfloat16).to(ft)

    H, T, dim = cfg.num_heads, cfg.T, cfg.dim
    R = args.state_indices.shape[0]
    num_slots = args.state.shape[0]
    dev = args.x.device
    src, conv_slot, off, live = liveness(args.state_indices, args.num_accepted_tokens, num_slots)
    # Dead requests read slot 0 (any valid slot would do) and their results are discarded.
    src_c = torch.where(live, src, torch.zeros_like(src))
    cs_c = torch.where(live, conv_slot, torch.zeros_like(conv_slot))

    # ---- conv + SiLU -------------------------------------------------------------------
    win = args.conv_state[cs_c]                                         # [R, 3dim, L]
    pos = (off[:, None] + torch.arange(3, device=dev)[None, :])         # [R, 3]
    # (gathered as raw bits: torch's CPU gather of bf16 rewrites NaN payloads)
    bits = {2: torch.int16, 4: torch.int32}[win.element_size()]
    hist = win.view(bits).gather(2, pos[:, None, :].expand(R, 3 * dim, 3)).view(win.dtype)
    x = args.x.view(R, T, 3 * dim)
    s = torch.cat([hist.to(ft), x.to(ft).transpose(1, 2)], dim=2)      # [R, 3dim, T+3]
    w = args.conv_weight.to(ft).permute(0, 2, 1).reshape(3 * dim, 4)   # [3dim, 4] (tap e)
    if args.conv_bias is not None:
        acc0 = args.conv_bias.to(ft)[None, :, None].expand(R, 3 * dim, T)
    else:
        acc0 = torch.zeros(R, 3 * dim, T, dtype=ft, device=dev)
    acc = acc0
    for e in range(4):
        if exact:
            acc = acc + s[:, :, e:e + T] * w[None, :, e:e + 1]
        else:  # fma(s, w, acc) in fp32: exact product, exact sum (value + error), one rounding
            prod = s[:, :, e:e + T].double() * w[None, :, e:e + 1].double()
            acc = _to_f32_once(*_two_sum(acc.double(), prod))
    y = rnd(F.silu(acc))                                                 # [R, 3dim, T]
    # the window holds copies: built in the cache's dtype, so even a NaN keeps its bits
    new_window = torch.cat([hist[:, :, 1:3], x.transpose(1, 2).to(hist.dtype)], dim=2)

    y = y.view(R, 3, H, D, T).permute(0, 1, 2, 4, 3)                   # [R, 3, H, T, D]
    q, k, v = y[:, 0], y[:, 1], y[:, 2]                                  # [R, H, T, D]
    q_hat = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_NORM_EPS) * cfg.scale
    k_hat = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_NORM_EPS)

    # ---- gate ----------------------------------------------------------------------------
    f_a = args.f_a.view(R, T, GATE_RANK).double()
    f_b = args.f_b.view(H, D, GATE_RANK).double()
    if exact:
        rg = torch.einsum("hkj,rtj->rhtk", f_b, f_a)
    else:
        # 16-wide partial sums, each rounded once to fp32 (a tensor-core k16 step)
        part = _k16_steps(f_b.view(1, H, 1, D, 8, 16), f_a.view(R, 1, T, 1, 8, 16))  # [R,H,T,D,8]
        if cfg.gate_mode == 0:
            rg = part[..., 0]
            for c in range(1, 8):
                rg = rg + part[..., c]
        else:
            chains = [part[..., 2 * i] + part[..., 2 * i + 1] for i in range(4)]
            rg = ((chains[0] + chains[1]) + chains[2]) + chains[3]
    rg = rnd(rg.to(ft))                                                  # [R, H, T, D]
    g = rg + args.dt_bias.to(ft).view(1, H, 1, D)
    A = torch.exp(args.A_log.to(ft)).view(1, H, 1, 1)
    if cfg.lower_bound is None:
        gk = -A * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))
    else:
        gk = cfg.lower_bound * torch.sigmoid(A * g)
    alpha = torch.exp(gk)                                                # [R, H, T, D]
    beta = args.beta.view(R, T, H).to(ft).permute(0, 2, 1)              # [R, H, T]
    if not cfg.beta_activated:      # raw logits (else the engine's sigmoid, used as it is)
        beta = torch.sigmoid(beta)

    # ---- recurrence ------------------------------------------------------------------------
    S = args.state[src_c].to(ft)             # [R, H, D(v), D(k)]: a copy, a bf16 page widened
    o = torch.empty(R, H, T, D, dtype=ft, device=dev)
    u_all = torch.empty(R, H, T, D, dtype=ft, device=dev)
    states = torch.empty(R, T, H, D, D, dtype=ft, device=dev) if T > 1 else None
    for t in range(T):
        S.mul_(alpha[:, :, t, None, :])                                  # decay key columns
        kt = k_hat[:, :, t]
        Sk = torch.matmul(S, kt[..., None])[..., 0]
        u = beta[:, :, t, None] * (v[:, :, t] - Sk)
        S.addcmul_(u[..., None], kt[:, :, None, :])                      # rank-1 update
        o[:, :, t] = torch.matmul(S, q_hat[:, :, t, :, None])[..., 0]
        u_all[:, :, t] = u
        if states is not None:
            states[:, t] = S
    if states is None:
        states = S.unsqueeze(1)

    # ---- gated RMSNorm -----------------------------------------------------------------------
    ob = rnd(o)
    gate = torch.sigmoid(args.output_gate.view(R, T, H, D).permute(0, 2, 1, 3).to(ft))
    normed = ob * torch.rsqrt((ob * ob).mean(-1, keepdim=True) + cfg.norm_eps)
    res = normed * args.norm_weight.to(ft) * gate                        # [R, H, T, D]
    res = torch.where(live[:, None, None, None], res, torch.zeros_like(res))
    out = res.permute(0, 2, 1, 3).reshape(R * T, dim)
    out = out if exact else out.to(torch.bfloat16)
    return ReferenceResult(out=out, live=live, src=src, conv_slot=conv_slot,
                           new_window=new_window, states=states, u=u_all, k_raw=k, rg=rg)


def _masked_scatter_(buf: torch.Tensor, index: torch.Tensor, valid: torch.Tensor,
                     values: torch.Tensor) -> None:
    """buf[index[i]] = values[i] where valid[i]; nothing else in ``buf`` changes.

    On the CPU the valid rows are selected directly. On a GPU there is no host sync: invalid
    rows are redirected to slot 0 and rewrite slot 0 with its own current contents, which
    leaves every bit of the buffer as it was (so the step can be captured in a CUDA graph).
    """
    values = values.to(buf.dtype)
    if buf.device.type == "cpu":
        if not bool(valid.all()):
            sel = valid.nonzero()[:, 0]
            index, values = index[sel], values[sel]
        buf.index_put_((index,), values)
        return
    index = torch.where(valid, index, torch.zeros_like(index))
    keep = buf[0:1].expand_as(values)
    shape = (-1,) + (1,) * (values.dim() - 1)
    buf.index_put_((index,), torch.where(valid.view(shape), values, keep))


@torch.no_grad()
def reference_step(cfg: KdaConfig, args: KdaArgs) -> None:
    """Run one decode step with the reference and write the results in place.

    Writes ``args.out`` (all rows), and for live items: the conv window positions 0..T+1 of
    ``conv_state[conv_slot]``; the state (T=1: ``state[src]``; T>1: ``state[state_indices[r, t]]``
    after token t, skipped where that index is <= 0 or >= slots; record mode: nothing) and, in
    record mode, ``v_record`` / ``kg_record`` rows ``conv_slot``. Dead items write zeros to
    their output rows and nothing else. A bf16 state pool receives each written state rounded
    once to bf16 (round to nearest even) from the fp32 recurrence; ``v_record`` (u) stays fp32.

    Args:
      cfg: static configuration. args: validated tensors (see :class:`kda.config.KdaArgs`).

    Returns:
      None (everything is written in place).

    Raises:
      Nothing of its own: validation is the caller's (:func:`kda.validate.validate_args`);
      unvalidated arguments fail with torch's indexing / shape errors.
    """
    res = reference_compute(cfg, args, "bf16")
    T = cfg.T
    num_slots = args.state.shape[0]
    args.out.copy_(res.out)
    live = res.live

    # conv window: positions 0..T+1 of the conv slot, via a [slots, L, 3dim] or [slots, 3dim, L] view
    cs = args.conv_state
    win_new = res.new_window.to(cs.dtype)                                # [R, 3dim, T+2]
    for j in range(T + 2):
        _masked_scatter_(cs[:, :, j], res.conv_slot, live, win_new[:, :, j])

    if cfg.record:
        vr, kr = args.v_record, args.kg_record
        _masked_scatter_(vr, res.conv_slot, live, res.u)
        kg = torch.cat([res.k_raw, res.rg], dim=-1)                      # [R, H, T, 2D]
        _masked_scatter_(kr, res.conv_slot, live, kg)
        return
    # the state's one rounding point: fp32 -> the pool's dtype (torch's cast to bf16 rounds to
    # nearest even; the identity for an fp32 pool)
    states = res.states.to(args.state.dtype)
    if args.state_indices.dim() == 1:
        _masked_scatter_(args.state, res.src, live, states[:, 0])
        return
    idx = args.state_indices.long()
    for t in range(T):
        tgt = idx[:, t]
        valid = live & (tgt > 0) & (tgt < num_slots)
        _masked_scatter_(args.state, tgt, valid, states[:, t])
