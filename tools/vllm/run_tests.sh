#!/usr/bin/env bash
# The vLLM plugin's tests against the real vllm==0.33.0, on a CPU:
#
#   tools/vllm/run_tests.sh [pytest args]      e.g. -k verify, -x
#
# Not part of `tools/kda test` / `bazel test //...` (it installs vLLM, and runs for minutes).
# What it does:
#  1. An isolated virtual environment at $KDA_VLLM_VENV (default ~/.cache/kda/vllm-venv-0.33.0),
#     created WITHOUT the system site-packages, so it holds exactly one torch.
#  2. Into it: torch==2.13.0 (the project's torch; the CPU machines carry its CPU wheel, so
#     nothing big is downloaded; $KDA_VLLM_TORCH overrides the requirement), triton==3.8.0
#     (its CPU interpreter runs vLLM's Triton kernels; 3.6's fails on the verify path's conv),
#     numpy, einops, pytest, pytest-timeout.
#  3. vllm==0.33.0 with --no-deps: its own pins (torch 2.14 CUDA, flashinfer, cutlass, ...,
#     about 9 GB) are GPU packages that cannot run here. Then the pure-Python packages that
#     importing vLLM's config, forward context, plugin loader and its Kimi-Linear, Kimi-K3 and
#     GLM-5-Next layers needs, at vLLM's pinned versions, with torch held at the version of
#     step 2 by a constraints file. (No torchvision: it has no CPU build for this torch here;
#     the tests enter GLM-5-Next's package without its multimodal __init__, see test_vllm.py.)
#  4. pip install -e <this repository>: the `vllm.general_plugins` entry point lands in the
#     venv's metadata, where vLLM's plugin loader finds it.
#  5. pytest tests/integrations/test_vllm.py with CUDA_VISIBLE_DEVICES="" (vLLM's Triton
#     import check then keeps its kernels) and TRITON_INTERPRET=1.
# pip then warns that vLLM's own pins (torch==2.14.0, ...) are not met: expected, harmless here.
# Steps 1-3 are skipped when the venv was built by this version of the script. On a 2-core
# machine: 1.5-2.5 minutes to build the venv (3 GB; PyPI reachable), then about 20 minutes of
# tests (vLLM's kernels in Triton's interpreter; the verify steps at the TP 1 head counts,
# 64 and 96 heads, are the slow ones: -k "not H96 and not H64 and not H32" skips them).
set -euo pipefail
venv=${KDA_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kda/vllm-venv-0.33.0}
torch_req=${KDA_VLLM_TORCH:-torch==2.13.0}
py=${KDA_VLLM_BASE_PYTHON:-python3}

# vLLM's import-time needs (vllm 0.33.0's METADATA pins where it has them)
deps=(
  "transformers>=5.16.1,<5.21.0" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2"
  "pydantic>=2.12.0" "fastapi>=0.133.0,<0.137.0" "aiohttp>=3.14.4" "openai>=2.25.0"
  "requests>=2.33.0" "prometheus_client>=0.18.0" "pillow>=13.0.0" "pyzmq>=25.0.0"
  "xgrammar==0.2.8" "llguidance>=1.7.0,<1.8.0" "compressed-tensors==0.17.0"
  regex cbor2 psutil urllib3 openai-harmony pybase64 cachetools msgspec cloudpickle uvloop
  py-cpuinfo partial-json-parser
)
base=("$torch_req" "triton==3.8.0" numpy einops "pytest==9.0.3" "pytest-timeout==2.4.0")
engine="vllm==0.33.0"
tag=vllm-tests tests=tests/integrations/test_vllm.py unset_vars="VLLM_PLUGINS KDA_BACKEND"
source "$(dirname "$0")/../engine_venv.sh"
run_engine_tests "$@"
