"""Probe: is a prefill batch on this GPU bound by its power limit? The pool's batches run back to back
(as ``bench_vllm_prefill.py`` runs both engines: one batch right after the other) and after an idle
gap, in groups taking turns, and the GPU's SM clock and power draw are read after each group.

    python benchmarks/probes/probe_sustained_clocks.py --checkpoint /tmp/v3-5layers --out probe.json

A pool of one GPU worker (``fp8_gemm`` auto, no prefix cache, ``--prompts`` prompts submitted together
with ``return_logits=False``, as the benchmark's headline runs) runs ``--runs`` batches in groups of
``--group``: the even groups back to back, the odd ones each after ``--idle-s`` of sleep. The first
group is a warm-up. Reported: the p50 milliseconds of each way, every run's seconds, and
``nvidia-smi``'s SM clock and power draw right after each group, the warm-up's included (the clock a
group ended at, the groups taking turns from back to back). A board whose clock falls under
sustained load while it draws its power limit is power-bound there: every engine measured back to
back on it runs at that clock, so its figures are lower than on a board that holds a higher one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/, the repository

import numpy as np
from machine import machine, query_gpu  # benchmarks/machine.py

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the model checkpoint the pool loads (e.g. write_checkpoint.py's V3 slice)")
    parser.add_argument("--prompts", type=int, nargs=2, default=(16, 4096), metavar=("N", "L"), help="N prompts of L tokens a batch")
    parser.add_argument("--runs", type=int, default=40, help="batches in all, the first group a warm-up")
    parser.add_argument("--group", type=int, default=4, help="batches run one way before the other way's turn")
    parser.add_argument("--idle-s", type=float, default=0.2, help="the idle gap before each batch of the 'after_idle' way")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.runs <= args.group:
        parser.error(f"--runs ({args.runs}) must exceed --group ({args.group}): the first group is a warm-up")

    from cluster.pool import PrefillPool
    from configs.pool import PoolConfig

    count, length = args.prompts
    config = PoolConfig(checkpoint=args.checkpoint, device="cuda", prefix_caching=False, seed=0, max_batch_tokens=max(65536, count * length),
                        chunk_tokens=max(32768, length), worker_cpus=1.0)  # fmt: skip
    ways = ("back_to_back", f"after_{args.idle_s:g}s_idle")
    runs: dict[str, list[float]] = {way: [] for way in ways}
    clocks = []
    with PrefillPool(config).start() as pool:
        vocab = pool.model_config.vocab_size
        for run in range(args.runs):
            batch = np.random.default_rng(run).integers(0, vocab, size=(count, length)).tolist()
            way = ways[(run // args.group) % 2]
            if way != "back_to_back":
                time.sleep(args.idle_s)
            began = time.perf_counter()
            pool.prefill_many(batch, return_logits=False)
            seconds = time.perf_counter() - began
            if run >= args.group:
                runs[way].append(seconds)
            if run % args.group == args.group - 1:
                clocks.append(query_gpu("clocks.sm,power.draw", units=True))  # as nvidia-smi prints them: "1350 MHz, 678.86 W"
    report = {
        "probe": "the pool's batches back to back against after an idle gap, and the GPU's clock",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(["benchmarks/probes/probe_sustained_clocks.py", *sys.argv[1:]]),
        "prompts": f"{count}x{length}",
        "p50_ms": {way: round(statistics.median(seconds) * 1000, 2) for way, seconds in runs.items()},
        "runs": runs,
        "clocks_after_groups": clocks,
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["p50_ms"]), *clocks, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
