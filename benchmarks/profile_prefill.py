"""Where the GPU time of one prefill batch goes: the pool's worker on one GPU under ``torch.profiler``.

Builds a ``PrefillWorker`` of ``--model`` (``--num-layers`` of it, random weights, FP8 where the
checkpoint format is FP8 and ``--weights fp8``), prefills ``--prompts N L`` (N prompts of L tokens,
all in one batch when they fit ``--chunk-tokens``; FP8 GEMMs on ``--fp8-gemm``) twice to warm up, times a third run, profiles a
fourth, and prints and writes the operators and kernels by GPU time, with the sum of kernel times
and the time the GPU was busy (kernels merged) against the run's wall time, and ``shares``: the
kernel time by part of the model (:data:`PARTS`, :func:`kernel_shares`), and ``gpu_idle``: the time
the GPU sat idle between kernels and the longest such gaps with their neighbours (:func:`idle_gaps`).

    python benchmarks/profile_prefill.py --model deepseek-v3 --num-layers 5 --prompts 16 4096 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from machine import machine  # benchmarks/machine.py
from timing import sync  # benchmarks/timing.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from spmd import chunk_batches  # noqa: E402 -- the tests' prompt-by-chunk batching, as the pool schedules it

from configs.model import FP8_GEMMS  # noqa: E402
from configs.pool import PoolConfig  # noqa: E402
from workers.worker import PrefillWorker, rendezvous_address  # noqa: E402


# the parts of a prefill, by kernel name (the first pattern that matches; case-insensitive): FP8 activation quantization
# serves the linears and the experts alike, so it is a part of its own. DeepGEMM's kernels name no GEMM type, only
# their template values: after the layout's major, M, N and K comes the number of groups, 1 for a dense GEMM. A norm
# that writes its rows quantized (attention.rms_norm_triton's _rms_norm_fp8_kernel) is a norm
PARTS = (
    ("moe_experts", r"GroupProblemShape|grouped|m_grouped|fused_moe|deep_gemm::\w+<\([^)]*\)\d+, \d+u, \d+u, \d+u, (?!1u,)\d+u,"),
    ("attention", r"flash_?attn|fmha|attention|mla"),
    ("linears", r"nvjet|gemm|cutlass|sm90_xmma"),
    ("fp8_quantize", r"quantize|quant_"),
    ("moe_routing", r"route|gather_sum|radix_sort|topk|sort"),
    ("norms", r"rms_norm|layer_norm"),
    ("rope_and_keys", r"rotate|rope|keys"),
)


def kernel_shares(kernels: list[tuple[str, float]]) -> dict:
    """GPU milliseconds and share of the total per part of :data:`PARTS` (the rest: ``glue``, copies,
    adds, gathers) of ``(kernel name, ms)`` pairs."""
    parts = {name: 0.0 for name, _ in PARTS} | {"glue": 0.0}
    for kernel, ms in kernels:
        part = next((name for name, pattern in PARTS if re.search(pattern, kernel, re.IGNORECASE)), "glue")
        parts[part] += ms
    total = sum(parts.values())
    return {name: {"ms": round(ms, 3), "share": round(ms / total, 4) if total else 0.0} for name, ms in parts.items()}


def _merged(events) -> list[tuple[float, float, str, str]]:
    """``events`` (GPU kernels and copies, ``name`` and ``time_range`` in microseconds) merged where they
    overlap or touch: ``(start, end, the first one's name, the name of the one that ends it)`` in time order."""
    spans = []
    for start, end, name in sorted((e.time_range.start, e.time_range.end, e.name) for e in events):
        if spans and start <= spans[-1][1]:
            if end > spans[-1][1]:
                spans[-1] = (spans[-1][0], end, spans[-1][2], name)
        else:
            spans.append((start, end, name, name))
    return spans


def _busy_ms(events) -> float:
    """Milliseconds in which at least one of ``events`` (GPU kernels, copies) ran."""
    return sum(end - start for start, end, *_ in _merged(events)) / 1e3


def idle_gaps(events, top: int = 12, min_ms: float = 0.05) -> dict:
    """Where the GPU sat idle between the first kernel and the last (``events`` as :func:`_merged` takes
    them): the idle milliseconds in all, and the ``top`` longest gaps of at least ``min_ms`` with the
    kernels on either side, the first one's start from the first kernel's (a host sync or a slow launch
    shows up as a gap after the kernel it waited for)."""
    spans = _merged(events)
    gaps = [((b[0] - a[1]) / 1e3, a[3], b[2], (a[1] - spans[0][0]) / 1e3) for a, b in zip(spans, spans[1:])]
    longest = sorted((g for g in gaps if g[0] >= min_ms), key=lambda g: -g[0])[:top]
    return {"idle_ms": round(sum(g[0] for g in gaps), 3),
            "gaps": [{"ms": round(ms, 3), "at_ms": round(at, 3), "after": before[:100], "before": after[:100]} for ms, before, after, at in longest]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--num-layers", type=int, default=5)
    parser.add_argument("--weights", default="fp8", choices=["fp8", "bf16"])
    parser.add_argument("--prompts", type=int, nargs=2, default=[16, 4096], metavar=("N", "L"))
    parser.add_argument("--chunk-tokens", type=int, default=32768)
    parser.add_argument("--backend", default="auto", help="the MLA prefill backend (PoolConfig.backend)")
    parser.add_argument("--fp8-gemm", default="auto", choices=FP8_GEMMS, help="what runs the FP8 GEMMs (PoolConfig.fp8_gemm; default auto)")
    parser.add_argument("--top", type=int, default=40, help="operators and kernels listed")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    count, length = args.prompts
    config = PoolConfig(
        model=args.model, num_layers=args.num_layers, backend=args.backend, fp8_gemm=args.fp8_gemm, dtype="bfloat16", device="cuda",
        quantization="auto" if args.weights == "fp8" else "none", chunk_tokens=args.chunk_tokens,
        max_batch_tokens=max(args.chunk_tokens, count * min(length, args.chunk_tokens)), gpu_memory_utilization=0.85, seed=0,
    )  # fmt: skip
    worker = PrefillWorker(config, 0)
    info = worker.setup(*rendezvous_address())
    gen = np.random.default_rng(0)
    prompts = [gen.integers(0, worker.model.config.vocab_size, size=length).astype(np.int32) for _ in range(count)]

    def run(tag: str) -> None:
        for pieces in chunk_batches(prompts, args.chunk_tokens, tag):
            worker.prefill(pieces)
        worker.release([f"{tag}{i}" for i in range(count)])

    run("warm0-")
    run("warm1-")
    sync()
    started = time.perf_counter()
    run("timed-")
    sync()
    wall = time.perf_counter() - started
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run("profiled-")
        sync()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[: args.top]
    top = [{"name": e.key[:140], "cuda_ms": round(e.device_time_total / 1e3, 3), "calls": e.count} for e in rows]
    result = {
        "benchmark": "one prefill batch on one GPU, torch.profiler", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": args.model, "layers": args.num_layers, "weights": info.weights, "fp8_gemm": info.fp8_gemm, "backend": info.backend,
        "prompts": count, "prompt_tokens": length, "wall_s": wall,
        "layer_tokens_per_s": count * length * args.num_layers / wall,
        "kernel_sum_ms": sum(e.device_time for e in gpu) / 1e3, "gpu_busy_ms": _busy_ms(gpu),
        "shares": kernel_shares([(e.name, e.device_time / 1e3) for e in gpu]), "gpu_idle": idle_gaps(gpu), "top": top,
    }  # fmt: skip
    print(f"{count} x {length} tokens, {args.num_layers} layers, {info.weights} on {info.fp8_gemm}, {info.backend}: {wall * 1e3:.1f} ms, "
          f"kernels {result['kernel_sum_ms']:.1f} ms, GPU busy {result['gpu_busy_ms']:.1f} ms, idle between kernels {result['gpu_idle']['idle_ms']:.1f} ms")  # fmt: skip
    for row in top:
        print(f"{row['cuda_ms']:10.2f} ms {row['calls']:6d}  {row['name'][:110]}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
