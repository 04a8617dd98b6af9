"""Pool prefill benchmark: TTFT and tokens/s of DeepSeek-V3-shaped layers for several TP degrees.

For each TP degree a pool is started (random weights, the model's first
``--layers`` dense layers), warmed up, and each prompt length is prefilled
``--repeats`` times; the median TTFT is reported. The logits and the latent KV
of the longest prompt are compared between the TP degrees (max abs error over
max magnitude). Writes one JSON file with the machine, versions and command.

    python benchmarks/bench_pool.py --tp 1 2 --tokens 8192 32768 --out benchmarks/results/pool.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from cluster.pool import PrefillPool
from configs.pool import PoolConfig

from machine import machine  # benchmarks/machine.py


def run_tp(args: argparse.Namespace, tp: int, prompts: dict[int, np.ndarray]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    config = PoolConfig(
        model=args.model, num_layers=args.layers, tp=tp, backend=args.backend,
        chunk_tokens=args.chunk_tokens, max_batch_tokens=max(args.chunk_tokens, 16384), seed=0,
    )  # fmt: skip
    started = time.perf_counter()
    with PrefillPool(config).start() as pool:
        startup = time.perf_counter() - started
        info = pool.worker_infos[0][0]
        warm = time.perf_counter()
        pool.prefill(prompts[min(prompts)][:1024])
        warmup = time.perf_counter() - warm
        rows = []
        for tokens, prompt in sorted(prompts.items()):
            ttfts = [pool.prefill(prompt).ttft_s for _ in range(args.repeats)]
            ttft = statistics.median(ttfts)
            rows.append({"tokens": tokens, "ttft_s": round(ttft, 4), "tokens_per_s": round(tokens / ttft, 1),
                         "ttft_runs_s": [round(t, 4) for t in ttfts]})  # fmt: skip
            print(f"TP={tp} {tokens:>6} tokens: TTFT {ttft * 1e3:8.1f} ms, {tokens / ttft:9.0f} tokens/s", flush=True)
        longest = pool.prefill(prompts[max(prompts)], keep_kv=True)
        kv = pool.fetch_kv(longest)
        pool.release(longest)
    summary = {
        "tp": tp, "backend": info.backend, "device": info.device, "dtype": info.dtype,
        "pool_startup_s": round(startup, 1), "worker_warmup_s": info.warmup_s, "first_request_s": round(warmup, 2),
        "kv_cache_tokens_per_worker": info.kv_blocks * info.block_size, "results": rows,
    }  # fmt: skip
    return summary, longest.logits, kv


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--layers", type=int, default=3, help="dense layers to run (DeepSeek-V3 has 3)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=8192)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--rtol", type=float, default=0.05, help="TP agreement tolerance (bf16)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    gen = np.random.default_rng(0)
    vocab = PoolConfig(model=args.model, num_layers=args.layers).model_config().vocab_size
    prompts = {n: gen.integers(0, vocab, size=n) for n in args.tokens}
    runs, outputs = [], {}
    for tp in args.tp:
        summary, logits, kv = run_tp(args, tp, prompts)
        runs.append(summary)
        outputs[tp] = (logits, kv)
    base = args.tp[0]
    agreement = {}
    for tp in args.tp[1:]:
        logits_err = relative_error(outputs[tp][0], outputs[base][0])
        kv_err = relative_error(outputs[tp][1], outputs[base][1])
        agreement[f"tp{tp}_vs_tp{base}"] = {
            "tokens": max(prompts), "logits_max_rel_err": logits_err, "kv_max_rel_err": kv_err,
            "same_first_token": int(outputs[tp][0].argmax()) == int(outputs[base][0].argmax()),
            "rtol": args.rtol, "within_tolerance": logits_err <= args.rtol and kv_err <= args.rtol,
        }  # fmt: skip
    result = {
        "benchmark": "pool prefill, random weights",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(("ray", "flashinfer", "triton")),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": args.model, "layers": args.layers, "chunk_tokens": args.chunk_tokens,
        "runs": runs, "agreement": agreement,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(agreement, indent=1))


if __name__ == "__main__":
    main()
