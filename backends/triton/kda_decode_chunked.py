"""The chunked kernel of the fused KDA decode step (one Triton launch), and its host wrapper.

Contract: ``docs/contract.md`` (section 2 formulas, section 3 rounding points, section 6
project decisions: liveness, per-token state writes for T>1, record mode, window rewrite,
64-bit slot offsets). The device helpers (bf16 rounding, fma, the gate projection, the decay,
the delta rule, the gated RMSNorm epilogue, the window rewrite) are those of
:mod:`kda.backends.triton.common`.

Work decomposition
------------------
The delta-rule update is independent per value row: row v of S evolves with k, q, the decay
vector, beta and v[v] only; just the gated RMSNorm at the end needs all 128 values of o. So
one program (``num_warps`` warps) per item ``(r, h) = divmod(pid, H)`` walks the page in
chunks of ``BV`` value rows, holding only one [BV, 128] fp32 chunk (32 floats per thread with
BV=32 and 4 warps or BV=16 and 2 warps, 16 with BV=16 and 4 warps) instead of the page:

1. slots and liveness (as :mod:`kda.backends.triton.kda_decode`): T=1 ``src = conv_slot =
   state_indices[r]``; T>1 ``a = clamp(nacc[r], 1, T)``, ``src = state_indices[r, a-1]``,
   ``conv_slot = state_indices[r, 0]``, ``off = a-1``; live iff ``0 < src < slots`` and
   ``0 < conv_slot < slots``; slot offsets in int64.
2. per item, before the row loop: conv + SiLU of the q, k and v channels of all T tokens as
   [TP, 128] tiles (TP = T padded to a power of two), y rounded to bf16, the L2 norms of q
   and k (eps 1e-6 on the sum of squares), the gate projection (``_gate_projection``: bf16
   operands on tensor cores, fp32 accumulation in gate_mode's order, rounded once), the
   decay of all T tokens (``_decay``), beta of all T tokens (a [TP] vector), the T write
   slots (a [TP] vector); record mode: the kg_record rows.
   ``q̂_t, k̂_t, α_t`` (fp32, along the key dimension) and ``y_v,t`` (along the value
   dimension) go to a per-item scratch (``scr``, [items, T, 4, 128] fp32) and a CTA barrier
   makes them visible to every thread. Storing the decay cuts the MMA layout of the gate's
   ``tl.dot`` off from the state chunk (Triton would otherwise convert the chunk into the MMA
   layout). T=1: q̂, k̂, α are read back once, before the loop, and stay in registers (4
   floats each per thread in the chunk's column layout). T>1: they are re-read per chunk
   and token (cache hits, 512 bytes each, the same addresses for all warps), as are the
   chunk's rows of ``y_v,t`` (BV values). The v conv runs here rather than per chunk, which
   keeps the window reads and the conv's fma chains out of the loop.
3. the row loop ``for c in tl.range(0, 128 // BV, num_stages=NUM_STAGES)``: load the
   [BV, 128] chunk of the source page (16-byte loads along the key dimension,
   ``evict_first``; its address depends only on ``src`` and ``c``, known before the loop,
   so the software pipeliner prefetches the next chunks with async copies into a
   shared-memory ring while chunk c computes); then, for each token t (unrolled: Triton does
   not pipeline a loop that contains another loop): the recurrence in the reference's order
   (``S *= α_t``; ``u = β_t (v - S k̂_t)``; ``S += u k̂_tᵀ``; ``o = S q̂_t``), the chunk's
   state write, streaming (``.cs``) (T=1: to ``src``; T>1: to ``state_indices[r, t]`` when
   that slot is valid, in token order; record mode: ``v_record`` rows instead), and
   ``bf16(o)`` of the chunk's rows parked in the item's out row t (overwritten by the result
   in step 4).
4. after the loop: a CTA barrier, the gated RMSNorm of all T rows as one [TP, 128] tile
   (``_finish_rows``: it reads the parked o rows, then a barrier, then writes out), and the
   conv window rewrite (``_write_window``: reads w1, w2, a CTA barrier, then the writes; every
   read of the old window by any thread of the program -- the conv of step 2 -- precedes
   its writes).

Dead items (null / out-of-range slots): every load and store is masked by ``live``; the out
rows get exact zeros (``_finish_rows``), nothing else is written (the scratch is the step
function's own buffer, not touched either).

Aliasing: a token's write slot may be the source slot (T>1), and the window read and write
ranges overlap. Chunks cover disjoint rows and each chunk is loaded completely (the same
thread writes an element that it read; with async copies, the wait for chunk c precedes its
consumers) before any of its rows is written; the pipeliner's prefetch of chunk c+1 (or c+2
with three stages) reads rows that no earlier iteration wrote, so it always sees the source
state. Two tokens naming the same write slot: the later token's store is issued later by the
same thread, so its state lands. The window: see step 4.

The scratch is one buffer per device and CUDA stream (:class:`kda.backend.StreamBuffers`),
shared by every chunked step function (every layer of a model), since steps on one stream run
one after the other; steps launched on two streams at once use two buffers. It grows when a
larger ``R * H * T`` than ever before arrives on its stream (during CUDA-graph capture too:
the new buffer then comes from the graph's pool; it needs no initial value) and the outgrown
buffers are kept alive, so graphs captured earlier never replay into freed memory. Its size
is ``R * H * T * 2 KiB``, written and re-read by the same program (mostly L2 traffic).

Builds and registers (offline sm_90a compile at H=32, Triton 3.6,
:func:`kda.backends.triton.offline.compile_offline`; registers, then bytes of stack at
T = 1 / 2 / 5 / 8): :data:`CHUNKED` (4 warps, BV=32, 2 stages, <= 88 registers: 5 programs
per SM) 88, 0 / 8 / 144 / 208 (ptxas hoists the unrolled tokens' loads); :data:`CHUNKED_BV16`
(4 warps, BV=16, 2 stages, <= 88) 88, 0 / 0 / 24 / 16; :data:`CHUNKED_W2` and
:data:`CHUNKED_W2_S3` (2 warps, BV=16, 2 or 3 stages, <= 128: 8 programs per SM) 128,
0 / 8 / 40-48 / 32-96, and 88-104 bytes at T=1 with gate_mode 1 and a conv bias. The TTGIR
shows the state chunk loaded by ``ttg.async_copy_global_to_local`` into a shared-memory ring,
together with the loop's scratch loads.

Numerics: the contract's rounding points (y, rg, o, out in bf16; everything else fp32), the
same formulas and operation order as the reference and the per-item kernel (see
:mod:`kda.backends.triton.common` for the interpreter's emulations). The interpreter's
reductions are numpy's, per row of 128 values whatever the tile, so under the interpreter
every build of both kernels gives the same bits (checked by the tests).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from kda.backend import StreamBuffers
from kda.backends.triton.common import (
    D, _bf16_rne, _bf16_round, _decay, _delta_rule, _finish_rows, _fma, _gate_projection,
    _load_f32, _rowoff, _sigmoid, _write_window, config_constants, config_scalars, interpreter_enabled,
    interpreter_quiet, kernel_operands, rows16)
from kda.config import KdaArgs, KdaConfig

#: fp32 values of scratch per item and token: q̂, k̂, α, y_v.
SCR_PER_TOKEN = 4 * D
#: The smallest scratch buffer made (elements): 64 item-tokens, 128 KiB.
SCRATCH_MIN_ELEMS = 64 * SCR_PER_TOKEN

#: device -> the chunked kernels' scratch (a :class:`kda.backend.StreamBuffers`: one buffer
#: per stream, shared by all step functions of the device; see the module docstring).
_SCRATCH: "dict[torch.device, StreamBuffers]" = {}


# --------------------------------------------------------------------------------------------
# the kernel
# --------------------------------------------------------------------------------------------

@triton.jit
def _conv_silu(c_ptr, xc_ptr, stride_x, n0, off, w_ptr, b_ptr, t, mask,
               DIM: tl.constexpr, STRIDE_L: tl.constexpr, HAS_BIAS: tl.constexpr,
               INTERP: tl.constexpr):
    """``y = bf16(silu(conv))`` of token(s) ``t`` for channels addressed by ``c_ptr`` (window
    position 0 of each channel), ``xc_ptr`` (x row 0 + channel), ``w_ptr`` (tap 0 weight),
    ``b_ptr`` (bias): taps over the sequence [w0, w1, w2, x_0, ..]; element p = t + e is window
    position off + p (p < 3) or token row p - 3. ``t``, ``mask`` and the pointers broadcast
    together; ``mask`` has the result's shape, or one that broadcasts to it with ``t``."""
    # (per-channel pointers and a per-token mask are broadcast together explicitly: Triton
    # 3.4's load does not broadcast the pointer to the mask's shape)
    if HAS_BIAS:
        bp, bm = tl.broadcast(b_ptr, mask)
        acc = _load_f32(bp, bm)
    else:
        acc = tl.zeros(mask.shape, dtype=tl.float32)
    for e in tl.static_range(4):
        p = t + e
        s_w = _load_f32(c_ptr + (off + p) * STRIDE_L, mask & (p < 3))
        s_x = _load_f32(xc_ptr + (n0 + p - 3) * stride_x, mask & (p >= 3))
        s_e = tl.where(p < 3, s_w, s_x)
        wp, wm = tl.broadcast(w_ptr + e * DIM, mask)
        acc = _fma(s_e, _load_f32(wp, wm), acc, INTERP)
    return _bf16_round(acc / (1.0 + tl.exp(-acc)), INTERP)


@triton.jit
def _qka(scr_item, t, dd):
    """q̂_t, k̂_t, α_t ([128] fp32 each) from the item's scratch."""
    return (tl.load(scr_item + t * 512 + dd), tl.load(scr_item + t * 512 + 128 + dd),
            tl.load(scr_item + t * 512 + 256 + dd))


@triton.jit(do_not_specialize=["num_slots"])
def _kda_chunked_kernel(
        x_ptr, stride_x, cw_ptr, cb_ptr, cs_ptr, stride_cs,
        fa_ptr, stride_fa, fb_ptr, beta_ptr, stride_beta, alog_ptr, dtb_ptr,
        st_ptr, stride_st, si_ptr, nacc_ptr, og_ptr, stride_og, nw_ptr,
        out_ptr, stride_out, vrec_ptr, kgrec_ptr, scr_ptr,
        num_slots, scale, norm_eps, lower_bound,
        H: tl.constexpr, T: tl.constexpr, L: tl.constexpr, SD: tl.constexpr,
        HAS_BIAS: tl.constexpr, BOUNDED: tl.constexpr, GATE_MODE: tl.constexpr,
        RECORD: tl.constexpr, INTERP: tl.constexpr, BV: tl.constexpr,
        NUM_STAGES: tl.constexpr, BETA_ACT: tl.constexpr, ROWS16: tl.constexpr,
        STATE_BF16: tl.constexpr):
    """The fused KDA decode step, one program per item, value rows in chunks of ``BV`` (see
    the module docstring). Grid: ``R * H`` programs. Pointers: the :class:`KdaArgs` tensors
    (unused optional ones point at any tensor and are never dereferenced) and the scratch;
    strides in elements."""
    DIM: tl.constexpr = H * 128
    TP: tl.constexpr = 1 if T == 1 else (2 if T == 2 else (4 if T <= 4 else 8))
    NCHUNK: tl.constexpr = 128 // BV
    if SD:
        STRIDE_C: tl.constexpr = 1
        STRIDE_L: tl.constexpr = 3 * H * 128
    else:
        STRIDE_C: tl.constexpr = L
        STRIDE_L: tl.constexpr = 1
    item = tl.program_id(0)
    r = item // H
    h = item % H
    r64 = r.to(tl.int64)
    item64 = item.to(tl.int64)

    # ---- 1. slots and liveness ----------------------------------------------------------
    if T == 1:
        src = tl.load(si_ptr + r64)
        cslot = src
        off = 0
    else:
        a = tl.load(nacc_ptr + r64)
        a = tl.minimum(tl.maximum(a, 1), T)
        src = tl.load(si_ptr + r64 * T + (a - 1))
        cslot = tl.load(si_ptr + r64 * T)
        off = a - 1
    live = (src > 0) & (src < num_slots) & (cslot > 0) & (cslot < num_slots)
    src64 = tl.where(live, src, 0).to(tl.int64)
    cs64 = tl.where(live, cslot, 0).to(tl.int64)
    n0 = r64 * T                                                    # first token row

    dd = tl.arange(0, 128)                                          # q/k channel, key column
    tt = tl.arange(0, TP)
    tmask = tt < T
    cs_base = cs_ptr + tl.multiple_of(cs64 * stride_cs, 8)
    scr_item = scr_ptr + item64 * (T * 512)

    # ---- 2. per item: q, k conv and norms, gate, decay, beta, write slots ------------------
    t2 = tt[:, None]
    m2 = tmask[:, None] & live
    chq = h * 128 + dd[None, :]                                     # q channels of head h
    chk = DIM + chq                                                 # k channels
    yq = _conv_silu(cs_base + chq * STRIDE_C, x_ptr + chq, stride_x, n0, off,
                    cw_ptr + h * 128 + dd[None, :], cb_ptr + chq, t2, m2,
                    DIM, STRIDE_L, HAS_BIAS, INTERP)                # [TP, 128]
    yk = _conv_silu(cs_base + chk * STRIDE_C, x_ptr + chk, stride_x, n0, off,
                    cw_ptr + 4 * DIM + h * 128 + dd[None, :], cb_ptr + chk, t2, m2,
                    DIM, STRIDE_L, HAS_BIAS, INTERP)
    qh = yq * tl.rsqrt(tl.sum(yq * yq, axis=1) + 1e-6)[:, None] * scale
    kh = yk * tl.rsqrt(tl.sum(yk * yk, axis=1) + 1e-6)[:, None]
    tl.store(scr_item + t2 * 512 + dd[None, :], qh, mask=m2)
    tl.store(scr_item + t2 * 512 + 128 + dd[None, :], kh, mask=m2)
    chv = 2 * DIM + chq                                             # v channels
    yv = _conv_silu(cs_base + chv * STRIDE_C, x_ptr + chv, stride_x, n0, off,
                    cw_ptr + 8 * DIM + h * 128 + dd[None, :], cb_ptr + chv, t2, m2,
                    DIM, STRIDE_L, HAS_BIAS, INTERP)
    tl.store(scr_item + t2 * 512 + 384 + dd[None, :], yv, mask=m2)

    G = _gate_projection(fa_ptr, stride_fa, n0, fb_ptr, h, live, scale * 0.0, T, GATE_MODE,
                         INTERP, ROWS16)                            # [16, 128] raw gate rg
    A = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    alpha = _decay(G + _load_f32(dtb_ptr + h * 128 + dd, True)[None, :], A, lower_bound,
                   BOUNDED)
    g16 = tl.arange(0, 16)[:, None]
    gmask = (g16 < T) & live
    tl.store(scr_item + g16 * 512 + 256 + dd[None, :], alpha, mask=gmask)
    if RECORD:
        # kg_record[conv_slot, h, t] = [bf16 k before the L2 norm | rg before dt_bias]
        kg_rows = kgrec_ptr + (cs64 * (H * T) + h * T) * 256
        tl.store(kg_rows + t2 * 256 + dd[None, :], yk.to(tl.bfloat16), mask=m2)
        tl.store(kg_rows + g16 * 256 + 128 + dd[None, :], G.to(tl.bfloat16), mask=gmask)

    bvec = tl.load(beta_ptr + (n0 + tt) * stride_beta + h, mask=tmask & live,
                   other=0.0).to(tl.float32)                        # [TP] beta per token
    if not BETA_ACT:                         # raw logits (activated: fp32, used as it is)
        bvec = _sigmoid(bvec)
    if T > 1:
        tgt = tl.load(si_ptr + n0 + tt, mask=tmask & live, other=0)
        tgt_ok = live & (tgt > 0) & (tgt < num_slots)
        tgt64 = tl.where(tgt_ok, tgt, 0).to(tl.int64)               # [TP]; 0 = no write
    tl.debug_barrier()                       # scratch rows visible to every thread
    # T=1: q̂, k̂, α read back once here and kept in registers for the whole row loop (T>1:
    # re-read per chunk and token: the loop's stores may alias the scratch as far as the
    # compiler knows, so it cannot hoist those loads)
    if T == 1:
        q_0, k_0, a_0 = _qka(scr_item, 0, dd)

    # ---- 3. the row loop -------------------------------------------------------------------
    st_page = st_ptr + tl.multiple_of(src64 * stride_st, 4) + h * (128 * 128)
    rows = tl.arange(0, BV)
    for c in tl.range(0, NCHUNK, num_stages=NUM_STAGES):
        vv = c * BV + rows                                          # this chunk's value rows
        st_off = vv[:, None] * 128 + dd[None, :]
        S = tl.load(st_page + st_off, mask=live, other=0.0, eviction_policy="evict_first")
        if STATE_BF16:
            S = S.to(tl.float32)                               # widened once, fp32 from here
        for t in tl.static_range(T):
            v_t = tl.load(scr_item + t * 512 + 384 + vv)            # the chunk's rows of y_v
            if T == 1:                                # read back before the loop
                q_t, k_t, a_t = q_0, k_0, a_0
            else:
                q_t, k_t, a_t = _qka(scr_item, t, dd)
            if T == 1:
                b_t = tl.sum(bvec, axis=0)
            else:
                b_t = tl.sum(tl.where(tt == t, bvec, 0.0), axis=0)

            S, u, o = _delta_rule(S, a_t, k_t, q_t, b_t, v_t)       # the chunk's rows

            if RECORD:
                rec = cs64 * (H * T) + h * T + t                 # record row (conv_slot, h, t)
                tl.store(vrec_ptr + rec * 128 + vv, u, mask=live)
            else:
                if T == 1:
                    dst_slot = src64
                    valid = live
                else:
                    dst_slot = tl.sum(tl.where(tt == t, tgt64, 0), axis=0)
                    valid = dst_slot > 0
                dst = st_ptr + tl.multiple_of(dst_slot * stride_st, 4) + h * (128 * 128) + st_off
                if STATE_BF16:                  # the state's one rounding (fp32 S carries on)
                    tl.store(dst, _bf16_rne(S, INTERP), mask=valid, cache_modifier=".cs")
                else:
                    tl.store(dst, S, mask=valid, cache_modifier=".cs")  # streaming store
            # o (bf16 values) parks in out row t until the epilogue
            tl.store(out_ptr + _rowoff(n0 + t, stride_out, ROWS16) + h * 128 + vv,
                     _bf16_round(o, INTERP).to(tl.bfloat16), mask=live)

    # ---- 4. gated RMSNorm of all T rows, conv window -----------------------------------------
    tl.debug_barrier()                       # all o rows are in place
    _finish_rows(out_ptr + _rowoff(n0, stride_out, ROWS16) + h * 128, stride_out, out_ptr,
                 stride_out, og_ptr, stride_og, nw_ptr, n0, h, norm_eps, live, True, T, TP, INTERP,
                 False, ROWS16)
    _write_window(cs_base, x_ptr, stride_x, n0, h, off, live, DIM, T, STRIDE_C, STRIDE_L,
                  ROWS16)


# --------------------------------------------------------------------------------------------
# builds and host wrapper
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChunkedBuild:
    """One compiled form of :func:`_kda_chunked_kernel`.

    Attributes:
      name: the name the launch policy uses (:mod:`kda.backends.triton.policy`).
      bv: value rows per chunk (16 or 32).
      num_warps: warps per program.
      num_stages: software-pipelining stages of the row loop (chunks in flight).
      maxnreg: register cap per thread passed to ptxas (None: Triton's choice).
    """

    name: str
    bv: int
    num_warps: int
    num_stages: int
    maxnreg: Optional[int] = None

    @property
    def kernel(self):
        """The Triton kernel this build compiles."""
        return _kda_chunked_kernel

    def constants(self, cfg: KdaConfig, interp: bool) -> dict:
        """The kernel's constexprs for ``cfg`` (``interp``: the interpreter's emulations), all
        but ``ROWS16``, which each call takes from its rows (:func:`rows16`)."""
        return dict(config_constants(cfg, interp), BV=self.bv, NUM_STAGES=self.num_stages)

    def options(self, interp: bool) -> dict:
        """Triton's launch options (the register cap only on the GPU)."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg and not interp:
            opts["maxnreg"] = self.maxnreg
        return opts


#: 4-warp programs, 32-row chunks, 2 stages, <= 88 registers (5 programs per SM).
CHUNKED = ChunkedBuild("chunked", bv=32, num_warps=4, num_stages=2, maxnreg=88)
#: 4-warp programs, 16-row chunks, 2 stages, <= 88 registers.
CHUNKED_BV16 = ChunkedBuild("chunked_bv16", bv=16, num_warps=4, num_stages=2, maxnreg=88)
#: 2-warp programs, 16-row chunks, 2 stages, <= 128 registers (8 programs per SM).
CHUNKED_W2 = ChunkedBuild("chunked_w2", bv=16, num_warps=2, num_stages=2, maxnreg=128)
#: 2-warp programs, 16-row chunks, 3 stages, <= 128 registers.
CHUNKED_W2_S3 = ChunkedBuild("chunked_w2_s3", bv=16, num_warps=2, num_stages=3, maxnreg=128)
#: The builds by name.
BUILDS = {b.name: b for b in (CHUNKED, CHUNKED_BV16, CHUNKED_W2, CHUNKED_W2_S3)}


class ChunkedStep:
    """Launches one build of :func:`_kda_chunked_kernel` for one :class:`KdaConfig` (callable).

    ``step(args)`` launches the kernel once on the current stream (grid ``R * H``) and writes
    ``args.out``, the state pages, the conv windows and (record mode) the records in place.
    Nothing is read back from the device; the current stream's scratch is made on its first
    step and grows (never shrinks) when a larger batch than ever before arrives.

    Args (constructor):
      cfg: the static configuration (validated).
      device: the CUDA device, or the CPU under ``TRITON_INTERPRET=1``.
      build: one of :data:`BUILDS`.
    """

    def __init__(self, cfg: KdaConfig, device, build: ChunkedBuild):
        self.cfg = cfg
        self.device = torch.device(device)
        self.build = build
        self.interp = interpreter_enabled()
        self._const = build.constants(cfg, self.interp)
        self._opts = build.options(self.interp)
        self._scalars = config_scalars(cfg)

    def _buffers(self) -> StreamBuffers:
        bufs = _SCRATCH.get(self.device)
        if bufs is None:
            bufs = _SCRATCH[self.device] = StreamBuffers(
                self.device, torch.float32, False, "the chunked scratch", SCRATCH_MIN_ELEMS)
        return bufs

    @property
    def scratch(self) -> Optional[torch.Tensor]:
        """The current stream's scratch (None before its first step)."""
        return self._buffers().current()

    def __call__(self, args: KdaArgs) -> None:
        R = args.state_indices.shape[0]
        if R == 0:
            return
        n_items = R * self.cfg.num_heads
        scr = self._buffers().get(n_items * self.cfg.T * SCR_PER_TOKEN)
        with interpreter_quiet(self.interp):
            _kda_chunked_kernel[(n_items,)](
                *kernel_operands(args), scr, args.state.shape[0], *self._scalars,
                **self._const, ROWS16=rows16(args), **self._opts)


__all__ = ["ChunkedBuild", "ChunkedStep", "CHUNKED", "CHUNKED_BV16", "CHUNKED_W2",
           "CHUNKED_W2_S3", "BUILDS", "SCR_PER_TOKEN"]
