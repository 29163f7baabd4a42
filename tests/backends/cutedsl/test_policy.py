"""The default policy of ``cutedsl`` (``backends/cutedsl/policy.py``): its rows in SM waves,
the head-count rule, early reads, and the step choosing by the host-side batch size. Pure
Python: no CuTe DSL, no GPU (the launchers are faked)."""

from types import SimpleNamespace

import pytest
import torch

from kda.backends.cutedsl import policy
from kda.backends.cutedsl import schedule as S
from kda.backends.cutedsl.problem import Problem
from kda.config import KdaConfig

bf16, f32 = torch.bfloat16, torch.float32
H200_SMS = policy.REFERENCE_SMS


def _pb(H, T, state_bf16=False):
    return Problem.from_config(KdaConfig(num_heads=H, T=T, window=T + 2,
                                         state_dtype=bf16 if state_bf16 else f32))


@pytest.mark.parametrize("state_bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", range(1, 9))
def test_default_rows(T, state_bf16):
    """Per state dtype and T: increasing bounds, cluster schedules first (each size once),
    then the streamed and one-CTA ones, a catch-all row last; each row's axes a schedule
    that serves the problem; ``Prep.GROUP`` only at T = 1."""
    rows = policy.default_rows(T, state_bf16)
    most = [m for m, _ in rows[:-1]]
    assert most == sorted(set(most)) and most[0] >= 1 and rows[-1][0] is None
    axes = [a for _, a in rows]
    assert all(a != b for a, b in zip(axes, axes[1:]))
    clusters = [a for a in axes if a["rows"] == "cluster"]
    assert axes[:len(clusters)] == clusters
    assert len({a["cluster"] for a in clusters}) == len(clusters)
    assert rows[-1][1]["rows"] in ("warp", "cta")
    assert all(a["prep"] != "group" for a in axes) or T == 1
    pb = _pb(8, T, state_bf16)
    for a in axes:
        S.from_axes(pb, a)             # raises if it cannot serve the problem
    for m, a in rows[:-1]:
        assert policy.default_axes(m, T, state_bf16, 8, H200_SMS) == a
        assert policy.default_axes(m + 1, T, state_bf16, 8, H200_SMS) != a
    assert policy.default_axes(1, T, state_bf16, 8, H200_SMS) == rows[0][1]
    assert policy.default_axes(10 ** 7, T, state_bf16, 8, H200_SMS) == rows[-1][1]


def test_rows_scale_with_the_gpu_in_waves():
    """A row's bound is items per SM: on a GPU of half the SMs every bound halves (rounded
    down), on the reference GPU it is the item count as written."""
    for T in (1, 2, 5):
        for sb in (False, True):
            for most, axes in policy.default_rows(T, sb)[:-1]:
                for sms in (66, 78, 114, 132, 264):
                    bound = most * sms // H200_SMS
                    assert policy.default_axes(bound, T, sb, 8, sms) == axes, (T, sb, most, sms)
                    assert policy.default_axes(bound + 1, T, sb, 8, sms) != axes
    assert policy.default_axes(1023, 1, False, 8, 132) == policy.STREAM
    assert policy.default_axes(1024, 1, False, 8, 132) == policy.STREAM4
    assert policy.default_axes(604, 1, False, 8, 78) == policy.STREAM     # 1023 * 78 / 132
    assert policy.default_axes(605, 1, False, 8, 78) == policy.STREAM4


def test_wide_by_heads():
    """WIDE_T4: fp32 pages at T = 4 run ``WIDE`` from 3072 to 4096 items (on 132 SMs) of 16-32
    heads, where the row names ``STREAM4``; nowhere else does the head count change it."""
    r = policy.WIDE_T4
    assert tuple(r) == (3072, 4096, 16, 32)
    first, last = r.first_items, r.last_items
    for H in (16, 24, 32):
        assert policy.default_axes(first, 4, False, H, 132) == policy.WIDE
        assert policy.default_axes(last, 4, False, H, 132) == policy.WIDE
        for items in (first - 1, last + 1, 10 ** 7):
            assert policy.default_axes(items, 4, False, H, 132) == policy.STREAM4
        assert policy.default_axes(first // 2, 4, False, H, 66) == policy.WIDE
        assert policy.default_axes(first // 2 - 1, 4, False, H, 66) == policy.STREAM4
        assert S.wide(_pb(H, 4)) in policy.schedules(_pb(H, 4), 132)
    for H in (1, 12, 15, 33, 64, 96):
        for items in (first, last):
            assert policy.default_axes(items, 4, False, H, 132) == policy.STREAM4
        assert S.wide(_pb(H, 4)) not in policy.schedules(_pb(H, 4), 132)
    for T in range(1, 9):
        for sb in (False, True):
            if sb or T != 4:
                for H in (8, 16, 32, 96):
                    rows = policy.default_rows(T, sb)
                    for items in (1, 96, first - 1, first, last, 10 ** 6):
                        want = next(a for m, a in rows if m is None or items <= m)
                        assert policy.default_axes(items, T, sb, H, 132) == want


def test_schedules_hold_every_choice():
    """:func:`policy.schedules` holds every schedule :func:`policy.schedule_for` returns, each
    once; with early reads allowed the walk on fp32 pages reads early."""
    for T in range(1, 9):
        for sb in (False, True):
            for H in (4, 16, 96):
                pb = _pb(H, T, sb)
                for early in (False, True):
                    all_ = policy.schedules(pb, 132, early)
                    assert len(set(all_)) == len(all_)
                    for R in (1, 2, 3, 5, 8, 16, 31, 64, 100, 128, 300, 512, 2000):
                        s = policy.schedule_for(pb, R * H, 132, early)
                        assert s in all_, (T, sb, H, R, s)
                        assert s.early_reads == (early and s.axes() == policy.STREAM and not sb)


@pytest.mark.parametrize("H", [16, 96])
@pytest.mark.parametrize("state_bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_cutedsl_builds_every_schedule_and_picks_by_items(monkeypatch, T, state_bf16, H):
    """``cutedsl``'s step: every schedule of the policy built once (a launcher each), each
    call runs the one :func:`policy.schedule_for` names for R * H items on the device's SMs,
    on both sides of every bound and of the head-count rule; ``cutedsl_wide`` builds the
    one-CTA schedule only."""
    from kda.backends.cutedsl import backend as be

    built, calls = [], []

    def fake_launcher(sched, cfg, device):
        built.append((sched, cfg, device))
        return lambda a: calls.append((sched, a.state_indices.shape[0]))

    monkeypatch.setattr(be.KdaBackend, "launcher", staticmethod(fake_launcher))
    monkeypatch.setattr(be, "sm_count", lambda index: 132)
    monkeypatch.setattr(be, "device_name", lambda index: "NVIDIA Test GPU without a table")
    cfg = KdaConfig(num_heads=H, T=T, window=T + 2, state_dtype=bf16 if state_bf16 else f32)
    pb = Problem.from_config(cfg)
    dev = torch.device("cuda", 0)
    step = be.KdaBackend().build(cfg, dev)
    want = policy.schedules(pb, 132)
    assert sorted(built, key=str) == sorted(((s, cfg, dev) for s in want), key=str)
    assert set(step.launchers) == set(want)
    r = policy.WIDE_T4
    by_heads = r.least_heads <= H <= r.most_heads
    assert (S.wide(pb) in want) == (not state_bf16 and (T >= 5 or T == 4 and by_heads))
    wide_from = -(-r.first_items // H)
    wide_to = r.last_items // H
    batches = {1, wide_from - 1, wide_from, wide_to, wide_to + 1}
    for most, _ in policy.default_rows(T, state_bf16)[:-1]:
        batches |= {max(1, most // H), most // H + 1}
    for R in sorted(batches):
        for _ in range(2):          # the second call takes the choice the first one made
            calls.clear()
            step(SimpleNamespace(state_indices=torch.zeros(R, 2, dtype=torch.int32)))
            assert calls == [(policy.schedule_for(pb, R * H, 132), R)], (R, calls)
    ran = {policy.schedule_for(pb, R * H, 132) for R in batches}
    if H == 16:     # at 96 heads one request is above the first bounds
        assert ran == set(want), "the batches cross every bound"
    built.clear()
    monkeypatch.setattr(be.KdaWideBackend, "launcher", staticmethod(fake_launcher))
    be.KdaWideBackend().build(cfg, dev)
    assert built == [(S.wide(pb), cfg, dev)]


def test_package_imports_without_cute_dsl():
    """The backend package, its policy and tables, and ``python3 -m kda`` work where CuTe DSL
    is not installed (``import cutlass`` fails): the DSL is imported only to compile."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['cutlass'] = None\n"
            "import kda.backends.cutedsl as pkg\n"
            "from kda.backends.cutedsl import policy, schedule, tables\n"
            "assert all('nvidia-cutlass-dsl' in b.availability() or 'CUDA' in b.availability() "
            "for b in pkg.BACKENDS), [b.availability() for b in pkg.BACKENDS]\n"
            "import runpy; runpy.run_module('kda', run_name='__main__')\n")
    import os
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0, r.stderr
    assert "cutedsl schedules" in r.stdout, r.stdout
    if not torch.cuda.is_available():   # what an image being built learns: auto's first
        # choice on a GPU, and that CuTe DSL does not import here
        assert "auto's first choice (H=32, every measured batch size): T=1 " in r.stdout
        assert "CuTe DSL does not import here: nvidia-cutlass-dsl not installed" in r.stdout


def test_the_table_of_a_gpu_with_other_sms_is_not_used(monkeypatch):
    """A GPU named as a shipped table's but with another SM count (a MIG slice, a variant)
    runs the default."""
    from kda.backends.cutedsl import backend as be
    from kda.backends.cutedsl import tables

    names = tables.shipped()
    if not names:
        pytest.skip("no table shipped")
    table = tables.for_device(names[0])
    monkeypatch.setattr(be.KdaBackend, "launcher", staticmethod(lambda s, c, d: (lambda a: None)))
    monkeypatch.setattr(be, "device_name", lambda index: names[0])
    cfg = KdaConfig(num_heads=32, T=1, window=3)
    pb = Problem.from_config(cfg)
    for sms, want in ((table.sms, table), (table.sms - 10, None)):
        monkeypatch.setattr(be, "sm_count", lambda index, sms=sms: sms)
        step = be.KdaBackend().build(cfg, torch.device("cuda", 0))
        assert set(step.launchers) == set(policy.schedules(pb, sms, table=want))
        assert [step.choose(R) for R in (1, 8, 64, 512)] == \
            [policy.schedule_for(pb, R * 32, sms, table=want) for R in (1, 8, 64, 512)]
