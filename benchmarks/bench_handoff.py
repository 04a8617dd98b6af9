"""KV handoff benchmark: how fast a prefilled request's latent KV reaches a decode actor.

A one-GPU prefill pool (TP = PCP = 1, GPU 0) prefills prompts of DeepSeek-V3 MLA shape; a
``DecodeActor`` on GPU 1 pulls each kept request over its NCCL point-to-point link (``p2p``),
three times uncounted (the first opens the link), then ``--repeats`` times (the median is
reported), once more while the pool prefills another prompt of the same length on GPU 0 (the
holder's link thread answers without waiting for the batch), and once as Ray objects
(``object``); then the TCP path (``KVServer`` to ``KVReceiver`` on this host's loopback) sends it
once. ``pull_s`` is the whole pull as the decode actor sees it: from asking the holders (a
message on each holder's control connection, ``pull_ask_s``) to the KV reassembled in its
memory; ``pull_transfer_s`` is its part after the ask, to the last byte in. The p2p copy is checked equal to the object copy.
Before Ray starts, two plain processes measure the one-way NCCL bandwidth between the same
GPUs (one 1 GiB message, as in DESIGN.md, and the handoff's own per-layer messages), the figure
the p2p rate is compared against.

The model is DeepSeek-V3's config with ``--layers`` layers, all with its dense MLP (the cache does
not depend on the MLP: 576 bf16 values per token per layer, 1,152 B). Writes one JSON file.

    python benchmarks/bench_handoff.py --layers 8 --tokens 32768 131072 --out benchmarks/results/handoff.json
    python benchmarks/bench_handoff.py --device cpu --layers 2 --tokens 512   # a CPU smoke run (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cluster.handoff import DecodeActor
from cluster.kv_server import KVServer
from cluster.pool import PrefillPool
from configs.model import load_model_config
from configs.pool import PoolConfig
from workers.kv_transfer import KVReceiver
from workers.worker import SAFE_NCCL_ENV

GIB = 1 << 30
WARMUP_PULLS = 3  # not counted: the first opens the link, the next allocate buffers and raise the clocks


def _one_way(rank: int, port: int, sizes: list[tuple[int, int]], repeats: int, results) -> None:
    """Rank 1 sends to rank 0: per (message bytes, count) the median seconds of ``count`` messages."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for size, count in sizes:
        buffers = [torch.empty(size // 2, dtype=torch.bfloat16, device="cuda") for _ in range(count)]
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            dist.barrier()
            torch.cuda.synchronize()
            started = time.perf_counter()
            works = [(dist.isend if rank else dist.irecv)(b, 1 - rank) for b in buffers]
            for work in works:
                work.wait()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        out[(size, count)] = statistics.median(times[1:])
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def one_way_nccl(sizes: list[tuple[int, int]], repeats: int) -> dict:
    port = 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_one_way, args=(port, sizes, repeats, results), nprocs=2)
        return {
            f"{count}x{size}B": {"bytes": size * count, "seconds": round(s, 6), "gib_per_s": round(size * count / s / GIB, 1)}
            for (size, count), s in dict(results).items()
        }


def model_file(layers: int, folder: Path) -> Path:
    """DeepSeek-V3's config.json with ``layers`` layers, every one dense."""
    raw = dict(load_model_config("deepseek-v3").source)
    raw.update(num_hidden_layers=layers, first_k_dense_replace=layers)
    path = folder / "config.json"
    path.write_text(json.dumps(raw))
    return path


def handoff(pool: PrefillPool, decoder, tokens: int, repeats: int, vocab: int) -> dict:
    prompt = np.random.default_rng(tokens).integers(0, vocab, size=tokens)
    result = pool.prefill(prompt, keep_kv=True)
    source = pool.kv_source(result)
    pulls = []
    for _ in range(WARMUP_PULLS + repeats):
        started = time.perf_counter()
        receipt = ray.get(decoder.receive.remote(source))
        pulls.append({**receipt, "driver_call_s": time.perf_counter() - started})
    first, pulls = pulls[0], pulls[WARMUP_PULLS:]
    busy = pool.submit(prompt[::-1].copy())  # another prompt keeps GPU 0 busy while the decoder pulls
    while not any(w["kv_requests"] > 1 for w in pool.health()[0]):
        time.sleep(0.001)
    during = ray.get(decoder.receive.remote(source))
    still_running = not busy.done()
    busy.result()
    p2p = ray.get(decoder.__ray_call__.remote(lambda self: self.states[result.request_id].rows))
    started = time.perf_counter()
    object_receipt = ray.get(decoder.receive.remote(source, transport="object"))
    object_s = time.perf_counter() - started
    by_object = ray.get(decoder.__ray_call__.remote(lambda self: self.states.pop(result.request_id).rows))
    same = all(torch.equal(a, b) for a, b in zip(p2p, by_object))
    size = receipt["bytes"]
    with KVServer(pool) as server:
        receiver = KVReceiver(server.host, server.port, model_fingerprint=pool.model_config.fingerprint())
        started = time.perf_counter()
        kv = receiver.fetch(result.request_id)  # the ack frees the request on the prefill side
        tcp_s = time.perf_counter() - started
    pull_s, call, ask, transfer = (
        statistics.median(pull[key] for pull in pulls) for key in ("seconds", "driver_call_s", "ask_s", "transfer_s")
    )
    row = {
        "tokens": tokens,
        "bytes": size,
        "p2p_equals_object_copy": same,
        "p2p": {
            "pull_s": round(pull_s, 6),
            "pull_gib_per_s": round(size / pull_s / GIB, 1),
            "pull_ask_s": round(ask, 6),
            "pull_transfer_s": round(transfer, 6),
            "pull_transfer_gib_per_s": round(size / transfer / GIB, 1),
            "first_pull_with_link_setup_s": round(first["seconds"], 4),
            "driver_call_s": round(call, 6),
            "pull_runs_s": [round(pull["seconds"], 6) for pull in pulls],
            "pull_during_a_prefill_s": round(during["seconds"], 6),
            "pull_during_a_prefill_gib_per_s": round(size / during["seconds"] / GIB, 1),
            "prefill_still_running_after_that_pull": still_running,
        },
        "object": {"transfer_s": round(object_receipt["seconds"], 4), "gib_per_s": round(size / object_receipt["seconds"] / GIB, 2),
                   "driver_call_s": round(object_s, 4)},  # fmt: skip
        "tcp_loopback": {"seconds": round(tcp_s, 4), "gib_per_s": round(size / tcp_s / GIB, 2),
                         "received_bytes": sum(layer.numel() * layer.element_size() for layer in kv.layers)},  # fmt: skip
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="layers of the DeepSeek-V3-shaped model (default 8)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072], help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=5, help="timed p2p pulls per prompt (median reported)")
    parser.add_argument("--backend", default="auto", help="prefill backend (default auto)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run over gloo")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args()
    os.environ.update(SAFE_NCCL_ENV)
    started = datetime.now(timezone.utc)
    gpu = args.device == "cuda"
    if gpu and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs (prefill on one, decode on the other), found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as folder:
        model = str(model_file(args.layers, Path(folder))) if gpu else "tiny"
        config = PoolConfig(model=model, num_layers=args.layers, backend=args.backend, device=args.device,
                            max_batch_tokens=32768, seed=0, **({} if gpu else {"worker_cpus": 0.5}))  # fmt: skip
        model_config = config.model_config()
        layer_bytes = max(args.tokens) * model_config.attention.latent_dim * 2
        reference = one_way_nccl([(GIB, 1), (layer_bytes, args.layers)], args.repeats) if gpu else None
        ray.init(num_cpus=4 if gpu else 2, num_gpus=2 if gpu else 0, include_dashboard=False,
                 runtime_env={"env_vars": SAFE_NCCL_ENV})  # fmt: skip
        with PrefillPool(config).start() as pool:
            decoder = ray.remote(DecodeActor).options(num_cpus=0.5, num_gpus=1 if gpu else 0).remote(config, device=args.device, transport="p2p")
            rows = [handoff(pool, decoder, tokens, args.repeats, model_config.vocab_size) for tokens in args.tokens]
            info = pool.worker_infos[0][0]
        ray.shutdown()
    report = {
        "benchmark": "kv handoff: prefill worker -> decode actor (p2p, Ray objects) and TCP loopback",
        "date": started.date().isoformat(),
        "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(0) if gpu else None,
                    "torch": torch.__version__, "cuda": torch.version.cuda, "ray": ray.__version__},  # fmt: skip
        "command": "python benchmarks/bench_handoff.py " + " ".join(sys.argv[1:]),
        "model": f"DeepSeek-V3 MLA, {args.layers} layers (all dense), cache {model_config.attention.latent_dim} x {info.dtype} per token per layer",
        "prefill_backend": info.backend,
        "one_way_nccl_reference": reference,
        "results": rows,
    }
    if gpu:
        best = max(v["gib_per_s"] for v in reference.values())
        for row in rows:
            for what in ("pull", "pull_transfer", "pull_during_a_prefill"):
                row["p2p"][f"{what}_fraction_of_one_way_nccl"] = round(row["p2p"][f"{what}_gib_per_s"] / best, 3)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
