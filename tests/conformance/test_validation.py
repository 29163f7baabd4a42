"""Bad inputs raise the documented error naming the argument, and nothing is written.

Validation runs in the common layer before any backend is touched, so these checks are
parametrized by backend: whichever backend is asked for, the same error comes first and
every buffer keeps its bits.
"""

import dataclasses

import pytest
import torch

import kda
from kda.config import KdaConfig
from kda.errors import KdaBackendError
from kda.testing import WRITTEN, CaseSpec, bits_equal, clone_args, make_case
from kda.errors import KdaArgumentError

CFG1 = KdaConfig(num_heads=2, T=1, window=3)
CFG2 = KdaConfig(num_heads=2, T=2, window=4)


def _kwargs(args, **over):
    kw = args._asdict()
    kw.update(over)
    return kw


def _misaligned(t):
    """A contiguous copy of ``t`` whose data starts 4 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    shift = (4 - flat.data_ptr() % 16) % 16 // t.element_size()
    return flat[shift:shift + t.numel()].view(t.shape).copy_(t)


def _transposed_x(a):
    t = a.x.t().contiguous().t()
    return {"x": t}


# (id, config, overrides, expected argument name, expected substring)
BAD = [
    ("x-dtype", CFG1, lambda a: {"x": a.x.half()}, "x", "dtype bfloat16"),
    ("x-shape", CFG1, lambda a: {"x": a.x[:, :-8]}, "x", "channels"),
    ("x-heads", CFG1, lambda a: {"x": torch.cat([a.x, a.x[:, :384]], 1)}, "x", "heads"),
    ("x-stride", CFG1, _transposed_x, "x", "stride"),
    ("x-rows", CFG1, lambda a: {"x": a.x[:1]}, "x", "rows"),
    ("conv_weight-shape", CFG1, lambda a: {"conv_weight": a.conv_weight[:, :3]}, "conv_weight", "shape"),
    ("conv_weight-dtype", CFG1, lambda a: {"conv_weight": a.conv_weight.double()}, "conv_weight",
     "expected dtype bfloat16 or float32, got float64"),
    ("conv_bias-shape", dataclasses.replace(CFG1, has_conv_bias=True),
     lambda a: {"conv_bias": a.conv_bias[:-1]}, "conv_bias", "shape"),
    ("conv_state-window", CFG2, lambda a: {"conv_state": a.conv_state[:, :, :3]}, "conv_state",
     "window too short"),
    ("conv_state-layout", CFG1,
     lambda a: {"conv_state": torch.zeros(a.conv_state.shape[0], 2 * a.conv_state.shape[1], 3,
                                          dtype=torch.bfloat16)[:, ::2]},
     "conv_state", "window-first strides"),
    ("conv_state-slots", CFG1, lambda a: {"conv_state": a.conv_state[:-1]}, "conv_state",
     "mismatched slot counts"),
    ("conv_state-dtype", CFG1, lambda a: {"conv_state": a.conv_state.half()}, "conv_state", "dtype"),
    ("conv_state-transposed", CFG1, lambda a: {"conv_state": a.conv_state.transpose(1, 2)},
     "conv_state", "transpose(1, 2)"),
    ("f_a-shape", CFG1, lambda a: {"f_a": a.f_a[:, :64]}, "f_a", "shape"),
    ("f_a-columns-strided", CFG1, lambda a: {"f_a": a.f_a.t().contiguous().t()}, "f_a", "stride 1"),
    ("output_gate-rows-overlap", CFG1,
     lambda a: {"output_gate": a.output_gate.as_strided(a.output_gate.shape, (100, 1))},
     "output_gate", "row stride >= 256"),
    ("f_b-dtype", CFG1, lambda a: {"f_b": a.f_b.float()}, "f_b", "dtype"),
    ("f_b-misaligned", CFG1, lambda a: {"f_b": _misaligned(a.f_b)}, "f_b", "16-byte aligned"),
    ("beta-shape", CFG1, lambda a: {"beta": a.beta[:, :1]}, "beta", "shape"),
    # an activated fp32 beta passed without beta_activated: the flag says, not the dtype
    ("beta-fp32-without-flag", CFG1, lambda a: {"beta": torch.sigmoid(a.beta.float())}, "beta",
     "expected dtype bfloat16 (raw logits, the op applies the sigmoid; pass beta_activated=True"),
    ("beta-columns-strided", CFG1, lambda a: {"beta": a.beta.t().contiguous().t()}, "beta",
     "stride 1"),
    ("A_log-dtype", CFG1, lambda a: {"A_log": a.A_log.double()}, "A_log", "dtype"),
    # H comes from A_log: one of the wrong length, beside x and state that agree, is A_log's error
    ("A_log-heads", CFG1, lambda a: {"A_log": torch.cat([a.A_log, a.A_log])}, "A_log",
     "expected shape [2] (one value per head: x and state hold 2 heads), got shape [4]"),
    ("A_log-short", CFG1, lambda a: {"A_log": a.A_log[:1]}, "A_log", "got shape [1]"),
    ("dt_bias-shape", CFG1, lambda a: {"dt_bias": a.dt_bias[:128]}, "dt_bias", "shape"),
    ("state-dtype", CFG1, lambda a: {"state": a.state.double()}, "state",
     "expected dtype float32 or bfloat16, got float64"),
    ("state-fp16", CFG1, lambda a: {"state": a.state.half()}, "state",
     "expected dtype float32 or bfloat16 (float16 state pools are not supported), got float16"),
    ("state-bf16-slot-stride", CFG1,
     lambda a: {"state": torch.zeros(a.state.shape[0], 2 * 128 * 128 + 4,
                                     dtype=torch.bfloat16)[:, :2 * 128 * 128].view(-1, 2, 128, 128)},
     "state", "multiple of 8 elements (16 bytes)"),
    ("state-kmajor-view", CFG1, lambda a: {"state": a.state.transpose(2, 3)}, "state", "V-major"),
    ("state-heads", CFG1, lambda a: {"state": a.state[:, :1]}, "state", "shape"),
    ("state_indices-dtype", CFG1, lambda a: {"state_indices": a.state_indices.long()}, "state_indices", "int32"),
    ("state_indices-count", CFG1, lambda a: {"state_indices": a.state_indices[:-1]}, "x", "R*T"),
    ("state_indices-2d-for-T1", CFG1, lambda a: {"state_indices": a.state_indices.view(-1, 1)},
     "state_indices", "expected [R] for T = 1"),
    ("num_accepted-missing", CFG2, lambda a: {"num_accepted_tokens": None}, "num_accepted_tokens", "required"),
    ("num_accepted-dtype", CFG2, lambda a: {"num_accepted_tokens": a.num_accepted_tokens.long()},
     "num_accepted_tokens", "dtype"),
    ("num_accepted-for-T1", CFG1, lambda a: {"num_accepted_tokens": a.state_indices.clone()},
     "num_accepted_tokens", "None"),
    ("output_gate-shape", CFG1, lambda a: {"output_gate": a.output_gate[:, :128]}, "output_gate", "shape"),
    ("norm_weight-shape", CFG1, lambda a: {"norm_weight": torch.ones(64)}, "norm_weight", "shape"),
    ("out-dtype", CFG1, lambda a: {"out": a.out.float()}, "out", "dtype"),
    ("out-aliases-x", CFG1, lambda a: {"out": a.x[:, :256]}, "out", "overlaps"),
    ("device", CFG1, lambda a: {"f_b": a.f_b.to("meta")}, "f_b", "device"),
    ("record-half", CFG1, lambda a: {"v_record": torch.zeros(a.state.shape[0], 2, 1, 128)}, "kg_record",
     "both"),
    ("record-shape", dataclasses.replace(CFG1, record=True),
     lambda a: {"v_record": a.v_record[:, :, :, :64]}, "v_record", "shape"),
]

BAD_SCALARS = [
    ("lower_bound-low", {"lower_bound": -6.0}, "lower_bound"),
    ("lower_bound-zero", {"lower_bound": 0.0}, "lower_bound"),
    ("lower_bound-pos", {"lower_bound": 0.5}, "lower_bound"),
    ("lower_bound-nan", {"lower_bound": float("nan")}, "lower_bound"),
    ("gate_mode", {"gate_mode": 2}, "gate_mode"),
    ("norm_eps", {"norm_eps": 0.0}, "norm_eps"),
    ("scale", {"scale": float("inf")}, "scale"),
    # finite and > 0 in float64, but 0 or inf in fp32, the kernels' precision (an all-zero o
    # then gave NaN rows; found by a contract audit)
    ("norm_eps-fp32-zero", {"norm_eps": 1e-50}, "norm_eps"),
    ("norm_eps-fp32-denormal", {"norm_eps": 1e-40}, "norm_eps"),
    ("scale-fp32-zero", {"scale": 1e-320}, "scale"),
    ("scale-fp32-inf", {"scale": 1e39}, "scale"),
    ("lower_bound-fp32-zero", {"lower_bound": -1e-50}, "lower_bound"),
    # ints too large for a float (an OverflowError before; a breaker's trial)
    ("scale-huge-int", {"scale": 10 ** 400}, "scale"),
    ("norm_eps-huge-int", {"norm_eps": 10 ** 400}, "norm_eps"),
    ("lower_bound-huge-int", {"lower_bound": -10 ** 400}, "lower_bound"),
]


def _assert_untouched(args, before):
    for name in WRITTEN:
        assert bits_equal(getattr(args, name), getattr(before, name)), f"{name} was written"


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_tensor(case, backend_name):
    _, cfg, override, arg, text = case
    args = make_case(CaseSpec(cfg, R=3, null_frac=0.0))
    before = clone_args(args)
    with pytest.raises(KdaArgumentError) as ei:
        kda.kda_decode(**_kwargs(args, **override(args)), lower_bound=cfg.lower_bound,
                       backend=backend_name)
    assert ei.value.arg == arg, str(ei.value)
    assert text in str(ei.value), str(ei.value)
    assert str(ei.value).startswith(f"{arg}: ")
    assert "torch." not in str(ei.value), "dtypes are spelled as 'float32', not 'torch.float32'"
    _assert_untouched(args, before)


@pytest.mark.parametrize("case", BAD_SCALARS, ids=[b[0] for b in BAD_SCALARS])
def test_bad_scalar(case, backend_name):
    _, over, arg = case
    args = make_case(CaseSpec(CFG1, R=2))
    before = clone_args(args)
    with pytest.raises(KdaArgumentError) as ei:
        kda.kda_decode(**_kwargs(args), backend=backend_name, **over)
    assert ei.value.arg == arg
    assert "expected" in str(ei.value) and "got" in str(ei.value)
    _assert_untouched(args, before)


@pytest.mark.parametrize("backend", ["tensorrt", ["reference"]])
def test_unknown_backend_lists_names(backend):
    """A name that is no backend, or no name at all (a list: a TypeError before)."""
    args = make_case(CaseSpec(CFG1, R=2))
    before = clone_args(args)
    with pytest.raises(KdaBackendError) as ei:
        kda.kda_decode(**_kwargs(args), backend=backend)
    for name in kda.CHOICES:
        assert name in str(ei.value)
    _assert_untouched(args, before)


def test_explicit_backend_that_cannot_serve_gives_reasons(monkeypatch):
    from kda import registry

    args = make_case(CaseSpec(CFG1, R=2))
    before = clone_args(args)
    unusable = [n for n in registry.BACKEND_NAMES
                if registry.unsupported_reasons(n, CFG1, args.x.device)]
    if not unusable:
        pytest.skip("every backend can serve this case here")
    name = unusable[0]
    with pytest.raises(KdaBackendError) as ei:
        kda.kda_decode(**_kwargs(args), backend=name)
    for reason in registry.unsupported_reasons(name, CFG1, args.x.device):
        assert reason in str(ei.value)
    _assert_untouched(args, before)


def test_empty_batch_is_a_no_op(backend_name, require_backend, kda_device):
    require_backend(backend_name, CFG1, kda_device)
    args = make_case(CaseSpec(CFG1, R=2), kda_device)
    empty = torch.empty(0, dtype=torch.int32, device=kda_device)
    out = kda.kda_decode(**_kwargs(args, x=args.x[:0], f_a=args.f_a[:0], beta=args.beta[:0],
                                   output_gate=args.output_gate[:0], out=None,
                                   state_indices=empty), backend=backend_name)
    assert out.shape == (0, CFG1.dim)


def test_interleaved_paged_cache_and_fused_slices_are_accepted(backend_name, require_backend, kda_device):
    """vLLM-style pages (a slot's conv window and state side by side in one buffer) and out /
    output_gate as column slices of one buffer share no element: accepted, same results."""
    cfg = KdaConfig(num_heads=2, T=1, window=3)
    require_backend(backend_name, cfg, kda_device)
    a = make_case(CaseSpec(cfg, R=3, null_frac=0.0, seed=31), kda_device)
    slots, dim, L, H = a.state.shape[0], cfg.dim, cfg.window, cfg.num_heads
    cs_bytes, st_bytes = 3 * dim * L * 2, H * 128 * 128 * 4
    page = cs_bytes + st_bytes
    raw = torch.zeros(slots * page, dtype=torch.uint8, device=kda_device)
    cs = torch.as_strided(raw.view(torch.bfloat16), (slots, 3 * dim, L), (page // 2, 1, 3 * dim))
    st = torch.as_strided(raw.view(torch.float32), (slots, H, 128, 128),
                          (page // 4, 128 * 128, 128, 1), cs_bytes // 4)
    cs.copy_(a.conv_state.nan_to_num(0.0))
    st.copy_(a.state.nan_to_num(0.0))
    fused = torch.empty(a.out.shape[0], 2 * dim, dtype=torch.bfloat16, device=kda_device)
    out, gate = fused[:, :dim], fused[:, dim:]
    gate.copy_(a.output_gate)
    ref = clone_args(a._replace(conv_state=cs.clone(), state=st.clone()))
    kda.kda_decode(**_kwargs(a, conv_state=cs, state=st, out=out, output_gate=gate),
                   backend=backend_name)
    kda.kda_decode(**_kwargs(ref, output_gate=gate.clone()), backend="reference")
    assert torch.allclose(out.float(), ref.out.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cs, ref.conv_state)
    assert torch.allclose(st, ref.state, atol=1e-3, rtol=1e-3)


def test_meta_tensors_are_rejected_by_device():
    a = make_case(CaseSpec(CFG1, R=2))
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in _kwargs(a).items()}
    with pytest.raises(KdaArgumentError) as ei:
        kda.kda_decode(**meta)
    assert ei.value.arg == "x" and "meta" in str(ei.value)


def _np_bools(shape):
    np = pytest.importorskip("numpy")
    return np.zeros(shape, dtype=bool)


@pytest.mark.parametrize("over,arg", [({"lower_bound": "-3"}, "lower_bound"), ({"gate_mode": True}, "gate_mode"),
                                       ({"gate_mode": 1.0}, "gate_mode"), ({"scale": "x"}, "scale"),
                                       ({"beta_activated": 1}, "beta_activated"),
                                       ({"beta_activated": "yes"}, "beta_activated"),
                                       ({"early_reads": 1}, "early_reads"),
                                       # numpy bool arrays are not bools (a 0-d one is)
                                       ({"early_reads": lambda: _np_bools((1, 1))}, "early_reads"),
                                       ({"beta_activated": lambda: _np_bools((2,))},
                                        "beta_activated")])
def test_scalar_types_are_checked(over, arg):
    over = {k: v() if callable(v) else v for k, v in over.items()}
    a = make_case(CaseSpec(CFG1, R=2))
    with pytest.raises(KdaArgumentError) as ei:
        kda.kda_decode(**_kwargs(a), **over)
    assert ei.value.arg == arg


def test_object_form_revalidates_when_a_layout_changes():
    a = make_case(CaseSpec(CFG1, R=3))
    step = kda.KdaDecode(CFG1, device="cpu", backend="reference")
    kw = _kwargs(a)
    nacc = kw.pop("num_accepted_tokens")
    kw.pop("v_record"), kw.pop("kg_record")
    step(**kw, num_accepted_tokens=nacc)
    dim_first = a.conv_state.contiguous()              # same values, DS layout
    before = clone_args(a)
    with pytest.raises(KdaArgumentError) as ei:
        step(**{**kw, "conv_state": dim_first}, num_accepted_tokens=nacc)
    assert ei.value.arg == "conv_state"
    assert bits_equal(a.state, before.state)


def _object_kw(a):
    kw = _kwargs(a)
    kw.pop("v_record"), kw.pop("kg_record")
    return kw


def test_object_form_rejects_1d_state_indices_for_verify(backend_name, require_backend, kda_device):
    """A step built for T > 1 given [R] slot ids (the T = 1 form) must refuse, not read
    state_indices[r*T + t] past its end (found by a new-user trial)."""
    require_backend(backend_name, CFG2, kda_device)
    a = make_case(CaseSpec(CFG2, R=2, null_frac=0.0), kda_device)
    step = kda.KdaDecode(CFG2, device=kda_device, backend=backend_name)
    kw = _object_kw(a)
    kw["state_indices"] = a.state_indices[:, 0].contiguous()
    before = clone_args(a)
    with pytest.raises(KdaArgumentError) as ei:
        step(**kw)
    assert ei.value.arg == "state_indices" and "[R, T=2]" in str(ei.value)
    _assert_untouched(a, before)


def test_object_form_names_its_config_for_t_and_record_mismatches():
    """Tensors of another T, or record buffers for a step built without record mode: the
    error names state_indices or the record buffer, and the KdaConfig field that decides
    (found by a new-user trial: x's row count was blamed, and "pass both" was the advice)."""
    a3 = make_case(CaseSpec(KdaConfig(num_heads=2, T=3, window=6), R=3, null_frac=0.0))
    for cfg in (KdaConfig(num_heads=2, T=2, window=6), KdaConfig(num_heads=2, T=1, window=6)):
        step = kda.KdaDecode(cfg, device="cpu", backend="reference")
        kw = _object_kw(a3)
        if cfg.T == 1:
            kw.pop("num_accepted_tokens")
        before = clone_args(a3)
        with pytest.raises(KdaArgumentError) as ei:
            step(**kw)
        assert ei.value.arg == "state_indices", ei.value
        assert f"for T = {cfg.T} (this KdaDecode's KdaConfig.T decides" in str(ei.value)
        assert "got shape [3, 3]" in str(ei.value)
        _assert_untouched(a3, before)
    r = make_case(CaseSpec(dataclasses.replace(CFG2, record=True), R=2, null_frac=0.0))
    step = kda.KdaDecode(CFG2, device="cpu", backend="reference")
    before = clone_args(r)
    with pytest.raises(KdaArgumentError) as ei:
        step(**_kwargs(r))
    assert ei.value.arg == "v_record"
    assert "this KdaDecode's KdaConfig.record is False" in str(ei.value)
    assert "KdaConfig(record=True)" in str(ei.value)
    _assert_untouched(r, before)


@pytest.mark.parametrize("validated_before", [True, False], ids=["seen", "first"])
@pytest.mark.parametrize("name", ["x", "conv_weight", "conv_bias", "conv_state", "f_a", "f_b", "beta",
                                  "A_log", "dt_bias", "state", "state_indices", "output_gate",
                                  "norm_weight", "out"])
def test_object_form_names_a_non_tensor(name, validated_before):
    cfg = dataclasses.replace(CFG1, has_conv_bias=True)
    a = make_case(CaseSpec(cfg, R=2))
    step = kda.KdaDecode(cfg, device="cpu", backend="reference")
    kw = _object_kw(a)
    if validated_before:
        step(**kw)
    before = clone_args(a)
    with pytest.raises(KdaArgumentError) as ei:
        step(**{**kw, name: [1, 2]})
    assert ei.value.arg == name and "list" in str(ei.value)
    _assert_untouched(a, before)


def test_object_form_names_a_conv_state_of_the_wrong_rank():
    a = make_case(CaseSpec(CFG1, R=2))
    step = kda.KdaDecode(CFG1, device="cpu", backend="reference")
    before = clone_args(a)
    for bad in (torch.tensor(1.0), a.conv_state[0]):
        with pytest.raises(KdaArgumentError) as ei:
            step(**{**_object_kw(a), "conv_state": bad})
        assert ei.value.arg == "conv_state" and "3-D" in str(ei.value)
    _assert_untouched(a, before)


@pytest.mark.parametrize("form", ["function", "object", "function-with-out"])
def test_a_0d_x_is_named(form):
    """x of the wrong rank is named before ``out`` is allocated from its first dimension
    (a 0-d x used to raise a bare IndexError; found by a contract audit)."""
    a = make_case(CaseSpec(CFG1, R=2))
    before = clone_args(a)
    x0 = a.x[0, 0]
    with pytest.raises(KdaArgumentError) as ei:
        if form == "object":
            kw = {**_object_kw(a), "x": x0}
            kw.pop("out")
            kda.KdaDecode(CFG1, device="cpu", backend="reference")(**kw)
        else:
            kw = _kwargs(a, x=x0)
            if form == "function":
                kw.pop("out")
            kda.kda_decode(**kw, backend="reference")
    assert ei.value.arg == "x" and "2-D" in str(ei.value)
    _assert_untouched(a, before)


def test_numpy_scalars_are_accepted():
    np = pytest.importorskip("numpy")
    a = make_case(CaseSpec(CFG1, R=2))
    b = clone_args(a)
    kda.kda_decode(**_kwargs(a), lower_bound=np.float32(-1.0), gate_mode=np.int64(1),
                   backend="reference")
    kda.kda_decode(**_kwargs(b), lower_bound=-1.0, gate_mode=1, backend="reference")
    assert bits_equal(a.out, b.out) and bits_equal(a.state, b.state)
    # in a KdaConfig too (lower_bound was refused there as not a float)
    import dataclasses
    cfg = dataclasses.replace(CFG1, lower_bound=np.float32(-1.0))
    kda.KdaDecode(cfg, device="cpu", backend="reference")


def test_config_and_batch_arguments_are_checked():
    """KdaDecode takes a KdaConfig; backend_for takes a batch size >= 1; x with R*T rows but a
    1-D state_indices points at the [R, T] form (found by a new-user trial)."""
    with pytest.raises(KdaArgumentError) as ei:
        kda.KdaDecode({"num_heads": 2}, device="cpu", backend="reference")
    assert ei.value.arg == "cfg"
    step = kda.KdaDecode(CFG1, device="cpu", backend="reference")
    for bad in (0, -3, 1.5, True):
        with pytest.raises(KdaArgumentError) as ei:
            step.backend_for(bad)
        assert ei.value.arg == "batch"
    assert step.backend_for(7) == "reference"
    a = make_case(CaseSpec(CFG2, R=3), torch.device("cpu"))
    with pytest.raises(KdaArgumentError) as ei:
        kda.kda_decode(**_kwargs(a, state_indices=a.state_indices[:, 0].contiguous()),
                       backend="reference")
    assert ei.value.arg == "x" and "[R, T]" in str(ei.value)


def test_a_sliced_conv_cache_names_its_shape():
    """A conv cache sliced to fewer channels has neither layout's strides; the message gives
    the shape beside the strides, since the channel count is what is wrong (found by a
    new-user trial)."""
    a = make_case(CaseSpec(CFG1, R=2))
    before = clone_args(a)
    cs = a.conv_state[:, :-8, :]
    with pytest.raises(KdaArgumentError) as ei:
        kda.kda_decode(**_kwargs(a, conv_state=cs), backend="reference")
    assert ei.value.arg == "conv_state" and str(list(cs.shape)) in str(ei.value)
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a, name), getattr(before, name)), name


def test_bits_equal_takes_every_float_width():
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        t = torch.tensor([1.0, float("nan"), -0.0], dtype=dt)
        assert bits_equal(t, t.clone()) and not bits_equal(t, t.abs())


def test_config_window_defaults_to_t_plus_2():
    assert [KdaConfig(num_heads=2, T=t).window for t in (1, 2, 5)] == [3, 4, 7]
    assert KdaConfig(num_heads=2, T=2, window=6).window == 6
    assert KdaConfig(num_heads=2) == KdaConfig(num_heads=2, window=3)  # one compiled kernel
    with pytest.raises(KdaArgumentError) as ei:  # a bad T is named before the window
        KdaConfig(num_heads=2, T="2")
    assert ei.value.arg == "T"
    with pytest.raises(KdaArgumentError) as ei:
        KdaConfig(num_heads=2, T=3, window=4)
    assert ei.value.arg == "window" and "default T + 2" in str(ei.value)
    # derived from a call, the error names the argument the window comes from
    a = make_case(CaseSpec(KdaConfig(num_heads=2), R=2))
    with pytest.raises(KdaArgumentError) as ei:
        kda.kda_decode(**_kwargs(a, state_indices=a.state_indices.view(-1, 2).contiguous(),
                                 num_accepted_tokens=a.state_indices[:1].contiguous()),
                       backend="reference")
    assert ei.value.arg == "conv_state" and "conv_state.shape[2]" in str(ei.value), str(ei.value)
    # a copy made for another T keeps its window: the call's error says where L comes from
    t2 = dataclasses.replace(KdaConfig(num_heads=2), T=2, window=None)
    assert t2.window == 4
    t1 = dataclasses.replace(t2, T=1)                  # keeps window 4
    a = make_case(CaseSpec(KdaConfig(num_heads=2), R=2))
    with pytest.raises(KdaArgumentError) as ei:
        kda.KdaDecode(t1, device="cpu", backend="reference")(**_object_kw(a))
    assert ei.value.arg == "conv_state" and "expected L = 4" in str(ei.value)
    assert "KdaConfig.window" in str(ei.value)


def test_object_form_names_a_missing_conv_bias():
    """A KdaDecode configured with a conv bias, called without one: the error says why."""
    cfg = dataclasses.replace(CFG1, has_conv_bias=True)
    a = make_case(CaseSpec(cfg, R=2))
    before = clone_args(a)
    with pytest.raises(KdaArgumentError) as ei:
        kda.KdaDecode(cfg, device="cpu", backend="reference")(**{**_object_kw(a), "conv_bias": None})
    assert ei.value.arg == "conv_bias" and "got None" in str(ei.value), str(ei.value)
    _assert_untouched(a, before)


def test_object_form_names_a_bad_device():
    with pytest.raises(KdaArgumentError) as ei:
        kda.KdaDecode(CFG1, device="gpu", backend="reference")
    assert ei.value.arg == "device" and "'gpu'" in str(ei.value), str(ei.value)


def test_beta_form_comes_from_the_flag(backend_name):
    """``beta_activated`` says what beta is, never beta's dtype: a bf16 beta with the flag set
    (functional and object form) is refused naming beta with the expected and the given
    dtype, before anything is written (the reverse case is in BAD)."""
    cfg = dataclasses.replace(CFG1, beta_activated=True)
    a = make_case(CaseSpec(CFG1, R=3, null_frac=0.0))          # bf16 logits
    before = clone_args(a)
    with pytest.raises(KdaArgumentError) as ei:
        kda.kda_decode(**_kwargs(a), beta_activated=True, backend=backend_name)
    assert ei.value.arg == "beta"
    assert "expected dtype float32 (beta_activated=True" in str(ei.value)
    assert "got bfloat16" in str(ei.value)
    with pytest.raises(KdaArgumentError) as ei:
        kda.KdaDecode(cfg, device="cpu", backend="reference")(**_object_kw(a))
    assert ei.value.arg == "beta" and "got bfloat16" in str(ei.value)
    _assert_untouched(a, before)
    # with the flag and an fp32 beta it runs: the beta values as given, no sigmoid
    b = make_case(CaseSpec(cfg, R=3, null_frac=0.0))
    c = clone_args(b)
    kda.kda_decode(**_kwargs(b), beta_activated=True, backend="reference")
    kda.kda_decode(**_kwargs(c, beta=torch.logit(c.beta.double()).to(torch.bfloat16)),
                   backend="reference")
    assert torch.allclose(b.out.float(), c.out.float(), atol=2e-2, rtol=2e-2)


def test_any_row_pitch_and_element_alignment_is_accepted():
    """x, beta and f_a as slices of an engine's packed projection (row pitch 385*H + 256: odd
    at H = 3), output_gate and out one element into wider rows: accepted as they are, and
    the same bits as contiguous copies of the same values."""
    cfg = KdaConfig(num_heads=3, T=2, window=4)
    a = make_case(CaseSpec(cfg, R=3, packed=True, offset_rows=True, seed=32))
    assert a.x.stride(0) == 385 * 3 + 256 and a.f_a.data_ptr() % 4 == 2
    assert a.output_gate.data_ptr() % 4 == 2 and a.out.data_ptr() % 4 == 2
    b = clone_args(a)
    dense = {n: getattr(b, n).contiguous() for n in ("x", "beta", "f_a", "output_gate", "out")}
    kda.kda_decode(**_kwargs(a), backend="reference")
    kda.kda_decode(**_kwargs(b, **dense), backend="reference")
    assert bits_equal(a.out, dense["out"]) and bits_equal(a.state, b.state)
    assert bits_equal(a.conv_state, b.conv_state)


def test_object_form_names_the_state_dtype():
    """KdaDecode's configuration fixes the state dtype: a pool of the other dtype is an error
    naming ``state`` with the expected and the given dtype, and nothing is written."""
    args = make_case(CaseSpec(CFG1, R=2))
    before = clone_args(args)
    step = kda.KdaDecode(CFG1, device="cpu", backend="reference")
    with pytest.raises(KdaArgumentError) as ei:
        step(**_kwargs(args, state=args.state.to(torch.bfloat16)))
    assert ei.value.arg == "state"
    assert "expected dtype float32" in str(ei.value) and "got bfloat16" in str(ei.value)
    _assert_untouched(args, before)


def test_object_form_names_where_its_head_count_comes_from():
    """A KdaDecode built for H=2 given tensors of H=4: the error names x with both head counts
    and says that H is the object's configuration (not A_log, as in the functional form)."""
    args = make_case(CaseSpec(dataclasses.replace(CFG1, num_heads=4), R=2))
    before = clone_args(args)
    step = kda.KdaDecode(CFG1, device="cpu", backend="reference")
    with pytest.raises(KdaArgumentError) as ei:
        step(**_kwargs(args))
    assert str(ei.value) == ("x: expected 768 channels (3 x H=2 heads x D=128; H from this "
                             "KdaDecode's KdaConfig.num_heads), got 1536 (= 4 heads)")
    _assert_untouched(args, before)


def test_object_form_says_its_config_decides_the_head_count_of_a_log():
    """A KdaDecode given an A_log of the wrong length (x and state right): the error names
    A_log and says that the head count it expects is the object's KdaConfig's."""
    args = make_case(CaseSpec(CFG1, R=2))
    before = clone_args(args)
    step = kda.KdaDecode(CFG1, device="cpu", backend="reference")
    with pytest.raises(KdaArgumentError) as ei:
        step(**{**_object_kw(args), "A_log": torch.cat([args.A_log, args.A_log])})
    assert str(ei.value) == ("A_log: expected shape [2] (one value per head; H = 2 from this "
                             "KdaDecode's KdaConfig.num_heads), got [4]")
    _assert_untouched(args, before)


@pytest.mark.parametrize("name,field", [("conv_state", "conv_state_dtype"),
                                        ("state", "state_dtype"),
                                        ("conv_weight", "conv_weight_dtype"),
                                        ("norm_weight", "norm_weight_dtype")])
def test_object_form_says_its_config_decides_a_dtype(name, field):
    """A KdaDecode given a cache or weight of the other accepted dtype (an fp32 conv_state
    to a default KdaConfig, whose conv_state_dtype is bf16): the error names the argument
    and says that the object's KdaConfig field decides; nothing is written."""
    args = make_case(CaseSpec(CFG1, R=2))
    before = clone_args(args)
    step = kda.KdaDecode(CFG1, device="cpu", backend="reference")
    t = getattr(args, name)
    other = torch.bfloat16 if t.dtype == torch.float32 else torch.float32
    with pytest.raises(KdaArgumentError) as ei:
        step(**{**_object_kw(args), name: t.to(other)})
    assert ei.value.arg == name
    assert (f"(this KdaDecode's KdaConfig.{field} decides), got "
            f"{str(other).replace('torch.', '')}") in str(ei.value), str(ei.value)
    _assert_untouched(args, before)


def _made_in_inference_mode(t):
    with torch.inference_mode():
        return t.clone()


@pytest.mark.parametrize("name", ["conv_state", "state", "out"])
def test_inference_tensors_are_written_only_in_inference_mode(name, backend_name, require_backend,
                                                             kda_device):
    """A written buffer made under torch.inference_mode() (as engines make their caches):
    refused outside inference mode, naming it, with nothing written (the reference raised
    from inside the step, after writing out and part of the windows; a GPU kernel wrote it
    unasked); inside inference mode the step runs as with a normal tensor."""
    require_backend(backend_name, CFG1, kda_device)
    a = make_case(CaseSpec(CFG1, R=3, null_frac=0.0), kda_device)
    with torch.no_grad():
        plain = clone_args(a)
    kda.kda_decode(**_kwargs(plain), backend=backend_name)
    a = a._replace(**{name: _made_in_inference_mode(getattr(a, name))})
    before = clone_args(a)
    with pytest.raises(KdaArgumentError, match="inference tensor") as ei:
        kda.kda_decode(**_kwargs(a), backend=backend_name)
    assert ei.value.arg == name
    _assert_untouched(a, before)
    with torch.inference_mode():
        kda.kda_decode(**_kwargs(a), backend=backend_name)
    for n in ("out", "state", "conv_state"):
        assert bits_equal(getattr(a, n), getattr(plain, n)), n


@pytest.mark.parametrize("name", ["conv_state", "state"])
def test_buffers_that_require_grad_are_written_only_without_grad_mode(name, backend_name,
                                                                     require_backend, kda_device):
    """A written buffer with requires_grad=True: refused while grad mode is on, naming it,
    nothing written (the write would bypass autograd; a compiled step crashed in autograd's
    epilogue after writing the window); under torch.no_grad() the step runs. In record mode
    the state is only read: accepted."""
    require_backend(backend_name, CFG1, kda_device)
    a = make_case(CaseSpec(CFG1, R=3, null_frac=0.0), kda_device)
    getattr(a, name).requires_grad_(True)
    with torch.no_grad():
        before = clone_args(a)
    with pytest.raises(KdaArgumentError, match="requires_grad=True") as ei:
        kda.kda_decode(**_kwargs(a), backend=backend_name)
    assert ei.value.arg == name
    with torch.no_grad():
        _assert_untouched(a, before)
        kda.kda_decode(**_kwargs(a), backend=backend_name)
    cfg_rec = dataclasses.replace(CFG1, record=True)
    require_backend(backend_name, cfg_rec, kda_device)
    rec = make_case(CaseSpec(cfg_rec, R=2, null_frac=0.0), kda_device)
    rec.state.requires_grad_(True)
    kda.kda_decode(**_kwargs(rec), backend=backend_name)


def test_object_form_checks_the_write_mode_of_each_call():
    """The object form validates once per argument metadata; a later call with the same
    metadata but an inference-tensor cache, or outside the mode it first ran in, is checked."""
    a = make_case(CaseSpec(CFG1, R=3, null_frac=0.0))
    step = kda.KdaDecode(CFG1, device="cpu", backend="reference")
    kw = _object_kw(a)
    with torch.inference_mode():
        kw_inf = {**kw, "state": _made_in_inference_mode(a.state)}
        step(**kw_inf)
    step(**kw)
    before = clone_args(a)
    with pytest.raises(KdaArgumentError, match="inference tensor") as ei:
        step(**kw_inf)
    assert ei.value.arg == "state"
    _assert_untouched(a, before)
