"""Probe: a batch's result rows (logits and last hidden rows, float32) from the GPU to the host, as the
worker hands them to Ray: into pageable memory (``tensor.cpu()``) against through pinned memory from
torch's caching host allocator (``workers.worker.results_to_host``).

    python benchmarks/probes/probe_results_to_host.py --out probe.json

Per batch of ``--prompts`` requests of a model of ``--vocab`` and ``--hidden`` (default DeepSeek-V3's):
each way's first call (nothing cached yet: fresh pages, a fresh pinned block) and the p50 of
``--repeats`` calls after it, wall time on the host including the synchronization.
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

import torch
from machine import machine  # benchmarks/machine.py

from workers.worker import results_to_host


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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    ways = {"pageable": lambda rows: rows.cpu().numpy(), "pinned": results_to_host}
    report = {"probe": "result rows from the GPU to the host", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "command": " ".join(sys.argv), "vocab": args.vocab, "hidden": args.hidden, "batches": {}}  # fmt: skip
    for count in args.prompts:
        rows = torch.randn(count, args.vocab + args.hidden, device="cuda")
        entry = {"megabytes": round(rows.numel() * rows.element_size() / 1e6, 2)}
        for name, way in ways.items():
            first = timed(lambda: way(rows))
            later = [timed(lambda: way(rows)) for _ in range(args.repeats)]
            entry[name] = {"first_ms": round(first * 1e3, 3), "p50_ms": round(statistics.median(later) * 1e3, 3)}
        report["batches"][str(count)] = entry
        print(f"{count} prompts ({entry['megabytes']} MB): " + ", ".join(f"{n} {entry[n]['p50_ms']} ms (first {entry[n]['first_ms']})" for n in ways), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
