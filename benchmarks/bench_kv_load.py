"""How fast a request's latent KV moves from a holder's paged cache into a decode server's per-layer
caches (vLLM's layout) on one host, with the blocks scattered on both sides: the ``mapped`` transport
(``kv.mapped``: the holder's cache mapped into the receiver; on a GPU its one kernel for all layers,
``mapped_kernel``, and torch's gather/scatter per layer and chunk, ``mapped_chunk<rows>``) against NIXL READs of every run of rows (``kv.nixl``: what the connector did before), in one run, on
the same caches.

    python benchmarks/bench_kv_load.py --layers 61 5 --tokens 32768 4096 --out kv-load.json
    python benchmarks/bench_kv_load.py --device cpu --layers 3 --tokens 1024 --out /tmp/kv-load-cpu.json

The holder is a process of its own (``spawn``): a ``[layers, blocks, 64, 576]`` cache, as a pool
worker holds it, the request's blocks drawn at random among twice as many (a prefix cache that has run
a while); the receiver, this process, has one ``[blocks, 64, 576]`` tensor per layer, as vLLM
allocates them, and the request's blocks drawn at random too (vLLM's free list after other requests).
Each method's rate is the KV bytes moved over the seconds from the first byte asked to the last one in
the destination (as the connector logs ``kv_load_gib_per_s``), the median of ``--repeats`` loads after
one that maps or connects; the destination is compared with the holder's rows after each method. The
device's own copy rate of the same bytes (one contiguous ``copy_``) is the bound beside them. NIXL is
measured where it is installed (``--methods``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from machine import machine  # benchmarks/machine.py
from timing import percentiles  # benchmarks/timing.py

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kv.mapped import Mapper, MappedRegion, share_cache, shared_host_tensor, unlink_shared  # noqa: E402
from kv.nixl import NixlEndpoint, Region, descriptors, nixl_unavailable, runs  # noqa: E402
from kv.receiver import place_rows  # noqa: E402

WIDTH, BLOCK = 576, 64  # DeepSeek's latent row (kv_lora_rank 512 + rope 64); vLLM's MLA block on the GPU


def holder(conn, layers: int, blocks: int, device: str, methods: list[str]) -> None:
    """A pool worker's cache, filled, described for the receiver; held until told to go."""
    torch.manual_seed(0)
    shape = (layers, blocks, BLOCK, WIDTH)
    path = None
    if device == "cpu":
        cache, path = shared_host_tensor(shape, torch.bfloat16)
        cache.normal_()
    else:
        cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
        torch.cuda.synchronize()
    offer = {"mapped": share_cache(cache, path).as_dict()}
    endpoint = None
    if "nixl" in methods:
        endpoint = NixlEndpoint("bench-holder", serves=True)
        offer["nixl"] = endpoint.register(cache).as_dict()
    conn.send(offer)
    conn.recv()  # the receiver is done
    if path is not None:
        unlink_shared(path)


def scattered(rng: np.random.Generator, needed: int, available: int) -> np.ndarray:
    return rng.permutation(available)[:needed].astype(np.int64)


def measure(args, layers: int, tokens: int, device: str) -> dict:
    rng = np.random.default_rng(layers * 100003 + tokens)
    needed = -(-tokens // BLOCK)
    pool_blocks, dest_blocks = 2 * needed, 2 * needed
    holder_table, dest_table = scattered(rng, needed, pool_blocks), scattered(rng, needed, dest_blocks)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=holder, args=(theirs, layers, pool_blocks, device, args.methods), daemon=True)
    process.start()
    try:
        offer = ours.recv()
        dest = [torch.zeros(dest_blocks, BLOCK, WIDTH, dtype=torch.bfloat16, device=device) for _ in range(layers)]
        meta = {"block_size": BLOCK, "pcp": 1, "tokens": tokens, "shards": [{"blocks": holder_table.tolist()}]}
        (part,) = place_rows(meta, BLOCK, dest_table.tolist(), 0)
        src_runs = len(runs(part.src, part.dst)[0])
        moved = tokens * layers * WIDTH * 2
        row = {"layers": layers, "tokens": tokens, "bytes": moved, "runs_per_layer": src_runs, "blocks": needed}
        region = MappedRegion.from_dict(offer["mapped"])
        mappers = {f"mapped_chunk{chunk}": Mapper(chunk_rows=chunk, kernel=False) for chunk in args.chunk_rows}
        if device != "cpu":
            mappers["mapped_kernel"] = Mapper()
        for name, mapper in mappers.items():
            seconds = [mapper.copy(region, dest, part.src, part.dst)[0] for _ in range(args.repeats + 1)][1:]
            row[name] = _rate(seconds, moved) | {"peak_temporary_bytes": mapper.peak_in_flight_bytes, "equal": _equal(mapper, region, dest, part)}
            for layer in dest:
                layer.zero_()
        if "nixl" in offer:
            row["nixl_per_run"] = _nixl(offer["nixl"], dest, part, args.repeats, moved)
            row["nixl_per_run"]["equal"] = _equal(Mapper(), region, dest, part)
        flat = torch.empty(moved // 2, dtype=torch.bfloat16, device=device)
        other = torch.empty_like(flat)
        row["device_copy_bound"] = _rate([_timed(lambda: other.copy_(flat), device) for _ in range(args.repeats + 1)][1:], moved)
        return row
    finally:
        ours.send("done")
        process.join(timeout=30)


def _nixl(raw: dict, dest: list[torch.Tensor], part, repeats: int, moved: int) -> dict:
    """READs of every run of rows consecutive on both sides, a descriptor per layer and run (kv.receiver)."""
    endpoint = NixlEndpoint("bench-receiver", serves=False)
    for layer in dest:
        endpoint.register_tensor(layer)
    remote = Region.from_dict(raw)
    row_bytes = WIDTH * 2
    src, dst, lengths = runs(part.src, part.dst)
    local_bases = np.array([layer.data_ptr() for layer in dest], dtype=np.uint64)
    local_device = (dest[0].device.index or 0) if dest[0].is_cuda else 0
    pieces = [(remote, descriptors(remote.layer_bases(), row_bytes, src, lengths, remote.device),
               "VRAM" if dest[0].is_cuda else "DRAM", descriptors(local_bases, row_bytes, dst, lengths, local_device))]  # fmt: skip
    seconds = [endpoint.read(pieces, timeout_s=600) for _ in range(repeats + 1)][1:]
    return _rate(seconds, moved) | {"descriptors": len(pieces[0][1])}


def _equal(mapper: Mapper, region: MappedRegion, dest: list[torch.Tensor], part) -> bool:
    source = mapper.open(region, dest[0].device)
    src, dst = torch.from_numpy(part.src).to(dest[0].device), torch.from_numpy(part.dst).to(dest[0].device)
    return all(torch.equal(layer.view(-1, WIDTH)[dst], source[i][src]) for i, layer in enumerate(dest))


def _timed(fn, device: str) -> float:
    if device != "cpu":
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _rate(seconds: list[float], moved: int) -> dict:
    return {"seconds": percentiles(seconds), "gib_per_s_p50": round(moved / statistics.median(seconds) / 2**30, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the results JSON")
    parser.add_argument("--device", default="cuda", help="cuda (the holder and the receiver on GPU 0) or cpu")
    parser.add_argument("--layers", type=int, nargs="+", default=[61, 5], help="layers of the KV (61: DeepSeek-V3; 5: the benchmarks' slice)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 4096], help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--chunk-rows", type=int, nargs="+", default=[16384], help="kv.mapped.Mapper chunk_rows to measure on the per-layer path")
    parser.add_argument("--methods", nargs="+", choices=["mapped", "nixl"], default=["mapped", "nixl"])
    args = parser.parse_args()
    missing = nixl_unavailable()
    if "nixl" in args.methods and missing:
        print(f"NIXL not measured: {missing}", flush=True)
        args.methods = [m for m in args.methods if m != "nixl"]
    report = {"what": "bench_kv_load: a request's KV from a holder's cache into per-layer caches, blocks scattered on both sides",
              "date": datetime.date.today().isoformat(), "machine": machine(("nixl_cu13",)), "command": " ".join(sys.argv),
              "device": args.device, "block_size": BLOCK, "width": WIDTH, "dtype": "bfloat16", "results": []}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for layers in args.layers:
        for tokens in args.tokens:
            row = measure(args, layers, tokens, args.device)
            print(json.dumps(row), flush=True)
            report["results"].append(row)
            args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
