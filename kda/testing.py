"""Shared case generation, poisoning and comparison for tests and benchmarks.

One generator serves the conformance suite, the per-backend tests, the benchmarks and the
serve tool, so every consumer exercises the same layouts:

* :func:`make_case` draws fresh random inputs for a :class:`kda.config.KdaConfig` and a batch
  of R requests: slot ids, null slots (0 and -1), out-of-range accepted counts, in-place
  aliasing of the source slot with a token's write slot, both conv-cache layouts (real
  strided storage, not a contiguous copy), optional padded row and slot strides, the
  engine-facing forms (an engine's packed projection whose rows are not 16-byte aligned,
  rows at odd element offsets, an activated fp32 beta).
* Every buffer the step may write (out, records) and every cache element the step must not
  read (unreferenced slots, slot 0, window positions outside the read range) is filled with
  NaN poison, so a stray read shows up as NaN and a stray write as a changed poison bit.
* :func:`compare_step` checks a backend's buffers against the reference's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import torch

from kda.config import GATE_RANK, HEAD_DIM, WRITTEN, KdaArgs, KdaConfig

D = HEAD_DIM


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """One conformance case: a config plus the batch and what the slot ids look like.

    Attributes:
      cfg: the static configuration.
      R: requests in the batch.
      null_frac: fraction of requests whose source slot is null (0 or -1) or out of range.
      alias: make some requests' token write slots alias their source slot (T>1).
      padded: use row strides larger than the row width and slot strides larger than a page.
      packed: x, beta and f_a are column slices of one packed projection buffer
        [N, 3*dim + H + 256] as an engine passes them (q|k|v, beta, f_a, then 128 columns of
        another projection), row pitch 385*H + 256 elements: rows 16-byte aligned only when
        H % 8 == 0 (8 bytes at H = 4, 4 at H = 2, 2 at odd H); every other column is NaN.
        With ``cfg.beta_activated`` beta is its own fp32 tensor (the engine's sigmoid output)
        and the buffer's beta columns stay NaN.
      offset_rows: output_gate and out start one element into rows one element longer than
        theirs (odd row pitch, 2-byte aligned rows).
      seed: the random seed.
    """

    cfg: KdaConfig
    R: int
    null_frac: float = 0.25
    alias: bool = True
    padded: bool = False
    packed: bool = False
    offset_rows: bool = False
    seed: int = 0

    @property
    def id(self) -> str:
        """A readable, unique test id: the config, R and the case's flags and seed."""
        s = f"{self.cfg.short()}-R{self.R}"
        if self.null_frac == 0:
            s += "-nonull"
        if self.padded:
            s += "-padded"
        if self.packed:
            s += "-packed"
        if self.offset_rows:
            s += "-offset"
        return s + f"-s{self.seed}"


def make_config(H: int, T: int, layout: str = "SD", lb=None, gm: int = 0, bias: bool = False,
                record: bool = False, extra_window: int = 0, cs32: bool = False,
                bf16_weights: bool = False, beta_act: bool = False,
                bf16_state: bool = False) -> KdaConfig:
    """Shorthand for test matrices: a :class:`KdaConfig` with window T + 2 + extra_window,
    an fp32 conv cache when ``cs32``, bf16 conv / norm weights when ``bf16_weights``, an
    activated fp32 beta when ``beta_act`` and a bf16 state pool when ``bf16_state``."""
    return KdaConfig(num_heads=H, T=T, window=T + 2 + extra_window, conv_layout=layout,
                     lower_bound=lb, gate_mode=gm, has_conv_bias=bias, record=record,
                     conv_state_dtype=torch.float32 if cs32 else torch.bfloat16,
                     conv_weight_dtype=torch.bfloat16 if bf16_weights else torch.float32,
                     norm_weight_dtype=torch.bfloat16 if bf16_weights else torch.float32,
                     beta_activated=beta_act,
                     state_dtype=torch.bfloat16 if bf16_state else torch.float32)


def call_public(args: KdaArgs, cfg: KdaConfig, backend: Optional[str]) -> torch.Tensor:
    """Run ``args`` through the public :func:`kda.kda_decode` with ``cfg``'s scalars and
    form of beta."""
    import kda
    return kda.kda_decode(**args._asdict(), scale=cfg.scale, norm_eps=cfg.norm_eps,
                          lower_bound=cfg.lower_bound, gate_mode=cfg.gate_mode,
                          beta_activated=cfg.beta_activated, early_reads=cfg.early_reads,
                          backend=backend)


def _randn(shape, dtype, device, gen, scale=1.0, offset=0.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale + offset).to(
        device=device, dtype=dtype)


def _rows(n: int, width: int, dtype, device, gen, padded: bool, scale=1.0) -> torch.Tensor:
    """A [n, width] tensor whose row stride is padded by 8 elements when ``padded``."""
    pad = 8 if padded else 0
    full = _randn((n, width + pad), dtype, device, gen, scale)
    return full[:, :width]


def _offset_rows(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in rows that start one element into a NaN buffer one column wider:
    an odd row pitch, rows 2-byte aligned (for bf16)."""
    store = torch.full((t.shape[0], t.stride(0) + 1), float("nan"), dtype=t.dtype)
    view = store[:, 1:1 + t.shape[1]]
    view.copy_(t)
    return view


def make_case(spec: CaseSpec, device="cpu") -> KdaArgs:
    """Draw a fresh random case for ``spec`` on ``device``, with poison where nothing may go.

    Slot assignment: slots are 1..slots-1 (slot 0 is the null slot), each request gets its own
    distinct slots (one per token position for T>1). A ``null_frac`` share of requests get a
    dead source (0, -1 or >= slots); for T>1 some non-source token positions are null
    (their state write is skipped), accepted counts include values outside 1..T (clamped),
    and with ``alias`` some requests' token write slots equal their source slot.

    The state pool has ``cfg.state_dtype`` (live source pages drawn in fp32 and rounded to
    bf16 for a bf16 pool; every other page NaN, as in fp32).

    Returns:
      KdaArgs with ``out`` (and records) NaN-poisoned. Deterministic for a given spec.
    """
    cfg = spec.cfg
    gen = torch.Generator().manual_seed(spec.seed)
    H, T, L, dim = cfg.num_heads, cfg.T, cfg.window, cfg.dim
    R, N = spec.R, spec.R * cfg.T
    slots = R * T + 3
    nan = float("nan")

    # ---- slot ids ---------------------------------------------------------------------
    perm = torch.randperm(slots - 1, generator=gen)[: R * T] + 1
    idx = perm.view(R, T).clone()
    nacc = torch.randint(1, T + 1, (R,), generator=gen)
    if T > 1:
        # accepted counts outside 1..T are clamped by the op
        odd = torch.rand(R, generator=gen) < 0.15
        nacc = torch.where(odd, torch.tensor([0, T + 3])[torch.randint(0, 2, (R,), generator=gen)], nacc)
    a = nacc.clamp(1, T)
    dead = torch.rand(R, generator=gen) < spec.null_frac
    if R > 1 and spec.null_frac > 0 and not dead.any():
        dead[0] = True
    if spec.null_frac < 1 and dead.all():
        dead[-1] = False
    bad_ids = torch.tensor([0, -1, slots, 0])
    for r in range(R):
        if dead[r]:
            choice = bad_ids[torch.randint(0, 4, (1,), generator=gen)].item()
            if T == 1 or torch.rand(1, generator=gen).item() < 0.7:
                idx[r, a[r] - 1] = choice          # dead source
            else:
                idx[r, 0] = choice                 # dead conv slot, live source
        elif T > 1:
            for t in range(T):
                if t != a[r] - 1 and t != 0 and torch.rand(1, generator=gen).item() < 0.2:
                    idx[r, t] = [0, -1][t % 2]      # skipped state write
            if spec.alias and torch.rand(1, generator=gen).item() < 0.5:
                t = torch.randint(0, T, (1,), generator=gen).item()
                idx[r, t] = idx[r, a[r] - 1]        # write slot aliases the source slot
    state_indices = idx[:, 0].contiguous() if T == 1 else idx.contiguous()
    state_indices = state_indices.to(torch.int32)
    num_accepted = nacc.to(torch.int32) if T > 1 else None

    src = idx[torch.arange(R), a - 1]
    cslot = idx[:, 0]
    live = (src > 0) & (src < slots) & (cslot > 0) & (cslot < slots)

    # ---- caches -------------------------------------------------------------------------
    # The state pool (up to ~1 GiB in the GPU matrix) and the records are built and drawn on
    # ``device`` with a generator of that device seeded from the spec: deterministic for a
    # given (spec, device), and no host-side gigabyte per case.
    dev = torch.device(device)
    dgen = torch.Generator(device=dev).manual_seed(spec.seed + 7919)
    pad_slot = 64 if spec.padded else 0
    state_store = torch.full((slots, H * D * D + pad_slot), nan, dtype=cfg.state_dtype, device=dev)
    state = state_store[:, : H * D * D].view(slots, H, D, D)
    live_src = src[live].to(dev)
    state[live_src] = (torch.randn((len(live_src), H, D, D), generator=dgen, device=dev)
                       * 0.5).to(cfg.state_dtype)
    cs_dtype = cfg.conv_state_dtype
    pad_cs = 8 if spec.padded else 0
    if cfg.conv_layout == "SD":
        store = torch.full((slots, L * 3 * dim + pad_cs), nan, dtype=cs_dtype)
        conv_state = store[:, : L * 3 * dim].view(slots, L, 3 * dim).transpose(1, 2)
    else:
        store = torch.full((slots, 3 * dim * L + pad_cs), nan, dtype=cs_dtype)
        conv_state = store[:, : 3 * dim * L].view(slots, 3 * dim, L)
    lr = torch.nonzero(live)[:, 0]
    hist = _randn((len(lr), 3 * dim, 3), cs_dtype, "cpu", gen)
    for j in range(3):   # window positions off..off+2 of each live conv slot
        conv_state[cslot[lr], :, (a[lr] - 1 + j)] = hist[:, :, j]

    # ---- operands -----------------------------------------------------------------------
    x = _rows(N, 3 * dim, torch.bfloat16, "cpu", gen, spec.padded)
    f_a = _rows(N, GATE_RANK, torch.bfloat16, "cpu", gen, spec.padded)
    if cfg.beta_activated:      # the engine's sigmoid(logits), fp32, not rounded
        beta = torch.sigmoid(_rows(N, H, torch.float32, "cpu", gen, spec.padded, scale=2.0))
    else:
        beta = _rows(N, H, torch.bfloat16, "cpu", gen, spec.padded, scale=2.0)
    output_gate = _rows(N, dim, torch.bfloat16, "cpu", gen, spec.padded, scale=2.0)
    out_store = torch.full((N, dim + (8 if spec.padded else 0)), nan, dtype=torch.bfloat16)
    out = out_store[:, :dim]
    if spec.packed:
        # q|k|v, beta, f_a and 128 columns of another projection in one row (pitch 385H + 256)
        packed = torch.full((N, 3 * dim + H + 2 * GATE_RANK), nan, dtype=torch.bfloat16)
        cols = {"x": (0, 3 * dim), "beta": (3 * dim, H), "f_a": (3 * dim + H, GATE_RANK)}
        views = {k: packed[:, c0:c0 + w] for k, (c0, w) in cols.items()}
        views["x"].copy_(x)
        views["f_a"].copy_(f_a)
        x, f_a = views["x"], views["f_a"]
        if not cfg.beta_activated:
            views["beta"].copy_(beta)
            beta = views["beta"]
    if spec.offset_rows:
        output_gate = _offset_rows(output_gate)
        out = _offset_rows(out)
    conv_weight = _randn((3, 4, dim), cfg.conv_weight_dtype, "cpu", gen, 0.5)
    conv_bias = _randn((3 * dim,), torch.float32, "cpu", gen, 0.2) if cfg.has_conv_bias else None
    f_b = _randn((dim, GATE_RANK), torch.bfloat16, "cpu", gen, 1.0 / math.sqrt(GATE_RANK))
    A_log = torch.log(torch.rand(H, generator=gen) * 15 + 1)
    dt_bias = _randn((dim,), torch.float32, "cpu", gen, 1.0, -1.0)
    norm_weight = _randn((D,), cfg.norm_weight_dtype, "cpu", gen, 0.1, 1.0)
    v_record = kg_record = None
    if cfg.record:
        v_record = torch.full((slots, H, T, D), nan, dtype=torch.float32, device=dev)
        kg_record = torch.full((slots, H, T, 2 * D), nan, dtype=torch.bfloat16, device=dev)

    args = KdaArgs(
        x=x, conv_weight=conv_weight, conv_bias=conv_bias, conv_state=conv_state, f_a=f_a,
        f_b=f_b, beta=beta, A_log=A_log, dt_bias=dt_bias, state=state,
        state_indices=state_indices, num_accepted_tokens=num_accepted,
        output_gate=output_gate, norm_weight=norm_weight, out=out, v_record=v_record,
        kg_record=kg_record)
    return args_to(args, device)


def _restrided(t: Optional[torch.Tensor], fn) -> Optional[torch.Tensor]:
    """Apply ``fn`` to the storage-owning base of ``t`` and re-view the result like ``t``."""
    if t is None:
        return None
    base = t._base if t._base is not None else t
    return fn(base).as_strided(t.shape, t.stride(), t.storage_offset())


def clone_args(args: KdaArgs) -> KdaArgs:
    """Deep copy preserving strides (including the storage padding of strided views)."""
    return KdaArgs(*[_restrided(t, torch.Tensor.clone) for t in args])


def expected_after(cfg: KdaConfig, args: KdaArgs, steps: int = 1):
    """(before, expected): a copy of ``args`` as they are, and a copy after ``steps`` steps of
    the reference (:func:`kda.reference.reference_step`); compare a backend's buffers with
    :func:`compare_step` ``(args, expected, before)`` after it ran the same steps."""
    from kda.reference import reference_step
    before, expected = clone_args(args), clone_args(args)
    for _ in range(steps):
        reference_step(cfg, expected)
    return before, expected


def args_to(args: KdaArgs, device) -> KdaArgs:
    """Move every tensor to ``device`` preserving strides."""
    return KdaArgs(*[_restrided(t, lambda b: b.to(device)) for t in args])


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t.contiguous()
    itype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(itype)


def bits_equal(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """True when a and b hold the same bits (NaN payloads included)."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        torch.equal(_bits(a.cpu()), _bits(b.cpu())))


@dataclasses.dataclass
class Tolerance:
    """|actual - expected| <= atol + rtol*|expected| must hold for all but ``frac`` of the
    elements, and ``loose_*`` must hold for all of them. NaN never passes."""

    atol: float
    rtol: float
    frac: float = 0.01
    loose_atol: float = 0.1
    loose_rtol: float = 0.1


#: Default tolerances per buffer (see docs/testing.md for the reasoning).
TOLERANCES: Dict[str, Tolerance] = {
    "out": Tolerance(atol=1e-3, rtol=2 ** -7),
    "state": Tolerance(atol=1e-5, rtol=1e-4),
    # A bf16 state, compared as stored (after its one rounding): one bf16 ulp, as out and
    # kg_record. A backend's fp32 state is within the fp32 bound above of the reference's;
    # stored, the two differ where that difference straddles a bf16 rounding boundary, by one
    # bf16 ulp: 2^-8..2^-7 of |x| (x in [2^e, 2^(e+1)) has ulp 2^(e-7)), so rtol = 2^-7
    # admits exactly one ulp; atol keeps the fp32 bound near zero. The 1% beyond it and the
    # loose bound are the fp32 state's (a flipped rounding point upstream moves a key column
    # or a value row of the page by more). Rounding itself is held tighter by
    # BF16_STATE_DIFFER_FRAC.
    "state_bf16": Tolerance(atol=1e-5, rtol=2 ** -7),
    "v_record": Tolerance(atol=1e-5, rtol=1e-4),
    "kg_record": Tolerance(atol=1e-3, rtol=2 ** -7),
}


#: At most this fraction of a bf16 state's written elements may differ from the reference's
#: at all. An fp32 difference of up to the fp32 state bound (1e-4 |x|) straddles a bf16
#: rounding boundary for at most 1e-4 / 2^-8 = 2.6% of the elements; truncating instead of
#: rounding to nearest even moves about half of them (one ulp toward zero), all within
#: one ulp, so only this count catches it.
BF16_STATE_DIFFER_FRAC = 0.05


def _slot_liveness(before: KdaArgs):
    """(slot ids int64 [R] or [R, T], T, source slot [R], conv slot [R], live [R]) on the CPU,
    by :func:`kda.reference.liveness`."""
    from kda.reference import liveness
    idx = before.state_indices.cpu().long()
    T = 1 if idx.dim() == 1 else idx.shape[1]
    nacc = before.num_accepted_tokens.cpu() if before.num_accepted_tokens is not None else None
    src, cslot, _, live = liveness(idx, nacc, before.state.shape[0])
    return idx, T, src, cslot, live


def dead_rows(before: KdaArgs) -> torch.Tensor:
    """Bool [R*T] (CPU): the out rows of dead requests (:func:`kda.reference.liveness`), whose
    every element the contract sets to zero."""
    _, T, _, _, live = _slot_liveness(before)
    return (~live).repeat_interleave(T)


def written_masks(before: KdaArgs, device=None) -> Dict[str, torch.Tensor]:
    """Per written buffer, the elements the contract lets this step write (bool masks on
    ``device``, default the CPU; the state / record masks are expanded views).

    Derived from the slot ids and accepted counts (not from values): out: everything; state:
    the pages of live items' write slots (none in record mode); conv_state: positions 0..T+1
    of live conv slots; records: the rows of live conv slots.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    idx, T, src, cslot, live = _slot_liveness(before)
    slots = before.state.shape[0]
    record = before.v_record is not None
    masks = {"out": torch.ones(before.out.shape, dtype=torch.bool, device=dev)}
    st = torch.zeros(slots, dtype=torch.bool)
    if not record:
        targets = src[live] if T == 1 else idx[live].flatten()
        targets = targets[(targets > 0) & (targets < slots)]
        st[targets] = True
    masks["state"] = st.to(dev).view(-1, 1, 1, 1).expand(before.state.shape)
    cs = torch.zeros(before.conv_state.shape, dtype=torch.bool)
    cs[cslot[live], :, : T + 2] = True
    masks["conv_state"] = cs.to(dev)
    rows = torch.zeros(slots, dtype=torch.bool)
    rows[cslot[live]] = True
    for name in ("v_record", "kg_record"):
        t = getattr(before, name)
        if t is not None:
            masks[name] = rows.to(dev).view(-1, 1, 1, 1).expand(t.shape)
    return masks


def _dim0_slices(t: torch.Tensor, elements: int = 1 << 25):
    """Slices along dim 0 of about ``elements`` elements each (bounds the temporaries)."""
    per = max(1, t[0].numel()) if t.shape[0] else 1
    step = max(1, elements // per)
    return [slice(i, min(t.shape[0], i + step)) for i in range(0, t.shape[0], step)]


def compare_step(actual: KdaArgs, expected: KdaArgs, before: KdaArgs,
                 tolerances: Optional[Dict[str, Tolerance]] = None) -> List[str]:
    """Compare a backend's written buffers with the reference's; return the failures.

    Rules: (1) every element outside what the step may write (:func:`written_masks`: dead
    items, unreferenced slots, window positions >= T+2, poison) is bit-identical to
    ``before``; (2) the conv window matches the reference exactly; (3) every written element
    of out, state and records is within its :class:`Tolerance`; (4) no NaN where the
    reference has none; (5) the out rows of dead items (:func:`dead_rows`, from the slot ids,
    not from values: a live element may be exactly zero) are exact zeros. Runs on the
    buffers' device, a slice of slots at a time.
    """
    tol = dict(TOLERANCES)
    tol.update(tolerances or {})
    errors = []
    dead = dead_rows(before).to(actual.out.device)
    a_dead, e_dead = actual.out[dead], expected.out[dead]
    if (e_dead != 0).any():
        errors.append("out: the reference wrote a nonzero into a dead item's row (harness bug)")
    bad = (a_dead != 0) | torch.isnan(a_dead)
    if bad.any():
        r, c = bad.nonzero()[0].tolist()
        errors.append(f"out: {int(bad.sum())} elements of dead items' rows are not exact zeros "
                      f"(first: row {int(dead.nonzero()[r])}, column {c}: {float(a_dead[r, c])})")
    masks = written_masks(before, actual.out.device)
    for name in WRITTEN:
        a, e, b = getattr(actual, name), getattr(expected, name), getattr(before, name)
        if e is None:
            continue
        t = tol.get("state_bf16" if name == "state" and a.dtype == torch.bfloat16 else name)
        stray = False
        changed, changed_at = 0, None
        diff, diff_at = 0, None
        n_nan = n_bad = n_loose = n_all = n_ne = 0
        max_err = 0.0
        bf16_state = name == "state" and a.dtype == torch.bfloat16
        for sl in _dim0_slices(a):
            a_, e_, b_, wm = a[sl], e[sl], b[sl], masks[name][sl]
            a_bits, e_bits, b_bits = _bits(a_), _bits(e_), _bits(b_)
            stray = stray or bool(((e_bits != b_bits) & ~wm).any())
            ch = (a_bits != b_bits) & ~wm
            c = int(ch.sum())
            if c and changed_at is None:
                first = ch.nonzero()[0].tolist()
                changed_at = (first[0] + sl.start, *first[1:])
            changed += c
            if name == "conv_state":
                dm = a_bits != e_bits
                d = int(dm.sum())
                if d and diff_at is None:
                    first = dm.nonzero()[0].tolist()
                    diff_at = (first[0] + sl.start, *first[1:])
                diff += d
                continue
            av, ev = a_.float()[wm], e_.float()[wm]
            if av.numel() == 0:
                continue
            n_all += av.numel()
            if bf16_state:
                n_ne += int(((a_bits != e_bits)[wm] & torch.isfinite(ev)).sum())
            n_nan += int((torch.isnan(av) & ~torch.isnan(ev)).sum())
            err = (av - ev).abs()
            fin = torch.isfinite(ev)
            n_bad += int(((err > t.atol + t.rtol * ev.abs()) & fin).sum())
            n_loose += int(((err > t.loose_atol + t.loose_rtol * ev.abs()) & fin).sum())
            max_err = max(max_err, float(torch.nan_to_num(err, nan=0.0).max()))
        if stray:   # the reference itself must respect the masks
            errors.append(f"{name}: the reference wrote outside the written mask (harness bug)")
        if changed:
            errors.append(f"{name}: {changed} elements changed outside what the step may "
                          f"write (first at {changed_at})")
        if name == "conv_state":
            if diff:
                errors.append(f"conv_state: {diff} window elements differ from the "
                              f"reference (must be exact; first at {diff_at})")
            continue
        if n_all == 0:
            continue
        if n_nan:
            errors.append(f"{name}: {n_nan} NaN where the reference is finite")
            continue
        frac = n_bad / n_all
        if frac > t.frac:
            errors.append(f"{name}: {frac:.2%} of written elements beyond atol={t.atol} "
                          f"rtol={t.rtol} (allowed {t.frac:.2%}); max err {max_err:.3g}")
        if n_loose:
            errors.append(f"{name}: {n_loose} elements beyond the loose bound; "
                          f"max err {max_err:.3g}")
        if bf16_state and n_ne / n_all > BF16_STATE_DIFFER_FRAC:
            errors.append(f"state: {n_ne / n_all:.2%} of written bf16 elements differ from the "
                          f"reference's (allowed {BF16_STATE_DIFFER_FRAC:.0%}: rounded other "
                          f"than to nearest even?)")
    return errors


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 over the elements where b is finite."""
    a, b = a.double().cpu(), b.double().cpu()
    m = torch.isfinite(b)
    return float((a[m] - b[m]).norm() / b[m].norm().clamp_min(1e-30))


def step_bytes(cfg: KdaConfig, live_requests: int) -> int:
    """Fewest bytes one step must move for ``live_requests`` live requests (the floor's numerator).

    Per live item (request, head): the state page (64 KiB fp32, 32 KiB bf16:
    ``cfg.state_dtype``) read once; T page writes (record
    mode writes T*(D*4 + 2D*2) record bytes instead); its operands per token: x (3*D),
    output gate (D), out (D) in bf16, beta (bf16, or fp32 when activated); its window: 3 history positions read and T+2 written,
    3*D channels each, in the cache dtype. Per live request: f_a (128 bf16 per token).
    Parameters shared by all requests (conv weights, f_b, A_log, dt_bias, norm weight) stay in
    L2 and are not counted.
    """
    T = cfg.T
    page = D * D * torch.tensor([], dtype=cfg.state_dtype).element_size()
    writes = T * (D * 4 + 2 * D * 2) if cfg.record else T * page
    cs = torch.tensor([], dtype=cfg.conv_state_dtype).element_size()
    operands = T * ((3 * D + D + D) * 2 + (4 if cfg.beta_activated else 2))
    window = 3 * D * (3 + T + 2) * cs
    per_item = page + writes + operands + window
    return live_requests * (cfg.num_heads * per_item + T * GATE_RANK * 2)
