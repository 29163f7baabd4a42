#!/usr/bin/env bash
# The GPU machine's checks, in one call (there is no Bazel there: plain python3 + pytest).
#
#   bash tools/gpu/check.sh [stage ...]      stages (default: all, in this order):
#     env          versions, GPU, which backends are available and why not
#     cudabuild    build (or wait for / load) the CUDA extension, reporting the time
#     conformance  tests/conformance, every backend required, matrix $KDA_MATRIX (default ci)
#     backends     tests/backends (per-backend GPU tests: bit identity of the CuTe DSL pair, ...)
#     kda          tests/kda and tests/tools (reference vs fla-core, custom op, serve)
#     serve        the serve tool with each GPU backend, checked step for step against the reference
#     bench        the benchmark (all backends and peers, H=32) into $OUT/bench
#     full         tests/conformance/test_decode.py on the full matrix (long: last)
#
# Each stage runs under a time limit ($KDA_STAGE_TIMEOUT seconds, default 900).
# Logs go to $OUT/<stage>.log (the device tool brings $OUT back); a summary line per stage is
# printed last. Wheels staged by ../shared/device/stage must be installed first.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kda-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export KDA_CACHE_DIR=${KDA_CACHE_DIR:-/tmp/kda-cache}
matrix=${KDA_MATRIX:-ci}
limit=${KDA_STAGE_TIMEOUT:-900}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env conformance backends kda serve bench)
summary=()
run() {  # run <stage> <command...>
  local stage=$1; shift
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$stage.log" 2>&1
  local rc=$?
  summary+=("$stage: rc=$rc $((SECONDS - t0))s :: $(tail -n 1 "$OUT/$stage.log" | cut -c1-160)")
}
for s in "${stages[@]}"; do
  case "$s" in
    env) run env python3 -c "
import torch, kda, sys
print(sys.version); print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
for n, why, d in kda.registry.status(): print(f'{n:14s}', 'OK' if why is None else why)
" ;;
    cudabuild) run cudabuild python3 -c "
import time; t = time.time()
from backends.cuda import build
m = build.load()
print(f'CUDA extension ready in {time.time() - t:.1f} s: {m.__file__}')" ;;
    conformance) run conformance python3 -m pytest -q -rfE tests/conformance --kda-require-backends \
        --kda-matrix="$matrix" ;;
    full) run full python3 -m pytest -q -rfE tests/conformance/test_decode.py \
        --kda-require-backends --kda-matrix=full ;;
    backends) run backends python3 -m pytest -q -rfE tests/backends --kda-require-backends ;;
    kda) run kda python3 -m pytest -q tests/kda tests/tools ;;
    serve)
      for b in triton cutedsl cutedsl_wide cuda; do
        run "serve-$b" python3 -m tools.serve.serve --kda_backend="$b" --check_against=reference \
          --num_requests=24 --max_batch=16
        run "serve-$b-T3" python3 -m tools.serve.serve --kda_backend="$b" --check_against=reference \
          --num_requests=16 --max_batch=8 --spec_tokens=3 --lower_bound=-5
      done ;;
    bench) run bench python3 -m tools.bench.bench --backends=all --out_dir="$OUT" --tag=h200 --noplot ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
