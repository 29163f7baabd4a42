"""The wide CuTe DSL kernel executed on the CPU by the lockstep SIMT emulator, vs the reference.

:mod:`tests.backends.cutedsl.emulator` runs the kernel's own sources (index math, staging
layout, schedule, MMA fragment layout, predication) with every device access bounds- and
alignment-checked; see its docstring for what it does and does not cover. This is the CPU
stand-in for ``test_cutedsl_gpu.py`` and runs in CI without CuTe DSL or a GPU.
The split kernel cannot be emulated (CuTe tensors and atoms, clusters); it is checked on the GPU.
"""

import pytest
import torch

from kda.backends.cutedsl import schedule as S
from kda.backends.cutedsl.problem import Problem
from kda.config import KdaConfig
from kda.reference import reference_step
from kda.testing import WRITTEN, CaseSpec, bits_equal, clone_args, compare_step, make_case
from tests.backends.cutedsl import emulator

bf16, f32 = torch.bfloat16, torch.float32

SPECS = [
    CaseSpec(KdaConfig(num_heads=2, T=1, window=3), R=4, seed=1),
    CaseSpec(KdaConfig(num_heads=4, T=2, window=4, conv_layout="DS", lower_bound=-5.0,
                       gate_mode=1, has_conv_bias=True), R=5, seed=2),
    CaseSpec(KdaConfig(num_heads=3, T=5, window=7, gate_mode=1, record=True), R=4, seed=3),
    CaseSpec(KdaConfig(num_heads=1, T=8, window=12, conv_layout="DS", conv_state_dtype=f32,
                       conv_weight_dtype=bf16, norm_weight_dtype=bf16), R=5, seed=4),
    CaseSpec(KdaConfig(num_heads=2, T=5, window=7, lower_bound=-5.0), R=3, padded=True, seed=5),
    CaseSpec(KdaConfig(num_heads=2, T=8, window=10, record=True, conv_state_dtype=f32,
                       has_conv_bias=True, lower_bound=-2.0), R=3, padded=True, seed=6),
    CaseSpec(KdaConfig(num_heads=2, T=3, window=6, conv_state_dtype=f32, gate_mode=1), R=4,
             seed=7),
    CaseSpec(KdaConfig(num_heads=1, T=1, window=5, conv_layout="DS", record=True,
                       has_conv_bias=True, conv_state_dtype=f32), R=6, null_frac=0.5, seed=8),
    CaseSpec(KdaConfig(num_heads=5, T=2, window=4, lower_bound=-1.0, norm_weight_dtype=bf16,
                       scale=0.3, norm_eps=1e-3), R=3, seed=9),
    # the engine-facing forms: packed projection rows 8- / 4- / 2-byte aligned (H = 4 / 2 /
    # odd), rows at odd element offsets, an activated fp32 beta
    CaseSpec(KdaConfig(num_heads=4, T=1, window=3, beta_activated=True), R=3, packed=True,
             seed=10),
    CaseSpec(KdaConfig(num_heads=2, T=2, window=4, conv_layout="DS", lower_bound=-5.0,
                       gate_mode=1, has_conv_bias=True), R=3, packed=True, null_frac=0.4, seed=11),
    CaseSpec(KdaConfig(num_heads=3, T=5, window=7, record=True, beta_activated=True), R=2,
             packed=True, offset_rows=True, seed=13),
    CaseSpec(KdaConfig(num_heads=2, T=3, window=5, conv_state_dtype=f32), R=4, offset_rows=True,
             null_frac=0.5, seed=14),
    # bf16 state pools: 8-byte page copies and stores, rounded once to nearest even
    CaseSpec(KdaConfig(num_heads=2, T=1, window=3, state_dtype=bf16), R=4, null_frac=0.3,
             seed=15),
    CaseSpec(KdaConfig(num_heads=3, T=4, window=6, conv_layout="DS", lower_bound=-5.0,
                       state_dtype=bf16), R=3, padded=True, seed=16),
    CaseSpec(KdaConfig(num_heads=2, T=2, window=4, record=True, state_dtype=bf16), R=3,
             seed=17),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_emulated_matches_reference(spec):
    cfg = spec.cfg
    args = make_case(spec, "cpu")
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(cfg, expected)
    info = emulator.run(cfg, args)
    assert info["ctas"] == spec.R * cfg.num_heads
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("spec", SPECS[:4], ids=[s.id for s in SPECS[:4]])
def test_emulated_page_last_other_way(spec):
    """The state page committed the way the backend does not choose at this T (last in its
    own cp.async group, or with the operands in one;
    :attr:`kda.backends.cutedsl.schedule.Schedule.page_last`, chosen by
    :func:`kda.backends.cutedsl.schedule.default_flags`): the reference within tolerance and the default's
    bits, with the emulator's check that no thread reads staged bytes before its wait covers
    them."""
    cfg = spec.cfg
    args = make_case(spec, "cpu")
    default = clone_args(args)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(cfg, expected)
    emulator.run(cfg, default)
    emulator.run(cfg, args, page_last=not S.wide(Problem.from_config(cfg)).page_last)
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)
    for buf in WRITTEN:
        assert bits_equal(getattr(default, buf), getattr(args, buf)), buf


def test_emulated_chained_steps():
    """Three steps on the same buffers (each reads the state and window the previous one
    wrote) against three reference steps."""
    spec = CaseSpec(KdaConfig(num_heads=2, T=2, window=4), R=3, seed=12)
    cfg = spec.cfg
    args = make_case(spec, "cpu")
    before = clone_args(args)
    expected = clone_args(args)
    for _ in range(3):
        reference_step(cfg, expected)
        emulator.run(cfg, args)
    errors = compare_step(args, expected, before)
    assert not errors, "\n".join(errors)


def test_row_builds_follow_the_rows():
    """The launcher's row alignment (kda.backend.row_bytes) of the forms above, and the
    16-byte build on rows that are not 16-byte aligned faults (a misaligned copy), as it
    would on a GPU: the narrower builds are needed."""
    from kda.backend import row_bytes

    forms = SPECS[9:13]
    assert [row_bytes(make_case(s, "cpu")) for s in forms] == [8, 4, 2, 2]
    spec = forms[0]
    with pytest.raises(emulator.EmulationError, match="misaligned"):
        emulator.run(spec.cfg, make_case(spec, "cpu"), row_bytes=16)


def test_emulator_catches_bad_access():
    """Sanity of the harness itself: out-of-bounds and misaligned accesses are errors."""
    import numpy as np

    mem = emulator.GlobalMemory()
    t = torch.zeros(64, dtype=torch.float32)
    base = mem.register(t, "t")
    ok = np.ones(emulator.NT, bool)
    mem.load(emulator.Ptr(base + 4 * np.arange(emulator.NT) % 256, 4), 4, ok, "in bounds")
    with pytest.raises(emulator.EmulationError):
        mem.load(emulator.Ptr(base + 16 * np.arange(emulator.NT), 16), 16, ok, "beyond the end")
    with pytest.raises(emulator.EmulationError):
        mem.load(emulator.Ptr(base + 2, 4), 4, ok, "misaligned")


def test_emulator_catches_races():
    """Sanity of the race check: within one barrier epoch, a shared byte written by one
    thread may not be read or written by another, nor written (a cp.async included) after
    another thread read it; a barrier in between, or the same thread, is fine."""
    import numpy as np

    NT = emulator.NT
    cta = emulator.CTA(0, 4 * NT, emulator.GlobalMemory())
    cta.check_races(0, 4 * NT)
    own = 4 * np.arange(NT)                       # each thread its own word
    other = 4 * ((np.arange(NT) + 1) % NT)        # its neighbour's word
    ones = np.ones(NT, bool)
    word = np.zeros((NT, 4), np.uint8)
    saved = emulator._State.active
    emulator._State.active = [ones]
    try:
        cta.sstore(own, word, ones, "write own")
        cta.sload(own, 4, ones, "read own")              # same thread: fine
        with pytest.raises(emulator.EmulationError, match="read after another thread's write"):
            cta.sload(other, 4, ones, "read neighbour's")
        cta.barriers += 1                                # bar.sync
        cta.sload(other, 4, ones, "read neighbour's after a barrier")
        with pytest.raises(emulator.EmulationError, match="write after another thread's read"):
            cta.sstore(own, word, ones, "overwrite what the neighbour read")
        cta.barriers += 1
        mem = emulator.GlobalMemory()
        src = torch.zeros(4 * NT, dtype=torch.float32)
        base = mem.register(src, "src")
        cta.gmem = mem
        cta.sload(other, 4, ones, "read neighbour's")
        with pytest.raises(emulator.EmulationError, match="write after another thread's read"):
            cta.cp_async(own, emulator.Ptr(base + 16 * np.arange(NT), 4), 4, ones)
    finally:
        emulator._State.active = saved
