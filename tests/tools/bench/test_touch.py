"""The touch peers (tools/bench/touch.py under Triton's interpreter, and on a GPU also
tools/bench/touch_ring.py): each moves exactly the step's state pages (source page to every
write slot), skips dead items, and touches nothing else."""

import pytest
import torch

pytest.importorskip("triton")

from kda.backends.triton.backend import interpreter_enabled  # noqa: E402
from kda.config import KdaConfig  # noqa: E402
from kda.testing import CaseSpec, make_case  # noqa: E402
from tools.bench import peers  # noqa: E402
from tools.bench.touch import TOUCH_PEERS, make_touch  # noqa: E402

if not interpreter_enabled() and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if interpreter_enabled() else "cuda")


def _expected(state, si, nacc, T):
    """The pages after a touch, computed with torch indexing."""
    out = state.clone()
    slots = state.shape[0]
    for r in range(si.shape[0]):
        if T == 1:
            src, dsts = int(si[r]), [int(si[r])]
        else:
            a = min(max(int(nacc[r]), 1), T)
            src, dsts = int(si[r, a - 1]), [int(s) for s in si[r]]
        cslot = int(si[r]) if T == 1 else int(si[r, 0])
        if not (0 < src < slots and 0 < cslot < slots):
            continue
        for d in dsts:
            if 0 < d < slots:
                out[d] = state[src]
    return out


def _pages_case(T, dtype, H=2, R=7, seed=0):
    """(cfg, args, state before) with every page distinct (no NaN poison, which would hide
    copies of poison onto poison), so a copy from the wrong slot, head or rows, a write to a
    dead slot or a skipped write shows; dead items and dead write slots of every kind."""
    cfg = KdaConfig(num_heads=H, T=T, window=T + 2, state_dtype=dtype)
    g = torch.Generator().manual_seed(seed + T)
    args = make_case(CaseSpec(cfg, R=R, seed=7 + T), DEVICE)
    slots = R * T + 6
    state = torch.randn(slots, H, 128, 128, generator=g).to(dtype)
    si = (torch.randperm(slots - 1, generator=g)[:R * T] + 1)
    si = si.to(torch.int32).view(R, T) if T > 1 else si.to(torch.int32)
    nacc = None
    if T > 1:
        nacc = torch.randint(1, T + 1, (R,), generator=g, dtype=torch.int32)
        nacc[:7] = torch.tensor([1, 1, 3, 2, 3, 5, 2], dtype=torch.int32)   # 5: clamped to 3
        si[1, 1] = 0                    # a dead write slot of a live item
        si[3, 2] = slots + 2            # a write slot past the pool
        si[4, 0] = -1                   # dead conv slot: the whole item is dead
        si[5, 1] = -1                   # dead write slot that is not the source (a = 3)
        si[6, 1] = 0                    # null source slot, live conv slot: the item is dead
    else:
        si[3] = slots + 2               # a slot past the pool: dead
    si[2] = 0                           # a dead item (null slot)
    si, nacc = si.to(DEVICE), (None if nacc is None else nacc.to(DEVICE))
    args = args._replace(state=state.to(DEVICE), state_indices=si, num_accepted_tokens=nacc)
    return cfg, args, args.state.clone()


def _check_pages(args, state0, T):
    """Bitwise: the pages are copied (bf16 pages as bf16), nothing else changes. (T=1 writes
    each page back onto itself: a copy of the wrong slot, head or rows changes the page.)"""
    nacc = None if T == 1 else args.num_accepted_tokens.cpu()
    expected = _expected(state0.cpu(), args.state_indices.cpu(), nacc, T)
    if T > 1:
        assert not torch.equal(expected.view(torch.int16), state0.cpu().view(torch.int16))
    assert torch.equal(args.state.cpu().view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("name", sorted(TOUCH_PEERS))
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_touch_moves_exactly_the_step_pages(name, T, dtype):
    cfg, args, state0 = _pages_case(T, dtype)
    assert peers.available(name, DEVICE) is None
    make_touch(name, cfg, args)(args.state_indices, args.num_accepted_tokens)
    _check_pages(args, state0, T)


RING_SHAPES = [dict(), dict(rows=16, consumers=8, depth=2), dict(rows=64, consumers=4, depth=1),
               dict(rows=32, consumers=4, depth=3)]


@pytest.mark.parametrize("shape", RING_SHAPES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grid", [None, 2], ids=["grid_auto", "grid2"])
def test_touch_ring_moves_exactly_the_step_pages(shape, T, dtype, grid):
    """touch_ring (GPU only): one item per CTA, and 2 CTAs walking 90+ items each (several
    slot-id batches of 32 per warp, many passes over each warp's stages); run twice."""
    if peers.available("touch_ring", DEVICE) is not None:
        pytest.skip(peers.available("touch_ring", DEVICE))
    from tools.bench.touch_ring import make_touch_ring
    cfg, args, state0 = _pages_case(T, dtype, H=3, R=7 if grid is None else 61)
    step = make_touch_ring(cfg, args, grid=grid, **shape)
    step(args.state_indices, args.num_accepted_tokens)
    torch.cuda.synchronize()
    _check_pages(args, state0, T)
    if T == 1:     # T=1 moves each page onto itself: a second step must change nothing
        step(args.state_indices, args.num_accepted_tokens)
        torch.cuda.synchronize()
        _check_pages(args, state0, T)


def test_unknown_touch_peer_is_refused():
    cfg = KdaConfig(num_heads=1, T=1, window=3)
    args = make_case(CaseSpec(cfg, R=1), DEVICE)
    with pytest.raises(ValueError, match="unknown touch peer"):
        make_touch("touch_rows7", cfg, args)
