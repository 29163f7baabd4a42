"""torch.ops.kda.decode: same results as the direct call, eager and under
torch.compile(fullgraph=True) with the mutated buffers declared."""

import torch

import kda
import kda.torch_op
from kda.config import KdaConfig
from kda.testing import CaseSpec, bits_equal, clone_args, make_case


def _args(a):
    return (a.x, a.conv_weight, a.conv_bias, a.conv_state, a.f_a, a.f_b, a.beta, a.A_log,
            a.dt_bias, a.state, a.state_indices, a.output_gate, a.norm_weight)


def _layer(x, conv_weight, conv_state, f_a, f_b, beta, A_log, dt_bias, state, state_indices,
           output_gate, norm_weight, nacc, out):
    y = x * 1  # work around the op, so the graph is more than the op
    kda.torch_op.decode(y, conv_weight, None, conv_state, f_a, f_b, beta, A_log, dt_bias, state,
                        state_indices, output_gate, norm_weight, out=out,
                        num_accepted_tokens=nacc, lower_bound=-5.0)
    return out.float().sum()


def test_custom_op_matches_direct_call_and_compiles():
    cfg = KdaConfig(num_heads=2, T=2, window=4, lower_bound=-5.0)
    a = make_case(CaseSpec(cfg, R=3, seed=4))
    b, c = clone_args(a), clone_args(a)
    kda.kda_decode(*_args(a), num_accepted_tokens=a.num_accepted_tokens, lower_bound=-5.0,
                   out=a.out)
    kda.torch_op.decode(*_args(b), num_accepted_tokens=b.num_accepted_tokens, lower_bound=-5.0,
                        out=b.out)
    compiled = torch.compile(_layer, fullgraph=True)   # default backend (inductor)
    total = compiled(c.x, c.conv_weight, c.conv_state, c.f_a, c.f_b, c.beta, c.A_log, c.dt_bias,
                     c.state, c.state_indices, c.output_gate, c.norm_weight,
                     c.num_accepted_tokens, c.out)
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a, name), getattr(b, name)), name
        assert bits_equal(getattr(a, name), getattr(c, name)), name
    assert torch.isfinite(total)


def test_custom_op_refuses_a_missing_out_before_writing():
    """out=None used to run the step (caches advanced) and lose its output (found by a review)."""
    import pytest
    from kda.validate import KdaArgumentError
    cfg = KdaConfig(num_heads=2, T=1, window=3)
    a = make_case(CaseSpec(cfg, R=3, seed=5))
    before = clone_args(a)
    with pytest.raises(KdaArgumentError) as ei:
        kda.torch_op.decode(*_args(a), out=None, backend="reference")
    assert ei.value.arg == "out"
    for name in ("state", "conv_state", "out"):
        assert bits_equal(getattr(a, name), getattr(before, name)), name


def test_custom_op_validates_again_when_metadata_changes():
    """The op validates the first time it sees an argument metadata: steps with the same
    metadata run from the cache (and match the direct call step for step); a call whose
    metadata differs is validated again and refused before anything is written."""
    import pytest
    from kda.validate import KdaArgumentError
    cfg = KdaConfig(num_heads=2, T=1, window=3)
    a = make_case(CaseSpec(cfg, R=3, seed=6))
    b = clone_args(a)
    for _ in range(3):
        kda.kda_decode(*_args(a), out=a.out, backend="reference")
        kda.torch_op.decode(*_args(b), out=b.out, backend="reference")
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a, name), getattr(b, name)), name
    bad = clone_args(b)
    bad_state = bad.state.to(torch.float64)          # new metadata: a wrong dtype
    before = clone_args(bad)
    args = list(_args(bad))
    args[9] = bad_state
    with pytest.raises(KdaArgumentError) as ei:
        kda.torch_op.decode(*args, out=bad.out, backend="reference")
    assert ei.value.arg == "state"
    for name in ("out", "conv_state"):
        assert bits_equal(getattr(bad, name), getattr(before, name)), name


def test_compiled_graph_calls_the_op_in_place():
    """Inductor must call the op on the caller's buffers: a functionalized copy of the state
    pool (gigabytes in a server) per step would be a silent disaster."""
    from torch._inductor.utils import run_and_get_code
    cfg = KdaConfig(num_heads=2, T=2, window=4, lower_bound=-5.0)
    c = make_case(CaseSpec(cfg, R=3, seed=7))
    compiled = torch.compile(_layer, fullgraph=True)
    _, codes = run_and_get_code(compiled, c.x, c.conv_weight, c.conv_state, c.f_a, c.f_b, c.beta,
                                c.A_log, c.dt_bias, c.state, c.state_indices, c.output_gate,
                                c.norm_weight, c.num_accepted_tokens, c.out)
    code = "\n".join(codes)
    assert "kda.decode.default(" in code
    for line in code.splitlines():
        assert not any(w in line for w in ("clone", "copy_(")), line


def test_custom_op_refuses_scalars_of_the_wrong_kind_before_writing():
    """The op's schema converts scalars (int(), float()); what kda_decode refuses must be
    refused before that conversion, naming the argument (found by a new-user trial)."""
    import pytest
    from kda.validate import KdaArgumentError
    cfg = KdaConfig(num_heads=2, T=1, window=3)
    a = make_case(CaseSpec(cfg, R=3, seed=6))
    before = clone_args(a)
    for over, arg in (({"gate_mode": 1.5}, "gate_mode"), ({"gate_mode": True}, "gate_mode"),
                      ({"scale": "a"}, "scale"), ({"norm_eps": None}, "norm_eps")):
        with pytest.raises(KdaArgumentError) as ei:
            kda.torch_op.decode(*_args(a), out=a.out, backend="reference", **over)
        assert ei.value.arg == arg, over
    for name in ("state", "conv_state", "out"):
        assert bits_equal(getattr(a, name), getattr(before, name)), name
