#!/usr/bin/env bash
# One lease of the GPU machine: every check that needs the GPU, in parallel where nothing is
# being timed, within a time budget ($KDA_BUDGET seconds, default 560). There is no Bazel on
# that machine: plain python3 + pytest from the repo root, after the staged wheels are installed.
#
#   env      environment and backend availability; build (or load) the CUDA extension
#   tune     alone, only when named in $KDA_STAGES: tools/kda tune's sweep on this GPU
#            ($KDA_TUNE_FLAGS) -> $OUT/tune/tune-<device>.json and the table it writes into
#            the package, copied to $OUT/tune/ (commit both: the table names the first)
#   bench    alone: the benchmark (the backends in $KDA_BENCH_BACKENDS, default
#            $KDA_GPU_BACKENDS = every GPU backend; the fla-core and touch peers; the default
#            grid of tools/bench/bench.py on fp32 and bf16 state pools, or other flags in
#            $KDA_BENCH_FLAGS) -> $OUT/bench-<gpu>.json (gpu: the H model in the device's name, e.g.
#            h200, h100)
#   hot      alone: the benchmark with --hot_state (every request of a step on one slot, so the
#            state stays in L2: the kernels' compute / latency bound) for $KDA_HOT_BACKENDS
#            (default all), R 128 and 512, T 1 and 5 -> $OUT/bench-hot-<gpu>.json
#   ncu      alone: one Nsight Compute profile (speed of light, memory, warp stats, occupancy,
#            executed instructions) per backend ($KDA_NCU_BACKENDS, default all) at H=32
#            R=$KDA_NCU_BATCHES (default 128) T=$KDA_NCU_TOKENS (default 1), other bench flags
#            in $KDA_NCU_FLAGS (e.g. --state_dtype=bf16) -> logs/ncu.log; and one per schedule
#            of the CuTe DSL family named in $KDA_NCU_SCHEDULES (e.g. "split4 streamg"), on the
#            first step of tools/gpu/step_check at H=$KDA_NCU_HEADS (default 32), the same R and
#            T, state $KDA_NCU_STATE (default fp32)
#   tests    in parallel (one CPU thread each): the conformance suite once per backend in
#            $KDA_TEST_BACKENDS (default all; ci matrix, every backend required), the
#            per-backend GPU tests
#   kdatools tests/kda + tests/tools
#   serve    serve runs checked step for step against the reference
#   bigmem   the GPU-scale cases (2**31 offsets, >65,535 items)
#   full     the full conformance matrix, per backend in $KDA_FULL_SHARDS shards (default 2),
#            or the jobs listed in $KDA_FULL_JOBS ("backend:i/n ...", e.g. "cuda:2/3")
#   sanitize compute-sanitizer memcheck, racecheck and synccheck on one checked step of the
#            CuTe DSL kernels (tools/gpu/step_check.py; cutedsl at a split-kernel and at a
#            streamed-kernel batch, streamg at T=1, the gate in batches, blocks with the tail,
#            the cluster kernel's direct rows at 4 and 8 CTAs, its cluster of 2,
#            cutedsl_wide at T=1) and of cuda's bf16-state builds, each kernel with fp32 and
#            bf16 state pools; after the stages above are done (beside them racecheck runs
#            failed), at most 12 at a time; a racecheck run that ends with the program gone
#            and no hazard runs once more alone (<name>-alone in the summary)
#
# A stage's job that would start with the budget spent is skipped and listed as skipped.
#
# Stages run in the order above; tests/kdatools/serve/bigmem/full run together in the
# background, then sanitize.
# $KDA_STAGES picks stages (default: all of them). $OUT gets summary.txt (also printed),
# logs.tgz (every log) and the bench JSON.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kda-gpu-out}
L=$OUT/logs
rm -f "$L/_rc"    # no stale stage results of an earlier run
mkdir -p "$L"
export COLUMNS=${COLUMNS:-250} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 KDA_CACHE_DIR=${KDA_CACHE_DIR:-/tmp/kda-cache}
# The device's copy of the tree may carry a stale .git (seen: a JSON naming an older commit):
# the commit recorded in the results is $KDA_COMMIT, never read from git there.
export KDA_COMMIT=${KDA_COMMIT:-unknown}
deadline=$((SECONDS + ${KDA_BUDGET:-560}))
STAGES=" ${KDA_STAGES:-bench ncu tests kdatools serve bigmem full sanitize} "
GPU=${KDA_GPU_BACKENDS:-triton cutedsl cutedsl_wide cuda}
want() { [[ "$STAGES" == *" $1 "* ]]; }
has() { [[ " $GPU " == *" $1 "* ]]; }
left() { local l=$((deadline - SECONDS)); [ $l -lt 5 ] && l=5; echo $l; }
bg() {  # bg <name> <command...>: run in the background under the deadline, record rc and tail
  local name=$1; shift
  if [ $((deadline - SECONDS)) -lt 15 ]; then     # not started: not a failure of the stage
    echo "$name skipped: the budget (\$KDA_BUDGET) is spent" >> "$L/_rc"; return
  fi
  ( t0=$SECONDS; timeout "$(left)" "$@" > "$L/$name.log" 2>&1; rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s :: $(grep -E 'passed|failed|error|PASSED|FAILED' "$L/$name.log" | tail -n 1 | cut -c1-140)" >> "$L/_rc" ) &
}
throttle() {  # throttle <n>: wait while n background jobs run
  while [ "$(jobs -rp | wc -l)" -ge "$1" ]; do sleep 1; done
}
finish() {
  { echo "== stages"; sort "$L/_rc" 2>/dev/null; } >> "$OUT/summary.txt"
  # one archive: the device tool returns only a few files per run; the loose logs are
  # removed only once the archive is written
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
  cat "$OUT/summary.txt"
}
trap finish EXIT

GPU_TAG=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(); m = re.search(r'\bH[0-9]+', n); print((m.group() if m else n.split()[-1]).lower())" 2>/dev/null || echo gpu)
python3 - > "$L/env.log" 2>&1 <<'PY'
import sys, torch, kda
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for n, why, d in kda.registry.status():
    print(f"{n:13s}", "available" if why is None else why)
PY
{ echo "stages:$STAGES backends: $GPU"
  echo "commit label: $KDA_COMMIT  tree: $(bash tools/gpu/tree_digest.sh 2>&1) (check: tools/gpu/tree_digest.sh $KDA_COMMIT)"
  cat "$L/env.log"; } > "$OUT/summary.txt"
bg cudabuild python3 -c "
import time; t = time.time()
from kda.backends.cuda import build
print(build.load().__file__, f'ready in {time.time() - t:.1f} s')"
wait

if want tune; then
  t0=$SECONDS
  mkdir -p "$OUT/tune"
  timeout "$(left)" python3 -m tools.bench.tune --results_dir="$OUT/tune" ${KDA_TUNE_FLAGS:-} \
    > "$L/tune.log" 2>&1
  echo "tune rc=$? $((SECONDS - t0))s" >> "$L/_rc"
  cp backends/cutedsl/tables/*.json "$OUT/tune/" 2>/dev/null
  tail -n 4 "$L/tune.log" >> "$OUT/summary.txt"
fi

if want bench; then
  t0=$SECONDS
  B=${KDA_BENCH_BACKENDS:-$GPU}
  timeout "$(left)" python3 -m tools.bench.bench --backends="${B// /,}" --out_dir="$OUT" --tag="$GPU_TAG" \
    --noplot --state_dtype=fp32,bf16 ${KDA_BENCH_FLAGS:-} > "$L/bench.log" 2>&1
  echo "bench rc=$? $((SECONDS - t0))s" >> "$L/_rc"
  tail -n 30 "$L/bench.log" >> "$OUT/summary.txt"
fi

if want hot; then       # alone: every request on one slot per set (state in L2): compute bound
  t0=$SECONDS
  B=${KDA_HOT_BACKENDS:-$GPU}
  timeout "$(left)" python3 -m tools.bench.bench --backends="${B// /,}" --hot_state \
    --peers=touch,touch_rows32,fla_recurrent --batches=128,512 --tokens=1,5 --noplot \
    --out_dir="$OUT" --tag="hot-$GPU_TAG" > "$L/hot.log" 2>&1
  echo "hot rc=$? $((SECONDS - t0))s" >> "$L/_rc"
  tail -n 12 "$L/hot.log" >> "$OUT/summary.txt"
fi

if want ncu; then
  t0=$SECONDS
  NCU=(ncu --clock-control none --launch-count 1 --section SpeedOfLight
       --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy
       --section LaunchStats --metrics 'smsp__inst_executed.sum,sm__ctas_launched.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio')
  for b in ${KDA_NCU_BACKENDS:-$GPU}; do
    echo "=== $b" >> "$L/ncu.log"
    timeout 60 "${NCU[@]}" --launch-skip 2 -k 'regex:kda|Kda|cutlass' \
      python3 -m tools.bench.bench --backends="$b" --peers=none --heads=32 \
      --batches="${KDA_NCU_BATCHES:-128}" \
      --tokens="${KDA_NCU_TOKENS:-1}" --iters=8 \
      --warmup=0 --mode=eager --noplot ${KDA_NCU_FLAGS:-} >> "$L/ncu.log" 2>&1
  done
  # (the step check's reference runs torch kernels beside: only the family's kernel is profiled)
  for name in ${KDA_NCU_SCHEDULES:-}; do
    echo "=== cutedsl:$name" >> "$L/ncu.log"
    timeout 60 "${NCU[@]}" -k 'regex:kdabackendscutedsl' python3 -m tools.gpu.step_check \
      "cutedsl:$name" "${KDA_NCU_HEADS:-32}" "${KDA_NCU_BATCHES:-128}" "${KDA_NCU_TOKENS:-1}" \
      "${KDA_NCU_STATE:-fp32}" >> "$L/ncu.log" 2>&1
  done
  echo "ncu rc=$? $((SECONDS - t0))s" >> "$L/_rc"
fi

export OMP_NUM_THREADS=1
PYT="python3 -m pytest -q -rfE -p no:cacheprovider --durations=5"
if want tests; then
  for b in ${KDA_TEST_BACKENDS:-$GPU}; do
    bg "conformance-$b" $PYT tests/conformance --kda-backends="$b" --kda-require-backends -m "not bigmem"
  done
  has cuda && bg backends-cuda $PYT tests/backends/cuda --kda-require-backends
  { has cutedsl || has cutedsl_wide; } && bg backends-cutedsl $PYT tests/backends/cutedsl --kda-require-backends
  has triton && bg backends-triton $PYT tests/backends/triton --kda-require-backends
fi
if want kdatools; then
  bg kda-tools $PYT tests/kda tests/tools
fi
if want serve; then
  has cutedsl && bg serve-cutedsl python3 -m tools.serve.serve --kda_backend=cutedsl \
     --check_against=reference --num_requests=24 --max_batch=16
  has cuda && bg serve-cuda-T3 python3 -m tools.serve.serve --kda_backend=cuda \
     --check_against=reference --num_requests=16 --max_batch=8 --spec_tokens=3 --lower_bound=-5
  has triton && bg serve-triton-T2 python3 -m tools.serve.serve --kda_backend=triton \
     --check_against=reference --num_requests=16 --max_batch=8 --spec_tokens=2
  has cutedsl_wide && bg serve-wide python3 -m tools.serve.serve --kda_backend=cutedsl_wide \
     --check_against=reference --num_requests=16 --max_batch=8
  has cuda && bg serve-cuda-bf16 python3 -m tools.serve.serve --kda_backend=cuda \
     --check_against=reference --num_requests=16 --max_batch=8 --state_dtype=bf16
  # auto switches backend with the batch size (buckets 1..64 cross R=16)
  has cuda && has cutedsl_wide && bg serve-auto python3 -m tools.serve.serve --kda_backend=auto \
     --check_against=reference --num_requests=96 --max_batch=64 --arrival_rate=6
fi
if want bigmem; then
  bg bigmem $PYT tests/conformance -m bigmem --kda-backends="${GPU// /,}" --kda-require-backends
fi
if want full; then
  jobs=${KDA_FULL_JOBS:-}
  if [ -z "$jobs" ]; then
    n=${KDA_FULL_SHARDS:-2}
    for b in $GPU; do for ((i = 0; i < n; i++)); do jobs="$jobs $b:$i/$n"; done; done
  fi
  for job in $jobs; do          # backend:i/n
    b=${job%%:*}; sh=${job#*:}
    bg "full-$b-${sh/\//of}" $PYT tests/conformance/test_decode.py --kda-backends="$b" \
       --kda-require-backends --kda-matrix=full --kda-shard="$sh"
  done
fi
if want sanitize; then
  # racecheck runs beside the test stages' large cases ended without output (the program
  # gone, no hazard reported) where the same run alone was clean: the sanitizers start once
  # the other stages are done, at most 12 at a time
  wait
  sanitizer() {  # sanitizer <tool> <job> <step_check arguments...>: one run in the background
    local tool=$1 job=$2; shift 2
    bg "$job" compute-sanitizer --tool "$tool" --print-limit 20 --error-exitcode 9 \
       --report-api-errors no python3 -m tools.gpu.step_check "$@"
  }
  san() {  # san <name> <step_check arguments...>: one sanitizer run of $tool on one step
    local name=$1; shift
    echo "$*" > "$L/sanitize-$tool-$name.args"
    throttle 12; sanitizer "$tool" "sanitize-$tool-$name" "$@"
  }
  for tool in memcheck racecheck synccheck; do
    for sd in fp32 bf16; do
      san "$sd" cutedsl 4 3 2 $sd
      # the streamed kernel (800 items at T=2, about 6 per CTA so that its item slots and
      # stages are reused)
      san "stream-$sd" cutedsl:stream 8 100 2 $sd
      # the persistent kernel with the groups preparing their items (T=1, 800 items; its
      # second step in record mode)
      san "streamg-$sd" cutedsl:streamg 8 100 1 $sd record
      # the gate in batches of items (T=1), blocks with the half-length tail (T=2), the
      # cluster kernel with its rows loaded into registers
      san "gb-$sd" cutedsl:stream4+gb 8 100 1 $sd
      san "tail-$sd" cutedsl:stream4t 8 100 2 $sd
      san "direct-$sd" cutedsl:split4+direct 4 3 2 $sd
      # the cluster of 8 with the direct rows (one pass of 16 rows: the H100 table's pick at
      # the smallest batches), T=1 as it runs there
      san "direct8-$sd" cutedsl:split8+direct 12 8 1 $sd
      # the cluster of 2 (two waves of 32 rows per CTA), as the H100 table runs it
      san "split2-$sd" cutedsl:split2 12 16 1 $sd
      # the q / k channels shared out over the cluster (T=2: two tokens' exchange), C = 8
      # and 2
      san "qk8-$sd" cutedsl:split8+direct+qk 4 3 2 $sd
      san "qk2-$sd" cutedsl:split2+qk 12 8 1 $sd
      # the one-CTA-per-item kernel at an odd T (its epilogue's upper half has no last token)
      san "wide-$sd" cutedsl_wide 4 3 1 $sd
    done
    san cuda-bf16 cuda 4 3 2 bf16
  done
  wait
  # a racecheck run among 12 can end with the program gone and no hazard reported where the
  # same run alone is clean: such a run (no hazard, no failed check or refusal of
  # step_check's) runs once more alone, as <name>-alone; both results stay in the summary
  for f in "$L"/sanitize-racecheck-*.args; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .args)
    log="$L/$name.log"
    failed=$(grep -E 'R=[0-9]+: ' "$log" | grep -v ': ok$'; grep '^step_check:' "$log")
    if grep -q "^$name rc=[1-9]" "$L/_rc" && grep -q "RACECHECK SUMMARY: 0 hazards" "$log" \
       && [ -z "$failed" ]; then
      sanitizer racecheck "$name-alone" $(cat "$f")
      wait
    fi
  done
fi
wait
