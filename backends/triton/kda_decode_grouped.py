"""The fused KDA decode step at T=1 with one Triton program per (head, group of requests), and
its host wrapper (the ``grouped`` variants of :mod:`backends.triton.kda_decode`).

Contract: ``docs/contract.md``. The device helpers are those of ``kda_decode.py`` and
``kda_decode_chunked.py``; the per-item math and its order are the ``chunked`` kernel's (so
the interpreter results are bit-identical to it, checked by the tests).

Why
---
The ``chunked`` kernel runs one program per item, and every program computes its item's gate
projection ``rg = f_a f_bᵀ`` with a [16, 128] x [128, 128] ``tl.dot`` whose B operand, the
head's 128 f_b rows (32 KiB of bf16), it reads from L2: at R=128, H=32 that is 128 MiB of
L2 reads per step next to 512 MiB of state pages. At T=1 the f_a rows of consecutive requests
are consecutive rows, so one dot serves G requests of a head (rows t < G of the tile, which
``chunked`` pads to 16 anyway): this kernel's program owns head ``h`` of requests
``r0 .. r0+G-1`` and reads the head's f_b once for all of them. (The CUDA backend's version of
the same saving, staging f_b per head in shared memory, measured 4-6% at T=1 on the H200.)

Work decomposition (T=1; a step with T > 1 runs the ``chunked`` kernel)
------------------
Program ``pid``: head ``h = pid % H``, requests ``r0 = (pid // H) * G`` .. ``r0 + G - 1``
(those ``>= R`` are masked off: the grid is ``ceil(R / G) * H``).

1. slots and liveness of the G requests (a [G] vector): ``src = conv_slot =
   state_indices[r]``, live iff ``0 < src < slots``.
2. conv + SiLU of q, k, v as [G, 128] tiles, the q/k L2 norms, the gate projection of the G
   f_a rows (one ``tl.dot``), the decay, beta; q̂, k̂, α and y_v go to the items' scratch rows
   (the ``chunked`` kernel's scratch, item ``r * H + h``); record mode: the kg_record rows.
3. one pipelined loop over the G items' pages in ``BV``-row chunks (``G * 128 / BV``
   iterations, so the software pipeliner prefetches the next item's first chunk while the
   current item's last one computes): per chunk the item's q̂, k̂, α and rows of y_v from the
   scratch (L1 hits), the delta rule, the state write back to ``src``, bf16(o) parked in the
   item's out row. Dead items: every load and store of the iteration is masked off.
4. the gated RMSNorm of the G out rows as one [G, 128] tile (zeros for dead items), then the
   conv-window rewrite per item.

Aliasing: as in ``chunked``; the G requests' slots are distinct (at T=1 two live requests
naming one slot is outside the contract).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.triton.kda_decode import (
    _bf16_round, _decay, _delta_rule, _finish_rows, _gate_projection, _load_f32, _rowoff,
    _sigmoid, _store_state, _write_window, compile_kernel_offline, kernel_operands)
from backends.triton.kda_decode_chunked import ChunkedStep, _conv_silu, _qka
from kda.config import KdaArgs, KdaConfig


@triton.jit(do_not_specialize=["num_slots", "R"])
def _kda_grouped_kernel(
        x_ptr, stride_x, cw_ptr, cb_ptr, cs_ptr, stride_cs,
        fa_ptr, stride_fa, fb_ptr, beta_ptr, stride_beta, alog_ptr, dtb_ptr,
        st_ptr, stride_st, si_ptr, nacc_ptr, og_ptr, stride_og, nw_ptr,
        out_ptr, stride_out, vrec_ptr, kgrec_ptr, scr_ptr,
        num_slots, R, scale, norm_eps, lower_bound,
        H: tl.constexpr, L: tl.constexpr, SD: tl.constexpr,
        HAS_BIAS: tl.constexpr, BOUNDED: tl.constexpr, GATE_MODE: tl.constexpr,
        RECORD: tl.constexpr, G: tl.constexpr, BV: tl.constexpr, NUM_STAGES: tl.constexpr,
        EVICT: tl.constexpr, INTERP: tl.constexpr):
    """The fused KDA decode step at T=1, one program per (head, G requests) (see the module
    docstring). Grid: ``ceil(R / G) * H`` programs. Pointers: the :class:`KdaArgs` tensors
    (unused optional ones point at any tensor and are never dereferenced) and the scratch;
    strides in elements."""
    DIM: tl.constexpr = H * 128
    NCHUNK: tl.constexpr = 128 // BV
    if SD:
        STRIDE_C: tl.constexpr = 1
        STRIDE_L: tl.constexpr = 3 * H * 128
    else:
        STRIDE_C: tl.constexpr = L
        STRIDE_L: tl.constexpr = 1
    pid = tl.program_id(0)
    h = pid % H
    r0 = (pid // H).to(tl.int64) * G

    # ---- 1. slots and liveness of the G requests ---------------------------------------------
    gg = tl.arange(0, G)
    rr = r0 + gg                                                    # [G] requests (= out rows)
    rin = rr < R
    src = tl.load(si_ptr + rr, mask=rin, other=0)
    live = rin & (src > 0) & (src < num_slots)
    src64 = tl.where(live, src, 0).to(tl.int64)
    dd = tl.arange(0, 128)
    cs_base = cs_ptr + tl.multiple_of(src64 * stride_cs, 8)         # [G] windows (conv slot = src)
    scr_rows = scr_ptr + (rr * H + h)[:, None] * 512 + dd[None, :]  # [G, 128] item scratch rows

    # ---- 2. per item: conv, norms, gate, decay, beta ------------------------------------------
    n0 = rr[:, None]                                                # token row of each item
    t0 = n0 * 0                                                     # token 0 for every row
    m2 = live[:, None]
    chq = h * 128 + dd[None, :]
    chk = DIM + chq
    chv = 2 * DIM + chq
    cs2 = cs_base[:, None]
    yq = _conv_silu(cs2 + chq * STRIDE_C, x_ptr + chq, stride_x, n0, 0,
                    cw_ptr + h * 128 + dd[None, :], cb_ptr + chq, t0, m2,
                    DIM, STRIDE_L, HAS_BIAS, INTERP)                # [G, 128]
    yk = _conv_silu(cs2 + chk * STRIDE_C, x_ptr + chk, stride_x, n0, 0,
                    cw_ptr + 4 * DIM + h * 128 + dd[None, :], cb_ptr + chk, t0, m2,
                    DIM, STRIDE_L, HAS_BIAS, INTERP)
    qh = yq * tl.rsqrt(tl.sum(yq * yq, axis=1) + 1e-6)[:, None] * scale
    kh = yk * tl.rsqrt(tl.sum(yk * yk, axis=1) + 1e-6)[:, None]
    tl.store(scr_rows, qh, mask=m2)
    tl.store(scr_rows + 128, kh, mask=m2)
    yv = _conv_silu(cs2 + chv * STRIDE_C, x_ptr + chv, stride_x, n0, 0,
                    cw_ptr + 8 * DIM + h * 128 + dd[None, :], cb_ptr + chv, t0, m2,
                    DIM, STRIDE_L, HAS_BIAS, INTERP)
    tl.store(scr_rows + 384, yv, mask=m2)

    # the gate of the G requests in one dot: f_a rows r0 .. r0+G-1 (rows >= G of the tile are 0)
    t16 = tl.arange(0, 16)
    r16 = r0 + t16
    in16 = (t16 < G) & (r16 < R)
    s16 = tl.load(si_ptr + r16, mask=in16, other=0)
    live16 = in16 & (s16 > 0) & (s16 < num_slots)
    Gt = _gate_projection(fa_ptr, stride_fa, r0, fb_ptr, h, live16, scale * 0.0, G, GATE_MODE,
                          INTERP)                                   # [16, 128] raw gate rg
    A = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    alpha = _decay(Gt + _load_f32(dtb_ptr + h * 128 + dd, True)[None, :], A, lower_bound,
                   BOUNDED)
    tl.store(scr_ptr + (r16 * H + h)[:, None] * 512 + 256 + dd[None, :], alpha,
             mask=live16[:, None])
    if RECORD:
        # kg_record[conv_slot, h, 0] = [bf16 k before the L2 norm | rg before dt_bias]
        tl.store(kgrec_ptr + ((src64 * H + h) * 256)[:, None] + dd[None, :], yk.to(tl.bfloat16),
                 mask=m2)
        c16 = tl.where(live16, s16, 0).to(tl.int64)
        tl.store(kgrec_ptr + ((c16 * H + h) * 256)[:, None] + 128 + dd[None, :],
                 Gt.to(tl.bfloat16), mask=live16[:, None])
    bvec = _sigmoid(tl.load(beta_ptr + rr * stride_beta + h, mask=live,
                            other=0.0).to(tl.float32))              # [G]
    tl.debug_barrier()                       # scratch rows visible to every thread

    # ---- 3. one loop over the G pages' row chunks --------------------------------------------
    rows = tl.arange(0, BV)
    for c in tl.range(0, G * NCHUNK, num_stages=NUM_STAGES):
        j = c // NCHUNK
        vv = (c % NCHUNK) * BV + rows                               # this chunk's value rows
        sel = gg == j
        src_j = tl.sum(tl.where(sel, src64, 0), axis=0)
        live_j = src_j > 0
        b_j = tl.sum(tl.where(sel, bvec, 0.0), axis=0)
        scr_j = scr_ptr + ((r0 + j) * H + h) * 512
        q_j = tl.load(scr_j + dd, mask=live_j, other=0.0)
        k_j = tl.load(scr_j + 128 + dd, mask=live_j, other=0.0)
        a_j = tl.load(scr_j + 256 + dd, mask=live_j, other=0.0)
        v_j = tl.load(scr_j + 384 + vv, mask=live_j, other=0.0)
        page = st_ptr + tl.multiple_of(src_j * stride_st, 4) + h * (128 * 128)
        st_off = vv[:, None] * 128 + dd[None, :]
        if EVICT:
            S = tl.load(page + st_off, mask=live_j, other=0.0, eviction_policy="evict_first")
        else:
            S = tl.load(page + st_off, mask=live_j, other=0.0)
        S, u, o = _delta_rule(S, a_j, k_j, q_j, b_j, v_j)
        if RECORD:
            tl.store(vrec_ptr + (src_j * H + h) * 128 + vv, u, mask=live_j)
        else:
            _store_state(page + st_off, S, live_j, EVICT)
        # o (bf16 values) parks in the item's out row until the epilogue
        tl.store(out_ptr + _rowoff(r0 + j, stride_out) + h * 128 + vv,
                 _bf16_round(o, INTERP).to(tl.bfloat16), mask=live_j)

    # ---- 4. gated RMSNorm of the G rows, conv windows ------------------------------------------
    tl.debug_barrier()                       # all o rows are in place
    _finish_rows(out_ptr + _rowoff(r0, stride_out) + h * 128, stride_out, out_ptr, stride_out,
                 og_ptr, stride_og, nw_ptr, r0, h, norm_eps, m2, rin[:, None], G, G, INTERP,
                 False)
    for j in tl.static_range(G):
        sel = gg == j
        src_j = tl.sum(tl.where(sel, src64, 0), axis=0)
        _write_window(cs_ptr + tl.multiple_of(src_j * stride_cs, 8), x_ptr, stride_x, r0 + j, h,
                      0, src_j > 0, DIM, 1, STRIDE_C, STRIDE_L)


# --------------------------------------------------------------------------------------------
# host wrapper
# --------------------------------------------------------------------------------------------

class GroupedStep(ChunkedStep):
    """The step function of a ``grouped`` variant (callable): at T=1 one launch of
    :func:`_kda_grouped_kernel` (grid ``ceil(R / G) * H``), at T > 1 the ``chunked`` kernel
    with the variant's chunk rows, warps and stages (:class:`ChunkedStep`). The scratch is the
    ``chunked`` kernels' (shared per device; grows outside CUDA-graph capture only).

    Raises (at call time):
      RuntimeError: the scratch must grow while the stream is being captured.
    """

    def __call__(self, args: KdaArgs) -> None:
        cfg = self.cfg
        if cfg.T != 1:
            return super().__call__(args)
        R = args.state_indices.shape[0]
        if R == 0:
            return
        v = self.variant
        groups = -(-R // v.group)
        opts = {}
        if v.maxnreg and not self.interp:
            opts["maxnreg"] = v.maxnreg
        scr = self._scratch(groups * v.group * cfg.num_heads)
        scale, norm_eps, lb = self._scalars
        c = self._const
        _kda_grouped_kernel[(groups * cfg.num_heads,)](
            *kernel_operands(args), scr, args.state.shape[0], R, scale, norm_eps, lb,
            H=c["H"], L=c["L"], SD=c["SD"], HAS_BIAS=c["HAS_BIAS"], BOUNDED=c["BOUNDED"],
            GATE_MODE=c["GATE_MODE"], RECORD=c["RECORD"], G=v.group, BV=v.bv,
            NUM_STAGES=v.num_stages, EVICT=v.evict, INTERP=self.interp,
            num_warps=v.num_warps or 4, num_stages=v.num_stages, **opts)


def compile_grouped_offline(cfg: KdaConfig, variant, arch: int = 90,
                            stride_divisible: bool = True, **options):
    """Compile :func:`_kda_grouped_kernel` (T=1 only) for ``cfg`` and the :class:`Variant`
    ``variant`` offline (no GPU), as :func:`backends.triton.kda_decode.compile_offline` does."""
    if cfg.T != 1:
        raise ValueError(f"the grouped kernel serves T=1 only, got T={cfg.T}")
    consts = dict(
        H=cfg.num_heads, L=cfg.window, SD=cfg.conv_layout == "SD", HAS_BIAS=cfg.has_conv_bias,
        BOUNDED=cfg.lower_bound is not None, GATE_MODE=cfg.gate_mode, RECORD=cfg.record,
        G=variant.group, BV=variant.bv, NUM_STAGES=variant.num_stages, EVICT=variant.evict,
        INTERP=False)
    opts = {"num_warps": variant.num_warps or 4, "num_stages": variant.num_stages}
    if variant.maxnreg:
        opts["maxnreg"] = variant.maxnreg
    opts.update(options)
    return compile_kernel_offline(_kda_grouped_kernel, cfg, consts, opts, arch, stride_divisible)


__all__ = ["GroupedStep", "compile_grouped_offline"]
