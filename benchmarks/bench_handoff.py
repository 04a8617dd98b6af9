"""KV handoff benchmark: how fast a prefilled request's latent KV reaches a decode server.

A one-GPU prefill pool (TP = PCP = 1, GPU 0) prefills prompts of DeepSeek-V3 MLA shape. Inside the
cluster, a ``DecodeActor`` on GPU 1 pulls each kept request over its NCCL point-to-point link
(``p2p``), three times uncounted (the first opens the link), then ``--repeats`` times (the median
is reported), then every 0.2 s while the pool prefills another prompt of the same length on GPU 0,
and once as Ray objects (``object``). Outside the cluster, a decode server in a process of its own (no Ray,
GPU 1) takes kept requests through the pool's ``KVServer`` with a ``KVReceiver`` into its own paged
cache, registered once: by NIXL READs from the holder's cache (``nixl``: ``--repeats`` fetches, after
one small uncounted one that connects the agents) and by TCP pulls from the holder (``tcp``: one
fetch as the receiver's defaults have it, one more with payload checksums, ``tcp_checksum``). Each
outside fetch consumes the request (the ack frees it), so every one is a prefill of its own; the
first of each transport is checked equal to the holder's rows.

``pull_s`` is the whole p2p pull as the decode actor sees it, from asking the holders to the KV
reassembled in its memory; ``pulls_during_a_prefill_s`` are pulls that ended while GPU 0 was
prefilling another prompt of the same length. For the outside receiver, ``transfer_s`` runs from the first byte asked
of the holder to the last one in its cache, and ``fetch_s`` is the whole fetch (hello to ack,
including the server asking the holder where the blocks are). Before Ray starts, two plain
processes measure the one-way NCCL bandwidth between the same GPUs (one 1 GiB message, and the
handoff's own per-layer messages), the figure the GPU rates are compared against; the TCP rate is
compared with two plain processes sending 512 MiB over this host's loopback.

The model is DeepSeek-V3's config with ``--layers`` layers, all with its dense MLP (the cache does
not depend on the MLP: 576 bf16 values per token per layer, 1,152 B). ``--device cpu`` measures the
outside receiver on the CPU (no decode actor) with a small model of DeepSeek's latent width (576,
float32): many layers of a short prompt make a cache of realistic size that the CPU prefills quickly.
Writes one JSON file.

    python benchmarks/bench_handoff.py --layers 8 --tokens 32768 131072 --out benchmarks/results/handoff.json
    python benchmarks/bench_handoff.py --device cpu --layers 64 --tokens 2048 --out handoff-cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
import zlib
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
from kv.nixl import nixl_unavailable
from kv.receiver import KVReceiver
from workers.worker import SAFE_NCCL_ENV

from machine import machine  # benchmarks/machine.py

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


def _loopback_sender(port: int, size: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(memoryview(np.ones(size, dtype=np.uint8)))


def socket_loopback(size: int = 512 << 20) -> dict:
    """Two plain processes, ``size`` bytes over this host's loopback: what TCP alone can do here."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = multiprocessing.get_context("spawn").Process(target=_loopback_sender, args=(listener.getsockname()[1], size))
        sender.start()
        conn, _ = listener.accept()
        buf, got, started = memoryview(bytearray(size)), 0, None
        with conn:
            while got < size:
                got += conn.recv_into(buf[got:], min(size - got, 1 << 24))
                started = started or time.perf_counter()  # from the first bytes: the sender's setup is not counted
        seconds = time.perf_counter() - started
        sender.join()
    return {"bytes": size, "seconds": round(seconds, 4), "gib_per_s": round(size / seconds / GIB, 2)}


def model_file(layers: int, tokens: int, gpu: bool, folder: Path) -> Path:
    """DeepSeek-V3's config.json with ``layers`` layers, every one dense; on the CPU the tiny model with
    DeepSeek's latent width (kv_lora_rank 512 + rope 64)."""
    raw = dict(load_model_config("deepseek-v3" if gpu else "tiny").source)
    raw.update(num_hidden_layers=layers, first_k_dense_replace=layers)
    if not gpu:
        raw.update(kv_lora_rank=512, qk_rope_head_dim=64, max_position_embeddings=max(8192, tokens))
    path = folder / "config.json"
    path.write_text(json.dumps(raw))
    return path


# ---- the decode server outside the cluster: a process of its own, no Ray ----------------------------
def _outside_main(conn, address: tuple[str, int], fingerprint: str, device: str, shape: tuple, dtype: str) -> None:
    """Fetch what the driver asks for into one paged cache (registered with NIXL on first use)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    cache = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    receivers = {}
    while (ask := conn.recv()) is not None:
        request_id, transport, checksum, verify = ask
        key = (transport, checksum)
        if key not in receivers:
            receivers[key] = KVReceiver(*address, model_fingerprint=fingerprint, transport=transport, checksum=checksum, timeout_s=300)
        try:
            started = time.perf_counter()
            kv = receivers[key].fetch(request_id, into=cache, block_ids=list(range(shape[1])))
            fetch_s = time.perf_counter() - started
            crc = _crc_of(kv.rows().cpu()) if verify else None
            conn.send({"transport": kv.transport, "bytes": kv.bytes, "transfer_s": kv.transfer_s, "fetch_s": fetch_s, "crc": crc})
        except Exception as exc:  # noqa: BLE001 -- reported to the driver
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


class OutsideDecodeServer:
    def __init__(self, address, fingerprint: str, device: str, shape: tuple, dtype: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_outside_main, args=(child, address, fingerprint, device, shape, dtype), daemon=True)
        self.process.start()

    def fetch(self, request_id: str, transport: str, checksum: bool = True, verify: bool = False) -> dict:
        self.conn.send((request_id, transport, checksum, verify))
        answer = self.conn.recv()
        if "error" in answer:
            raise RuntimeError(f"the outside receiver failed: {answer['error']}")
        return answer

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(30)


def _crc_of(rows: torch.Tensor) -> int:
    return zlib.crc32(rows.contiguous().view(torch.uint8).numpy())


def inside(pool: PrefillPool, decoder, prompt: np.ndarray, repeats: int) -> dict:
    """The decode actor's p2p pulls (and one as Ray objects) of one kept request."""
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
    during = []  # pulls spread over the busy prefill, while it lasts (at most 5)
    while not busy.done() and len(during) < 5:
        receipt_during = ray.get(decoder.receive.remote(source))
        if not busy.done():
            during.append(receipt_during["seconds"])
        time.sleep(0.2)
    busy.result()
    p2p = ray.get(decoder.__ray_call__.remote(lambda self: self.states[result.request_id].rows))
    started = time.perf_counter()
    object_receipt = ray.get(decoder.receive.remote(source, transport="object"))
    object_s = time.perf_counter() - started
    by_object = ray.get(decoder.__ray_call__.remote(lambda self: self.states.pop(result.request_id).rows))
    pool.release(result)
    size = receipt["bytes"]
    pull_s, call, ask, transfer = (
        statistics.median(pull[key] for pull in pulls) for key in ("seconds", "driver_call_s", "ask_s", "transfer_s")
    )
    return {
        "p2p_equals_object_copy": all(torch.equal(a, b) for a, b in zip(p2p, by_object)),
        "p2p": {
            "pull_s": round(pull_s, 6),
            "pull_gib_per_s": round(size / pull_s / GIB, 1),
            "pull_ask_s": round(ask, 6),
            "pull_transfer_s": round(transfer, 6),
            "pull_transfer_gib_per_s": round(size / transfer / GIB, 1),
            "first_pull_with_link_setup_s": round(first["seconds"], 4),
            "driver_call_s": round(call, 6),
            "pull_runs_s": [round(pull["seconds"], 6) for pull in pulls],
            "pull_during_a_prefill_s": round(statistics.median(during), 6) if during else None,
            "pull_during_a_prefill_gib_per_s": round(size / statistics.median(during) / GIB, 1) if during else None,
            "pulls_during_a_prefill_s": [round(t, 6) for t in during],
        },
        "object": {"transfer_s": round(object_receipt["seconds"], 4), "gib_per_s": round(size / object_receipt["seconds"] / GIB, 2),
                   "driver_call_s": round(object_s, 4)},  # fmt: skip
    }


def outside(pool: PrefillPool, server: OutsideDecodeServer, prompt: np.ndarray, runs: list[tuple[str, bool]]) -> dict:
    """The outside receiver's fetches, one prefill each; the first of each transport checked against
    the holder's rows (as Ray objects: another path)."""
    rows, checked = {}, set()
    for transport, checksum in runs:
        result = pool.prefill(prompt, keep_kv=True)
        verify = transport not in checked
        expected = _crc_of(pool.fetch_kv(result)) if verify else None
        answer = server.fetch(result.request_id, transport, checksum, verify)
        if verify:
            answer["equals_the_holders_rows"] = answer.pop("crc") == expected
            checked.add(transport)
        answer.pop("crc", None)
        rows.setdefault(f"{transport}{'_checksum' if checksum else ''}", []).append(answer)
    report = {}
    for name, answers in rows.items():
        size, transfer, fetch = answers[0]["bytes"], [a["transfer_s"] for a in answers], [a["fetch_s"] for a in answers]
        report[name] = {
            "bytes": size,
            "transfer_s": round(statistics.median(transfer), 6),
            "gib_per_s": round(size / statistics.median(transfer) / GIB, 2),
            "fetch_s": round(statistics.median(fetch), 6),
            "fetch_gib_per_s": round(size / statistics.median(fetch) / GIB, 2),
            "runs_transfer_s": [round(t, 6) for t in transfer],
            "equals_the_holders_rows": answers[0].get("equals_the_holders_rows"),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="layers of the DeepSeek-V3-shaped model (default 8)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072], help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=5, help="timed p2p pulls, and NIXL fetches, per prompt (median reported)")
    parser.add_argument("--backend", default="auto", help="prefill backend (default auto)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the outside receiver on the CPU (no decode actor)")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args()
    os.environ.update(SAFE_NCCL_ENV)
    started = datetime.now(timezone.utc)
    gpu = args.device == "cuda"
    if gpu and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs (prefill on one, decode on the other), found {torch.cuda.device_count()}")
    nixl = nixl_unavailable() is None
    runs = ([("nixl", False)] * args.repeats if nixl else []) + [("tcp", False), ("tcp", True)]
    with tempfile.TemporaryDirectory() as folder:
        model = str(model_file(args.layers, max(args.tokens), gpu, Path(folder)))
        config = PoolConfig(model=model, num_layers=args.layers, backend=args.backend, device=args.device,
                            max_batch_tokens=32768, seed=0, nixl="on" if nixl else "off",
                            **({} if gpu else {"worker_cpus": 0.5, "kv_cache_tokens": 4 * max(args.tokens)}))  # fmt: skip
        model_config = config.model_config()
        width = model_config.attention.latent_dim
        layer_bytes = max(args.tokens) * width * 2
        nccl = one_way_nccl([(GIB, 1), (layer_bytes, args.layers)], args.repeats) if gpu else None
        loopback = socket_loopback()
        ray.init(num_cpus=4 if gpu else 2, num_gpus=2 if gpu else 0, include_dashboard=False,
                 runtime_env={"env_vars": SAFE_NCCL_ENV})  # fmt: skip
        rows = []
        with PrefillPool(config).start() as pool, KVServer(pool, ack_timeout_s=600) as server:
            info = pool.worker_infos[0][0]
            decoder = None
            if gpu:
                decoder = ray.remote(DecodeActor).options(num_cpus=0.5, num_gpus=1).remote(config, device="cuda", transport="p2p")
            blocks = -(-max(args.tokens) // config.block_size)
            decode_server = OutsideDecodeServer(
                (server.host, server.port), model_config.fingerprint(), "cuda:1" if gpu else "cpu",
                (args.layers, blocks, config.block_size, width), info.dtype,
            )  # fmt: skip
            try:
                vocab = model_config.vocab_size
                if nixl:  # connects the receiver's agent to the holder's: not counted
                    warm = pool.prefill(np.arange(config.block_size * 4) % vocab, keep_kv=True)
                    decode_server.fetch(warm.request_id, "nixl")
                for tokens in args.tokens:
                    prompt = np.random.default_rng(tokens).integers(0, vocab, size=tokens)
                    row = {"tokens": tokens}
                    if gpu:
                        row.update(inside(pool, decoder, prompt, args.repeats))
                    row["outside"] = outside(pool, decode_server, prompt, runs)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            finally:
                decode_server.close()
        ray.shutdown()
    report = {
        "benchmark": "kv handoff: prefill worker -> decode actor (p2p, Ray objects) and -> a decode server outside the cluster (NIXL, TCP)",
        "date": started.date().isoformat(),
        "machine": machine(),
        "command": "python benchmarks/bench_handoff.py " + " ".join(sys.argv[1:]),
        "model": f"{'DeepSeek-V3' if gpu else 'tiny with DeepSeek latent width'} MLA, {args.layers} layers (all dense), "
                 f"cache {width} x {info.dtype} per token per layer",  # fmt: skip
        "prefill_backend": info.backend,
        "outside_receiver": f"a process of its own (no Ray) on {'GPU 1' if gpu else 'the CPU'}, its paged cache allocated and registered once",
        "one_way_nccl_reference": nccl,
        "socket_loopback_reference": loopback,
        "results": rows,
    }
    longest = rows[-1]["outside"]
    if nixl:
        report["nixl_gib_per_s"] = longest["nixl"]["gib_per_s"]
    report["tcp_gib_per_s"] = longest["tcp"]["gib_per_s"]
    report["tcp_fraction_of_socket_loopback"] = round(longest["tcp"]["gib_per_s"] / loopback["gib_per_s"], 3)
    if gpu:
        best = max(v["gib_per_s"] for v in nccl.values())
        for row in rows:
            for what in ("pull", "pull_transfer", "pull_during_a_prefill"):
                if row["p2p"][f"{what}_gib_per_s"] is not None:
                    row["p2p"][f"{what}_fraction_of_one_way_nccl"] = round(row["p2p"][f"{what}_gib_per_s"] / best, 3)
        if nixl:
            report["nixl_fraction_of_one_way_nccl"] = round(report["nixl_gib_per_s"] / best, 3)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
