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
# machine: a few minutes to build the venv (PyPI reachable), then about two minutes of tests.
set -euo pipefail
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
base=(--isolated --cert /etc/ssl/certs/ca-certificates.crt "$torch_req" "torchvision==0.28.0"
      numpy einops "pytest==9.0.3" "pytest-timeout==2.4.0")
engine="sglang==0.5.23"
tag=sglang-tests tests=tests/integrations/test_sglang_package.py unset_vars="KDA_BACKEND"
source "$(dirname "$0")/../engine_venv.sh"
run_engine_tests "$@"
