# Sourced by tools/vllm/run_tests.sh and tools/sglang/run_tests.sh: build (once) an isolated
# virtual environment holding one inference engine on a CPU, install this repository into it,
# and run one test file there. The caller sets:
#   tag      log prefix, e.g. "vllm-tests"
#   venv     the environment's folder
#   py       the Python that creates it
#   base     array: the first `pip install` arguments (torch and the test tools)
#   engine   the engine's requirement, installed with --no-deps (its own pins are GPU packages)
#   deps     array: what importing the engine's parts under test needs, torch held at base's
#   tests    the test file
#   unset_vars  environment variables to clear before the tests
# The venv is rebuilt when the caller's script or this file changes.
set -euo pipefail

run_engine_tests() {
  local root stamp start pip constraints
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  stamp=$(cat "$0" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)
  if [ "$(cat "$venv/.kda-stamp" 2>/dev/null || true)" != "$stamp" ]; then
    start=$SECONDS
    echo "[$tag] building $venv" >&2
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$py" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    constraints="$venv/kda-constraints.txt"
    "${pip[@]}" "${base[@]}"
    "$venv/bin/python" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' \
      > "$constraints"
    "${pip[@]}" --no-deps "$engine"
    "${pip[@]}" -c "$constraints" "${deps[@]}"
    "${pip[@]}" -c "$constraints" -e "$root"          # with its own deps (absl-py, rich)
    echo "$stamp" > "$venv/.kda-stamp"
    echo "[$tag] venv built in $((SECONDS - start)) s" >&2
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$root"
  "$venv/bin/python" -c 'import sys
from importlib.metadata import version as v
print(f"[{sys.argv[1]}] " + ", ".join(f"{p} {v(p)}" for p in sys.argv[2:]))' \
    "$tag" "${engine%%[=<>]*}" torch triton
  cd "$root"
  export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
  unset $unset_vars || true
  exec "$venv/bin/python" -m pytest "$tests" -v -rs "$@"
}
