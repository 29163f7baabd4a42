"""What the Triton backend's test files share: the device, one step against the reference."""

import pytest
import torch

from kda.backends.triton.backend import interpreter_enabled
from kda.reference import reference_step
from kda.testing import WRITTEN, CaseSpec, bits_equal, clone_args, compare_step, make_case

#: True under ``TRITON_INTERPRET=1`` (the CPU; the Bazel targets set it).
INTERP = interpreter_enabled()


def device() -> torch.device:
    """The CPU under the interpreter, else the CUDA device; skips the test without either."""
    if INTERP:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set")


def run_step(spec: CaseSpec, dev: torch.device, step):
    """(args after ``step(args)``, the reference's result, the inputs) on a fresh case."""
    args = make_case(spec, dev)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(spec.cfg, expected)
    step(args)
    return args, expected, before


def check_step(spec: CaseSpec, dev: torch.device, step, what: str):
    """Run ``step`` on ``spec``'s case, assert it matches the reference, return its args."""
    args, expected, before = run_step(spec, dev, step)
    errors = compare_step(args, expected, before)
    assert not errors, f"{what}: " + "\n".join(errors)
    return args


def assert_same_bits(a, b, what: str):
    """Every written buffer of two steps' args is bit-identical."""
    for name in WRITTEN:
        assert bits_equal(getattr(a, name), getattr(b, name)), (what, name)


# Figures of one offline sm_90a compile (kda.backends.triton.offline), computed in a
# subprocess: resources, and counts in the TTIR / TTGIR / PTX of what the builds rely on.
_FIGURES = r"""
import json, re, sys, torch
from kda.config import KdaConfig
from kda.backends.triton.offline import compile_offline, resource_usage


def figures(build, cfg, rows16=True):
    k = compile_offline(cfg, build, rows16=rows16)
    g, ptx = k.asm["ttgir"], k.asm["ptx"]
    dots = [re.search(r"(%\S+) = tt.dot \S+, \S+, (%[\w.]+)", l).groups()
            for l in k.asm["ttir"].splitlines() if "tt.dot" in l]
    results = {d[0] for d in dots}
    return dict(resource_usage(k),
        dots=len(dots), chained_dots=sum(1 for d in dots if d[1] in results),
        big_converts=sum(1 for l in g.splitlines() if "convert_layout" in l
                         and re.search(r"tensor<(32|64|128)x128x", l)),
        state_ld_v4=len(re.findall(r"ld\.global\.L1::evict_first[.\w:]*\.v4\.b32", ptx)),
        state_st_v4=len(re.findall(r"st\.global\.cs\.v4\.b32", ptx)),
        mma=len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)),
        atom=len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
        state_async=len(re.findall(r"ttg\.async_copy_global_to_local .* evictionPolicy = "
                                   r"evict_first .*tensor<(16|32)x128x!tt\.ptr<f32>", g)),
        cp_async16=len(re.findall(r"cp\.async\.cg\.shared\.global .*, 0x10", ptx)),
        state_ld_v2=len(re.findall(r"ld\.global\.L1::evict_first[.\w:]*\.v2\.b32", ptx)),
        state_st_v2=len(re.findall(r"st\.global\.cs\.v2\.b32", ptx)),
        cvt_bf16x2=len(re.findall(r"cvt\.rn\.bf16x2\.f32", ptx)),
        cvt_bf16_not_rn=len(re.findall(r"cvt\.r[zmp]i?\.bf16", ptx)))


T1 = KdaConfig(num_heads=32)
T1DS = KdaConfig(num_heads=32, conv_layout="DS", gate_mode=1, has_conv_bias=True)
T2 = KdaConfig(num_heads=32, T=2, window=4)
T5 = KdaConfig(num_heads=32, T=5, window=7, lower_bound=-5.0)
T2REC = KdaConfig(num_heads=8, T=2, window=4, record=True, conv_state_dtype=torch.float32)
T1BETA = KdaConfig(num_heads=4, beta_activated=True)
T1S16 = KdaConfig(num_heads=32, state_dtype=torch.bfloat16)
T2S16 = KdaConfig(num_heads=32, T=2, window=4, state_dtype=torch.bfloat16)
CASES = json.loads(sys.argv[1])
print("RESULT" + json.dumps({name: figures(build, globals()[cfg], *rest)
                             for name, (build, cfg, *rest) in CASES.items()}))
"""


def offline_figures(cases: dict, tmp_path) -> dict:
    """Compile ``cases`` ({name: (build name, config name[, rows16])}, configs ``T1`` (SD,
    gate_mode 0), ``T1DS`` (DS, gate_mode 1, conv bias), ``T2``, ``T5`` (bounded gate),
    ``T2REC`` (record mode, fp32 conv cache), ``T1BETA`` (activated fp32 beta), ``T1S16`` /
    ``T2S16`` (bf16 state pool, T = 1 / 2), H=32 but
    T2REC H=8 and T1BETA H=4; ``rows16=False``: the build for rows that are not 16-byte
    aligned, :func:`kda.backends.triton.offline.compile_offline`) for sm_90a in a subprocess
    without
    ``TRITON_INTERPRET`` (under it ``triton.jit`` makes interpreter functions, which do not
    compile), so the tests run under either setting; return each case's figures.

    Every case must keep the state tile in its layout (no 32/64/128-row layout conversion: the
    tile would go through shared memory) and run the gate projection on bf16 tensor cores.
    """
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    # Triton's default cache ($HOME/.triton) is read-only inside Bazel's linux-sandbox
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-c", _FIGURES, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name, r in res.items():
        assert r["big_converts"] == 0, (name, r)        # the state tile keeps its layout
        assert r["mma"] >= 16, (name, r)                # the gate runs on bf16 tensor cores
    return res
