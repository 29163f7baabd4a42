"""CUDA graphs: a captured step replayed with new slot ids, accepted counts, padding and
inputs gives exactly what eager launches give, and the step never synchronizes with the host.

GPU only (skipped on the CPU machine with the reason; `--kda-require-backends` on the GPU).
"""

import pytest
import torch

import kda
from kda.config import KdaConfig
from kda.reference import reference_step
from kda.testing import CaseSpec, bits_equal, clone_args, compare_step, make_case

CFGS = [KdaConfig(num_heads=4), KdaConfig(num_heads=4, T=3, window=5, lower_bound=-5.0)]


def _call(op, a):
    return op(a.x, a.conv_weight, a.conv_bias, a.conv_state, a.f_a, a.f_b, a.beta, a.A_log,
              a.dt_bias, a.state, a.state_indices, a.output_gate, a.norm_weight,
              num_accepted_tokens=a.num_accepted_tokens, out=a.out)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CFGS, ids=[c.short() for c in CFGS])
def test_graph_replay_matches_eager(backend_name, cfg, kda_device, require_backend):
    if kda_device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    require_backend(backend_name, cfg, kda_device)
    if backend_name == "reference":
        pytest.skip("the reference is not a graph-captured hot path")
    R = 8
    op = kda.KdaDecode(cfg, device=kda_device, backend=backend_name)
    static = make_case(CaseSpec(cfg, R=R, null_frac=0.25, seed=100), kda_device)
    _call(op, static)                      # first call validates (host side) and compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _call(op, static)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        _call(op, static)
    for it in range(3):
        fresh = make_case(CaseSpec(cfg, R=R, null_frac=0.25, seed=200 + it), kda_device)
        # copy everything into the captured buffers (new slot ids, counts, padding, inputs, caches)
        for name in ("x", "f_a", "beta", "output_gate", "state_indices", "state", "conv_state"):
            getattr(static, name).copy_(getattr(fresh, name))
        if cfg.T > 1:
            static.num_accepted_tokens.copy_(fresh.num_accepted_tokens)
        before = clone_args(static)
        graph.replay()
        torch.cuda.synchronize()
        eager = clone_args(before)
        torch.cuda.set_sync_debug_mode("error")   # any host sync inside the step raises
        try:
            _call(op, eager)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        for name in ("out", "state", "conv_state"):
            assert bits_equal(getattr(static, name), getattr(eager, name)), (it, name)
        expected = clone_args(before)
        reference_step(cfg, expected)
        errors = compare_step(static, expected, before)
        assert not errors, "\n".join(errors)
