"""MoE prefill benchmark: DeepSeek-shaped slices and whole smaller models, 1..N GPUs, FP8 and bf16.

For each layout ``FORMAT:G[:tpT][:SCHEDULE][:smsN][:chunkC][:deep_gemm]`` (weights ``fp8`` or ``bf16``, G GPUs,
TP=T, default 1; the EP schedule and SM carveout of ``PoolConfig.ep_schedule``/``ep_comm_sms``;
chunks of C tokens instead of ``--chunk-tokens``; FP8 GEMMs run by DeepGEMM, ``PoolConfig.fp8_gemm``), one
process per GPU runs a ``PrefillWorker`` of one replica (TP=T x PCP=G/T: the PCP ranks take their
share of every prompt's tokens, and the MoE layers' routed experts are split over all G GPUs,
EP=G), with the model's seeded random weights (FP8 in DeepSeek's
block format where the config says so; ``bf16`` dequantizes the same weights at load). Batches go to
every worker directly, as the pool's scheduler sends them, so the times are the workers' own (no Ray
call or driver queue in them). Per prompt case ``NxL`` (N prompts of L tokens in flight, prefilled
in chunks of at most ``--chunk-tokens`` tokens each, or the layout's own):

Cases ``NxL/gpu`` give each GPU N prompts (weak scaling: the per-GPU work stays that of one GPU).

- ``seconds``: median over ``--repeats`` runs (after one warm-up run) from the first batch sent to
  the last logits on rank 0; for one prompt this is its TTFT;
- ``tokens_per_s``, per GPU, and ``layer_tokens_per_s_per_gpu`` = tokens/s x layers / GPUs;
- model FLOPs (2 x active parameters per token, plus causal attention ``H * S^2 * (192 + 128)`` per
  prompt) per GPU per second, as a fraction of the H200's dense peaks (989 TF/s bf16, 1979 FP8);
- the (token, expert) pairs each GPU computed per MoE layer.

Also per run: ``moe_layer``: the first MoE layer alone on ``--moe-tokens`` tokens per GPU (router,
dispatch, experts, combine; shared experts apart) against the raw grouped-GEMM kernels on the very
shapes that call produced, and the whole layer (shared experts beside the combine) against those
GEMMs plus the shared experts alone; ``agreement``: each prompt case's first prompt, logits and latent KV,
against the first layout of the same weight format (or the run's first layout, for the first of a
format: FP8 against bf16), relative max and L2 errors and the first token. A layout that differs from
its baseline only in its chunk size (``fp8:1 fp8:1:chunk4096``) gives the noise floor of these
comparisons: the same math as PCP's (partial attention merged by its LSE) in another rounding order,
amplified as far as the model amplifies it (FP8 activation scales, top-k expert choice). The MoE
layer's times are GPU times per call (CUDA events, calls queued back to back as a forward pass
queues its layers); ``routed_synced_s`` is the routed call's wall time with the GPU synchronized
around it, its host launch latency included.

    python benchmarks/bench_moe.py --model deepseek-v3 --num-layers 5 --layouts fp8:1 fp8:2 fp8:4 bf16:1 \\
        --prompts 1x8192 1x32768 1x131072 16x4096/gpu --out FILE.json
    python benchmarks/bench_moe.py --model deepseek-v3 --num-layers 5 --layouts fp8:1 fp8:2 fp8:2:local-first:sms16 \\
        --prompts 16x4096/gpu --out FILE.json
    python benchmarks/bench_moe.py --model deepseek-v2-lite --layouts bf16:1 --prompts 1x4096 1x32768 --out FILE.json

A ``ckpt`` layout loads ``--checkpoint`` (its files evicted from the page cache first) instead of
drawing the weights; each rank's load seconds, bytes read and peak host memory before and after
loading are in its run. On a checkpoint of the seeded weights (``benchmarks/write_checkpoint.py``)
its outputs equal those of the layout drawing them.

``--share-gpus`` runs a layout's ranks on fewer GPUs (round-robin, gloo process groups), to check a
multi-GPU layout's outputs where its GPUs are not at hand; its times are not the pool's:

    python benchmarks/bench_moe.py --model deepseek-v3 --num-layers 5 --layouts fp8:1 fp8:1:chunk4096 fp8:4:tp2 \\
        --prompts 1x8192 --repeats 1 --moe-tokens 0 --share-gpus --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from spmd import _put, _results_while_alive, chunk_batches  # noqa: E402 -- the tests' rank plumbing and prompt-by-chunk batching, as the pool schedules it

from machine import PEAK_TFLOPS, machine  # noqa: E402 -- benchmarks/machine.py
from timing import seconds_per_call, sync  # noqa: E402 -- benchmarks/timing.py

from configs.model import EP_SCHEDULES, FP8_GEMM_LIBRARIES  # noqa: E402
from workers.worker import SAFE_NCCL_ENV  # noqa: E402



class Layout(NamedTuple):
    weights: str  # fp8 or bf16
    gpus: int
    tp: int = 1
    schedule: str = "all-to-all"  # PoolConfig.ep_schedule
    comm_sms: int = 0  # PoolConfig.ep_comm_sms
    chunk: int = 0  # tokens per chunk, 0: --chunk-tokens (chunk_tokens())
    checkpoint: bool = False  # load --checkpoint instead of drawing the seeded weights
    fp8_gemm: str = "torch"  # PoolConfig.fp8_gemm

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``FORMAT:GPUS`` followed by any of ``:tpT``, ``:SCHEDULE`` (an EP schedule), ``:smsN``, ``:chunkC``, ``:ckpt``
        and ``:deep_gemm`` (the FP8 GEMMs run by DeepGEMM, ``PoolConfig.fp8_gemm``; torch's otherwise)."""
        weights, _, rest = text.partition(":")
        gpus, *options = rest.split(":")
        fields = {}
        for option in options:
            if option.startswith("tp") and option[2:].isdigit():
                fields["tp"] = int(option[2:])
            elif option.startswith("sms") and option[3:].isdigit():
                fields["comm_sms"] = int(option[3:])
            elif option.startswith("chunk") and option[5:].isdigit() and int(option[5:]) > 0:
                fields["chunk"] = int(option[5:])
            elif option in EP_SCHEDULES:
                fields["schedule"] = option
            elif option == "ckpt":
                fields["checkpoint"] = True
            elif option in FP8_GEMM_LIBRARIES:
                fields["fp8_gemm"] = option
            else:
                fields = None
                break
        if weights not in ("fp8", "bf16") or not gpus.isdigit() or fields is None or int(gpus) % fields.get("tp", 1):
            raise ValueError(
                f"layout {text!r} is not FORMAT:GPUS[:tpT][:SCHEDULE][:smsN][:chunkC][:ckpt][:GEMM] (FORMAT fp8 or bf16, T dividing "
                f"GPUS, SCHEDULE one of {', '.join(EP_SCHEDULES)}, C > 0 tokens, GEMM one of {', '.join(FP8_GEMM_LIBRARIES)})"
            )
        return cls(weights, int(gpus), **fields)

    def chunk_tokens(self, default: int) -> int:
        return self.chunk or default

    @property
    def name(self) -> str:
        options = [f"tp{self.tp}"] if self.tp > 1 else []
        if self.gpus > 1:  # one GPU has no all-to-all
            options += [self.schedule] if self.schedule != "all-to-all" else []
            options += [f"sms{self.comm_sms}"] if self.comm_sms else []
        options += [f"chunk{self.chunk}"] if self.chunk else []
        options += ["ckpt"] if self.checkpoint else []
        options += [self.fp8_gemm] if self.fp8_gemm != "torch" else []
        return "-".join([self.weights, f"{self.gpus}gpu", *options])


def parse_case(text: str, gpus: int) -> tuple[int, int]:
    """``NxL``: N prompts of L tokens; ``NxL/gpu``: N per GPU (weak scaling)."""
    case, _, per = text.lower().partition("/")
    count, length = case.split("x")
    return int(count) * (gpus if per == "gpu" else 1), int(length)


def model_flops(config, prompt_lens: list[int]) -> float:
    """Forward FLOPs of the prompts: 2 x active parameters per token, plus causal attention."""
    from workers.model import DeepseekPrefillModel
    from attention.backends.torch_sdpa import TorchSDPAPrefillBackend

    meta = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, device="meta")
    active = 0
    for name, param in meta.model.layers.named_parameters():
        if ".experts." in name:  # stacked routed experts: k of E per token
            active += param.numel() * config.moe.num_experts_per_tok // config.moe.n_routed_experts
        elif not name.endswith("norm.weight"):
            active += param.numel()
    tokens = sum(prompt_lens)
    dims = config.attention.dims
    attention = sum(config.num_heads * s * s * (dims.qk_head_dim + dims.v_head_dim) for s in prompt_lens)
    return 2 * active * tokens + attention * config.num_hidden_layers


def _run_prompts(worker, prompts: list[np.ndarray], chunk: int, tag: str):
    """Prefill every prompt (all in flight, each chunk by chunk); returns rank 0's logits by id."""
    logits = {}
    for pieces in chunk_batches(prompts, chunk, tag):
        out = worker.prefill(pieces)
        if out is not None:
            logits.update({r.request_id: out.logits(r) for r in out.results})
    return logits


def _moe_layer(worker, tokens: int) -> dict:
    """The first MoE layer on ``tokens`` random hidden rows per GPU against its raw grouped GEMMs."""
    moe = worker.model.moe_layers()[0][1]
    experts = moe.experts
    hidden = worker.model.config.hidden_size
    device = worker.model.lm_head.weight.device
    gen = torch.Generator(device=device).manual_seed(100 + worker.rank)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(worker.model.dtype)
    calls = []  # the experts' inputs of the last routed call (one per micro-batch): no more, they are GiBs at 32K tokens
    forward = experts.forward

    def capture(rows, weights, offs, layout=None):
        calls.append((rows, weights, offs, layout))
        return forward(rows, weights, offs, layout)

    def routed():
        calls.clear()
        return moe.routed(x)

    experts.forward = capture
    routed_s = seconds_per_call(routed, 10)
    experts.forward = forward
    routed_synced_s = seconds_per_call(lambda: moe.routed(x), 10, synced=True)
    experts_s = seconds_per_call(lambda: [experts(*call) for call in calls], 10)
    gemms = [_raw_gemms(experts, *call) for call in calls]
    gemm_s = seconds_per_call(lambda: [run() for run in gemms], 10)
    shared_s = seconds_per_call(lambda: moe.shared_experts(x), 10) if moe.shared_experts is not None else 0.0
    layer_s = seconds_per_call(lambda: moe(x), 10)  # router, routed and shared experts (beside the combine)
    pairs = sum(int(offs[-1]) for _, _, offs, _ in calls)
    width = experts.intermediate
    flops = 2 * pairs * (hidden * 2 * width + width * hidden)
    return {
        "tokens_per_gpu": tokens, "pairs_here": pairs, "experts_here": experts.num_local,
        "routed_s": routed_s, "routed_synced_s": routed_synced_s, "experts_s": experts_s, "grouped_gemm_s": gemm_s, "shared_experts_s": shared_s,
        "grouped_gemm_tflops": flops / gemm_s / 1e12,
        "routed_over_grouped_gemm": routed_s / gemm_s, "experts_over_grouped_gemm": experts_s / gemm_s,
        "layer_s": layer_s, "layer_over_grouped_gemm_and_shared": layer_s / (gemm_s + shared_s),
    }  # fmt: skip


def _raw_gemms(experts, rows, weights, offs, layout=None):
    """A function running just the two grouped-GEMM kernels of one experts call, on its inputs."""
    width = experts.intermediate
    if not experts.fp8:
        (x,) = rows
        h = torch.randn(x.shape[0], width, device=x.device, dtype=x.dtype)
        return lambda: (
            torch._grouped_mm(x, experts.gate_up_proj.transpose(-2, -1), offs=offs),
            torch._grouped_mm(h, experts.down_proj.transpose(-2, -1), offs=offs),
        )
    from workers.fp8 import BLOCK, FP8, quantize_activations

    if experts.block:  # DeepGEMM's two grouped GEMMs, on the call's rows in its contiguous layout (placed there first if they came in order)
        from workers import deepgemm

        rows, layout = deepgemm.in_layout(rows, offs, layout)
        up = (rows[0].view(FP8), rows[1], experts.gate_up_proj, experts.gate_up_proj_scale, layout.m_indices)
        h, h_scale = quantize_activations(deepgemm.grouped_gemm(*up), BLOCK, silu_mul=True)
        down = (h, h_scale.t(), experts.down_proj, experts.down_proj_scale, layout.m_indices)
        return lambda: (deepgemm.grouped_gemm(*up), deepgemm.grouped_gemm(*down))
    q, scale = rows[0].view(FP8), rows[1]
    up = (q, experts.gate_up_proj.transpose(-2, -1), scale, experts.gate_up_proj_scale)
    gate_up = torch._scaled_grouped_mm(*up, offs=offs, out_dtype=torch.bfloat16)
    hq, hs = quantize_activations(gate_up, width, silu_mul=True, row_weight=weights)
    down = (hq, experts.down_proj.transpose(-2, -1), hs[0], experts.down_proj_scale)
    return lambda: (
        torch._scaled_grouped_mm(*up, offs=offs, out_dtype=torch.bfloat16),
        torch._scaled_grouped_mm(*down, offs=offs, out_dtype=torch.bfloat16),
    )


def _worker(rank: int, layout: Layout, args, port: int, reports) -> None:
    os.environ.update(SAFE_NCCL_ENV)
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count() if args.share_gpus else rank)
    if args.share_gpus:  # NCCL refuses two ranks on one GPU; gloo takes CUDA tensors through host memory
        init_process_group = torch.distributed.init_process_group
        torch.distributed.init_process_group = lambda backend, **kw: init_process_group("gloo", **kw)
    from configs.pool import PoolConfig
    from workers.worker import PrefillWorker

    weights, gpus, chunk = layout.weights, layout.gpus, layout.chunk_tokens(args.chunk_tokens)
    cases = {spec: parse_case(spec, gpus) for spec in args.prompts}
    config = PoolConfig(
        model=args.model, num_layers=args.num_layers, tp=layout.tp, pcp=gpus // layout.tp, backend=args.backend,
        checkpoint=str(args.checkpoint) if layout.checkpoint else None,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        quantization="auto" if weights == "fp8" else "none", device=args.device, chunk_tokens=chunk,
        max_batch_tokens=max(chunk, max(n * min(length, chunk) for n, length in cases.values())),
        gpu_memory_utilization=0.85, ep_schedule=layout.schedule, ep_comm_sms=layout.comm_sms, fp8_gemm=layout.fp8_gemm, seed=0,
        # ranks sharing a GPU would each size their cache by the whole GPU's memory: size it by the prompts
        kv_cache_tokens=max(n * length for n, length in cases.values()) + chunk if args.share_gpus else None,
    )  # fmt: skip
    try:
        worker = PrefillWorker(config, rank)
        info = worker.setup("127.0.0.1", port)
        if weights == "fp8" and info.weights != "fp8" and args.device == "cuda":
            raise RuntimeError(f"asked for FP8 GEMMs, the worker holds its weights as {info.weights}")
        model_config = worker.model.config
        out = {"info": info.__dict__, "cases": []}
        for index, (spec, (count, length)) in enumerate(cases.items()):
            gen = np.random.default_rng(index)  # each case's first prompt is the same in every layout
            prompts = [gen.integers(0, model_config.vocab_size, size=length).astype(np.int32) for _ in range(count)]
            loads_before = worker.moe_load()
            times = []
            for run in range(args.repeats + 1):
                if gpus > 1:
                    torch.distributed.barrier()
                sync()
                started = time.perf_counter()
                results = _run_prompts(worker, prompts, chunk, f"c{count}x{length}r{run}-")
                sync()
                seconds = time.perf_counter() - started
                if run:
                    times.append(seconds)
                ids = [f"c{count}x{length}r{run}-{i}" for i in range(count)]
                if run == args.repeats:
                    kv = worker.fetch_kv(ids[0]).tensor()
                    first = results.get(ids[0])
                worker.release(ids)
            loads = {k: v - loads_before.get(k, 0) for k, v in worker.moe_load().items()}
            # the first prompt's outputs go through a file: tensors in a queue die with their process
            outputs = Path(args.scratch) / f"{layout.name}-{rank}-{count}x{length}.pt"
            torch.save({"logits": torch.from_numpy(first) if first is not None else None, "kv": kv}, outputs)
            out["cases"].append({
                "case": spec, "prompts": count, "prompt_tokens": length, "seconds": statistics.median(times), "runs_s": times,
                "pairs_per_layer": {str(k): v / (args.repeats + 1) for k, v in loads.items()}, "outputs": str(outputs),
            })  # fmt: skip
        if args.moe_tokens and worker.model.moe_layers():
            out["moe_layer"] = _moe_layer(worker, args.moe_tokens)
        out["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
        _put(reports, (rank, out))
    except Exception as exc:  # noqa: BLE001 -- reported to the parent, which records it and goes on
        _put(reports, (rank, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args, layout: Layout) -> list[dict]:
    """One layout: every rank's results (rank order), or raises with the first error. A rank that fails
    (an out-of-memory) leaves the others waiting in a collective for it: the layout stops at the first
    error reported, a rank that dies, or ``--timeout`` seconds (the tests' ``_results_while_alive``)."""
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, layout, args, port, reports)) for r in range(layout.gpus)]
    for proc in procs:
        proc.start()
    got: dict[int, dict] = {}
    try:
        for rank, out in _results_while_alive(reports, procs, args.timeout):
            got[rank] = out
            if "error" in out:
                raise RuntimeError(out["error"] + "\n" + out["traceback"])
    finally:
        for proc in procs:
            proc.join(timeout=30 if len(got) == len(procs) else 0)
            if proc.is_alive():
                proc.kill()
    return [got[r] for r in range(len(procs))]


def evict_page_cache(checkpoint: Path) -> None:
    """Drop the checkpoint's files from the page cache (clean pages: no privileges needed), so a load
    reads them from the disk as on a node that never read them."""
    for file in checkpoint.glob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error over the largest magnitude."""
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def relative_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def summarize(args, model_config, layout: Layout, ranks: list[dict]) -> dict:
    from workers.pcp_layout import interleave_shards

    layers, (weights, gpus, tp, schedule, comm_sms, *_) = model_config.num_hidden_layers, layout
    info = ranks[0]["info"]
    entry = {
        "layout": layout.name, "weights": weights, "gpus": gpus, "tp": tp, "pcp": gpus // tp, "ep": gpus,
        "ep_schedule": schedule, "ep_comm_sms": comm_sms, "fp8_gemm": layout.fp8_gemm, "backend": info["backend"],
        "checkpoint": str(args.checkpoint) if layout.checkpoint else None,
        "load_s": [r["info"]["load_s"] for r in ranks], "read_gib": [r["info"]["read_bytes"] / 2**30 for r in ranks],
        "peak_host_mib_before_load": [r["info"]["peak_host_mib_before_load"] for r in ranks],
        "peak_host_mib": [r["info"]["peak_host_mib"] for r in ranks],
        "weight_gib_per_gpu": [r["info"]["weight_bytes"] / 2**30 for r in ranks],
        "peak_gpu_gib": [r["peak_gpu_gib"] for r in ranks], "warmup_s": info["warmup_s"], "cases": [],
    }  # fmt: skip
    outputs = {}
    for i, case in enumerate(ranks[0]["cases"]):
        count, length = case["prompts"], case["prompt_tokens"]
        tokens = count * length
        flops = model_flops(model_config, [length] * count)
        seconds = case["seconds"]
        per_gpu = flops / seconds / gpus / 1e12
        entry["cases"].append({
            "case": case["case"], "prompts": count, "prompt_tokens": length, "tokens": tokens, "chunk_tokens": layout.chunk_tokens(args.chunk_tokens),
            "seconds": round(seconds, 4), "ttft_s": round(seconds, 4) if count == 1 else None,
            "runs_s": [round(t, 4) for t in case["runs_s"]],
            "tokens_per_s": round(tokens / seconds, 1), "tokens_per_s_per_gpu": round(tokens / seconds / gpus, 1),
            "layer_tokens_per_s_per_gpu": round(tokens * layers / seconds / gpus, 1),
            "model_tflops_per_gpu": round(per_gpu, 1),
            "fraction_of_bf16_peak": round(per_gpu / PEAK_TFLOPS["bf16"], 3),
            "fraction_of_fp8_peak": round(per_gpu / PEAK_TFLOPS["fp8"], 3),
            "pairs_per_gpu_per_layer": {layer: [r["cases"][i]["pairs_per_layer"][layer] for r in ranks]
                                        for layer in case["pairs_per_layer"]},
        })  # fmt: skip
        saved = [torch.load(r["cases"][i]["outputs"]) for r in ranks[::tp]]  # TP rank 0 of each PCP rank
        outputs[case["case"]] = (saved[0]["logits"], interleave_shards([part["kv"] for part in saved], 64))
        print(f"{layout.name} {case['case']} ({count}x{length}): {seconds * 1e3:9.1f} ms  {tokens / seconds:10.0f} tok/s  "
              f"{tokens * layers / seconds / gpus:10.0f} layer-tok/s/GPU  {per_gpu:6.1f} TF/s/GPU", flush=True)  # fmt: skip
    if "moe_layer" in ranks[0]:
        entry["moe_layer"] = [r["moe_layer"] for r in ranks]
        worst = max(r["moe_layer"]["routed_over_grouped_gemm"] for r in ranks)
        print(f"  MoE layer: routed / raw grouped GEMM = {worst:.3f} (worst rank)", flush=True)
    return entry, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--num-layers", type=int, default=None, help="the first N layers (DeepSeek-V3: 3 dense, then MoE)")
    parser.add_argument("--layouts", nargs="+", default=["fp8:1"],
                        help="FORMAT:GPUS[:tpT][:SCHEDULE][:smsN][:chunkC][:ckpt]: fp8 or bf16, TP=T (default 1, the rest PCP), "
                             "the EP schedule (default all-to-all), SM carveout (default 0), chunk size (default "
                             "--chunk-tokens), weights loaded from --checkpoint (ckpt) instead of drawn; each layout's "
                             "outputs are compared with the first of its format")  # fmt: skip
    parser.add_argument("--prompts", nargs="+", default=["1x8192"], help="cases NxL: N prompts of L tokens in flight")
    parser.add_argument("--chunk-tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--moe-tokens", type=int, default=16384, help="tokens per GPU for the MoE-layer-alone timing (0: skip)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of this script (gloo, float32)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="the checkpoint ckpt layouts load, its files evicted from the page cache before each "
                             "(benchmarks/write_checkpoint.py writes the seeded weights the other layouts draw)")  # fmt: skip
    parser.add_argument("--share-gpus", action="store_true",
                        help="run a layout's ranks on this machine's GPUs round-robin, to check a multi-GPU layout's "
                             "outputs on fewer GPUs: their process groups are gloo (NCCL refuses two ranks on one GPU), "
                             "so their times are not the pool's and no scaling is reported")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=540, help="seconds a layout may take before its ranks are stopped (default 540)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scratch", default="/tmp/bench_moe", help="where workers leave their outputs for the comparisons")
    args = parser.parse_args()
    Path(args.scratch).mkdir(parents=True, exist_ok=True)

    from configs.pool import PoolConfig

    model_config = PoolConfig(model=args.model, num_layers=args.num_layers).model_config()
    result = {
        "benchmark": "MoE prefill, random weights, one process per GPU (no Ray)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(("flash_attn", "flashinfer", "triton")),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": args.model, "layers": model_config.num_hidden_layers, "moe_layers": model_config.moe_layers,
        "shared_gpus": args.share_gpus, "runs": [], "agreement": {}, "scaling": {}, "errors": [],
    }  # fmt: skip
    try:
        layouts = [Layout.parse(text) for text in args.layouts]
    except ValueError as exc:
        parser.error(str(exc))
    if any(layout.checkpoint for layout in layouts) and (args.checkpoint is None or not args.checkpoint.is_dir()):
        parser.error(f"ckpt layouts load --checkpoint, a checkpoint directory; got {args.checkpoint}")
    baselines, rates = {}, {}  # the first run's outputs of each weight format
    for layout in layouts:
        try:
            if layout.checkpoint:
                evict_page_cache(args.checkpoint)
            entry, outputs = summarize(args, model_config, layout, run(args, layout))
        except Exception as exc:  # noqa: BLE001 -- one layout failing keeps the others' results
            print(f"{layout.name} failed: {exc}", flush=True)
            result["errors"].append({"layout": layout.name, "error": str(exc)[-3000:]})
            args.out.write_text(json.dumps(result, indent=1) + "\n")
            continue
        result["runs"].append(entry)
        for case in entry["cases"]:
            rates[(layout, case["case"])] = case["tokens_per_s"]
        baseline = baselines.get(layout.weights) or next(iter(baselines.values()), None)
        baselines.setdefault(layout.weights, (layout.name, outputs))
        if baseline is not None:
            for spec, (logits, kv) in outputs.items():
                ref_logits, ref_kv = baseline[1][spec]
                result["agreement"][f"{layout.name} vs {baseline[0]}, {spec}, first prompt"] = {
                    "logits_max_rel_err": relative_error(logits, ref_logits),
                    "logits_rel_l2_err": relative_l2(logits, ref_logits),
                    "kv_max_rel_err": relative_error(kv, ref_kv),
                    "kv_rel_l2_err": relative_l2(kv, ref_kv),
                    "kv_rel_l2_err_per_layer": [round(relative_l2(a, b), 5) for a, b in zip(kv, ref_kv)],
                    "same_first_token": int(logits.argmax()) == int(ref_logits.argmax()),
                }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for (layout, spec), rate in rates.items():
        one = next((r for (other, case), r in rates.items() if case == spec and other.gpus == 1 and other.weights == layout.weights), None)
        if layout.gpus > 1 and one and not args.share_gpus:
            result["scaling"][f"{layout.name} {spec}"] = {
                "tokens_per_s": rate, "one_gpu_tokens_per_s": one, "fraction_of_linear": round(rate / (layout.gpus * one), 3)
            }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"agreement": result["agreement"], "scaling": result["scaling"]}, indent=1))


if __name__ == "__main__":
    main()
