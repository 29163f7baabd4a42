"""The cuda backend's host side on the CPU (no GPU, no nvcc needed): the launch policy, the
launcher's argument order against the binding's, the environment it reads, the build cache."""

import ast
import re
import types

import pytest
import torch

from kda.backends.cuda import backend, build, policy
from kda.config import KdaArgs
from kda.testing import make_config

BINDING = build.HERE / "binding.cpp"


def _binding_step_params():
    """(C++ parameter names of step(), names of its py::arg list), from binding.cpp."""
    src = BINDING.read_text()
    sig = re.search(r"\nvoid step\((.*?)\)\s*\{", src, re.S).group(1)
    cpp = [re.search(r"(\w+)\s*$", p.strip()).group(1) for p in sig.split(",")]
    m_def = re.search(r'm\.def\("step",(.*?)\);', src, re.S).group(1)
    py = re.findall(r'py::arg\("(\w+)"\)', m_def)
    return cpp, py


def test_policy_covers_every_build():
    """One entry per T the kernel is built for and state dtype, each choice with a one-line
    reason carrying its figure; no T beyond them."""
    assert sorted(policy.POLICY) == [(t, bf) for t in range(1, backend.MAX_T + 1)
                                     for bf in (False, True)]
    for (T, bf), pol in policy.POLICY.items():
        assert policy.policy(T, bf) is pol
        assert 0.0 <= pol.static_fraction <= 1.0, T
        assert isinstance(pol.fb_smem, bool), T
        assert pol.fb_smem == (T == 1 or bf), (T, bf)   # the builds kda_decode.cu has
        assert len(pol.why) == 2, (T, pol.why)        # static_fraction, fb_smem
        for line in pol.why:
            assert "\n" not in line and re.search(r"\d", line), (T, line)
    assert policy.policy(3) is policy.policy(3, False)
    with pytest.raises(KeyError):
        policy.policy(backend.MAX_T + 1)


def test_binding_names_the_record_fields_in_order():
    """binding.cpp's step() takes KdaArgs's tensors first, in the record's field order, and
    its py::arg names are its C++ parameters."""
    cpp, py = _binding_step_params()
    assert cpp == py
    assert tuple(py[:len(KdaArgs._fields)]) == KdaArgs._fields


@pytest.mark.parametrize("cfg", [make_config(4, 1, lb=-5.0, gm=1, record=True),
                                 make_config(2, 3, "DS", bias=True, beta_act=True),
                                 make_config(3, 2, bf16_state=True)],
                         ids=lambda c: c.short())
def test_launcher_matches_the_binding(cfg, monkeypatch):
    """The built step passes the record's tensors unchanged, then the configuration and the
    policy, as many arguments as the binding declares; the counters are one zeroed int32 pair."""
    calls = []
    monkeypatch.setattr(build, "load", lambda verbose=False: types.SimpleNamespace(
        step=lambda *a, **kw: calls.append((a, kw))))
    step = backend.BACKEND.build(cfg, torch.device("cpu"))
    args = KdaArgs(*(object() for _ in KdaArgs._fields))
    step(args)
    step(args)
    _, names = _binding_step_params()
    (a, kw), (a2, _) = calls
    assert kw == {} and len(a) == len(names)
    got = dict(zip(names, a))
    assert all(got[f] is getattr(args, f) for f in KdaArgs._fields)
    pol = policy.policy(cfg.T, cfg.state_dtype == torch.bfloat16)
    assert (got["num_heads"], got["T"], got["scale"], got["norm_eps"], got["lower_bound"],
            got["gate_mode"], got["record"], got["beta_activated"]) == (
        cfg.num_heads, cfg.T, cfg.scale, cfg.norm_eps, cfg.lower_bound, cfg.gate_mode,
        cfg.record, cfg.beta_activated)
    assert (got["static_fraction"], got["fb_smem"]) == (pol.static_fraction, pol.fb_smem)
    sched = got["sched"]
    assert sched.dtype == torch.int32 and sched.numel() >= 2 and not sched.any()
    assert a2[names.index("sched")] is sched      # the same pair on the same stream


def test_reads_no_environment():
    """The backend's modules read no environment variable: the cache folder comes from
    kda.backend.cache_dir, the one place that reads KDA_CACHE_DIR."""
    read = []
    for path in sorted(build.HERE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                read.append((path.name, node.lineno))
            if isinstance(node, ast.ImportFrom) and node.module == "kda.backend":
                assert not [a.name for a in node.names if a.name.endswith("_from_env")], path
    assert read == [], read


def test_cache_dir_is_keyed_on_sources_and_flags(monkeypatch, tmp_path):
    """$KDA_CACHE_DIR/cuda_ext/<fingerprint>/ (else ~/.cache/kda/cuda_ext/<fingerprint>/), the
    module named after the same fingerprint, which changes with any source, header or flag."""
    monkeypatch.setenv("KDA_CACHE_DIR", str(tmp_path / "cache"))
    first = build.cache_dir()
    assert first.parent == tmp_path / "cache" / "cuda_ext"
    assert build.module_name() == f"kda_cuda_{first.name}"
    monkeypatch.delenv("KDA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_dir() == tmp_path / "home" / ".cache" / "kda" / "cuda_ext" / first.name

    srcs = tmp_path / "src"
    srcs.mkdir()
    for name in build.SOURCES + build.HEADERS:
        (srcs / name).write_bytes((build.HERE / name).read_bytes())
    monkeypatch.setattr(build, "HERE", srcs)
    assert build.cache_dir().name == first.name
    seen = {first.name}
    for name in build.SOURCES + build.HEADERS:
        (srcs / name).write_bytes((srcs / name).read_bytes() + b"\n// changed\n")
        seen.add(build.cache_dir().name)
    monkeypatch.setattr(build, "CUDA_FLAGS", build.CUDA_FLAGS + ["-DX"])
    seen.add(build.cache_dir().name)
    assert len(seen) == 2 + len(build.SOURCES + build.HEADERS)


def test_load_imports_a_built_library_without_compiling(monkeypatch, tmp_path):
    """A module already built into the cache directory is imported, not compiled again, and
    later calls return the same module."""
    monkeypatch.setenv("KDA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_module", None)
    lib = build.cache_dir() / f"{build.module_name()}.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    imported = []
    sentinel = types.ModuleType("kda_cuda_test")
    monkeypatch.setattr(build, "_import_library",
                        lambda path, name: imported.append((path, name)) or sentinel)
    from torch.utils import cpp_extension

    def no_compile(**kw):
        raise AssertionError("compiled although the library is built")

    monkeypatch.setattr(cpp_extension, "load", no_compile)
    assert build.load() is sentinel and build.load() is sentinel
    assert imported == [(lib, build.module_name())]


def test_load_without_a_built_library_on_cpu_torch_says_so(monkeypatch, tmp_path):
    """With nothing built and a CPU build of torch, load names the cause instead of failing
    inside the compiler, and compiles nothing."""
    import torch
    from torch.utils import cpp_extension

    monkeypatch.setenv("KDA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(torch.version, "cuda", None)

    def no_compile(**kw):
        raise AssertionError("compiled with a CPU build of torch")

    monkeypatch.setattr(cpp_extension, "load", no_compile)
    with pytest.raises(RuntimeError, match="needs a CUDA build of torch"):
        build.load()
