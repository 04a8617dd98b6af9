"""Where the time of one MoE layer goes, on one GPU or expert-parallel over ``--gpus``.

Builds the first MoE layer of ``--model`` (default DeepSeek-V3; random weights, FP8 or bf16; its
routed experts split over the GPUs, one process each, in ``--schedule`` with ``--comm-sms``), runs
its routed experts on ``--tokens`` random hidden rows per GPU under ``torch.profiler`` and prints
rank 0's operators and kernels by GPU time, with the wall time of a call and of the whole layer
(shared experts included, computed beside the combine). On one GPU it then times the ways of
summing each token's weighted expert rows (``--tokens x k`` rows): ``index_add_`` into bf16
(atomics), and un-permuting the rows to ``[tokens, k, hidden]`` and summing over the k in float32.
``--device cpu`` is a smoke test of the script (gloo processes, float32).

    python benchmarks/profile_moe.py --weights fp8 --tokens 16384 --out FILE.json
    python benchmarks/profile_moe.py --weights fp8 --gpus 4 --schedule local-first --comm-sms 16 --out FILE.json
    python benchmarks/profile_moe.py --device cpu --model deepseek-v2-lite --weights bf16 --tokens 64 --gpus 2 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from configs.model import EP_SCHEDULES, load_model_config
from workers.collectives import expert_parallel_group
from workers.model import DeepseekPrefillModel
from workers.expert_parallel import EPGroup
from workers.weights import load_weights
from workers.worker import SAFE_NCCL_ENV

from timing import seconds_per_call, sync  # benchmarks/timing.py


def timed(fn) -> float:
    """Median wall seconds of a call, the GPU synchronized around it."""
    return seconds_per_call(fn, synced=True)


def run(rank: int, args, port: int) -> None:
    os.environ.update(SAFE_NCCL_ENV)
    device = torch.device(args.device, rank if args.device == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ep = EPGroup()
    if args.gpus > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.gpus)
        ep = EPGroup(rank, args.gpus, expert_parallel_group(args.gpus, device, args.comm_sms))
    config = load_model_config(args.model)
    config = load_model_config(args.model, num_hidden_layers=config.moe.first_k_dense_replace + 1)  # the first MoE layer
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = DeepseekPrefillModel.create(
        config, TorchSDPAPrefillBackend, ep=ep, fp8=args.weights == "fp8", ep_schedule=args.schedule,
        ep_comm_sms=args.comm_sms, dtype=dtype, device=device,
    )  # fmt: skip
    load_weights(model, None, 0)
    moe = model.moe_layers()[0][1]
    x = torch.randn(args.tokens, config.hidden_size, device=device, generator=torch.Generator(device).manual_seed(rank)).to(dtype)
    routed = timed(lambda: moe.routed(x))
    layer = timed(lambda: moe(x))
    shared = timed(lambda: moe.shared_experts(x))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            moe.routed(x)
        sync()
    if rank:
        dist.destroy_process_group()
        return
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    print(table)
    kernels = [
        {"name": e.key[:120], "cuda_ms_per_call_of_routed": e.device_time_total / 3 / 1e3, "calls": e.count // 3}
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:30]
    ]

    combine = {}
    if args.gpus == 1 and device.type == "cuda":
        k, hidden = config.moe.num_experts_per_tok, config.hidden_size
        y = torch.randn(args.tokens * k, hidden, device="cuda").to(torch.bfloat16)
        order = torch.randperm(args.tokens * k, device="cuda")
        row = order // k
        combine = {
            "index_add_bf16_s": timed(lambda: torch.zeros(args.tokens, hidden, dtype=torch.bfloat16, device="cuda").index_add_(0, row, y)),
            "unpermute_sum_fp32_s": timed(
                lambda: torch.empty_like(y).index_copy_(0, order, y).view(args.tokens, k, hidden).sum(dim=1, dtype=torch.float32)
            ),
        }
    elif args.gpus > 1:
        dist.destroy_process_group()
    print(f"routed experts: {routed * 1e3:.2f} ms per call on rank 0, with the shared experts {layer * 1e3:.2f} ms "
          f"(shared alone {shared * 1e3:.2f} ms); combine: {combine}")  # fmt: skip
    result = {
        "benchmark": f"one {args.model} MoE layer, torch.profiler", "model": args.model, "device": args.device,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__, "python": platform.python_version()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "weights": args.weights, "gpus": args.gpus, "schedule": args.schedule, "comm_sms": args.comm_sms,
        "tokens_per_gpu": args.tokens,
        "routed_s": routed, "layer_s": layer, "shared_experts_s": shared, "host_ms_per_call": sum(e.self_cpu_time_total for e in prof.key_averages()) / 3 / 1e3,
        "kernels": kernels, "combine": combine,
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3", help="a built-in MoE model; its first MoE layer is profiled")
    parser.add_argument("--weights", default="fp8", choices=["fp8", "bf16"])
    parser.add_argument("--tokens", type=int, default=16384, help="hidden rows per GPU")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--schedule", default="all-to-all", choices=EP_SCHEDULES, help="PoolConfig.ep_schedule")
    parser.add_argument("--comm-sms", type=int, default=0, help="PoolConfig.ep_comm_sms")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of this script (gloo, float32, bf16 weights)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.device == "cpu" and args.weights == "fp8":
        parser.error("--weights fp8 needs CUDA (FP8 GEMMs); use --weights bf16 on the CPU")
    if args.gpus == 1:
        run(0, args, 0)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(run, args=(args, port), nprocs=args.gpus)


if __name__ == "__main__":
    main()
