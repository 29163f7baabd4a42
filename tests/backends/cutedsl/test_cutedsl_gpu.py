"""The CuTe DSL kernels on a GPU: what is specific to this backend.

Skipped without CUDA. On the GPU machine run (from the repository root):

    python3 -m pytest -q tests/backends/cutedsl/test_cutedsl_gpu.py --kda-require-backends

Correctness of the two backends against the reference, CUDA graphs, the public entry points
and 64-bit slot offsets are the conformance suite's (``tests/conformance``). Here:
  * the streamed kernel gives the wide kernel's bits and matches the reference on the same
    configurations and on batches where each CTA walks many items, also over three chained
    steps, on 3 CTAs walking hundreds of items each, and on hostile slot ids and accepted
    counts (the conformance suite's CPU-sized cases run on the split kernels); so does its
    build in blocks of 4 requests (``stream4``);
  * the split kernel on every cluster size C in 2, 4, 8 gives the wide kernel's bits
    (out / state / conv_state / records) and matches the reference, on configurations
    covering T in {1, 2, 5, 8}, both conv layouts, both gates, gate_mode 0/1, conv bias,
    record mode, fp32 conv state, bf16 weights, padded strides, null slots and aliasing, and
    the engine-facing forms (packed projection rows 8-, 4- and 2-byte aligned, rows at odd
    element offsets, an activated fp32 beta), each on the build for its rows;
  * ``cutedsl`` runs the schedule its policy picks on this GPU (its measured table, else the
    default in SM waves), on both sides of every batch size where the choice changes, at T =
    1 to 5, for both state dtypes;
  * three chained steps on the same buffers (programmatic dependent launch back to back)
    match three reference steps, for ``cutedsl`` at the largest batch of each schedule it
    runs and for ``cutedsl_wide``;
  * the ``early_reads`` builds give the wide kernel's bits and match the reference, also
    as the contract allows them: behind another layer's step that writes their output gate;
  * every compile / load is recorded.
"""

import dataclasses
import os
import warnings

import pytest
import torch

from kda.backend import row_bytes
from kda.testing import (WRITTEN, CaseSpec, bits_equal, clone_args, compare_step, expected_after,
                         make_case, make_config)
from tools.schedules import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CLUSTERS = (2, 4, 8)

SPECS = [
    CaseSpec(make_config(4, 1), R=5, seed=1),
    CaseSpec(make_config(4, 2, "DS", lb=-5.0, gm=1, bias=True), R=6, seed=2),
    CaseSpec(make_config(8, 5, gm=1, record=True), R=4, seed=3),
    CaseSpec(make_config(1, 8, "DS", cs32=True, bf16_weights=True, extra_window=2), R=7, seed=4),
    CaseSpec(make_config(12, 5, lb=-5.0, bf16_weights=True), R=3, padded=True, seed=5),
    CaseSpec(make_config(16, 8, record=True, cs32=True, bias=True, lb=-2.0), R=3, padded=True,
             seed=6),
    CaseSpec(make_config(8, 1, "DS", record=True, lb=-1.0, gm=1, bias=True, extra_window=3),
             R=12, null_frac=0.5, seed=7),
    CaseSpec(make_config(96, 2, "DS", gm=1, cs32=True, extra_window=1), R=9, seed=8),
    CaseSpec(make_config(4, 1, beta_act=True), R=5, packed=True, seed=9),
    CaseSpec(make_config(2, 2, "DS", lb=-5.0, gm=1), R=4, packed=True, seed=10),
    CaseSpec(make_config(3, 5, bias=True, record=True, beta_act=True), R=3, packed=True,
             offset_rows=True, seed=12),
    # bf16 state pools
    CaseSpec(make_config(4, 1, bf16_state=True), R=5, null_frac=0.3, seed=13),
    CaseSpec(make_config(12, 4, "DS", lb=-5.0, gm=1, bf16_state=True), R=3, padded=True,
             seed=14),
    CaseSpec(make_config(8, 2, record=True, bf16_state=True), R=4, seed=15),
]

_launchers = {}
_steps = {}


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", torch.cuda.current_device())


def _launcher(kind, cfg, device, require_backend):
    """The launcher of the schedule labelled ``kind`` (``tests/backends/cutedsl/schedules.py``)
    for ``cfg``, built once."""
    backend = require_backend("cutedsl", cfg, device)
    key = (kind, cfg, str(device))
    if key not in _launchers:
        _launchers[key] = backend.launcher(build(kind, cfg)[1], cfg, device)
    return _launchers[key]


def _step(name, cfg, device, require_backend):
    backend = require_backend(name, cfg, device)
    key = (name, cfg, str(device))
    if key not in _steps:
        _steps[key] = backend.build(cfg, device)
    return _steps[key]


def _differs(a, b):
    return [buf for buf in WRITTEN if not bits_equal(getattr(a, buf), getattr(b, buf))]


def _check_beside_wide(name, run, cfg, args, device, require_backend, check_wide=False):
    """``run(args)`` and the wide kernel on a copy of ``args``: ``run``'s results (with
    ``check_wide`` the wide kernel's too) within the reference's tolerance, and the two bit for
    bit equal. Returns the wide kernel's launcher."""
    wide = _launcher("wide", cfg, device, require_backend)
    a_wide = clone_args(args)
    before, expected = expected_after(cfg, args)
    run(args)
    wide(a_wide)
    torch.cuda.synchronize()
    errors = [f"{name}: {e}" for e in compare_step(args, expected, before)]
    if check_wide:
        errors += [f"wide: {e}" for e in compare_step(a_wide, expected, before)]
    assert not errors, "\n".join(errors)
    assert not _differs(args, a_wide), f"{name} and wide differ in {_differs(args, a_wide)}"
    return wide


#: The cluster kernels by label: every cluster size, with the rows loaded straight into
#: registers (``state_direct``, C = 4 and 8), and with the q / k channels shared out over the
#: cluster (``split_qk``)
SPLITS = [f"split{c}" for c in CLUSTERS] + [f"split{c}+direct" for c in CLUSTERS if c >= 4]
SPLITS += [f"split{c}+qk" for c in CLUSTERS] + ["split8+direct+qk"]


@pytest.mark.parametrize("kind", SPLITS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_split_bit_identical_to_wide(spec, kind, device, require_backend):
    """Every cluster kernel == wide bit for bit, and both within the reference's tolerance."""
    cfg = spec.cfg
    split = _launcher(kind, cfg, device, require_backend)
    a_split = make_case(spec, device)
    wide = _check_beside_wide(kind, split, cfg, a_split, device, require_backend,
                              check_wide=True)
    rows = row_bytes(a_split)
    assert rows in split.by_rows and rows in wide.by_rows      # the build for the rows ran


#: The streamed kernel beside the wide one: SPECS (mostly one item per CTA on a full GPU), and
#: batches where CTAs walk several items (dead items among live ones, head changes inside a
#: CTA's range); :func:`test_stream_few_ctas` walks them on a few CTAs.
STREAM_SPECS = SPECS + [
    CaseSpec(make_config(32, 1), R=64, seed=21),
    CaseSpec(make_config(96, 1, lb=-5.0, gm=1), R=96, null_frac=0.2, seed=22),
    CaseSpec(make_config(12, 4, "DS", bias=True, bf16_state=True), R=200, null_frac=0.1,
             seed=23),
    CaseSpec(make_config(24, 8, record=True), R=40, null_frac=0.3, seed=24),
    CaseSpec(make_config(32, 2, bf16_state=True, beta_act=True), R=90, packed=True, seed=25),
]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_stream_hostile_ids_and_counts(bf16, device, require_backend):
    """The streamed kernel (256 items, T=3) on null, padding and out-of-range slot ids at every
    position of a row and accepted counts outside 1..T: the reference's dead items, skipped
    writes and clamps, and the wide kernel's bits."""
    cfg = make_config(32, 3, bf16_state=bf16)
    a = make_case(CaseSpec(cfg, R=8, null_frac=0.0, alias=False, seed=51), device)
    slots = a.state.shape[0]
    assert slots > 24
    idx = torch.arange(1, 25, dtype=torch.int32).view(8, 3)   # distinct live slots
    nacc = torch.tensor([1, 2, 3, 3, 9, -4, 3, 2], dtype=torch.int32)   # clamped to 1..3
    idx[0, 0] = 0           # dead conv slot (the source too at 1 accepted)
    idx[1, 1] = -1          # dead source (2 accepted)
    idx[2, 0] = slots       # conv slot past the pool, live-looking source
    idx[3, 1] = 0           # skipped write of token 1, live
    idx[4, 1] = -1          # skipped write of token 1, live, 9 accepted: source at token 2
    idx[5, 1] = slots + 7   # skipped write past the pool, live, -4 accepted: source at token 0
    idx[6, 0] = -1          # dead conv slot with a live source (3 accepted)
    src = idx[torch.arange(8), nacc.clamp(1, 3) - 1]
    live = (src > 0) & (src < slots) & (idx[:, 0] > 0) & (idx[:, 0] < slots)
    assert live.tolist() == [False, False, False, True, True, True, False, True]
    a.state_indices.copy_(idx)
    a.num_accepted_tokens.copy_(nacc)
    for sl in idx.flatten().tolist():   # every slot named above holds data
        if 0 < sl < slots:
            a.state[sl].normal_()
            a.conv_state[sl].copy_(torch.randn(a.conv_state[sl].shape).to(a.conv_state.dtype))
    _check_beside_wide("stream", _launcher("stream", cfg, device, require_backend), cfg, a,
                       device, require_backend)


#: Batches each walked by 3 CTAs (hundreds of items each): item slots and stages reused many
#: times, the consumers' slot-id batches of 32 crossed with their lookahead, on both dtypes.
FEW_CTAS_SPECS = [
    CaseSpec(make_config(32, 1), R=24, null_frac=0.2, seed=41),
    CaseSpec(make_config(12, 4, "DS", lb=-5.0, gm=1, bias=True, bf16_state=True), R=60,
             null_frac=0.1, seed=42),
    CaseSpec(make_config(8, 2, record=True, bf16_state=True), R=50, null_frac=0.3, seed=43),
    CaseSpec(make_config(16, 5, "DS", cs32=True), R=20, null_frac=0.2, seed=44),
]


FEW_CTAS_CASES = [("stream", s) for s in FEW_CTAS_SPECS] + [
    ("stream4t", FEW_CTAS_SPECS[0]), ("stream2t", FEW_CTAS_SPECS[2]),
    ("stream+gb", FEW_CTAS_SPECS[0]), ("streamg+gb", FEW_CTAS_SPECS[0]),
    ("streamg", FEW_CTAS_SPECS[0]),
    ("streamg", CaseSpec(make_config(12, 1, "DS", record=True, bias=True, bf16_state=True),
                         R=60, null_frac=0.3, seed=45)),
]


@pytest.mark.parametrize("kind,spec", FEW_CTAS_CASES,
                         ids=[f"{k}-{s.id}" for k, s in FEW_CTAS_CASES])
def test_stream_few_ctas(kind, spec, device, require_backend, monkeypatch):
    """The persistent kernels on 3 CTAs (in blocks with the tail: 3 SMs, one CTA of half a
    block) == wide bit for bit, and the reference."""
    stream = _launcher(kind, spec.cfg, device, require_backend)
    monkeypatch.setattr(stream, "sms", 3)       # the grid: min(sms, items)
    _check_beside_wide(kind, stream, spec.cfg, make_case(spec, device), device,
                       require_backend)


#: The streamed kernel in blocks of 4 requests (CTAs of 4 items of one head): requests not a
#: multiple of 4 (the last block shorter, CTAs across two heads), null slots, record mode,
#: both layouts and gates, packed rows, T = 1-3, and bf16 pages (which the policy does not run
#: in blocks, but the build serves).
BLOCK_SPECS = [
    CaseSpec(make_config(32, 1), R=61, null_frac=0.2, seed=61),
    CaseSpec(make_config(96, 1, lb=-5.0, gm=1), R=14, null_frac=0.2, seed=62),
    CaseSpec(make_config(8, 1, "DS", record=True, lb=-1.0, gm=1, bias=True, extra_window=3),
             R=13, null_frac=0.5, seed=63),
    CaseSpec(make_config(4, 1, beta_act=True), R=7, packed=True, seed=64),
    CaseSpec(make_config(12, 1, bf16_state=True), R=30, null_frac=0.1, seed=65),
    CaseSpec(make_config(32, 2, bf16_state=True, beta_act=True), R=22, packed=True, seed=66),
    CaseSpec(make_config(5, 1, lb=-5.0), R=41, null_frac=0.2, seed=71),  # 205 items, CTAs of 3-4
    CaseSpec(make_config(32, 2), R=45, null_frac=0.2, seed=67),
    CaseSpec(make_config(12, 2, "DS", record=True, bias=True, gm=1), R=30, null_frac=0.3, seed=68),
    CaseSpec(make_config(12, 3, lb=-5.0), R=43, null_frac=0.2, seed=69),
    CaseSpec(make_config(16, 3, "DS", record=True, cs32=True), R=21, packed=True, seed=70),
    CaseSpec(make_config(12, 4, lb=-5.0, bias=True), R=37, null_frac=0.2, seed=72),
]


#: The persistent kernel with the consumer groups preparing their own items (``streamg``,
#: T = 1): the T = 1 cases above, and batches of many items per CTA with head changes,
#: record mode, fp32 windows, bf16 weights, padded strides, rows at odd element offsets and
#: bf16 pages.
GROUP_SPECS = [s for s in STREAM_SPECS + BLOCK_SPECS[:5] if s.cfg.T == 1] + [
    CaseSpec(make_config(12, 1, "DS", record=True, bias=True, gm=1, bf16_state=True,
                         extra_window=2), R=40, null_frac=0.3, seed=81),
    CaseSpec(make_config(32, 1, cs32=True, lb=-5.0, bf16_state=True), R=33, null_frac=0.1,
             seed=82),
    CaseSpec(make_config(4, 1, bias=True, bf16_weights=True), R=50, padded=True, null_frac=0.2,
             seed=83),
    CaseSpec(make_config(3, 1, "DS", record=True, beta_act=True, bf16_state=True), R=40,
             packed=True, offset_rows=True, seed=84),
]

#: The gate batches' f_a rows at odd element offsets (2-byte aligned: element copies)
GB_ODD_ROWS = CaseSpec(make_config(3, 1, "DS", beta_act=True), R=40, packed=True,
                       offset_rows=True, null_frac=0.2, seed=85)

#: (kernel, case) of :func:`test_stream_bit_identical_to_wide`
STREAM_CASES = ([("stream", s) for s in STREAM_SPECS] + [("stream4", s) for s in BLOCK_SPECS]
                + [("stream4t", s) for s in BLOCK_SPECS[:4] + BLOCK_SPECS[6:9]]
                + [("stream2t", BLOCK_SPECS[9]), ("stream8t", BLOCK_SPECS[0])]
                + [("streamg", s) for s in GROUP_SPECS]
                + [(k + "+gb", s) for k, specs in (("stream", STREAM_SPECS),
                                                    ("stream4", BLOCK_SPECS),
                                                    ("stream8", BLOCK_SPECS[:4]),
                                                    ("streamg", GROUP_SPECS))
                   for s in specs if s.cfg.T == 1 and not s.cfg.record]
                + [("stream4t+gb", s) for s in BLOCK_SPECS if s.cfg.T == 1 and not s.cfg.record]
                + [(k, GB_ODD_ROWS) for k in ("stream+gb", "stream4+gb", "streamg+gb")])


@pytest.mark.parametrize("kind,spec", STREAM_CASES, ids=[f"{k}-{s.id}" for k, s in STREAM_CASES])
def test_stream_bit_identical_to_wide(kind, spec, device, require_backend):
    """The streamed kernel, persistent (``stream``; ``streamg``: the groups preparing their
    items) or on one CTA per 4 items in blocks of 4 requests (``stream4``; ``stream4t``: the
    last 66 CTAs at 2 items, on 132 SMs), with the gate in batches of items (``+gb``, T = 1;
    ``stream4t+gb`` both),
    == wide bit for bit, and both within the reference's tolerance."""
    run = _launcher(kind, spec.cfg, device, require_backend)
    _check_beside_wide(kind, run, spec.cfg, make_case(spec, device), device, require_backend,
                       check_wide=True)


def _check_three_steps(step, spec, device):
    """Three steps launched back to back on the same buffers (a PDL chain) == the reference
    run three times."""
    args = make_case(spec, device)
    before, expected = expected_after(spec.cfg, args, steps=3)
    for _ in range(3):
        step(args)
    torch.cuda.synchronize()
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("T,R", [(1, 40), (5, 9)])
def test_stream_chained_steps(T, R, device, require_backend):
    """Three streamed steps back to back on the same buffers (PDL chain) == reference x3."""
    spec = CaseSpec(make_config(32, T), R=R, seed=31 + T)
    _check_three_steps(_launcher("stream", spec.cfg, device, require_backend), spec, device)


def _early(cfg):
    return dataclasses.replace(cfg, early_reads=True)


#: ``early_reads`` builds (slot ids, first windows and pages read before the PDL wait; the
#: persistent walk on fp32 pages): T = 1-8, both layouts and gates, record mode, conv bias,
#: packed rows, null slots, CTAs of one and of many items.
EARLY_CASES = [
    ("stream+early", CaseSpec(_early(make_config(12, 1, lb=-5.0, bias=True)), R=32, null_frac=0.2,
                        seed=81)),
    ("stream+early", CaseSpec(_early(make_config(8, 1, "DS", gm=1)), R=100, null_frac=0.3, seed=82)),
    ("stream+early", CaseSpec(_early(make_config(32, 4, beta_act=True)), R=20, packed=True, seed=83)),
    ("stream+early", CaseSpec(_early(make_config(16, 2, "DS", record=True, gm=1)), R=30,
                        null_frac=0.3, seed=85)),
    ("stream+early", CaseSpec(_early(make_config(12, 4, lb=-5.0, bias=True)), R=37, null_frac=0.2,
                        seed=86)),
    ("stream+early", CaseSpec(_early(make_config(4, 8, cs32=True)), R=9, seed=87)),
]


@pytest.mark.parametrize("kind,spec", EARLY_CASES, ids=[f"{k}-{s.id}" for k, s in EARLY_CASES])
def test_early_reads_bit_identical_to_wide(kind, spec, device, require_backend):
    """The ``early_reads`` builds == wide bit for bit, and the reference."""
    run = _launcher(kind, spec.cfg, device, require_backend)
    assert run.sched.early_reads
    _check_beside_wide(kind, run, spec.cfg, make_case(spec, device), device, require_backend)


@pytest.mark.parametrize("H,R", [(12, 8), (12, 32)], ids=["96-items", "384-items"])
def test_early_reads_behind_another_layer(H, R, device, require_backend):
    """``early_reads`` as the contract allows it: two layers' steps back to back, three times
    (PDL chain), each behind the other layer's step, which writes none of its caches or slot
    ids but does write its output gate (the first layer's ``out`` is the second's
    ``output_gate``, an activation read after the wait) == the reference step by step."""
    cfg = _early(make_config(H, 1, lb=-5.0))
    step = _launcher("stream+early", cfg, device, require_backend)
    a1 = make_case(CaseSpec(cfg, R=R, null_frac=0.1, seed=91), device)
    a2 = make_case(CaseSpec(cfg, R=R, null_frac=0.1, seed=92), device)
    a2 = a2._replace(output_gate=a1.out)
    for _ in range(3):
        ref1, ref2 = clone_args(a1), clone_args(a2)
        step(a1)
        step(a2)
        torch.cuda.synchronize()
        before1, expected1 = expected_after(cfg, ref1)
        ref2 = ref2._replace(output_gate=a1.out.clone())   # what the first step wrote
        before2, expected2 = expected_after(cfg, ref2)
        errors = [f"layer 1: {e}" for e in compare_step(a1, expected1, before1)]
        errors += [f"layer 2: {e}" for e in compare_step(a2, expected2, before2)]
        assert not errors, "\n".join(errors)


#: T of the dispatch tests: a row of each key of the default policy's table (fp32 T = 2-4:
#: split8, stream, stream4; T = 5: split8, split4, wide)
DISPATCH_TS = (1, 2, 3, 4, 5)
DISPATCH_H = 16
#: The batches the dispatch and chain tests search for where ``cutedsl``'s choice changes
#: (the default's last bound at 16 heads on 132 SMs: 4096 items, R = 256)
MAX_R = 1024


def _edges(step):
    """The batch sizes on both sides of every change of ``step``'s schedule up to MAX_R."""
    out = set()
    for R in range(1, MAX_R):
        if step.choose(R) != step.choose(R + 1):
            out |= {R, R + 1}
    return sorted(out)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", DISPATCH_TS)
def test_cutedsl_runs_the_policy_schedule(T, bf16, device, require_backend, monkeypatch):
    """``cutedsl`` builds a launcher for every schedule its policy picks on this GPU, and at
    R * H items on both sides of every change it launches the one ``step.choose(R)`` names,
    once, with the wide kernel's bits and the reference's values."""
    H = DISPATCH_H
    cfg = make_config(H, T, bias=True, bf16_state=bf16)
    step = _step("cutedsl", cfg, device, require_backend)
    assert set(step.launchers) == {step.choose(R) for R in range(1, MAX_R + 1)}
    calls = []
    for k, fn in list(step.launchers.items()):
        def counted(a, k=k, fn=fn):
            calls.append(k)
            fn(a)
        monkeypatch.setitem(step.launchers, k, counted)
    edges = _edges(step)
    assert edges or len(step.launchers) == 1
    for R in edges:
        calls.clear()
        want = step.choose(R)

        def run(a):
            step(a)
            assert calls == [want], f"R={R} ({R * H} items): ran {calls}, policy names {want}"

        _check_beside_wide(want.name, run, cfg, make_case(CaseSpec(cfg, R=R, seed=40 + R),
                                                          device), device, require_backend)


CHAIN_H = 32


@pytest.mark.parametrize("name", ["cutedsl", "cutedsl_wide"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 5])
def test_chained_steps(name, T, bf16, device, require_backend):
    """Three steps launched back to back on the same buffers (PDL chain) == reference x3:
    ``cutedsl`` at the largest batch (up to MAX_R) of each schedule it runs, ``cutedsl_wide``
    at the largest."""
    cfg = make_config(CHAIN_H, T, bf16_state=bf16)
    step = _step(name, cfg, device, require_backend)
    if name == "cutedsl":
        last = {}
        for R in range(1, MAX_R + 1):
            last[step.choose(R)] = R
        batches = sorted(last.values())
    else:
        batches = [MAX_R // 8]
    for R in batches:
        _check_three_steps(step, CaseSpec(cfg, R=R, seed=11 + T + R), device)


def _labelled_builds():
    """Every (problem, schedule) this module launches by label, and the wide kernel beside each
    configuration: what :func:`_compiled` compiles before the tests."""
    from kda.backends.cutedsl.problem import Problem

    pairs = ([(k, s.cfg) for k in SPLITS for s in SPECS]
             + [(k, s.cfg) for k, s in FEW_CTAS_CASES + STREAM_CASES + EARLY_CASES])
    pairs = list(dict.fromkeys(pairs + [("wide", cfg) for _, cfg in pairs]))
    return [(Problem.from_config(cfg), build(kind, cfg)[1]) for kind, cfg in pairs]


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """The module's builds compiled into the disk cache by one process per CPU first: one at a
    time in the test process they take tens of minutes, and the tests then load them. (Under
    pytest-xdist each worker compiles what it runs.)"""
    from kda.backends.cutedsl.backend import import_cutedsl
    if import_cutedsl() is None and "PYTEST_XDIST_WORKER" not in os.environ:
        from kda.backends.cutedsl.cache import precompile
        try:
            precompile(_labelled_builds())
        except Exception as e:  # noqa: BLE001 - the tests compile what is missing and fail there
            warnings.warn(f"precompiling this module's builds failed ({type(e).__name__}: {e})")


def test_compile_time_is_recorded(device, require_backend):
    from kda.backends.cutedsl import compile_seconds
    from kda.backends.cutedsl.cache import COMPILE_LOG

    step = _step("cutedsl", SPECS[0].cfg, device, require_backend)
    names = {rec.name for rec in COMPILE_LOG}
    assert {s.name for s in step.launchers} <= names
    assert compile_seconds() > 0
    for rec in COMPILE_LOG:
        print(f"{rec.name:12s} {rec.tag:64s} {rec.source:8s} {rec.seconds:6.2f} s")
