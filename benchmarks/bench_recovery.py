"""Time from a rank's fault inside a batch to its replica serving again, for a given pool.

Starts one replica (TP x PCP workers), prefills a prompt, then ``--repeats`` times per fault
kind: arms worker ``--rank`` to ``raise`` or ``exit`` at the start of layer ``--layer`` of the
next batch (``PrefillPool.inject_fault``; its peers are then inside that layer's collectives),
submits the prompt again and waits for it (retried on the replacement replica; with spare workers,
each fault waits for the replica's spares to be ready first). Each recovery's
``serving_s`` runs from the fault's detection to the replacement's first finished batch, and
``start_s`` splits the replacement's start into its phases and each worker's setup steps. The
retried answer is checked against the fault-free one. Writes one JSON file.

    python benchmarks/bench_recovery.py --model deepseek-v3 --num-layers 2 --tp 2 --out recovery.json   # 2 GPUs: FP8 weights, bf16
    python benchmarks/bench_recovery.py --model tiny --device cpu --tp 2 --out recovery-cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import ray
import torch

from cluster.pool import PrefillPool
from configs.pool import PoolConfig
from workers.worker import SAFE_NCCL_ENV

from machine import machine  # benchmarks/machine.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pcp", type=int, default=1)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length (default: 4096)")
    parser.add_argument("--kinds", nargs="+", default=["raise", "exit"], choices=("raise", "exit"))
    parser.add_argument("--repeats", type=int, default=2, help="faults per kind (default: 2)")
    parser.add_argument("--rank", type=int, default=1, help="the worker that fails (default: 1)")
    parser.add_argument("--layer", type=int, default=1, help="the layer it fails at (default: 1)")
    parser.add_argument("--spare-workers", default="auto", choices=("auto", "on", "off"), help="PoolConfig.spare_workers (default: auto)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = PoolConfig(model=args.model, num_layers=args.num_layers, tp=args.tp, pcp=args.pcp, device=args.device,
                        dtype=args.dtype, backend=args.backend, collective_timeout_s=10.0, spare_workers=args.spare_workers)  # fmt: skip
    gpus = torch.cuda.device_count()
    os.environ.update(SAFE_NCCL_ENV, OMP_NUM_THREADS="1")
    ray.init(num_cpus=max(4, 2 * args.tp * args.pcp), num_gpus=gpus, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": dict(SAFE_NCCL_ENV)})  # fmt: skip
    prompt = np.random.default_rng(0).integers(0, config.model_config().vocab_size, size=args.tokens)
    recoveries, gpu_processes = [], None
    with PrefillPool(config).start() as pool:
        info = pool.worker_infos[0][0]
        expected = pool.prefill(prompt).logits.float()
        spares = pool._replicas[0].spares
        if spares is not None and info.device.startswith("cuda"):  # do the ready spares hold GPU memory? (they must not)
            ray.get(spares.ready, timeout=600)
            query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
            gpu_processes = {"workers": [i.pid for i in pool.worker_infos[0]],
                             "nvidia_smi": subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()}  # fmt: skip
            print("GPU processes with the spares ready:", gpu_processes, flush=True)
        for kind in args.kinds:
            for _ in range(args.repeats):
                spares = pool._replicas[0].spares
                if spares is not None:  # a fault soon after the last replacement finds its spares still starting
                    ray.get(spares.ready, timeout=600)
                pool.inject_fault(0, args.rank, kind, layer=args.layer)
                got = pool.submit(prompt).result(timeout=600).logits.float()
                recovery = pool.stats.recoveries[-1].as_dict()
                recovery["kind"] = kind
                recovery["logits_rel_err"] = round(float((got - expected).abs().max() / expected.abs().max()), 6)
                recoveries.append(recovery)
                print(kind, json.dumps({k: recovery[k] for k in ("cause", "restart_s", "serving_s", "logits_rel_err")}), flush=True)
        counts = {"retried": pool.stats.retried, "failed": pool.stats.failed}
    ray.shutdown()
    serving = [r["serving_s"] for r in recoveries]
    result = {
        "benchmark": "fault inside a batch -> replica serving again",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "pool": {"model": args.model, "num_layers": args.num_layers, "tp": args.tp, "pcp": args.pcp, "device": info.device,
                 "dtype": info.dtype, "weights": info.weights, "backend": info.backend, "tokens": args.tokens,
                 "spare_workers": args.spare_workers},  # fmt: skip
        "serving_s": {"median": round(statistics.median(serving), 3), "max": round(max(serving), 3), "all": serving},
        "requests": counts,
        "gpu_processes_with_spares_ready": gpu_processes,
        "recoveries": recoveries,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("pool", "serving_s", "requests")}))


if __name__ == "__main__":
    main()
