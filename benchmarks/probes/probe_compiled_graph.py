"""Probe: the pool's per-batch SPMD call to its workers as Ray tasks (what ``cluster.scheduler`` does)
against the same call through a Ray Compiled Graph (``ray.dag`` with ``experimental_compile``, as
vLLM's Ray executor runs its workers), on a replica of a running pool.

    python benchmarks/probes/probe_compiled_graph.py --device cuda --checkpoint /tmp/v3-5layers --tokens 16 512 --out probe.json

Each way runs ``--batches`` batches of one new prompt of each ``--tokens`` length (its KV released
after each batch, outside the timing) and reports the wall time per batch (p50, p10, p90); the
difference is what the dispatch costs, the model's own time being the same. ``--device cpu`` runs a
small model (``--checkpoint`` default: the built-in ``tiny`` model, random weights) on Ray's CPUs,
TP ``--tp``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ (machine.py, timing.py, ...), the repository

import numpy as np
import ray
from machine import machine  # benchmarks/machine.py
from timing import spread_ms  # benchmarks/timing.py

from cluster.pool import PrefillPool
from cluster.replica import gather
from configs.pool import PoolConfig
from workers.batch_io import ChunkPiece
from workers.worker import SAFE_NCCL_ENV


def timed(call, workers, tokens: int, batches: int, vocab: int, tag: str) -> list[float]:
    rng, out = np.random.default_rng(tokens), []
    for i in range(batches + 3):  # the first three warm up
        piece = ChunkPiece(f"{tag}-{tokens}-{i}", rng.integers(0, vocab, size=tokens).astype(np.int32), 0, tokens)
        started = time.perf_counter()
        outputs = call([piece])
        elapsed = time.perf_counter() - started
        assert outputs[0] is not None and outputs[0].results[0].request_id == piece.request_id
        ray.get([w.release.remote([piece.request_id]) for w in workers])
        if i >= 3:
            out.append(elapsed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cpu")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the built-in tiny model, random weights)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks of the replica (default 2)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 512], help="prompt lengths (default 16 512)")
    parser.add_argument("--batches", type=int, default=50, help="timed batches per length and way (default 50)")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    os.environ.update(SAFE_NCCL_ENV)
    ray.init(num_cpus=os.cpu_count() if gpu else 2, num_gpus=args.tp if gpu else 0, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": SAFE_NCCL_ENV})  # fmt: skip
    model = {"checkpoint": args.checkpoint} if args.checkpoint else {"model": "tiny"}
    config = PoolConfig(**model, tp=args.tp, device=args.device, use_gpus=gpu, worker_cpus=1.0 if gpu else 0.25, kv_cache_tokens=1 << 14)
    report = {"what": "the pool's per-batch call to its workers: Ray tasks against a Ray Compiled Graph", "date": datetime.date.today().isoformat(),
              "machine": machine(), "config": {"model": args.checkpoint or "tiny", "tp": args.tp, "device": args.device}, "results": {}}  # fmt: skip
    with PrefillPool(config).start() as pool:
        workers = pool._replicas[0].workers
        vocab = pool.model_config.vocab_size
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as pieces:
            graph = MultiOutputNode([w.prefill.bind(pieces) for w in workers])
        compiled = graph.experimental_compile()
        try:
            for tokens in args.tokens:
                tasks = timed(lambda p: gather([w.prefill.remote(p) for w in workers]), workers, tokens, args.batches, vocab, "tasks")
                graphed = timed(lambda p: ray.get(compiled.execute(p), timeout=60), workers, tokens, args.batches, vocab, "graph")
                report["results"][str(tokens)] = {"ray_tasks": spread_ms(tasks), "compiled_graph": spread_ms(graphed),
                                                  "saved_p50_ms": round((statistics.median(tasks) - statistics.median(graphed)) * 1e3, 3)}  # fmt: skip
                print(tokens, report["results"][str(tokens)], flush=True)
        finally:
            compiled.teardown()
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
