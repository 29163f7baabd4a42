"""torch.ops.kda.decode: same results as the direct call, eager and under
torch.compile(fullgraph=True) with the mutated buffers declared."""

import pytest
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
    from kda.errors import KdaArgumentError
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
    from kda.errors import KdaArgumentError
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
    from kda.errors import KdaArgumentError
    cfg = KdaConfig(num_heads=2, T=1, window=3)
    a = make_case(CaseSpec(cfg, R=3, seed=6))
    before = clone_args(a)
    for over, arg in (({"gate_mode": 1.5}, "gate_mode"), ({"gate_mode": True}, "gate_mode"),
                      ({"scale": "a"}, "scale"), ({"norm_eps": None}, "norm_eps"),
                      ({"beta_activated": 1}, "beta_activated"),
                      ({"early_reads": "yes"}, "early_reads")):
        with pytest.raises(KdaArgumentError) as ei:
            kda.torch_op.decode(*_args(a), out=a.out, backend="reference", **over)
        assert ei.value.arg == arg, over
    for name in ("state", "conv_state", "out"):
        assert bits_equal(getattr(a, name), getattr(before, name)), name


def test_custom_op_refuses_a_meta_argument_beside_real_ones_before_writing():
    """A real call with one argument on the meta device is dispatched to the op's fake kernel,
    which used to return quietly: no output, caches unchanged (found by a new-user trial). It
    must raise kda_decode's device error; all arguments on meta stay a valid no-op."""
    import pytest
    from kda.errors import KdaArgumentError
    cfg = KdaConfig(num_heads=2, T=1, window=3)
    a = make_case(CaseSpec(cfg, R=3, seed=7))
    a = a._replace(out=torch.full_like(a.out, 7.0))
    before = clone_args(a)
    for arg in ("A_log", "state", "out", "norm_weight"):
        d = a._asdict()
        d[arg] = torch.empty_like(d[arg], device="meta")
        with pytest.raises(KdaArgumentError, match="expected device cpu") as ei:
            kda.torch_op.decode(*_args(kda.KdaArgs(**d)), out=d["out"], backend="reference")
        assert ei.value.arg == arg
    for name in ("state", "conv_state", "out"):
        assert bits_equal(getattr(a, name), getattr(before, name)), name
    m = kda.KdaArgs(**{k: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
                       for k, v in a._asdict().items()})
    kda.torch_op.decode(*_args(m), out=m.out, backend="reference")


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("entry", ["kda_decode", "KdaDecode"])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_public_entry_points_compile_to_the_op(T, entry, fullgraph):
    """kda_decode and KdaDecode under torch.compile give the eager bits: they are traced as the
    custom op. Tracing the reference's own code let inductor drop its bf16 round trips (the
    contract's rounding points): 405 of 768 outputs differed (found by a new-user trial);
    with fullgraph=True KdaDecode did not compile at all."""
    cfg = KdaConfig(num_heads=2, T=T, window=T + 2)
    a = make_case(CaseSpec(cfg, R=3, seed=8))
    if entry == "kda_decode":
        def fn(x, *rest, nacc, out):
            return kda.kda_decode(x, *rest, num_accepted_tokens=nacc, out=out, backend="reference")
    else:
        step = kda.KdaDecode(cfg, device="cpu", backend="reference")

        def fn(x, *rest, nacc, out):
            return step(x, *rest, num_accepted_tokens=nacc, out=out)
    eager, comp = clone_args(a), clone_args(a)
    fn(*_args(eager), nacc=eager.num_accepted_tokens, out=eager.out)
    torch._dynamo.reset()
    torch.compile(fn, fullgraph=fullgraph)(*_args(comp), nacc=comp.num_accepted_tokens,
                                           out=comp.out)
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(eager, name), getattr(comp, name)), name


@pytest.mark.parametrize("entry", ["kda_decode", "KdaDecode"])
def test_public_entry_points_trace_with_fake_and_proxy_tensors(entry):
    """Outside dynamo, with fake tensors (FakeTensorMode) and under make_fx, kda_decode and
    KdaDecode trace as the custom op: a fake out of the right shape, and one
    torch.ops.kda.decode in the graph (the eager path read the fake tensors' null addresses
    and refused "out overlaps x"; found by an integrator's trial)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    cfg = KdaConfig(num_heads=2, T=2, window=4)
    a = make_case(CaseSpec(cfg, R=3, seed=9))
    step = kda.KdaDecode(cfg, device="cpu", backend="reference")

    def fn(x, *rest, nacc, out):
        if entry == "kda_decode":
            return kda.kda_decode(x, *rest, num_accepted_tokens=nacc, out=out,
                                  backend="reference")
        return step(x, *rest, num_accepted_tokens=nacc, out=out)

    mode = FakeTensorMode()
    fake = [None if t is None else mode.from_tensor(t)
            for t in (*_args(a), a.num_accepted_tokens, a.out)]
    with mode:
        out = fn(*fake[:13], nacc=fake[13], out=fake[14])
    assert tuple(out.shape) == tuple(a.out.shape) and out.dtype == torch.bfloat16
    g = make_fx(lambda *t: fn(*t[:13], nacc=t[13], out=t[14]), tracing_mode="fake")(
        *_args(a), a.num_accepted_tokens, a.out)
    assert [n.target for n in g.graph.nodes if "kda" in str(n.target)] == \
        [torch.ops.kda.decode.default]


def test_compiled_kda_decode_object_refuses_tensors_of_another_configuration():
    """Under torch.compile, KdaDecode checks (while tracing) that the tensors' configuration is
    its own, as its eager call does, before handing them to the op (dynamo may also give up on
    the frame there and run it eagerly, whose validation names the same argument). With
    fullgraph=True the raise cannot leave the graph: torch's compile error reports it
    instead."""
    from kda.errors import KdaArgumentError
    step = kda.KdaDecode(KdaConfig(num_heads=2, T=1, window=4), device="cpu", backend="reference")
    a = make_case(CaseSpec(KdaConfig(num_heads=2, T=1, window=3), R=2, seed=9))
    before = clone_args(a)
    torch._dynamo.reset()
    with pytest.raises(KdaArgumentError, match="window|shape") as ei:
        torch.compile(lambda *t: step(*t, out=a.out))(*_args(a))
    assert ei.value.arg == "conv_state"
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(lambda *t: step(*t, out=a.out), fullgraph=True)(*_args(a))
    for name in ("state", "conv_state", "out"):
        assert bits_equal(getattr(a, name), getattr(before, name)), name


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_entry_points_take_numpy_scalars(fullgraph):
    """numpy scalars, accepted eagerly, also under torch.compile (dynamo turns them into arrays
    that the op's schema refused; found by a review). With fullgraph=True numpy float64 only:
    a float32 one becomes a data-dependent value there."""
    import dataclasses
    np = pytest.importorskip("numpy")
    cfg = KdaConfig(num_heads=2, T=1, window=3, lower_bound=-1.0)
    a = make_case(CaseSpec(cfg, R=2, seed=10))
    kw = dict(lower_bound=np.float64(-1.0) if fullgraph else np.float32(-1.0),
              scale=np.float64(0.05), gate_mode=1, backend="reference")
    step = kda.KdaDecode(dataclasses.replace(cfg, scale=np.float32(0.05), norm_eps=np.float64(1e-5)),
                         device="cpu", backend="reference")
    for fn in (lambda *t, out: kda.kda_decode(*t, out=out, **kw),
               lambda *t, out: step(*t, out=out)):
        eager, comp = clone_args(a), clone_args(a)
        fn(*_args(eager), out=eager.out)
        torch._dynamo.reset()
        torch.compile(fn, fullgraph=fullgraph)(*_args(comp), out=comp.out)
        for name in ("out", "state", "conv_state"):
            assert bits_equal(getattr(eager, name), getattr(comp, name)), name


def test_compiled_entry_points_name_bad_arguments_as_eager():
    """Under torch.compile (not fullgraph: a raise cannot leave a full graph) the compile path
    names the argument as the eager one does: x not a tensor, a backend that is not a name,
    only kg_record given to a KdaDecode without record mode (found by a review)."""
    from kda.errors import KdaBackendError
    from kda.errors import KdaArgumentError
    cfg = KdaConfig(num_heads=2, T=1, window=3)
    a = make_case(CaseSpec(cfg, R=2, seed=11))
    before = clone_args(a)
    rest = _args(a)[1:]
    torch._dynamo.reset()
    with pytest.raises(KdaArgumentError) as ei:
        torch.compile(lambda *t: kda.kda_decode([1, 2], *t, out=a.out))(*rest)
    assert ei.value.arg == "x"
    torch._dynamo.reset()
    with pytest.raises(KdaBackendError, match="unknown KDA backend 5"):
        torch.compile(lambda *t: kda.kda_decode(*t, out=a.out, backend=5))(*_args(a))
    step = kda.KdaDecode(cfg, device="cpu", backend="reference")
    kg = torch.zeros(a.state.shape[0], 2, 1, 256, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with pytest.raises(KdaArgumentError) as ei:
        torch.compile(lambda *t: step(*t, out=a.out, kg_record=kg))(*_args(a))
    assert ei.value.arg == "kg_record"
    for name in ("state", "conv_state", "out"):
        assert bits_equal(getattr(a, name), getattr(before, name)), name


def test_compiled_entry_points_name_a_meta_tensor():
    """A meta tensor beside real ones under torch.compile: the op wrapper checks the devices
    while tracing, so the call gets kda_decode's device error (it used to reach inductor,
    which failed with "auto_functionalized_v2 was not removed"); nothing is written."""
    from kda.errors import KdaArgumentError
    cfg = KdaConfig(num_heads=2, T=1, window=3)
    a = make_case(CaseSpec(cfg, R=2, seed=12))
    before = clone_args(a)
    args = list(_args(a))
    args[5] = torch.empty_like(a.f_b, device="meta")          # f_b
    step = kda.KdaDecode(cfg, device="cpu", backend="reference")
    for fn in (lambda *t: kda.kda_decode(*t, out=a.out), lambda *t: step(*t, out=a.out)):
        torch._dynamo.reset()
        with pytest.raises(KdaArgumentError) as ei:
            torch.compile(fn)(*args)
        assert ei.value.arg == "f_b" and "meta" in str(ei.value)
    for name in ("state", "conv_state", "out"):
        assert bits_equal(getattr(a, name), getattr(before, name)), name


def test_custom_op_carries_the_engine_forms():
    """An activated fp32 beta (``beta_activated``) and rows of an engine's packed projection
    (4-byte aligned at H = 2) through the op, eagerly and as a compiled KdaDecode: the direct
    call's bits; a bf16 beta with the flag set is refused naming beta."""
    import pytest
    from kda.errors import KdaArgumentError
    from kda.testing import make_config
    cfg = make_config(2, 2, beta_act=True)
    a = make_case(CaseSpec(cfg, R=3, packed=True, seed=8))
    b, c = clone_args(a), clone_args(a)
    kda.kda_decode(*_args(a), num_accepted_tokens=a.num_accepted_tokens, beta_activated=True,
                   out=a.out, backend="reference")
    kda.torch_op.decode(*_args(b), num_accepted_tokens=b.num_accepted_tokens,
                        beta_activated=True, out=b.out, backend="reference")
    step = kda.KdaDecode(cfg, device="cpu", backend="reference")

    def layer(*t):
        step(*t[:13], num_accepted_tokens=t[13], out=t[14])
        return t[14].float().sum()

    compiled = torch.compile(layer, fullgraph=True)
    assert torch.isfinite(compiled(*_args(c), c.num_accepted_tokens, c.out))
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a, name), getattr(b, name)), name
        assert bits_equal(getattr(a, name), getattr(c, name)), name
    d = make_case(CaseSpec(make_config(2, 2), R=3, seed=8))        # bf16 beta
    with pytest.raises(KdaArgumentError) as ei:
        kda.torch_op.decode(*_args(d), num_accepted_tokens=d.num_accepted_tokens,
                            beta_activated=True, out=d.out, backend="reference")
    assert ei.value.arg == "beta" and "float32" in str(ei.value)


@pytest.mark.parametrize("record", [False, True], ids=["plain", "record"])
@pytest.mark.parametrize("form", ["function", "object"])
def test_compiled_step_refuses_a_state_that_requires_grad(form, record):
    """Under torch.compile with grad mode on, a state pool that requires grad (the op's schema
    declares it written, in record mode too) is refused while tracing, before anything is
    written: autograd's epilogue for the mutated input failed after the op had written the
    window (a breaker's trial). Under torch.no_grad() the compiled step equals eager."""
    cfg = KdaConfig(num_heads=2, T=1, window=3, record=record)
    a = make_case(CaseSpec(cfg, R=2, seed=12))
    a.state.requires_grad_(True)
    extra = dict(v_record=a.v_record, kg_record=a.kg_record)        # (None without record)
    if form == "function":
        fn = lambda *t: kda.kda_decode(*t, out=a.out, backend="reference", **extra)
    else:
        step = kda.KdaDecode(cfg, device="cpu", backend="reference")
        fn = lambda *t: step(*t, out=a.out, **extra)
    with torch.no_grad():
        before = clone_args(a)
        expected = clone_args(a)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="requires_grad=True") as ei:
        torch.compile(fn, fullgraph=True)(*_args(a))
    assert isinstance(ei.value, (torch._dynamo.exc.Unsupported, kda.KdaArgumentError))
    with torch.no_grad():
        for name in ("state", "conv_state", "out"):
            assert bits_equal(getattr(a, name), getattr(before, name)), name
        torch._dynamo.reset()
        torch.compile(fn, fullgraph=True)(*_args(a))
        kda.kda_decode(*_args(expected), out=expected.out, backend="reference",
                       v_record=expected.v_record, kg_record=expected.kg_record)
        for name in ("conv_state", "out") + (("v_record",) if record else ("state",)):
            assert bits_equal(getattr(a, name), getattr(expected, name)), name
