"""What a benchmark's result file says about the machine it ran on."""

from __future__ import annotations

import os
import platform
import subprocess

import torch

# dense peaks of the SM90 cards measured here (an H100 SXM and an H200 alike; NVIDIA's datasheets), TF/s
PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}


def machine(modules: tuple[str, ...] = ("ray", "flash_attn", "flashinfer", "triton")) -> dict:
    """Host, CPU count, Python, torch, the GPUs (name, count, CUDA) and the versions of ``modules``
    (None where one is not installed)."""
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
        limits = _nvidia_smi("power.limit,clocks.max.sm")
        if limits is not None:
            info.update(power_limit_w=limits[0], max_sm_clock_mhz=limits[1])
    else:
        info["cpu"] = platform.processor() or platform.machine()
    for module in modules:
        try:
            info[module] = getattr(__import__(module), "__version__", "installed")
        except ImportError:
            info[module] = None
    return info


def gpu_state() -> dict | None:
    """The first visible GPU's SM clock (MHz) and power draw (W) now, from ``nvidia-smi``; None where it
    cannot say (no GPU, no ``nvidia-smi``, a value it does not report). Read right after runs made back
    to back, it shows whether the board ran them at its power limit: the H200s measured here draw ~680 W
    of their 700 W and fall to 1.1-1.4 GHz of 1.98 (``benchmarks/probes/probe_sustained_clocks.py``),
    so two boards of one kind differ by a few percent and engines are compared within one machine."""
    values = _nvidia_smi("clocks.sm,power.draw")
    return None if values is None else {"sm_clock_mhz": round(values[0]), "power_w": values[1]}


def parse_query(text: str) -> list[float] | None:
    """The numbers of one GPU's line of ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``;
    None when one is not a number (``[N/A]``, ``[Not Supported]``)."""
    try:
        return [float(part) for part in text.strip().splitlines()[0].split(",")]
    except (ValueError, IndexError):
        return None


def query_gpu(fields: str, *, units: bool = False) -> str | None:
    """``nvidia-smi``'s CSV line of ``fields`` for the first GPU this process sees
    (``CUDA_VISIBLE_DEVICES``' first entry, an index or a UUID, else GPU 0), with the units it prints
    (``1350 MHz, 678.86 W``) or without; None where ``nvidia-smi`` cannot be run."""
    device = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    form = "csv,noheader" if units else "csv,noheader,nounits"
    try:
        done = subprocess.run(["nvidia-smi", "-i", device, f"--query-gpu={fields}", f"--format={form}"],
                              capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _nvidia_smi(fields: str) -> list[float] | None:
    """``fields`` of the first visible GPU as numbers; None where ``nvidia-smi`` cannot be run or does not say."""
    line = query_gpu(fields)
    return None if line is None else parse_query(line)
