#!/usr/bin/env bash
# One lease of the GPU machine: every check that needs the H200, in parallel where nothing is
# being timed, within a time budget ($KDA_BUDGET seconds, default 560). There is no Bazel on
# that machine: plain python3 + pytest from the repo root, after the staged wheels are installed.
#
#   1. environment and backend availability; build (or load) the CUDA extension
#   2. alone: the benchmark (every backend, the Triton launch variants in $KDA_TRITON_VARIANTS,
#      the fla-core peers; H=32) -> $OUT/bench-h200.json
#   3. alone: one Nsight Compute profile (speed of light, memory, warp stalls) of each GPU
#      backend and of fla-core's recurrence at H=32 R=128 T=1 -> logs/ncu.log
#   4. in parallel (one CPU thread each): the conformance suite once per GPU backend (ci matrix,
#      every backend required), the per-backend GPU tests, tests/kda + tests/tools, serve runs
#      checked step for step against the reference, the GPU-scale cases (2**31 offsets,
#      >65,535 items), the full matrix per backend in two shards
#
# $OUT gets summary.txt (last lines also printed), logs.tgz (every log) and bench-h200.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kda-gpu-out}
L=$OUT/logs
mkdir -p "$L"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 KDA_CACHE_DIR=${KDA_CACHE_DIR:-/tmp/kda-cache}
deadline=$((SECONDS + ${KDA_BUDGET:-560}))
left() { local l=$((deadline - SECONDS)); [ $l -lt 5 ] && l=5; echo $l; }
bg() {  # bg <name> <command...>: run in the background under the deadline, record rc and tail
  local name=$1; shift
  ( t0=$SECONDS; timeout "$(left)" "$@" > "$L/$name.log" 2>&1; rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s :: $(grep -E 'passed|failed|error|PASSED|FAILED' "$L/$name.log" | tail -n 1 | cut -c1-140)" >> "$L/_rc" ) &
}
finish() {
  { echo "== stages"; sort "$L/_rc" 2>/dev/null; } >> "$OUT/summary.txt"
  tar czf "$OUT/logs.tgz" -C "$OUT" logs
  cat "$OUT/summary.txt"
}
trap finish EXIT
GPU="triton cutedsl cutedsl_wide cuda"

python3 - > "$L/env.log" 2>&1 <<'PY'
import sys, torch, kda
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for n, why, d in kda.registry.status():
    print(f"{n:13s}", "available" if why is None else why)
PY
cat "$L/env.log" > "$OUT/summary.txt"
bg cudabuild python3 -c "
import time; t = time.time()
from backends.cuda import build
print(build.load().__file__, f'ready in {time.time() - t:.1f} s')"
wait

t0=$SECONDS
timeout "$(left)" python3 -m tools.bench.bench --backends=all --out_dir="$OUT" --tag=h200 --noplot \
  --triton_variants="${KDA_TRITON_VARIANTS-item,vsplit2,vsplit4,item_w16_r64}" > "$L/bench.log" 2>&1
echo "bench rc=$? $((SECONDS - t0))s" >> "$L/_rc"
tail -n 30 "$L/bench.log" >> "$OUT/summary.txt"

t0=$SECONDS
for b in cuda cutedsl cutedsl_wide triton; do
  echo "=== $b" >> "$L/ncu.log"
  timeout 60 ncu --clock-control none --launch-skip 2 --launch-count 1 \
    -k 'regex:kda|Kda|cutlass' --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 -m tools.bench.bench --backends="$b" --peers= --batches=128 --tokens=1 --iters=8 \
    --warmup=0 --mode=eager --noplot >> "$L/ncu.log" 2>&1
done
echo "ncu rc=$? $((SECONDS - t0))s" >> "$L/_rc"

export OMP_NUM_THREADS=1
for b in $GPU; do
  bg "conformance-$b" python3 -m pytest -q -rfE tests/conformance --kda-backends="$b" \
     --kda-require-backends -m "not bigmem"
done
bg backends-cuda python3 -m pytest -q -rfE tests/backends/cuda --kda-require-backends
bg backends-cutedsl python3 -m pytest -q -rfE tests/backends/cutedsl --kda-require-backends
bg backends-triton python3 -m pytest -q -rfE tests/backends/triton --kda-require-backends
bg kda-tools python3 -m pytest -q -rfE tests/kda tests/tools
bg serve-cutedsl python3 -m tools.serve.serve --kda_backend=cutedsl --check_against=reference \
   --num_requests=24 --max_batch=16
bg serve-cuda-T3 python3 -m tools.serve.serve --kda_backend=cuda --check_against=reference \
   --num_requests=16 --max_batch=8 --spec_tokens=3 --lower_bound=-5
bg serve-triton-T2 python3 -m tools.serve.serve --kda_backend=triton --check_against=reference \
   --num_requests=16 --max_batch=8 --spec_tokens=2
bg serve-wide python3 -m tools.serve.serve --kda_backend=cutedsl_wide --check_against=reference \
   --num_requests=16 --max_batch=8
bg bigmem python3 -m pytest -q -rfE tests/conformance -m bigmem --kda-backends="${GPU// /,}" \
   --kda-require-backends
for b in $GPU; do
  bg "full-$b-a" python3 -m pytest -q -rfE tests/conformance/test_decode.py --kda-backends="$b" \
     --kda-require-backends --kda-matrix=full -k "H1- or H4- or H8- or H12-"
  bg "full-$b-b" python3 -m pytest -q -rfE tests/conformance/test_decode.py --kda-backends="$b" \
     --kda-require-backends --kda-matrix=full -k "not (H1- or H4- or H8- or H12-)"
done
wait
