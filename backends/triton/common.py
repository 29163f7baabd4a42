"""What the Triton backend's two kernels share: device helpers, operands, host utilities.

The ``@triton.jit`` helpers compute one piece of the step each, with the contract's rounding
points (``docs/contract.md`` sections 2 and 3): bf16 rounding, fma, the gate projection on
tensor cores, the decay, the delta-rule update of a block of state rows, the gated RMSNorm
epilogue and the conv window rewrite. :mod:`kda.backends.triton.kda_decode` (one program or
V-row block per item) and :mod:`kda.backends.triton.kda_decode_chunked` (one program per item
walking the page in chunks) are built from them.

Numerics: on the GPU the transcendental functions are Triton's fast ones (the contract allows
approximate transcendentals). Under ``TRITON_INTERPRET=1`` (CPU) the ``INTERP`` constexpr
selects emulations that match the reference's definitions: bf16 loads are converted to fp32
at once, the fma is emulated in float64 (exact product, one rounding), the gate projection
sums each 16-wide K step exactly (float64) and rounds it to fp32 before chaining (a
tensor-core k16 step, as the reference models it), and bf16 rounding is integer
round-to-nearest-even on the fp32 bits (the interpreter's own fp32->bf16 conversion does not
carry into the exponent).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from kda.backend import row_bytes
from kda.backends.triton.backend import interpreter_enabled  # noqa: F401  (the kernels' import)
from kda.config import HEAD_DIM, L2_NORM_EPS, KdaArgs, KdaConfig

#: Head dimension (keys and values per head; a state page is D x D, fp32 or bf16).
D = HEAD_DIM
assert L2_NORM_EPS == 1e-6  # written as a literal in the kernels (a JIT function reads no globals)
#: SM count assumed under the interpreter: the tests' batches of 1 to a few dozen items then
#: reach every build the launch policy picks (:mod:`kda.backends.triton.policy`).
INTERPRETER_SMS = 4


def interpreter_quiet(interp: bool):
    """A context for one launch: under the interpreter (``interp``), numpy's overflow /
    invalid-value warnings are off. The interpreter also computes the masked-off lanes of a
    block, whose values (other=, poisoned buffers) can overflow; those lanes are never
    stored, and the tests compare every written element (NaN never passes), so the warnings
    only alarm. On the GPU: nothing."""
    if not interp:
        return contextlib.nullcontext()
    import numpy as np
    return np.errstate(over="ignore", invalid="ignore")


def sm_count(device: torch.device, interp: bool) -> int:
    """The device's SM count; :data:`INTERPRETER_SMS` under the interpreter or off CUDA."""
    device = torch.device(device)
    if device.type == "cuda" and not interp:
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def config_constants(cfg: KdaConfig, interp: bool) -> dict:
    """The constexprs both kernels take from the configuration: heads, tokens, window, conv
    layout, bias, gate kind and mode, record mode, the form of beta (``BETA_ACT``: fp32,
    already activated), the state pool's dtype (``STATE_BF16``) and whether the interpreter
    runs them."""
    return dict(H=cfg.num_heads, T=cfg.T, L=cfg.window, SD=cfg.conv_layout == "SD",
                HAS_BIAS=cfg.has_conv_bias, BOUNDED=cfg.lower_bound is not None,
                GATE_MODE=cfg.gate_mode, RECORD=cfg.record, INTERP=interp,
                BETA_ACT=cfg.beta_activated, STATE_BF16=cfg.state_dtype == torch.bfloat16)


def rows16(args: KdaArgs) -> bool:
    """The ``ROWS16`` constexpr of a call: every row of x, f_a, output_gate and out is 16-byte
    aligned (:func:`kda.backend.row_bytes`), so the row offsets may be hinted as multiples of
    8 elements (16-byte vector loads and stores); False takes the same code without the hint
    (any row pitch, any element alignment)."""
    return row_bytes(args) == 16


def config_scalars(cfg: KdaConfig) -> tuple:
    """The fp32 scalar operands of both kernels: (scale, norm_eps, lower_bound or 0)."""
    return (float(cfg.scale), float(cfg.norm_eps),
            0.0 if cfg.lower_bound is None else float(cfg.lower_bound))


def kernel_operands(args: KdaArgs) -> tuple:
    """The leading operands of both kernels, in their order: the call's tensors and row
    strides (in elements), up to the records. An absent optional tensor is replaced by one
    that is never dereferenced (``x``; the slot ids for the accepted counts at T = 1)."""
    x = args.x
    cb = args.conv_bias if args.conv_bias is not None else x
    nacc = args.num_accepted_tokens if args.num_accepted_tokens is not None else args.state_indices
    vrec = args.v_record if args.v_record is not None else x
    kgrec = args.kg_record if args.kg_record is not None else x
    return (x, x.stride(0), args.conv_weight, cb, args.conv_state, args.conv_state.stride(0),
            args.f_a, args.f_a.stride(0), args.f_b, args.beta, args.beta.stride(0), args.A_log,
            args.dt_bias, args.state, args.state.stride(0), args.state_indices, nacc,
            args.output_gate, args.output_gate.stride(0), args.norm_weight,
            args.out, args.out.stride(0), vrec, kgrec)


# --------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _bf16_round(x, INTERP: tl.constexpr):
    """Round fp32 ``x`` to the nearest bf16 (ties to even) and return it as fp32."""
    if INTERP:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _bf16_rne(x, INTERP: tl.constexpr):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), as bf16: a bf16 state's store.
    On the GPU Triton's conversion with ``rtne`` (its default for a float downcast, spelled
    out: ``cvt.rn.bf16``); under the interpreter, whose cast truncates, the integer rounding of
    :func:`_bf16_round` first, after which the cast is exact."""
    if INTERP:
        return _bf16_round(x, INTERP).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne")


@triton.jit
def _fma(a, b, c, INTERP: tl.constexpr):
    """fma(a, b, c) in fp32 (one rounding)."""
    if INTERP:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _rowoff(n, stride, ROWS16: tl.constexpr):
    """``n * stride`` (scalar or 1-D). With ``ROWS16`` (:func:`rows16`: every row stride of x,
    f_a, output_gate and out a multiple of 8 elements) hinted as a multiple of 8, so that
    Triton emits 16-byte row accesses; without it no hint, and Triton vectorizes a row only
    as far as its pointer's own alignment and the stride's specialization prove."""
    if ROWS16:
        return tl.multiple_of(n * stride, 8)
    else:
        return n * stride


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _load_f32(ptrs, mask):
    """Load and convert to fp32 right away (the interpreter gets bf16 arithmetic wrong)."""
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _decay(g, A, lower_bound, BOUNDED: tl.constexpr):
    """The decay ``alpha = exp(gk)`` of the gate ``g = rg + dt_bias`` (any shape), with
    ``gk = lower_bound * sigmoid(A * g)`` (bounded gate) or ``-A * softplus(g)``."""
    if BOUNDED:
        gk = lower_bound * _sigmoid(A * g)
    else:
        # softplus(g) = g for g > 20, else log1p(exp(g)); log1p(e) = log(u) * e / (u - 1)
        # with u = 1 + e (exact where u != 1, Goldberg's identity), e itself where u == 1
        eg = tl.exp(tl.minimum(g, 20.0))
        u1 = 1.0 + eg
        log1p_e = tl.where(u1 == 1.0, eg, tl.log(u1) * (eg / (u1 - 1.0)))
        gk = -A * tl.where(g > 20.0, g, log1p_e)
    return tl.exp(gk)


@triton.jit
def _delta_rule(S, alpha, k, q, b, v):
    """One token of the recurrence on a block of value rows (V-major: row = value channel,
    column = key), in the reference's order: ``S *= alpha``; ``u = b (v - S k)``;
    ``S += u kᵀ``; ``o = S q``. ``S`` [rows, 128], ``alpha``, ``k``, ``q`` [128] (key
    dimension), ``b`` a scalar, ``v`` [rows]. Returns (S, u, o)."""
    S = S * alpha[None, :]
    Sk = tl.sum(S * k[None, :], axis=1)
    u = b * (v - Sk)
    S = S + u[:, None] * k[None, :]
    return S, u, tl.sum(S * q[None, :], axis=1)


@triton.jit
def _gate_projection(fa_ptr, stride_fa, row0, fb_ptr, h, live, rt_zero,
                     T: tl.constexpr, GATE_MODE: tl.constexpr, INTERP: tl.constexpr,
                     ROWS16: tl.constexpr):
    """rg[t, k] = bf16(sum_j f_a[row0 + t, j] * f_b[h*128 + k, j]) as a [16, 128] fp32 tile.

    bf16 operands on tensor cores (``tl.dot``), fp32 accumulation in four 32-wide K slices.
    Rows t >= T are zero (masked loads pad the token dimension to 16: tl.dot needs M >= 16).
    gate_mode 0 chains the accumulator through the slices (one chain of MMA k16 steps);
    gate_mode 1 starts every slice from a zero and adds them ((c0 + c1) + c2) + c3.
    ``rt_zero`` is a zero the compiler cannot see through (a runtime scalar times 0.0), so
    that Triton does not fold ``acc + dot(a, b, 0)`` into ``dot(a, b, acc)``.
    """
    tt = tl.arange(0, 16)
    kk = tl.arange(0, 128)
    rows = row0 + tt.to(tl.int64)
    rmask = (tt < T) & live
    fb_rows = fb_ptr + (h * 128 + kk).to(tl.int64) * 128
    if INTERP:
        # exact sum of each 16-wide K step (float64), rounded once to fp32, chained in fp32
        acc = tl.zeros([16, 128], dtype=tl.float32)
        chain = tl.zeros([16, 128], dtype=tl.float32)
        for c in tl.static_range(8):
            jj = c * 16 + tl.arange(0, 16)
            a = tl.load(fa_ptr + _rowoff(rows, stride_fa, ROWS16)[:, None] + jj[None, :],
                        mask=rmask[:, None], other=0.0).to(tl.float32).to(tl.float64)  # [t, j]
            b = tl.load(fb_rows[None, :] + jj[:, None]).to(tl.float32).to(tl.float64)  # [j, k]
            part = tl.sum(a[:, :, None] * b[None, :, :], axis=1).to(tl.float32)  # [16 t, 128 k]
            if GATE_MODE == 0:
                acc = acc + part
            else:
                if c % 2 == 0:
                    chain = part
                else:
                    acc = acc + (chain + part)
    else:
        # each 32-wide slice is two MMA k16 steps
        acc = tl.zeros([16, 128], dtype=tl.float32)
        zero = tl.zeros([16, 128], dtype=tl.float32) + rt_zero
        for c in tl.static_range(4):
            jj = c * 32 + tl.arange(0, 32)
            a = tl.load(fa_ptr + _rowoff(rows, stride_fa, ROWS16)[:, None] + jj[None, :],
                        mask=rmask[:, None], other=0.0)                      # [16, 32] bf16
            b = tl.load(fb_rows[None, :] + jj[:, None])                      # [32, 128] bf16
            if GATE_MODE == 0:
                acc = tl.dot(a, b, acc, out_dtype=tl.float32)
            else:
                acc = acc + tl.dot(a, b, zero, out_dtype=tl.float32)
    return _bf16_round(acc, INTERP)


@triton.jit
def _write_window(cs_base, x_ptr, stride_x, n0, h, off, do_write,
                  DIM: tl.constexpr, T: tl.constexpr, STRIDE_C: tl.constexpr,
                  STRIDE_L: tl.constexpr, ROWS16: tl.constexpr):
    """new[0] = w1, new[1] = w2, new[2+t] = x_t for the item's 3x128 channels.

    All old-window reads of this CTA (the caller's and this function's) precede the barrier,
    every write follows it.
    """
    pp = tl.arange(0, 4)[:, None]
    dd = tl.arange(0, 128)[None, :]
    chan = pp * DIM + h * 128 + dd                                  # [4, 128]; row 3 unused
    cmask = (pp < 3) & do_write
    cptr = cs_base + chan * STRIDE_C
    w1 = tl.load(cptr + (off + 1) * STRIDE_L, mask=cmask)
    w2 = tl.load(cptr + (off + 2) * STRIDE_L, mask=cmask)
    tl.debug_barrier()
    tl.store(cptr, w1, mask=cmask)
    tl.store(cptr + STRIDE_L, w2, mask=cmask)
    for t in tl.static_range(T):
        xv = tl.load(x_ptr + _rowoff(n0 + t, stride_x, ROWS16) + chan, mask=cmask)
        tl.store(cptr + (2 + t) * STRIDE_L, xv.to(cs_base.dtype.element_ty), mask=cmask)


@triton.jit
def _finish_rows(ob_ptr, ob_stride, out_ptr, stride_out, og_ptr, stride_og, nw_ptr, n0, h,
                 norm_eps, live, w_ok, T: tl.constexpr, TP: tl.constexpr, INTERP: tl.constexpr,
                 FROM_OTHER_CTAS: tl.constexpr, ROWS16: tl.constexpr):
    """Gated RMSNorm of the item's T rows: ``out[n0+t, h*128 + v] = bf16(ob * rsqrt(mean(ob^2)
    + eps) * norm_weight[v] * sigmoid(output_gate))``, with ``ob`` (bf16 values) read from
    ``ob_ptr + t*ob_stride + v``; zeros for a dead item; rows written where ``w_ok``.

    One [TP, 128] tile for all tokens: every value computed once per CTA (in the state's row
    layout each value would be recomputed by all 32 lanes of a warp).
    """
    t1 = tl.arange(0, TP)
    tt = t1[:, None]
    vv = tl.arange(0, 128)[None, :]
    rows = tt < T
    if FROM_OTHER_CTAS:     # written by other CTAs of this grid: read through L2, not L1
        ob = tl.load(ob_ptr + _rowoff(t1, ob_stride, ROWS16)[:, None] + vv, mask=rows & live,
                     other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        ob = _load_f32(ob_ptr + _rowoff(t1, ob_stride, ROWS16)[:, None] + vv, rows & live)
    og = _load_f32(og_ptr + _rowoff(n0 + t1, stride_og, ROWS16)[:, None] + h * 128 + vv,
                   rows & live)
    nw = _load_f32(nw_ptr + vv, True)
    rn = tl.rsqrt(tl.sum(ob * ob, axis=1) * (1.0 / 128.0) + norm_eps)
    res = tl.where(live, _bf16_round(ob * rn[:, None] * nw * _sigmoid(og), INTERP), 0.0)
    tl.debug_barrier()                       # ob may live in the out rows written below
    tl.store(out_ptr + _rowoff(n0 + t1, stride_out, ROWS16)[:, None] + h * 128 + vv,
             res.to(tl.bfloat16), mask=rows & w_ok)
