#!/usr/bin/env bash
# The SGLang adapter's tests against the real sglang==0.5.23, on a CPU:
#
#   tools/sglang/run_tests.sh [pytest args]      e.g. -k packed, -x
#
# Not part of `tools/kda test` / `bazel test //...` (it installs SGLang). tests/integrations/
# test_sglang.py (no SGLang needed) is in the default suite; this runs test_sglang_package.py,
# which calls SGLang's own KDAAttnBackend.forward_decode and gated RMSNorm (Triton kernels, in
# Triton's CPU interpreter) and compares the adapter with them. What it does:
#  1. An isolated virtual environment at $KDA_SGLANG_VENV (default
#     ~/.cache/kda/sglang-venv-0.5.23), created WITHOUT the system site-packages.
#  2. Into it, from PyPI itself (pip --isolated: no local wheel mirror): torch==2.13.0 and
#     torchvision==0.28.0, PyPI's CUDA builds, which run on a CPU (SGLang's config package
#     imports torchvision at import time, and PyPI's torchvision loads only beside a CUDA
#     build of torch; $KDA_SGLANG_TORCH overrides the torch requirement), with the triton torch
#     pins (3.7.1; its interpreter runs SGLang's kernels), numpy, einops, pytest, pytest-timeout.
#  3. sglang==0.5.23 with --no-deps: its own pins (torch 2.14.1 CUDA, flashinfer, sgl-kernel,
#     cutlass, ...) are GPU packages that cannot run here. Then the pure-Python packages that
#     importing SGLang's KDA backend, its kernels and its config helpers needs (SGLang's pins
#     where its METADATA has them), with torch held at step 2's version by a constraints file.
#  4. pip install -e <this repository>, then pytest tests/integrations/test_sglang_package.py
#     with CUDA_VISIBLE_DEVICES="" and TRITON_INTERPRET=1.
# pip then warns that SGLang's own pins (torch==2.14.1, ...) are not met: expected, harmless.
# Steps 1-3 are skipped when the venv was built by this version of the script. On a 2-core
# machine: a few minutes to build the venv (PyPI reachable), then about a minute of tests.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${KDA_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kda/sglang-venv-0.5.23}
torch_req=${KDA_SGLANG_TORCH:-torch==2.13.0}
py=${KDA_SGLANG_BASE_PYTHON:-python3}

# what importing sglang.srt.layers.attention.linear.kda_backend and its kernels needs
deps=(
  "transformers==5.19.0" "tokenizers==0.23.2" "compressed-tensors==0.18.0" "openai==2.8.0"
  "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" psutil pybase64 starlette msgspec pyzmq
  tqdm aiohttp dill gguf partial_json_parser uvicorn fastapi orjson pydantic requests pillow
  IPython zstandard regex "python-dateutil<3" python-multipart prometheus-client setproctitle
  xxhash interegular easydict distro packaging
)
stamp=$(sha256sum < "$0" | cut -c1-16)

if [ "$(cat "$venv/.kda-stamp" 2>/dev/null || true)" != "$stamp" ]; then
  start=$SECONDS
  echo "[sglang-tests] building $venv" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  constraints="$venv/kda-constraints.txt"
  "${pip[@]}" --isolated --cert /etc/ssl/certs/ca-certificates.crt "$torch_req" \
    "torchvision==0.28.0" numpy einops "pytest==9.0.3" "pytest-timeout==2.4.0"
  "$venv/bin/python" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > "$constraints"
  "${pip[@]}" --no-deps "sglang==0.5.23"
  "${pip[@]}" -c "$constraints" "${deps[@]}"
  "${pip[@]}" -c "$constraints" -e "$root"          # with its own deps (absl-py, rich)
  echo "$stamp" > "$venv/.kda-stamp"
  echo "[sglang-tests] venv built in $((SECONDS - start)) s" >&2
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$root"
"$venv/bin/python" -c 'from importlib.metadata import version as v
print("[sglang-tests] " + ", ".join(f"{p} {v(p)}" for p in ("sglang", "torch", "triton")))'

cd "$root"
export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
unset KDA_BACKEND || true
exec "$venv/bin/python" -m pytest tests/integrations/test_sglang_package.py -v -rs "$@"
