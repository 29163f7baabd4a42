"""Backend choice: argument > --kda_backend flag > $KDA_BACKEND > auto; logging once; errors."""

import logging as pylogging
import os
import subprocess
import sys

import pytest
import torch
from absl import flags

import kda
import kda.flags  # noqa: F401  (a server's import: defines --kda_backend)
from kda import auto, registry
from kda.config import KdaConfig
from kda.errors import KdaBackendError
from kda.testing import CaseSpec, make_case

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = KdaConfig(num_heads=2)


@pytest.fixture
def parsed_flags():
    def parse(*argv):
        FLAGS.unparse_flags()
        FLAGS(["prog", *argv])
    yield parse
    FLAGS.unparse_flags()


def test_status_lists_every_backend_with_a_reason_or_none():
    rows = registry.status()
    assert [r[0] for r in rows] == list(registry.BACKEND_NAMES)
    for name, why, desc in rows:
        assert why is None or (isinstance(why, str) and why)
    assert dict((r[0], r[1]) for r in rows)["reference"] is None


def test_default_is_auto_and_auto_picks_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    assert registry.requested_name() == ("auto", "default")
    assert registry.resolve(CFG, torch.device("cpu")).name == "reference"


def test_import_kda_defines_no_flag_and_imports_no_absl():
    """Only a server's ``import kda.flags`` defines --kda_backend; ``import kda`` leaves absl
    alone (a fresh interpreter: this test process has imported kda.flags)."""
    code = ("import sys, kda; assert 'absl' not in sys.modules, 'absl imported'; "
            "assert 'kda.flags' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_env_var(monkeypatch):
    monkeypatch.setenv("KDA_BACKEND", "reference")
    assert registry.requested_name() == ("reference", "env KDA_BACKEND")


def test_flag_wins_over_env(monkeypatch, parsed_flags):
    monkeypatch.setenv("KDA_BACKEND", "triton")
    parsed_flags("--kda_backend=reference")
    assert registry.requested_name() == ("reference", "flag --kda_backend")
    # and an explicit argument wins over both
    assert registry.requested_name("cuda") == ("cuda", "argument")


def test_flag_rejects_unknown_names(parsed_flags):
    with pytest.raises(flags.IllegalFlagValueError) as ei:
        parsed_flags("--kda_backend=tensorrt")
    assert "cutedsl_wide" in str(ei.value)


def test_unknown_env_name_lists_valid_names(monkeypatch):
    monkeypatch.setenv("KDA_BACKEND", "tensorrt")
    with pytest.raises(KdaBackendError) as ei:
        registry.resolve(CFG, torch.device("cpu"))
    msg = str(ei.value)
    assert "env KDA_BACKEND" in msg and all(n in msg for n in registry.CHOICES)


def test_vllm_outside_the_plugin_says_whose_setting_it_is(monkeypatch):
    """``KDA_BACKEND=vllm`` (the vLLM plugin's value) outside vLLM: the error says so."""
    monkeypatch.setenv("KDA_BACKEND", "vllm")
    with pytest.raises(KdaBackendError, match="setting of the vLLM plugin only"):
        registry.resolve(CFG, torch.device("cpu"))


def test_choice_is_logged_once(monkeypatch, caplog):
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    registry._logged.clear()
    cfg = KdaConfig(num_heads=3)
    with caplog.at_level(pylogging.INFO, logger="kda"):
        for _ in range(3):
            registry.resolve(cfg, torch.device("cpu"), "reference")
    hits = [r for r in caplog.records if "KDA decode backend: reference" in r.getMessage()]
    assert len(hits) == 1


def test_kda_decode_object_validates_once(monkeypatch):
    from kda import op
    calls = []
    real = op.validate_args
    monkeypatch.setattr(op, "validate_args", lambda *a, **kw: (calls.append(1), real(*a, **kw)))
    step = kda.KdaDecode(CFG, device="cpu", backend="reference")
    a = make_case(CaseSpec(CFG, R=3))
    for _ in range(3):
        step(a.x, a.conv_weight, a.conv_bias, a.conv_state, a.f_a, a.f_b, a.beta, a.A_log,
             a.dt_bias, a.state, a.state_indices, a.output_gate, a.norm_weight, out=a.out)
    assert len(calls) == 1
    b = make_case(CaseSpec(CFG, R=5))   # a new batch size validates again
    step(b.x, b.conv_weight, b.conv_bias, b.conv_state, b.f_a, b.f_b, b.beta, b.A_log,
         b.dt_bias, b.state, b.state_indices, b.output_gate, b.norm_weight)
    assert len(calls) == 2
    # batch sizes that come back are not validated again (eager decoding alternates them;
    # only the last one was remembered before: a new-user trial measured 50 us a call)
    for c in (a, b, a, b):
        step(c.x, c.conv_weight, c.conv_bias, c.conv_state, c.f_a, c.f_b, c.beta, c.A_log,
             c.dt_bias, c.state, c.state_indices, c.output_gate, c.norm_weight, out=c.out)
    assert len(calls) == 2
    assert step.backend_name == "reference"


def test_kda_decode_object_remembers_a_bounded_number_of_layouts(monkeypatch):
    from kda import op
    monkeypatch.setattr(op, "VALIDATED_KEYS", 3)
    step = kda.KdaDecode(CFG, device="cpu", backend="reference")
    for R in (1, 2, 3, 4, 5):
        c = make_case(CaseSpec(CFG, R=R))
        step(c.x, c.conv_weight, c.conv_bias, c.conv_state, c.f_a, c.f_b, c.beta, c.A_log,
             c.dt_bias, c.state, c.state_indices, c.output_gate, c.norm_weight, out=c.out)
        assert 1 <= len(step._validated) <= 3


def test_kda_decode_object_matches_functional_form():
    a = make_case(CaseSpec(CFG, R=4, seed=9))
    out1 = kda.KdaDecode(CFG, device="cpu")(
        a.x, a.conv_weight, a.conv_bias, a.conv_state.clone(), a.f_a, a.f_b, a.beta, a.A_log,
        a.dt_bias, a.state.clone(), a.state_indices, a.output_gate, a.norm_weight)
    out2 = kda.kda_decode(a.x, a.conv_weight, a.conv_bias, a.conv_state.clone(), a.f_a, a.f_b,
                          a.beta, a.A_log, a.dt_bias, a.state.clone(), a.state_indices,
                          a.output_gate, a.norm_weight)
    assert torch.equal(out1, out2)


def test_stream_buffers_on_the_cpu():
    """kda.backend.StreamBuffers off CUDA (one stream, key 0): zeroed buffers start at zero,
    grow at least twofold and keep the outgrown one; a spare is kept for a stream first seen
    during capture (used on the GPU, tests/backends/*)."""
    from kda.backend import StreamBuffers, current_stream_handle
    assert current_stream_handle(torch.device("cpu")) == 0
    b = StreamBuffers(torch.device("cpu"), torch.int32, True, "counters", min_elems=4)
    assert b.current() is None and b.spare is not None and b.spare.numel() == 4
    first = b.get(3)
    assert first.numel() == 4 and int(first.abs().sum()) == 0 and b.get(4) is first
    first.fill_(7)                        # what a kernel must not leave behind; kept as is
    grown = b.get(5)
    assert grown.numel() == 8 and int(grown.abs().sum()) == 0 and b.current() is grown
    assert b.kept[0] == [first, grown] and b.spare.numel() >= 8
    assert list(b.newest().values()) == [grown]
    scratch = StreamBuffers(torch.device("cpu"), torch.float32, False, "scratch")
    assert scratch.spare is None and scratch.get(10).numel() == 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_buffers_per_stream_and_in_capture():
    """Two streams get two buffers; a stream first seen during CUDA-graph capture takes the
    zeroed spare (never memory made inside the capture, which holds garbage until that graph's
    first replay); with no spare large enough it refuses with a message saying what to do."""
    from kda.backend import StreamBuffers
    dev = torch.device("cuda")
    b = StreamBuffers(dev, torch.int32, True, "counters", min_elems=2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        c1 = b.get(2)
    with torch.cuda.stream(s2):
        c2 = b.get(2)
    assert c1.data_ptr() != c2.data_ptr()
    spare = b.spare
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c3 = b.get(2)
    assert c3 is spare and b.spare is None
    assert c3.tolist() == [0, 0]
    with torch.cuda.stream(s1):
        assert b.get(2) is c1 and b.spare is not None      # the eager call made a new spare
    g2 = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="eager step"):
        with torch.cuda.graph(g2, stream=torch.cuda.Stream()):
            b.get(1000)


CFG_BF16 = KdaConfig(num_heads=2, state_dtype=torch.bfloat16)


@pytest.mark.parametrize("name", registry.BACKEND_NAMES)
def test_every_backend_serves_a_bf16_state(name):
    """No backend declines a bf16 state pool: the reasons for it are those for fp32."""
    b = registry.get_backend(name)
    for dev in ("cpu", "cuda"):
        assert b.unsupported(CFG_BF16, torch.device(dev)) == b.unsupported(CFG, torch.device(dev))


def test_auto_ranks_every_gpu_backend_for_a_bf16_state(monkeypatch):
    """On a (pretend) GPU where every backend runs, auto's plan for a bf16 state follows the
    bf16 table (kda.auto.MEASURED["bf16"]) and ranks every GPU backend; the step is the
    table's first backend where every row has the same one, else a per-batch choice."""
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    monkeypatch.setattr(registry, "unsupported_reasons", lambda n, cfg, dev: [])
    cfg = KdaConfig(num_heads=32, state_dtype=torch.bfloat16)
    plan = registry.plan(cfg, torch.device("cuda"))
    for r, order in plan.items():
        assert set(order) >= {"cuda", "cutedsl", "cutedsl_wide", "triton"}, (r, order)
        assert order[0] == auto.MEASURED["bf16"][1][r][0], (r, order)
    got = registry.resolve(cfg, torch.device("cuda"))
    firsts = {order[0] for order in plan.values()}
    if len(firsts) == 1:
        assert got.name == firsts.pop()
    else:
        assert {r: c[0].name for r, c in got.candidates.items()} == {
            r: order[0] for r, order in plan.items()}


def test_auto_on_cpu_serves_a_bf16_state_with_the_reference(monkeypatch):
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    assert registry.resolve(CFG_BF16, torch.device("cpu")).name == "reference"


def test_one_cache_folder_scheme(monkeypatch, tmp_path):
    """Every on-disk cache is a folder of $KDA_CACHE_DIR, else of ~/.cache/kda: the CUDA
    extension's build (per source fingerprint) in cuda_ext/, the CuTe DSL kernels in
    cutedsl/ (the serve tool's checkpoint: tests/tools/serve)."""
    from kda.backend import cache_dir
    from kda.backends.cuda import build
    from kda.backends.cutedsl.static import default_cache_dir

    for env, root in ((str(tmp_path / "c"), tmp_path / "c"),
                      (None, tmp_path / "home" / ".cache" / "kda")):
        if env is None:
            monkeypatch.delenv("KDA_CACHE_DIR")
            monkeypatch.setenv("HOME", str(tmp_path / "home"))
        else:
            monkeypatch.setenv("KDA_CACHE_DIR", env)
        assert cache_dir("x") == root / "x"
        assert build.cache_dir().parent == root / "cuda_ext"
        assert default_cache_dir() == str(root / "cutedsl")
    assert not (tmp_path / "c").exists()          # naming a folder creates nothing


def test_python_m_kda_refuses_arguments(capsys):
    """``python3 -m kda`` takes no arguments: one is refused (exit 2) rather than ignored;
    ``--help`` prints what it reports (exit 0)."""
    from kda.__main__ import main
    assert main(["bogus"]) == 2
    out = capsys.readouterr()
    assert "takes no arguments, got bogus" in out.err and "python3 -m kda" in out.out
    assert main(["--help"]) == 0
    assert "which backends run here" in capsys.readouterr().out


def test_python_m_kda_says_when_kda_backend_names_no_backend(monkeypatch, capsys):
    """``KDA_BACKEND=bogus python3 -m kda`` says the value is refused (it said nothing)."""
    from kda.__main__ import main
    monkeypatch.setenv("KDA_BACKEND", "bogus")
    monkeypatch.setenv("COLUMNS", "200")
    assert main([]) == 0
    assert "unknown KDA backend 'bogus' (from env KDA_BACKEND)" in capsys.readouterr().out
