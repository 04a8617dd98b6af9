"""First-time costs of a fresh worker's first batches: JIT compiles that a request pays.

Builds one worker in this process (no Ray; TP = PCP = 1) the way a replica does (setup, warm-up
included), then runs batches of shapes a serving replica meets (prompts of odd lengths, two
prompts in one batch, a prompt's second chunk over cached context, several prompts), each
twice with new request ids, then ``--random-batches`` batches of random sizes up to
``--max-batch-tokens`` (in prompts of at most a chunk), and records per batch the time and the files that appeared in Triton's, the
CuTe DSL's and DeepGEMM's kernel caches meanwhile (a compile), and those of the worker's start. Run it
in a fresh process on a node whose caches are empty to see what a new node's start and first requests
pay (an FP8 checkpoint with ``--fp8-gemm deep_gemm``: DeepGEMM's kernels). Writes one JSON file.

    python benchmarks/probes/probe_first_batches.py --model deepseek-v3 --num-layers 3 --out first-batches.json
    python benchmarks/probes/probe_first_batches.py --checkpoint /tmp/v3-5layers --fp8-gemm deep_gemm --max-batch-tokens 65536 --random-batches 24 --out fb.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ (machine.py, timing.py, ...), the repository

import numpy as np
import torch

from configs.model import FP8_GEMMS
from configs.pool import PoolConfig
from workers.batch_io import ChunkPiece
from workers.worker import PrefillWorker

from machine import machine  # benchmarks/machine.py

CACHES = ("~/.triton/cache/**/*", "/tmp/**/*cute*/**/*", "~/.cache/**/*", os.environ.get("DG_JIT_CACHE_DIR", "~/.deep_gemm") + "/**/*")


def cache_files() -> set[str]:
    return {f for pattern in CACHES for f in glob.glob(os.path.expanduser(pattern), recursive=True)}


def deep_gemm_kernels(files) -> int:
    """DeepGEMM kernels among new cache files (one directory with a cubin each)."""
    return len({os.path.dirname(f) for f in files if f.endswith(".cubin")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--checkpoint", help="a checkpoint directory (its config.json names the model; default: --model with drawn weights)")
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--fp8-gemm", default="auto", choices=FP8_GEMMS, help="PoolConfig.fp8_gemm (default: auto)")
    parser.add_argument("--max-batch-tokens", type=int, default=32768, help="PoolConfig.max_batch_tokens (default: 32768)")
    parser.add_argument("--random-batches", type=int, default=0, help="then this many batches of random sizes up to --max-batch-tokens, in prompts of at most a chunk (default: 0)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = PoolConfig(model=args.model, checkpoint=args.checkpoint, num_layers=None if args.checkpoint else args.num_layers, device="cuda",
                        kv_cache_tokens=262144, fp8_gemm=args.fp8_gemm, max_batch_tokens=args.max_batch_tokens)  # fmt: skip
    worker = PrefillWorker(config, 0, {})
    before, started = cache_files(), time.perf_counter()
    info = worker.setup(*worker.rendezvous_address())
    setup_s, setup_kernels = time.perf_counter() - started, deep_gemm_kernels(cache_files() - before)
    rng = np.random.default_rng(0)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, config.model_config().vocab_size, size=n).astype(np.int32)

    long, mid = tokens(24954), tokens(9876)
    shapes = [  # (name, [(tokens, context)], finished)
        ("one prompt of 1135", [(tokens(1135), 0)]),
        ("one prompt of 1168", [(tokens(1168), 0)]),
        ("24954 + the first 7814 of 9876", [(long, 0), (mid[:7814], 0)]),
        ("the last 2062 of 9876 over 7814 cached", [(mid[7814:], 7814)]),
        ("4 prompts of 999-7007", [(tokens(n), 0) for n in (3001, 5003, 7007, 999)]),
    ]
    if args.max_batch_tokens >= 65536:
        shapes.append(("16 prompts of 4096", [(tokens(4096), 0) for _ in range(16)]))
    batches = []

    def run(round_, name, parts):
        ids = [f"r{round_}-{name}-{i}" for i in range(len(parts))]
        if parts[0][1]:  # a second chunk: its first chunk first, untimed
            worker.prefill([ChunkPiece(ids[0], mid[:7814], 0, len(mid))])
        pieces = [ChunkPiece(i, t, ctx, ctx + len(t)) for i, (t, ctx) in zip(ids, parts)]
        before = cache_files()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        worker.prefill(pieces)
        torch.cuda.synchronize()
        new = sorted(cache_files() - before)
        batches.append({"round": round_, "batch": name, "ms": round((time.perf_counter() - t0) * 1000, 1), "new_cache_files": len(new),
                        "compiled": sorted({os.path.basename(f).split(".")[0] for f in new if f.endswith(".json")}),
                        "deep_gemm_kernels": deep_gemm_kernels(new)})  # fmt: skip
        print(json.dumps(batches[-1]), flush=True)
        worker.release(ids)

    for round_ in range(2):
        for name, parts in shapes:
            run(round_, name, parts)
    for total in rng.integers(1, args.max_batch_tokens + 1, size=args.random_batches).tolist():  # in prompts of at most a chunk
        lens = [config.chunk_tokens] * (total // config.chunk_tokens) + ([total % config.chunk_tokens] if total % config.chunk_tokens else [])
        run(2, f"{total} tokens in {len(lens)} prompt(s)", [(tokens(n), 0) for n in lens])
    result = {
        "benchmark": "first-time costs of a fresh worker's first batches",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "model": args.checkpoint or args.model, "num_layers": config.model_config().num_hidden_layers, "backend": info.backend, "weights": info.weights,
        "fp8_gemm": info.fp8_gemm, "max_batch_tokens": config.max_batch_tokens,
        "setup_s": round(setup_s, 2), "setup_steps_s": info.start_phases_s, "setup_deep_gemm_kernels": setup_kernels,
        "batches": batches,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
