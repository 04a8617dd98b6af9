"""What a benchmark's result file says about the machine it ran on."""

from __future__ import annotations

import os
import platform

import torch

# dense peaks of the SM90 cards measured here (an H100 SXM and an H200 alike; NVIDIA's datasheets), TF/s
PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}


def machine(modules: tuple[str, ...] = ("ray", "flash_attn", "flashinfer", "triton")) -> dict:
    """Host, CPU count, Python, torch, the GPUs (name, count, CUDA) and the versions of ``modules``
    (None where one is not installed)."""
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    for module in modules:
        try:
            info[module] = getattr(__import__(module), "__version__", "installed")
        except ImportError:
            info[module] = None
    return info
