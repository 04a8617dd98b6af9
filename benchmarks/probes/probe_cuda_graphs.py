"""Probe: one prompt's prefill in the worker, its forward launched kernel by kernel against replayed
from the CUDA graphs captured at the worker's start (``workers.cuda_graphs``).

    python benchmarks/probes/probe_cuda_graphs.py --checkpoint /tmp/v3-5layers --tokens 16 512 2048 4096 --out probe.json

One ``PrefillWorker`` in this process (no Ray) on one GPU; for each ``--tokens`` length, ``--batches``
prefills of one new prompt (``PrefillWorker.prefill``: the KV written to the paged cache, the logits
copied to the host), its KV released after each, eagerly (the worker's graphs set aside) and by
replay, alternating so that both see the same GPU clocks. Reports the wall time per prefill (p50, p10,
p90) each way and, per length, how far the replayed logits are from the eager ones (the padded
prompt runs other GEMM shapes: bf16 rounding) and whether the first token is the same.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/, the repository

import numpy as np
from machine import machine  # benchmarks/machine.py
from timing import spread_ms  # benchmarks/timing.py

from configs.pool import PoolConfig
from workers.batch_io import ChunkPiece
from workers.worker import PrefillWorker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 512, 2048], help="prompt lengths (default 16 512 2048)")
    parser.add_argument("--batches", type=int, default=30, help="timed prefills per length and way (default 30)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    config = PoolConfig(checkpoint=args.checkpoint, device="cuda", kv_cache_tokens=1 << 16)
    worker = PrefillWorker(config, 0)
    info = worker.setup("127.0.0.1", 0)
    graphs, vocab = worker.graphs, worker.model.config.vocab_size
    report = {
        "what": __doc__.split("\n\n")[0],
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": " ".join(sys.argv),
        "backend": info.backend,
        "weights": info.weights,
        "cuda_graph_tokens": list(info.cuda_graph_tokens),
        "graph_pool_mib": round(graphs.pool_bytes / 2**20, 1) if graphs else None,
        "start_phases_s": info.start_phases_s,
        "lengths": {},
    }
    for tokens in args.tokens:
        rng, times, logits = np.random.default_rng(tokens), {"eager": [], "replayed": []}, {}
        for i in range(args.batches + 2):  # the first two warm up
            ids = rng.integers(0, vocab, size=tokens).astype(np.int32)
            for way in ("eager", "replayed"):
                worker.graphs = graphs if way == "replayed" else None
                request = f"{way}-{tokens}-{i}"
                started = time.perf_counter()
                out = worker.prefill([ChunkPiece(request, ids, 0, tokens)])
                elapsed = time.perf_counter() - started
                worker.release([request])
                logits[way] = out.logits(out.results[0])
                if i >= 2:
                    times[way].append(elapsed)
        worker.graphs = graphs
        diff = np.abs(logits["replayed"] - logits["eager"])
        entry = {way: spread_ms(t) for way, t in times.items()}
        entry.update(
            replayed_path="replay" if graphs and graphs.size_for(tokens) else "eager (longer than every graph)",
            speedup=round(entry["eager"]["p50_ms"] / entry["replayed"]["p50_ms"], 3),
            last_logits_max_abs_diff=float(diff.max()),
            last_logits_scale=float(np.abs(logits["eager"]).max()),
            same_first_token=bool(logits["replayed"].argmax() == logits["eager"].argmax()),
        )
        report["lengths"][str(tokens)] = entry
        print(tokens, json.dumps(entry), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
