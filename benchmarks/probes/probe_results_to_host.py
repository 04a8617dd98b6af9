"""Probe: a batch's result rows (logits and last hidden rows, float32) from the GPU to the host, as the
worker hands them to Ray: into pageable memory (``tensor.cpu()``) against through pinned memory from
torch's caching host allocator (``workers.batch_io.results_to_host``); with ``--ray``, also the batch's
output (a ``BatchOutput``, as the worker returns it: one array of rows) through a Ray actor's call
each way and with no rows at all (``first_token_only``: every request submitted with
``return_logits=False``), to see what Ray's part of the pool's call owes to the rows and where they live.

    python benchmarks/probes/probe_results_to_host.py --out probe.json [--ray]

Per batch of ``--prompts`` requests of a model of ``--vocab`` and ``--hidden`` (default DeepSeek-V3's):
each way's first call (nothing cached yet: fresh pages, a fresh pinned block) and the p50 of
``--repeats`` calls after it, wall time on the host including the synchronization. Through Ray
(``ray``): per call the actor's own seconds (the copy and building the output) and the rest of the
call as the driver saw it (Ray's: submitting, storing the arrays, fetching them), then the driver's
copies of each request's rows out of Ray's store (``cluster.results.owned_row``, the pool's), p50
of ``--repeats`` calls of each way, the ways taking turns.
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
import torch
from machine import machine  # benchmarks/machine.py

from workers.batch_io import BatchOutput, ChunkPiece, finished_results, results_to_host

WAYS = {"pageable": lambda rows: rows.cpu().numpy(), "pinned": results_to_host}
RAY_WAYS = (*WAYS, "first_token_only")


class ResultsActor:
    """What a worker's ``prefill`` does after its forward (``workers.batch_io.finished_results``): the
    greedy tokens, and the rows to the host (pageable or pinned) unless no request asks for them."""

    def __init__(self, count: int, vocab: int, hidden: int) -> None:
        self.rows, self.vocab = torch.randn(count, vocab + hidden, device="cuda"), vocab

    def batch(self, way: str) -> BatchOutput:
        pieces = [ChunkPiece(f"r{j}", np.zeros(1, np.int32), 0, 1, return_logits=way in WAYS) for j in range(len(self.rows))]
        torch.cuda.synchronize()
        began = time.perf_counter()
        results, host = finished_results(pieces, self.rows, self.vocab, WAYS.get(way, results_to_host))
        return BatchOutput(results, host, self.vocab, time.perf_counter() - began)


def through_ray(count: int, args) -> dict:
    import ray

    from cluster.results import owned_row

    actor = ray.remote(num_gpus=1, num_cpus=1)(ResultsActor).remote(count, args.vocab, args.hidden)
    ray.get(actor.batch.remote("pageable"))
    seen = {way: {"actor": [], "ray": [], "driver": []} for way in RAY_WAYS}
    for _ in range(args.repeats):
        for way in RAY_WAYS:
            began = time.perf_counter()
            out = ray.get(actor.batch.remote(way))
            fetched = time.perf_counter()
            owned = [(owned_row(out.logits(r)), owned_row(out.last_hidden(r))) for r in out.results]
            seen[way]["actor"].append(out.worker_s)
            seen[way]["ray"].append(fetched - began - out.worker_s)
            seen[way]["driver"].append(time.perf_counter() - fetched)
            del out, owned  # as the pool's driver does once it has taken the rows out
    ray.kill(actor)
    return {way: {f"{part}_p50_ms": round(statistics.median(v) * 1e3, 3) for part, v in parts.items()} for way, parts in seen.items()}


def timed(fn) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, nargs="+", default=[1, 16], help="requests finished in the batch (default 1 16)")
    parser.add_argument("--vocab", type=int, default=129280, help="the model's vocabulary (default DeepSeek-V3's)")
    parser.add_argument("--hidden", type=int, default=7168, help="the model's hidden width (default DeepSeek-V3's)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ray", action="store_true", help="also each way through a Ray actor's call (needs ray)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.ray:
        import ray

        ray.init(num_cpus=2, num_gpus=1, include_dashboard=False)  # its workers take this process's PYTHONPATH: the repository on it
    report = {"probe": "result rows from the GPU to the host", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "command": " ".join(sys.argv), "vocab": args.vocab, "hidden": args.hidden, "batches": {}}  # fmt: skip
    for count in args.prompts:
        rows = torch.randn(count, args.vocab + args.hidden, device="cuda")
        entry = {"megabytes": round(rows.numel() * rows.element_size() / 1e6, 2)}
        for name, way in WAYS.items():
            first = timed(lambda: way(rows))
            later = [timed(lambda: way(rows)) for _ in range(args.repeats)]
            entry[name] = {"first_ms": round(first * 1e3, 3), "p50_ms": round(statistics.median(later) * 1e3, 3)}
        if args.ray:
            entry["ray"] = through_ray(count, args)
        report["batches"][str(count)] = entry
        print(f"{count} prompts ({entry['megabytes']} MB): " + ", ".join(f"{n} {entry[n]['p50_ms']} ms (first {entry[n]['first_ms']})" for n in WAYS), flush=True)
        if args.ray:
            print("  through Ray: " + ", ".join(f"{n} actor {v['actor_p50_ms']} + Ray {v['ray_p50_ms']} + driver {v['driver_p50_ms']} ms" for n, v in entry["ray"].items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
