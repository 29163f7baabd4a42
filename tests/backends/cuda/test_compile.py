"""The CUDA backend's kernel compiles for sm_90a on a machine without a GPU, and fits.

Compiles ``backends/cuda/kda_decode.cu`` with the machine's nvcc and the backend's own flags
(``kda.backends.cuda.build.CUDA_FLAGS``) plus ``-Xptxas -v``, then checks that the kernel
builds are exactly the (T, fb_smem, state dtype) of the launch policy (``kda.backends.cuda.policy``),
each in its two row paths (16-byte aligned rows of x / output_gate / f_a, and the narrower
path for other rows) and its two state dtypes (fp32, bf16), and, for each: no spill stores or loads, no stack frame (no local
memory), and that two 256-thread CTAs fit on one SM from the reported registers and the
dynamic shared memory (read from the object itself through a small host probe, so no number
is duplicated here). Skipped when nvcc is not on PATH. Takes about 20 s on two cores.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from kda.backends.cuda import build
from kda.backends.cuda.backend import MAX_T
from kda.backends.cuda.policy import POLICY

SRC = build.HERE / "kda_decode.cu"
NVCC = shutil.which("nvcc")

# sm_90 limits (CUDA programming guide, compute capability 9.0).
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
CTAS_PER_SM = 2
#: (T, fb_smem, 16-byte rows, bf16 state) of every kernel build the launcher may ask for
KERNELS = [(t, int(POLICY[t, bool(bf)].fb_smem), v16, bf) for t in range(1, MAX_T + 1)
           for v16 in (0, 1) for bf in (0, 1)]

# (sizes up to T = MAX_T + 1, which has no build: 0)
PROBE = r"""
#include <cstdio>
#include "kda_decode.h"
int main() {
  for (int t = 0; t <= LAST_T; ++t)
    for (int fb = 0; fb <= 1; ++fb)
      for (int bf = 0; bf <= 1; ++bf)
        std::printf("smem %d %d %d %zu\n", t, fb, bf, kda_decode_smem_bytes(t, fb, bf));
  std::printf("threads %d\n", kda_decode_threads());
  const long long cases[][2] = {{4096, 264}, {16384, 264}, {1280, 264}, {256, 256}, {32, 32}, {5, 0}};
  const float fractions[] = {0.0f, 0.5f, 0.8f, 1.0f};
  for (const auto& c : cases)
    for (float f : fractions)
      std::printf("static %lld %lld %.2f %d\n", c[0], c[1], f, kda_decode_static_items(c[0], c[1], f));
  return 0;
}
""".replace("LAST_T", str(MAX_T + 1))

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(ptxas report per (T, fb_smem, 16-byte rows, bf16 state), smem bytes per (T, fb_smem, bf16 state) of the builds,
    threads per CTA, static range per (items, CTAs, fraction))."""
    d = tmp_path_factory.mktemp("kda_cuda")
    obj = d / "kda_decode.o"
    cmd = [NVCC, "-c", *build.CUDA_FLAGS, "-Xptxas", "-v", str(SRC), "-o", str(obj)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{res.stderr}"
    report = _parse_ptxas(res.stderr)

    (d / "probe.cpp").write_text(PROBE)
    probe = d / "probe"
    cmd = [NVCC, "-std=c++17", f"-I{build.HERE}", str(d / "probe.cpp"), str(obj), "-o", str(probe)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"probe link failed:\n{res.stderr}"
    out = subprocess.run([str(probe)], capture_output=True, text=True, timeout=60, check=True).stdout
    smem = {(int(t), int(fb), int(bf)): int(b)
            for t, fb, bf, b in re.findall(r"smem (\d+) (\d+) (\d+) (\d+)", out) if int(b) > 0}
    threads = int(re.search(r"threads (\d+)", out).group(1))
    static = {(int(i), int(c), float(f)): int(s)
              for i, c, f, s in re.findall(r"static (\d+) (\d+) ([\d.]+) (-?\d+)", out)}
    return report, smem, threads, static


def _parse_ptxas(text: str):
    """{(T, fb_smem, 16-byte rows, bf16 state): {"regs", "stack", "spill_st", "spill_ld", "smem"}} from nvcc
    -Xptxas -v output."""
    report = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            t = re.search(r"kda_decode_kernelILi(\d+)ELb([01])ELb([01])ELb([01])E", m.group(1))
            cur = tuple(int(g) for g in t.groups()) if t else None
            if cur is not None:
                report[cur] = {"smem": 0}
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            report[cur].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            report[cur]["regs"] = int(m.group(1))
            m2 = re.search(r"(\d+) bytes smem", line)
            if m2:
                report[cur]["smem"] = int(m2.group(1))
    return report


def test_builds_are_the_policys(compiled):
    """One build per T, row path and state dtype, with f_b staged in shared memory exactly where
    the policy says; the host-side size query knows no other (T, fb_smem, state dtype) either."""
    report, smem, threads, _ = compiled
    assert sorted(POLICY) == [(t, bf) for t in range(1, MAX_T + 1) for bf in (False, True)]
    assert sorted(report) == sorted(KERNELS), report.keys()
    assert threads == 256
    assert sorted(smem) == sorted({(t, fb, bf) for t, fb, _, bf in KERNELS})


@pytest.mark.parametrize("T,fb,v16,bf", KERNELS)
def test_no_local_memory(compiled, T, fb, v16, bf):
    r = compiled[0][T, fb, v16, bf]
    what = f"T={T} fb_smem={fb} rows16={v16} bf16_state={bf}"
    assert r["spill_st"] == 0 and r["spill_ld"] == 0, f"{what}: register spills {r}"
    assert r["stack"] == 0, f"{what}: {r['stack']} bytes of stack frame (local memory)"


@pytest.mark.parametrize("T,fb,v16,bf", KERNELS)
def test_two_ctas_per_sm(compiled, T, fb, v16, bf):
    report, smem, threads, _ = compiled
    r = report[T, fb, v16, bf]
    what = f"T={T} fb_smem={fb} rows16={v16} bf16_state={bf}"
    regs_per_cta = r["regs"] * threads
    assert CTAS_PER_SM * regs_per_cta <= REGS_PER_SM, f"{what}: {r['regs']} registers per thread"
    per_cta = smem[T, fb, bf] + r["smem"] + SMEM_RESERVED_PER_CTA
    assert CTAS_PER_SM * per_cta <= SMEM_PER_SM, (
        f"{what}: {per_cta} bytes of shared memory per CTA")


def test_static_range_sizes(compiled):
    """The launcher's static range per CTA (KdaParams.static_items): floor(f * items / CTAs),
    0 without CTAs; the CTAs' ranges never cover more than the items."""
    static = compiled[3]
    assert len(static) == 24
    for (items, ctas, f), s in static.items():
        want = int(f * items / ctas) if ctas else 0
        assert s == want, (items, ctas, f, s)
        assert ctas * s <= items
    assert static[4096, 264, 0.8] == 12 and static[16384, 264, 0.8] == 49
    assert static[256, 256, 1.0] == 1 and static[256, 256, 0.8] == 0


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-v"]))
