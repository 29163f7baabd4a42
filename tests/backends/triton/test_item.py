"""The per-item kernel's builds (``kda_decode.BUILDS``: 1, 2 or 4 programs per item) against
the reference, and bit-identical to each other under the interpreter; the V-split counters
across steps whose block count changes.

The conformance suite reaches these builds only at the batch sizes its cases happen to have
(4 "SMs" under the interpreter); here every build runs every case: T = 1 / 2 / 5 / 8, both
conv layouts and gates, gate modes, conv bias, record mode, fp32 conv cache, bf16 weights,
padded strides, aliasing write slots, dead and all-dead batches, an engine's packed projection
(rows 2- and 4-byte aligned), rows at odd element offsets, an activated fp32 beta and bf16
state pools.

On the CPU run with ``TRITON_INTERPRET=1`` (the Bazel target sets it); on a GPU run plainly.
"""

import pytest

pytest.importorskip("triton")

from kda.backends.triton import kda_decode as kd  # noqa: E402
from kda.backends.triton.auto import AutoStep  # noqa: E402
from kda.config import KdaConfig  # noqa: E402
from kda.testing import CaseSpec, compare_step, make_config  # noqa: E402
from tests.backends.triton.helpers import (  # noqa: E402
    INTERP, assert_same_bits, check_step, device, run_step)

# Small batches (the interpreter's time grows with items x programs per item); every case
# but the all-dead one has one dead and at least one live request; the T=2 case has a write
# slot aliasing its source slot, the T=8 one skipped (null) write slots and an alias.
SPECS = [
    CaseSpec(make_config(2, 1, "DS", lb=-5.0, gm=1, bias=True, cs32=True), R=2, padded=True),
    CaseSpec(make_config(1, 2, "SD", lb=-1.5, extra_window=2, bf16_weights=True), R=3),
    CaseSpec(make_config(1, 5, "DS", gm=1, record=True, bias=True), R=2),
    CaseSpec(make_config(1, 8, "SD"), R=2, seed=3),
    CaseSpec(make_config(1, 3), R=2, null_frac=1.0),
    CaseSpec(make_config(1, 2, beta_act=True), R=2, packed=True),
    CaseSpec(make_config(2, 1, "DS", lb=-5.0), R=2, packed=True, offset_rows=True),
    # bf16 state pools: T=1 in place (padded slot stride), T=3 per-token writes with an alias
    CaseSpec(make_config(2, 1, bf16_state=True), R=3, padded=True),
    CaseSpec(make_config(1, 3, "DS", lb=-5.0, bf16_state=True), R=3, seed=5),
]


@pytest.fixture(scope="module")
def dev():
    return device()


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_item_builds_match_reference_and_each_other(spec, dev):
    step = kd.ItemStep(spec.cfg, dev)
    results = {b.name: check_step(spec, dev, lambda a, b=b: step(a, b), b.name)
               for b in kd.BUILDS.values()}
    if INTERP:
        # the interpreter sums each row in one order whatever the block: identical bits
        first, *others = results
        for name in others:
            assert_same_bits(results[first], results[name], name)


def test_split_counters_across_calls(dev):
    """One step function, batches whose build changes NV from call to call (4, 2, 4 programs
    per item): the last block of each item puts its counter back to zero, so every launch
    starts from zero, and dead items never touch the counters. Without the reset, the third
    launch takes the second block to arrive for the last one and leaves half of ``o`` stale."""
    cfg = KdaConfig(num_heads=1, T=1, window=3)
    auto = AutoStep(cfg, dev)
    sms = auto.num_sms
    sizes = [max(1, sms // 4), max(2, sms // 2), max(1, sms // 4)]
    assert [auto.build_for(r) for r in sizes] == ["item_nv4", "item_nv2", "item_nv4"]
    for i, R in enumerate(sizes):
        spec = CaseSpec(cfg, R=R, seed=80 + i, null_frac=0.0 if R == 1 else 0.25)
        errors = compare_step(*run_step(spec, dev, auto))
        assert not errors, f"step {i} (R={R}): " + "\n".join(errors)
        assert int(auto.item.counters.abs().sum()) == 0, auto.item.counters



@pytest.mark.parametrize("T", [1, 3])
def test_bf16_state_is_the_fp32_step_rounded_once(T, dev):
    """A bf16 pool gives the fp32 pool of the same values' results: out and window bit for
    bit, every state written that fp32 state rounded once to nearest even (T=3: each token's,
    the fp32 state carried on). Under the interpreter only (the two builds run the same
    emulated fp32 arithmetic there; a GPU compiler may schedule them differently)."""
    if not INTERP:
        pytest.skip("bit equality of two builds holds under the interpreter")
    import torch
    from kda.testing import bits_equal, clone_args, make_case
    spec = CaseSpec(make_config(1, T, bf16_state=True), R=3, seed=11)
    a16 = make_case(spec, dev)
    a32 = clone_args(a16)
    a32 = a32._replace(state=a32.state.float())
    kd.ItemStep(spec.cfg, dev)(a16)
    kd.ItemStep(make_config(1, T), dev)(a32)
    for name in ("out", "conv_state"):
        assert bits_equal(getattr(a16, name), getattr(a32, name)), name
    fin = torch.isfinite(a32.state)
    assert torch.equal(fin, torch.isfinite(a16.state.float()))
    assert bits_equal(a16.state[fin], a32.state[fin].to(torch.bfloat16))
