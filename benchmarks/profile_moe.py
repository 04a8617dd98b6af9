"""Where the time of one DeepSeek-V3 MoE layer goes, on one GPU or expert-parallel over ``--gpus``.

Builds the first MoE layer of DeepSeek-V3 (random weights, FP8 or bf16; its 256 experts split over
the GPUs, one process each), runs its routed experts on ``--tokens`` random hidden rows per GPU
under ``torch.profiler`` and prints rank 0's operators and kernels by GPU time, with the wall time
of a call and of the whole layer (shared experts included, computed beside the combine); on one GPU it then times the ways of summing each token's weighted expert rows
(``--tokens x 8`` rows of 7168): ``index_add_`` into bf16 (atomics), and un-permuting the rows to
``[tokens, 8, 7168]`` and summing over the 8 in float32.

    python benchmarks/profile_moe.py --weights fp8 --tokens 16384 --out FILE.json
    python benchmarks/profile_moe.py --weights fp8 --gpus 4 --schedule local-first --comm-sms 16 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
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
from workers.moe import EPGroup
from workers.weights import load_weights


def timed(fn, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(rank: int, args, port: int) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    ep = EPGroup()
    if args.gpus > 1:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.gpus)
        ep = EPGroup(rank, args.gpus, expert_parallel_group(args.gpus, torch.device("cuda"), args.comm_sms))
    config = load_model_config("deepseek-v3", num_hidden_layers=4)
    model = DeepseekPrefillModel.create(
        config, TorchSDPAPrefillBackend, ep=ep, fp8=args.weights == "fp8", ep_schedule=args.schedule,
        ep_comm_sms=args.comm_sms,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    load_weights(model, None, 0)
    moe = model.moe_layers()[0][1]
    x = torch.randn(args.tokens, config.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    x = x.to(torch.bfloat16)
    routed = timed(lambda: moe.routed(x))
    layer = timed(lambda: moe(x))
    shared = timed(lambda: moe.shared_experts(x))
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            moe.routed(x)
        torch.cuda.synchronize()
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
    if args.gpus == 1:
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
    else:
        dist.destroy_process_group()
    print(f"routed experts: {routed * 1e3:.2f} ms per call on rank 0, with the shared experts {layer * 1e3:.2f} ms "
          f"(shared alone {shared * 1e3:.2f} ms); combine: {combine}")  # fmt: skip
    result = {
        "benchmark": "one DeepSeek-V3 MoE layer, torch.profiler",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "weights": args.weights, "gpus": args.gpus, "schedule": args.schedule, "comm_sms": args.comm_sms,
        "tokens_per_gpu": args.tokens,
        "routed_s": routed, "layer_s": layer, "shared_experts_s": shared, "host_ms_per_call": sum(e.self_cpu_time_total for e in prof.key_averages()) / 3 / 1e3,
        "kernels": kernels, "combine": combine,
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="fp8", choices=["fp8", "bf16"])
    parser.add_argument("--tokens", type=int, default=16384, help="hidden rows per GPU")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--schedule", default="all-to-all", choices=EP_SCHEDULES, help="PoolConfig.ep_schedule")
    parser.add_argument("--comm-sms", type=int, default=0, help="PoolConfig.ep_comm_sms")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.gpus == 1:
        run(0, args, 0)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(run, args=(args, port), nprocs=args.gpus)


if __name__ == "__main__":
    main()
