"""Where a worker runs and what it may take there: its device (which of the GPUs it sees), its
compute dtype, whether its shard's weights fit before anything is allocated, and whether its KV
cache may be sized by the GPU memory left."""

from __future__ import annotations

import torch

from configs.model import DTYPES, ModelConfig
from configs.pool import PoolConfig


def gpu_bytes_allowed(device: torch.device, utilization: float) -> tuple[float, int, int]:
    """What ``utilization`` of a GPU's memory still allows (its share less every byte in use there: other
    processes', CUDA contexts and libraries' buffers, which torch's counters do not see, and this
    process's), with the GPU's free and total bytes (``torch.cuda.mem_get_info``)."""
    free, total = torch.cuda.mem_get_info(device)
    return total * utilization - (total - free), free, total


def check_weights_fit(weight_bytes: int, device: torch.device, config: PoolConfig, model_config: ModelConfig) -> None:
    """Refuse, before allocating, a shard whose weights exceed what this device allows: on a GPU
    ``gpu_memory_utilization`` of its memory less what other processes hold, on the CPU the host's
    available memory (Linux; elsewhere the CPU is not checked)."""
    if device.type == "cuda":
        budget, free, total = gpu_bytes_allowed(device, config.gpu_memory_utilization)
        where = (
            f"this GPU has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB and "
            f"gpu_memory_utilization={config.gpu_memory_utilization} allows {max(budget, 0) / 2**30:.1f} GiB"
        )
    else:
        budget = _host_available_bytes()
        if budget is None:
            return
        where = f"this host has {budget / 2**30:.1f} GiB of memory available"
    if weight_bytes > budget:
        experts = f", routed experts split over {config.workers_per_replica} ranks" if model_config.moe else ""
        raise ValueError(
            f"{model_config.name} ({model_config.num_hidden_layers} layers) needs {weight_bytes / 2**30:.1f} GiB of weights "
            f"per rank at TP={config.tp} x PCP={config.pcp}{experts}; {where}. Use more ranks per replica "
            "(tp x pcp), FP8 weights, or fewer layers (--num-layers)"
        )


def check_kv_sizing(device: torch.device, config: PoolConfig) -> None:
    """Refuse a KV cache sized by the memory left on a GPU that packed workers share: each would
    measure the same free memory and take it (``kv_cache_tokens`` fixes each worker's share)."""
    if device.type == "cuda" and config.kv_cache_tokens is None and config.worker_gpus < 1:
        raise ValueError(
            f"worker_gpus={config.worker_gpus} packs workers on one GPU, and kv_cache_tokens=None would size each "
            "one's KV cache by the GPU memory left, which they would all take at once; set kv_cache_tokens"
        )


def _host_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resolve_device(name: str, shared_rank: int | None = None) -> torch.device:
    """The worker's device; ``shared_rank`` picks one of the GPUs this process sees: with GPUs shared
    between replicas (``worker_gpus < 1``) rank ``r`` of a replica takes the node's GPU ``r`` (modulo
    their number), so a replica's ranks never share one; a promoted spare takes the failed rank's."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("pool config device='cuda' but this worker sees no GPU; valid here: cpu, auto")
        index = torch.cuda.current_device() if shared_rank is None else shared_rank % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    return torch.float32 if device.type == "cpu" else model_dtype
