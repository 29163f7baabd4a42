"""The chunked kernel's builds (``kda_decode_chunked.BUILDS``) against the reference, and
bit-identical to the per-item kernel under the interpreter; its shared scratch across batch
sizes and step functions.

Under the interpreter the builds differ only in their chunk height (16 or 32 rows: warps and
pipeline stages are the GPU's), so one build of each height runs there; on a GPU all four.
The conformance suite reaches the chunked builds at T = 1 and 5 with 16-row chunks and at
T = 2 with 32; here both heights run T = 1 / 2 / 5 / 8 with records, padded strides, both
layouts and gates, the engine-facing forms (packed projection rows, rows at odd element
offsets, an activated fp32 beta) and bf16 state pools.

On the CPU run with ``TRITON_INTERPRET=1`` (the Bazel target sets it); on a GPU run plainly.
"""

import pytest
import torch

pytest.importorskip("triton")

from kda.backends.triton import kda_decode as kd, kda_decode_chunked as kc  # noqa: E402
from kda.backend import current_stream_handle  # noqa: E402
from kda.config import KdaConfig  # noqa: E402
from kda.testing import CaseSpec, compare_step, make_config  # noqa: E402
from tests.backends.triton.helpers import (  # noqa: E402
    INTERP, assert_same_bits, check_step, device, run_step)

BUILDS = (kc.CHUNKED, kc.CHUNKED_BV16) if INTERP else tuple(kc.BUILDS.values())
# Small batches with one dead request each; the T=2 case has a write slot aliasing its
# source slot, the T=5 one a skipped (null) write slot.
SPECS = [
    CaseSpec(make_config(2, 1, "SD", gm=1, record=True), R=2),
    CaseSpec(make_config(1, 2, "DS", lb=-5.0, bias=True, cs32=True), R=3, padded=True),
    CaseSpec(make_config(1, 5, "SD", lb=-1.5, extra_window=1, bf16_weights=True), R=2, seed=1),
    CaseSpec(make_config(1, 8, "DS", gm=1, record=True, bias=True), R=2, seed=5),
    CaseSpec(make_config(2, 2, beta_act=True), R=2, packed=True, offset_rows=True, seed=6),
    # bf16 state pools: T=1 in place, T=3 per-token writes (an alias), record mode
    CaseSpec(make_config(2, 1, bf16_state=True), R=3, padded=True),
    CaseSpec(make_config(1, 3, "DS", bf16_state=True), R=3, seed=5),
    CaseSpec(make_config(1, 2, lb=-5.0, record=True, bf16_state=True), R=2, seed=7),
]


@pytest.fixture(scope="module")
def dev():
    return device()


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_chunked_builds_match_reference_and_the_item_kernel(spec, dev):
    results = {b.name: check_step(spec, dev, kc.ChunkedStep(spec.cfg, dev, b), b.name)
               for b in BUILDS}
    if INTERP:
        # the interpreter's reductions run per row of 128 values whatever the tile: the
        # chunked kernel's bits are the per-item kernel's
        item = check_step(spec, dev, kd.ItemStep(spec.cfg, dev), "item_nv1")
        for name, args in results.items():
            assert_same_bits(item, args, name)


def test_chunked_scratch_across_batch_sizes(dev, monkeypatch):
    """Chunked step functions, batches of growing and shrinking size: the device's (and
    stream's) shared scratch grows once and is reused (no stale values leak between steps),
    a second step function (another layer) shares it, and the outgrown buffer stays alive
    (CUDA graphs captured before the growth keep valid pointers)."""
    monkeypatch.setattr(kc, "_SCRATCH", {})
    monkeypatch.setattr(kc, "SCRATCH_MIN_ELEMS", kc.SCR_PER_TOKEN)   # grow at small batches
    cfg = KdaConfig(num_heads=1, T=2, window=4)
    step = kc.ChunkedStep(cfg, dev, kc.CHUNKED_BV16)
    other = kc.ChunkedStep(KdaConfig(num_heads=2, T=1, window=3), dev, kc.CHUNKED)
    sizes = []
    for i, R in enumerate((2, 3, 1)):
        errors = compare_step(*run_step(CaseSpec(cfg, R=R, seed=60 + i), dev, step))
        assert not errors, f"step {i}: " + "\n".join(errors)
        sizes.append(step.scratch.numel())
    assert sizes[0] < sizes[1] == sizes[2], sizes
    assert other.scratch is step.scratch
    d = torch.device(dev)
    assert len(kc._SCRATCH[d].kept[current_stream_handle(d)]) == 2
