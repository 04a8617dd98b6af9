"""Prefill context parallelism benchmark: one DeepSeek-V3-shaped MLA layer over 1, 2 and 4 GPUs.

For each prompt length and PCP degree, one process per GPU (NCCL) prefills a
random hidden-state sequence through one MLA attention layer (H=128 heads, qk
192, v 128, latent 576, bf16, random weights) in chunks, exactly as a pool
worker does: the zigzag split, the striped paged KV cache and the chosen
context strategy (``workers.pcp``). Per run it reports the time, TF/s per GPU
(causal attention FLOPs ``H * S^2 * (192 + 128)`` over the whole prompt),
parallel efficiency against the 1-GPU run, and the bytes one GPU receives per
chunk under both strategies (from the plan; the strategy run is timed).

Peer: PyTorch's ``context_parallel`` ring attention (cuDNN SDPA) on the same
GPUs, causal, the same head count and dims, the whole sequence at once.

A check first: PCP > 1 against PCP = 1 on the same inputs (the last chunk's
layer output and the whole latent KV cache; bf16 relative error).

    torchrun-free: python benchmarks/bench_pcp.py --gpus 4 --tokens 32768 131072 524288 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HEADS = 128


def _flops(tokens: int) -> float:
    return HEADS * tokens * tokens * (192 + 128)


def _layer(seed: int, device, dtype, backend_name: str | None):
    from attention.backends.base import DeviceCapability, MLAPrefillSelectorConfig
    from attention.backends.selector import get_mla_prefill_backend
    from attention.mla import MLAAttention
    from configs.model import load_model_config

    config = load_model_config("deepseek-v3", num_hidden_layers=1).attention
    backend_cls = get_mla_prefill_backend(MLAPrefillSelectorConfig(dtype, config.dims), DeviceCapability.of(device), backend_name)
    attn = MLAAttention(config, config.create_backend(backend_cls, device=device), dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if name.endswith("layernorm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen, device=device))
    return attn


def _hidden(start: int, count: int, device, dtype) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(1000 + start)
    return torch.randn(count, 7168, generator=gen, device=device).to(dtype)


@torch.no_grad()
def prefill(attn, tokens: int, chunk: int, pcp, strategy: str, cost_model, workspace: int, block_size: int = 64, keep=False):
    """Prefill one prompt of ``tokens`` through the layer; returns (seconds, per-chunk plan info[, out, kv])."""
    from attention.mla import plan_prefill_batch
    from workers.kv_cache import PagedKVCache, blocks_for
    from workers.pcp import PCPPlan, context_parallel_attention
    from workers.pcp_layout import interleave_shards, shard_rows

    device, dtype = attn.o_proj.weight.device, attn.o_proj.weight.dtype
    rows = shard_rows(tokens, pcp.rank, pcp.size, block_size)
    kv = PagedKVCache(1, blocks_for(rows, block_size), block_size, 576, dtype, device)
    kv.reserve("r", rows)
    hiddens = [(s, _hidden(s, min(chunk, tokens - s), device, dtype)) for s in range(0, tokens, chunk)]
    infos, out = [], None
    _sync(device)
    if pcp.group is not None:
        dist.barrier(group=pcp.group)
    started = time.perf_counter()
    for start, hidden in hiddens:
        n = hidden.shape[0]
        context = kv.rows("r", 0, shard_rows(start, pcp.rank, pcp.size, block_size)) if start else None
        if pcp.size == 1:
            batch = plan_prefill_batch([n], [start], workspace_tokens=workspace, device=device, backend=attn.backend)
            out, latent = attn(hidden, batch, context)
            kv.append("r", [latent], slice(0, n))
        else:
            plan = PCPPlan(
                [n], [start], pcp=pcp, block_size=block_size, num_heads=HEADS, dims=attn.config.dims, latent_width=576,
                element_size=2, workspace_tokens=workspace, device=device, strategy=strategy, cost_model=cost_model,
                backend=attn.backend,
            )  # fmt: skip
            out, latent = context_parallel_attention(attn, hidden.index_select(0, plan.local_index), plan, context)
            kv.append("r", [latent], plan.store_index[0])
            infos.append({
                "context": start, "strategy": plan.strategy, "latent_bytes": plan.estimate.latent_bytes,
                "sharded_bytes": plan.estimate.sharded_bytes, "gather_bytes": plan.estimate.gather_bytes,
            })  # fmt: skip
    _sync(device)
    elapsed = time.perf_counter() - started
    if not keep:
        return elapsed, infos
    kv_rows = kv.rows("r", 0)
    if pcp.size > 1:  # the last chunk's output and the whole KV, in token order
        work, buf = pcp.all_gather(out, plan.padded)
        work.wait()
        out = buf.index_select(0, plan.gathered_to_batch)
        counts = [shard_rows(tokens, r, pcp.size, block_size) for r in range(pcp.size)]
        work, buf = pcp.all_gather(kv_rows, max(counts))
        work.wait()
        shards = [buf[r * max(counts) : r * max(counts) + n][None] for r, n in enumerate(counts)]
        kv_rows = interleave_shards(shards, block_size)[0]
    return elapsed, infos, out, kv_rows


@torch.no_grad()
def ring_attention(mesh, tokens: int, device) -> float:
    """PyTorch's context_parallel ring attention (cuDNN) on the mesh; seconds for one causal forward."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    times = []
    for _ in range(2):  # the first run warms up
        gen = torch.Generator(device=device).manual_seed(7)  # fresh buffers: context_parallel shards them in place
        q = torch.randn(1, HEADS, tokens, 192, generator=gen, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, HEADS, tokens, 192, generator=gen, device=device, dtype=torch.bfloat16)
        v = torch.randn(1, HEADS, tokens, 128, generator=gen, device=device, dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if mesh is None:
                torch.cuda.synchronize()
                started = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                    torch.cuda.synchronize()
                    dist.barrier(group=mesh.get_group())
                    started = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        del q, k, v
    return times[-1]


@torch.no_grad()
def merge_collectives(pcp, tokens: int, device) -> dict:
    """Seconds to exchange the context partials of ``tokens`` queries (all ranks' together) two ways:
    our all-to-all of bf16 o with its float32 LSE packed in, and all-gather of the LSEs followed by a
    reduce-scatter of the rescaled o (in float32, to keep the merge's precision; bf16 shown too)."""
    from workers.pcp import median_time, pack_partials

    rows = tokens // pcp.size * pcp.size
    o = torch.randn(rows, HEADS, 128, device=device, dtype=torch.bfloat16)
    lse = torch.randn(HEADS, rows, device=device)
    counts = [rows // pcp.size] * pcp.size
    packed = pack_partials(o, lse)
    lse_out = torch.empty(pcp.size * HEADS, rows, device=device)

    def reduce_scatter(dtype):
        part = o.to(dtype)
        out = part.new_empty(rows // pcp.size, HEADS, 128)
        dist.all_gather_into_tensor(lse_out, lse, group=pcp.group)
        dist.reduce_scatter_tensor(out, part, group=pcp.group)

    return {
        "query_rows": rows,
        "all_to_all_packed_s": median_time(lambda: pcp.all_to_all(packed, counts, counts)[0].wait(), device),
        "allgather_lse_reduce_scatter_fp32_s": median_time(lambda: reduce_scatter(torch.float32), device),
        "allgather_lse_reduce_scatter_bf16_s": median_time(lambda: reduce_scatter(torch.bfloat16), device),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, world: int, port: int, args, results) -> None:
    from workers.worker import SAFE_NCCL_ENV

    os.environ.update(SAFE_NCCL_ENV)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device)
    else:  # a smoke run of the script itself
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from workers.pcp import PCPGroup, measure_cost_model

    dtype = torch.bfloat16
    attn = _layer(0, device, dtype, args.backend)
    groups = {p: dist.new_group(list(range(p))) for p in args.pcp if p > 1}
    report = {"backend": attn.backend.name, "runs": [], "ring": [], "checks": [], "cost_models": {}}

    def emit():
        if rank == 0:
            results.put(json.loads(json.dumps(report)))

    def run_all(p, fn):
        """Run ``fn`` on ranks < p while the others wait; returns ``(value, error text)``."""
        value, error = None, None
        if rank < p:
            try:
                value = fn()
            except Exception as exc:  # noqa: BLE001 -- recorded; every rank still meets at the barrier
                error = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        dist.barrier()
        return value, error

    pcps = {}
    for p in args.pcp:
        group = PCPGroup(rank, p, groups[p]) if p > 1 and rank < p else PCPGroup()
        cost = measure_cost_model(group, groups[p], attn) if p > 1 and rank < p else None
        pcps[p] = (group, cost)
        if cost and rank == 0:
            report["cost_models"][p] = {"link_GBps": cost.link_bytes_per_s / 1e9, "up_projection_Mrows_per_s": cost.up_projection_rows_per_s / 1e6}
        if p > 1:
            timing, _ = run_all(p, lambda: merge_collectives(group, args.chunks[0], device))
            if rank == 0:
                report.setdefault("merge_collectives", {})[p] = timing
                print("merge collectives", p, timing, flush=True)
        dist.barrier()

    # warm-up (JIT, plans, allocator) and the correctness check at --check-tokens
    reference = None
    for p in args.pcp:
        group, cost = pcps[p]
        for strategy in ("sharded", "gather") if p > 1 else ("none",):
            got, error = run_all(p, lambda: prefill(attn, args.check_tokens, args.check_chunk, group, strategy, cost, args.workspace, keep=True))
            if rank == 0 and error:
                report["checks"].append({"pcp": p, "strategy": strategy, "error": error})
            elif rank == 0:
                _, _, out, kv = got
                if reference is None:
                    reference = (out.float(), kv.float())
                else:
                    rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()  # noqa: E731
                    report["checks"].append({"pcp": p, "strategy": strategy, "tokens": args.check_tokens, "chunk": args.check_chunk,
                                             "out_max_rel_err": rel(out, reference[0]), "kv_max_rel_err": rel(kv, reference[1])})  # fmt: skip
                    print("check", report["checks"][-1], flush=True)
    emit()

    for tokens in args.tokens:
        for chunk in args.chunks:
            for p in args.pcp:
                group, cost = pcps[p]
                for strategy in (args.strategies if p > 1 else ["none"]):
                    got, error = run_all(p, lambda: prefill(attn, tokens, chunk, group, strategy, cost, args.workspace))
                    if rank == 0 and error:
                        report["runs"].append({"tokens": tokens, "chunk": chunk, "pcp": p, "strategy": strategy, "error": error})
                    elif rank == 0:
                        elapsed, infos = got
                        base = next((r["time_s"] for r in report["runs"] if r["tokens"] == tokens and r["chunk"] == chunk and r["pcp"] == 1 and "time_s" in r), None)
                        row = {
                            "tokens": tokens, "chunk": chunk, "pcp": p, "strategy": strategy, "time_s": round(elapsed, 4),
                            "tflops_per_gpu": round(_flops(tokens) / elapsed / p / 1e12, 1),
                            "parallel_efficiency": round(base / (p * elapsed), 3) if base else None,
                        }  # fmt: skip
                        if infos:
                            ctx = [i for i in infos if i["context"] > 0]
                            row["chunks"] = len(infos)
                            row["strategies_chosen"] = sorted({i["strategy"] for i in infos})
                            for key in ("latent_bytes", "sharded_bytes", "gather_bytes"):
                                vals = [i[key] for i in ctx] or [0]
                                row[f"{key}_per_chunk_min_max"] = [min(vals), max(vals)]
                        report["runs"].append(row)
                        print(row, flush=True)
                    emit()

    for tokens in args.ring_tokens:
        for p in args.pcp:
            mesh = None
            if p > 1 and rank < p:
                from torch.distributed.device_mesh import DeviceMesh

                mesh = DeviceMesh.from_group(groups[p], "cuda")
            elapsed, error = run_all(p, lambda: ring_attention(mesh, tokens, device))
            if rank == 0:
                row = {"tokens": tokens, "pcp": p}
                row.update({"error": error} if error else {"time_s": round(elapsed, 4), "tflops_per_gpu": round(_flops(tokens) / elapsed / p / 1e12, 1)})
                report["ring"].append(row)
                print("ring", row, flush=True)
            emit()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--pcp", type=int, nargs="+", default=[1, 2, 4], help="PCP degrees (1 is the baseline)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072, 524288])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8192], help="chunk sizes (tokens per chunk)")
    parser.add_argument("--strategies", nargs="+", default=["sharded", "gather", "auto"])
    parser.add_argument("--ring-tokens", type=int, nargs="*", default=[32768, 131072, 524288])
    parser.add_argument("--workspace", type=int, default=16384, help="context rows up-projected at once")
    parser.add_argument("--check-tokens", type=int, default=16384)
    parser.add_argument("--check-chunk", type=int, default=4096)
    parser.add_argument("--backend", default=None, help="MLA prefill backend (default: the selector's choice)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a gloo smoke run of this script")
    parser.add_argument("--stall-timeout", type=float, default=600,
                        help="seconds without a finished case before every rank is stopped, what was measured kept (default 600)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.pcp = [p for p in args.pcp if p <= args.gpus]
    if args.pcp[0] != 1:
        raise SystemExit("--pcp must start with 1 (the baseline)")

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.gpus, port, args, results)) for r in range(args.gpus)]
    for proc in procs:
        proc.start()
    report = None
    started = last = time.time()
    while any(proc.is_alive() for proc in procs) or not results.empty():
        try:
            report = results.get(timeout=5)
        except queue.Empty:
            # a rank that fails inside a collective (an out-of-memory in the ring) leaves the others in it:
            # stop every rank when one has died or no case has finished for --stall-timeout, keeping what was measured
            died = {r: proc.exitcode for r, proc in enumerate(procs) if proc.exitcode not in (None, 0)}
            if died or time.time() - last > args.stall_timeout:
                why = f"ranks exited with {died}" if died else f"no case finished in --stall-timeout {args.stall_timeout:g} s"
                print(f"stopping every rank: {why}", flush=True)
                for proc in procs:
                    proc.kill()
                if report is not None:
                    _write(args, {**report, "stopped": why}, started)
                break
            continue
        last = time.time()
        _write(args, report, started)
    for proc in procs:
        proc.join()


def _write(args, report, started) -> None:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    payload = {
        "benchmark": "bench_pcp",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "gpu": gpu, "gpus": args.gpus, "torch": torch.__version__, "cuda": torch.version.cuda},
        "command": "python benchmarks/bench_pcp.py " + " ".join(os.sys.argv[1:]),
        "layer": "DeepSeek-V3 MLA attention layer: H=128, q_lora 1536, kv_lora 512, qk 128+64, v 128, bf16, TP=1",
        "flops": "causal attention H*S^2*(192+128) over the prompt",
        "bytes": "received per GPU per chunk (averaged over the PCP group), from the plan",
        "elapsed_s": round(time.time() - started, 1),
        **report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
