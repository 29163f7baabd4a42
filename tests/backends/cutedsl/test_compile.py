"""Compile both CuTe DSL kernels for sm_90a on a machine without a GPU, across every axis.

Every configuration axis (T in {1, 2, 3, 5, 7, 8}, both conv layouts, both gates, gate_mode
0/1, conv bias, record mode, conv_state fp32, bf16 conv / norm weights, odd head counts, long
windows) is exercised by *both* kernels, built as the backend builds them, through a covering
set of configurations (the full product would take too long on 2 cores). For each compiled
kernel the PTX is checked for the instructions the design relies on (tensor-core gate MMA,
16-byte cp.async staging, 16-byte state stores, griddepcontrol) and, when ``cuobjdump`` is
available, the register count for 2 CTAs per SM. Also checked without a GPU: the runtime scalars
(scale, norm_eps, lower_bound) are not part of the compile key, the shared-memory plan fits
two CTAs per SM, and the on-disk cache round-trips.

Run with ``CUTE_DSL_ARCH=sm_90a`` (the Bazel target sets it).
"""

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

_DUMP = tempfile.mkdtemp(prefix="kda_cutedsl_dump_")
atexit.register(shutil.rmtree, _DUMP, True)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_KEEP", "ptx,cubin")
os.environ.setdefault("CUTE_DSL_DUMP_DIR", _DUMP)

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")

import torch  # noqa: E402

from kda.backends.cutedsl import cache  # noqa: E402
from kda.backends.cutedsl.backend import kernel_static  # noqa: E402
from kda.backends.cutedsl.static import KernelStatic, SmemPlan  # noqa: E402
from kda.config import KdaConfig  # noqa: E402

bf16, f32 = torch.bfloat16, torch.float32

#: A covering set: every axis value appears, mixed with different T and H.
CONFIGS = [
    KdaConfig(num_heads=32, T=1, window=3),
    KdaConfig(num_heads=4, T=2, window=4, conv_layout="DS", lower_bound=-5.0, gate_mode=1,
              has_conv_bias=True, conv_weight_dtype=bf16, norm_weight_dtype=bf16),
    KdaConfig(num_heads=12, T=5, window=7, gate_mode=1, record=True, conv_state_dtype=f32),
    KdaConfig(num_heads=1, T=8, window=10, conv_layout="DS", has_conv_bias=True, record=True,
              norm_weight_dtype=bf16),
    KdaConfig(num_heads=96, T=8, window=12, lower_bound=-2.5, conv_state_dtype=f32,
              conv_weight_dtype=bf16),
    KdaConfig(num_heads=8, T=5, window=11, conv_layout="DS", lower_bound=-1.0, record=True,
              conv_state_dtype=f32),
    KdaConfig(num_heads=16, T=1, window=6, conv_layout="DS", lower_bound=-5.0, gate_mode=1,
              has_conv_bias=True, record=True, conv_state_dtype=f32),
    KdaConfig(num_heads=24, T=2, window=4, has_conv_bias=True, gate_mode=1),
    KdaConfig(num_heads=96, T=3, window=5, conv_weight_dtype=bf16),
    KdaConfig(num_heads=6, T=7, window=9, conv_layout="DS", lower_bound=-3.0, gate_mode=1,
              norm_weight_dtype=bf16),
]


def _cases():
    for kind in ("wide", "stream"):
        for i, cfg in enumerate(CONFIGS):
            yield pytest.param(kind, i, id=f"{kind}-{cfg.short()}")


def _cuobjdump():
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    for p in sys.path:
        cand = os.path.join(p, "nvidia", "cu13", "bin", "cuobjdump")
        if os.path.exists(cand):
            return cand
    return None


def _resource_usage(cubin: bytes):
    """{'REG': n, 'STACK': n, ...} of the (single) kernel in ``cubin``, or None."""
    exe = _cuobjdump()
    if exe is None or not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([exe, "--dump-resource-usage", f.name], capture_output=True,
                                 text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        return None
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m.groups())))


@pytest.mark.parametrize("kind,i", list(_cases()))
def test_compiles(kind, i):
    cfg = CONFIGS[i]
    ks = kernel_static(kind, cfg)
    compiled, secs = cache.compile_kernel(kind, ks)
    assert compiled is not None
    print(f"{kind} {ks.tag()}: compiled in {secs:.2f} s")
    ptx = compiled.__ptx__
    if not isinstance(ptx, str) or ".entry" not in ptx:
        pytest.skip("PTX not kept (CuTe DSL was imported before CUTE_DSL_KEEP was set)")
    # gate projection on the tensor cores: 8 k-steps of m16n8k16 (one or four chains)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)) == 8
    # 16-byte staging copies through L2 for the state page and the token rows
    assert "cp.async.cg.shared.global" in ptx and ", 16;" in ptx
    if cfg.record:
        assert "st.global.v4.f32" not in ptx, "record mode must not write the state"
    else:
        assert "st.global.v4.f32" in ptx, "state stores must be 16-byte vectors"
    # programmatic dependent launch: the wait first, the trigger after a GPU-scope fence at the end
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    i_wait, i_trig = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert i_wait < ptx.index("fence.acq_rel.gpu") < i_trig
    assert "ld.local" not in ptx and "st.local" not in ptx, "local arrays left in the PTX"
    usage = _resource_usage(compiled.__cubin__)
    if usage is not None:
        print(f"  resources: {usage}")
        assert usage["REG"] <= 128, "must fit 2 CTAs of 256 threads per SM"
        assert usage["STACK"] <= 512, "register spills grew out of bounds"


def test_smem_fits_two_ctas_per_sm():
    for T in range(1, 9):
        plan = SmemPlan(T)
        # 228 KiB per SM, 1 KiB reserved per CTA, 2 CTAs
        assert 2 * (plan.total + 1024) <= 228 * 1024, (T, plan.total)


def test_runtime_scalars_do_not_recompile():
    a = KdaConfig(num_heads=4, T=1, window=3)
    b = KdaConfig(num_heads=4, T=1, window=3, scale=0.5, norm_eps=1e-3)
    c = KdaConfig(num_heads=4, T=1, window=3, lower_bound=-5.0)
    d = KdaConfig(num_heads=4, T=1, window=3, lower_bound=-1.0)
    assert KernelStatic.from_config(a) == KernelStatic.from_config(b)
    assert KernelStatic.from_config(c) == KernelStatic.from_config(d)
    assert KernelStatic.from_config(a) != KernelStatic.from_config(c)
    n0 = len(cache.COMPILE_LOG)
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("KDA_CACHE_DIR")
        os.environ["KDA_CACHE_DIR"] = tmp
        try:
            k1 = cache.get_kernel("wide", KernelStatic.from_config(c))
            k2 = cache.get_kernel("wide", KernelStatic.from_config(d))
        finally:
            if old is None:
                del os.environ["KDA_CACHE_DIR"]
            else:
                os.environ["KDA_CACHE_DIR"] = old
    assert k1 is k2
    assert len(cache.COMPILE_LOG) == n0 + 1
    assert cache.COMPILE_LOG[-1].source == "compile" and cache.COMPILE_LOG[-1].seconds > 0


def test_disk_cache_round_trip():
    ks = KernelStatic.from_config(KdaConfig(num_heads=2, T=2, window=4))
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("KDA_CACHE_DIR")
        os.environ["KDA_CACHE_DIR"] = tmp
        try:
            cache.get_kernel("stream", ks)
            files = os.listdir(os.path.join(tmp, "cutedsl"))
            assert len(files) == 1 and files[0].endswith(".o"), files
            cache._mem.clear()
            loaded = cache.get_kernel("stream", ks)
        finally:
            if old is None:
                del os.environ["KDA_CACHE_DIR"]
            else:
                os.environ["KDA_CACHE_DIR"] = old
    assert cache.COMPILE_LOG[-1].source == "disk"
    assert list(loaded.execution_args.signature.parameters) == cache.arg_names("stream")


def test_package_imports_without_dsl_or_gpu():
    """The backend package and its availability checks never raise."""
    import kda.backends.cutedsl as pkg

    names = sorted(b.name for b in pkg.BACKENDS)
    assert names == ["cutedsl", "cutedsl_wide"]
    for b in pkg.BACKENDS:
        why = b.availability()
        assert why is None or isinstance(why, str)
        assert b.unsupported(KdaConfig(num_heads=4, T=9, window=11), torch.device("cuda"))
        assert not [r for r in b.unsupported(KdaConfig(num_heads=4, T=8, window=10),
                                             torch.device("cuda")) if "T=" in r]


@pytest.mark.parametrize("kind", ["stream", "wide"])
def test_launcher_packs_arguments(kind, monkeypatch):
    """The host fast path writes every argument where the compiled launcher reads it."""
    import ctypes
    import struct
    from types import SimpleNamespace

    from kda.backends.cutedsl import backend as be
    from kda.testing import CaseSpec, make_case

    seen = {}

    class FakeExe:
        def __init__(self):
            self.cuda_result = ctypes.c_int32(0)

        def _get_invoke_packed_args(self, addrs):
            return list(addrs) + [ctypes.addressof(self.cuda_result)]

        def capi_func(self, packed):
            seen["packed"] = [packed[i] for i in range(len(packed))]

    class FakeCompiled:
        def to(self, device):
            seen["device"] = device
            return FakeExe()

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(be, "current_stream_handle", lambda device: 0xABCDEF)
    cfg = KdaConfig(num_heads=4, T=2, window=5, conv_layout="DS", lower_bound=-2.0, scale=0.25,
                    norm_eps=1e-4, has_conv_bias=True, record=True)
    launcher = be._Launcher(kind, cfg, torch.device("cuda", 0), FakeCompiled(),
                            KernelStatic.from_config(cfg))
    a = make_case(CaseSpec(cfg, R=3, padded=True), "cpu")
    launcher(a)
    names = cache.arg_names(kind)
    packed = seen["packed"]
    assert len(packed) == len(names) + 1 and seen["device"] == 0

    def u64(i):
        return ctypes.c_uint64.from_address(packed[i]).value

    def i32(i):
        return ctypes.c_int32.from_address(packed[i]).value

    def f32(i):
        return struct.unpack("<f", struct.pack("<I", ctypes.c_uint32.from_address(packed[i]).value))[0]

    want_ptr = dict(x=a.x, cw=a.conv_weight, cb=a.conv_bias, cs=a.conv_state, fa=a.f_a, fb=a.f_b,
                    beta=a.beta, alog=a.A_log, dtb=a.dt_bias, state=a.state, si=a.state_indices,
                    na=a.num_accepted_tokens, og=a.output_gate, nw=a.norm_weight, out=a.out,
                    vrec=a.v_record, kgrec=a.kg_record)
    idx = {n: i for i, n in enumerate(names)}
    for n, t in want_ptr.items():
        assert u64(idx[n]) == t.data_ptr(), n
    assert i32(idx["R"]) == 3 and i32(idx["slots"]) == a.state.shape[0]
    assert i32(idx["x_rs"]) == a.x.stride(0) and i32(idx["fa_rs"]) == a.f_a.stride(0)
    assert i32(idx["beta_rs"]) == a.beta.stride(0) and i32(idx["og_rs"]) == a.output_gate.stride(0)
    assert i32(idx["out_rs"]) == a.out.stride(0)
    assert u64(idx["state_ss"]) == a.state.stride(0) and u64(idx["cs_ss"]) == a.conv_state.stride(0)
    assert f32(idx["scale"]) == pytest.approx(0.25) and f32(idx["eps"]) == pytest.approx(1e-4)
    assert f32(idx["lb"]) == -2.0
    assert u64(idx["stream"]) == 0xABCDEF
    if kind == "stream":
        assert i32(idx["ncta"]) == min(3 * 4, 264)
    assert packed[-1] == ctypes.addressof(launcher._result)
