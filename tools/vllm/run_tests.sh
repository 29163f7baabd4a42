#!/usr/bin/env bash
# The vLLM plugin's tests against the real vLLM packages, on a CPU, one venv per vLLM version:
#
#   tools/vllm/run_tests.sh                       every tested version, one after the other
#   tools/vllm/run_tests.sh 0.34.0 [pytest args]  one version, e.g. 0.34.0 -k verify -x
#   tools/vllm/run_tests.sh all [pytest args]     every tested version, with pytest args
#
# The tested versions are kda.integrations.vllm.TESTED_VLLM_VERSIONS (read from that file).
# With several versions the exit status is non-zero when any of them failed, and a summary
# line per version ends the output. Not part of `tools/kda test` / `bazel test //...` (it
# installs vLLM, and runs for minutes). What it does, per version V:
#  1. An isolated virtual environment at $KDA_VLLM_VENV_DIR/vllm-venv-V (default folder
#     ~/.cache/kda), created WITHOUT the system site-packages, so it holds exactly one torch.
#  2. Into it: torch==2.13.0 (the project's torch; the CPU machines carry its CPU wheel, so
#     nothing big is downloaded; $KDA_VLLM_TORCH overrides the requirement), triton==3.8.0
#     (its CPU interpreter runs vLLM's Triton kernels; 3.6's fails on the verify path's conv),
#     numpy, einops, pytest, pytest-timeout.
#  3. vllm==V with --no-deps: its own pins (torch 2.14 CUDA, flashinfer, cutlass, ...,
#     about 9 GB) are GPU packages that cannot run here. Then the pure-Python packages that
#     importing vLLM's config, forward context, plugin loader and its Kimi-Linear, Kimi-K3 and
#     GLM-5-Next layers needs, at V's pinned versions (deps_for below), with torch held at the
#     version of step 2 by a constraints file. (No torchvision: it has no CPU build for this
#     torch here; the tests enter GLM-5-Next's package without its multimodal __init__, see
#     test_vllm.py.)
#  4. pip install -e <this repository>: the `vllm.general_plugins` entry point lands in the
#     venv's metadata, where vLLM's plugin loader finds it.
#  5. pytest tests/integrations/test_vllm.py with CUDA_VISIBLE_DEVICES="" (vLLM's Triton
#     import check then keeps its kernels) and TRITON_INTERPRET=1.
# pip then warns that vLLM's own pins (torch==2.14.0, ...) are not met: expected, harmless here.
# Steps 1-3 are skipped when the venv was built by this version of the script. On a 2-core
# machine, per version: 1-2.5 minutes to build the venv (3 GB; PyPI reachable), then about
# 10 minutes of tests when nothing else runs, more on a busy machine (vLLM's kernels in
# Triton's interpreter; the verify steps at the TP 1 head counts, 64 and 96 heads, are the
# slow ones: -k "not H96 and not H64 and not H32" skips them).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

# The versions the plugin is tested against: its own constant, the one definition.
mapfile -t tested < <(python3 - "$root/kda/integrations/vllm.py" <<'EOF'
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
for node in tree.body:
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    if any(getattr(t, "id", "") == "TESTED_VLLM_VERSIONS" for t in targets):
        print("\n".join(ast.literal_eval(node.value)))
EOF
)
if [ "${#tested[@]}" -eq 0 ]; then
  echo "vllm-tests: no TESTED_VLLM_VERSIONS in kda/integrations/vllm.py" >&2
  exit 2
fi

# vLLM's import-time needs: what differs between the tested versions (each one's METADATA
# pins), then what they share.
deps_for() {
  case "$1" in
    0.33.0) echo "transformers>=5.16.1,<5.21.0 huggingface_hub>=1.31.0 tokenizers>=0.23.2" ;;
    0.34.0) echo "transformers>=5.16.1,<5.23.0 huggingface_hub>=2.0.0 tokenizers>=0.23.3" ;;
    *) return 1 ;;
  esac
}
common_deps=(
  "pydantic>=2.12.0" "fastapi>=0.133.0,<0.137.0" "aiohttp>=3.14.4" "openai>=2.25.0"
  "requests>=2.33.0" "prometheus_client>=0.18.0" "pillow>=13.0.0" "pyzmq>=25.0.0"
  "xgrammar==0.2.8" "llguidance>=1.7.0,<1.8.0" "compressed-tensors==0.17.0"
  regex cbor2 psutil urllib3 openai-harmony pybase64 cachetools msgspec cloudpickle uvloop
  py-cpuinfo partial-json-parser
)

version=""
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  version=$1; shift
elif [ $# -gt 0 ] && [ "$1" = all ]; then
  shift
fi

if [ -z "$version" ]; then
  # every tested version, each in its own process and venv
  status=0 summary=()
  for v in "${tested[@]}"; do
    start=$SECONDS
    if "$BASH" "$0" "$v" "$@"; then rc=0; else rc=$?; status=1; fi
    summary+=("[vllm-tests] vllm $v: exit $rc, $((SECONDS - start)) s")
  done
  printf '%s\n' "${summary[@]}"
  exit $status
fi

known=$(deps_for "$version") || {
  echo "vllm-tests: no dependency list for vllm $version in $0 (tested: ${tested[*]})" >&2
  exit 2
}
# shellcheck disable=SC2206
deps=($known "${common_deps[@]}")
venv=${KDA_VLLM_VENV_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kda}/vllm-venv-$version
torch_req=${KDA_VLLM_TORCH:-torch==2.13.0}
py=${KDA_VLLM_BASE_PYTHON:-python3}
base=("$torch_req" "triton==3.8.0" numpy einops "pytest==9.0.3" "pytest-timeout==2.4.0")
engine="vllm==$version"
tag="vllm-tests $version" tests=tests/integrations/test_vllm.py
unset_vars="VLLM_PLUGINS KDA_BACKEND"
source "$here/../engine_venv.sh"
run_engine_tests "$@"
