"""The CUDA backend's kernel compiles for sm_90a on a machine without a GPU, and fits.

Compiles ``backends/cuda/kda_decode.cu`` with the machine's nvcc and the backend's own flags
(``backends.cuda.build.CUDA_FLAGS``) plus ``-Xptxas -v``, then checks for every T
instantiation: no spill stores or loads, no stack frame (no local memory), and that two
256-thread CTAs fit on one SM from the reported registers and the dynamic shared memory
(read from the object itself through a small host probe, so no number is duplicated here).
Skipped when nvcc is not on PATH. Takes about 15 s on two cores.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from backends.cuda import build

SRC = build.HERE / "kda_decode.cu"
NVCC = shutil.which("nvcc")

# sm_90 limits (CUDA programming guide, compute capability 9.0).
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
CTAS_PER_SM = 2
T_VALUES = range(1, 9)

PROBE = r"""
#include <cstdio>
#include "kda_decode.h"
int main() {
  for (int t = 1; t <= 8; ++t) std::printf("smem %d %zu\n", t, kda_decode_smem_bytes(t));
  std::printf("threads %d\n", kda_decode_threads());
  return 0;
}
"""

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(ptxas report per T, smem bytes per T, threads per CTA)."""
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
    smem = {int(t): int(b) for t, b in re.findall(r"smem (\d+) (\d+)", out)}
    threads = int(re.search(r"threads (\d+)", out).group(1))
    return report, smem, threads


def _parse_ptxas(text: str):
    """{T: {"regs", "stack", "spill_st", "spill_ld", "smem"}} from nvcc -Xptxas -v output."""
    report = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            t = re.search(r"kda_decode_kernelILi(\d+)E", m.group(1))
            cur = int(t.group(1)) if t else None
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


def test_every_T_is_instantiated(compiled):
    report, smem, threads = compiled
    assert sorted(report) == list(T_VALUES), report.keys()
    assert threads == 256
    assert sorted(smem) == list(T_VALUES)


@pytest.mark.parametrize("T", T_VALUES)
def test_no_local_memory(compiled, T):
    r = compiled[0][T]
    assert r["spill_st"] == 0 and r["spill_ld"] == 0, f"T={T}: register spills {r}"
    assert r["stack"] == 0, f"T={T}: {r['stack']} bytes of stack frame (local memory)"


@pytest.mark.parametrize("T", T_VALUES)
def test_two_ctas_per_sm(compiled, T):
    report, smem, threads = compiled
    r = report[T]
    regs_per_cta = r["regs"] * threads
    assert CTAS_PER_SM * regs_per_cta <= REGS_PER_SM, f"T={T}: {r['regs']} registers per thread"
    per_cta = smem[T] + r["smem"] + SMEM_RESERVED_PER_CTA
    assert CTAS_PER_SM * per_cta <= SMEM_PER_SM, f"T={T}: {per_cta} bytes of shared memory per CTA"


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-v"]))
