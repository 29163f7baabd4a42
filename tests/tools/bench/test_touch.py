"""The touch peer (tools/bench/touch.py) under Triton's interpreter: it moves exactly the
step's state pages (source page to every write slot), skips dead items, and touches nothing
else."""

import pytest
import torch

pytest.importorskip("triton")

from backends.triton.kda_decode import interpreter_enabled  # noqa: E402
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
        if not 0 < src < slots:
            continue
        for d in dsts:
            if 0 < d < slots:
                out[d] = state[src]
    return out


@pytest.mark.parametrize("name", sorted(TOUCH_PEERS))
@pytest.mark.parametrize("T", [1, 3])
def test_touch_moves_exactly_the_step_pages(name, T):
    cfg = KdaConfig(num_heads=2, T=T, window=T + 2)
    args = make_case(CaseSpec(cfg, R=4, seed=7 + T), DEVICE)
    si = args.state_indices.clone()
    if T > 1:
        si[1, 1] = 0                    # one dead write slot
    si[2] = -1                          # one dead item
    args = args._replace(state_indices=si)
    state0 = args.state.clone()
    assert peers.available(name, DEVICE) is None
    make_touch(name, cfg, args)(si, args.num_accepted_tokens)
    nacc = None if T == 1 else args.num_accepted_tokens.cpu()
    expected = _expected(state0.cpu(), si.cpu(), nacc, T)
    if T > 1:   # (T=1 writes each page back onto itself: only "nothing else changes" is checked)
        assert not torch.equal(expected.view(torch.int32), state0.cpu().view(torch.int32))
    # bitwise (NaN poison included): the pages are copied, nothing else changes
    assert torch.equal(args.state.cpu().view(torch.int32), expected.view(torch.int32))


def test_unknown_touch_peer_is_refused():
    cfg = KdaConfig(num_heads=1, T=1, window=3)
    args = make_case(CaseSpec(cfg, R=1), DEVICE)
    with pytest.raises(ValueError, match="unknown touch peer"):
        make_touch("touch_rows7", cfg, args)
