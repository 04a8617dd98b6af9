"""The FP8 activation-quantization kernel (``workers.fp8_triton``) at a model's MoE and linear shapes.

For each use, on ``--tokens`` tokens of ``--model``: the experts' input (one scale per token; plain,
and scattered to the token's ``k`` pair rows), their activation (``silu(gate) * up`` times the routing
weight, ``tokens x k`` rows) and the 1x128 groups of the block-scaled linear layers. Each is timed
with the launcher's compile-time choice (``quantize_constants``), the two-pass form (128-column
chunks read twice) and other tile sizes (rows per program, warps), every variant checked to write
the same bytes and scales as the launcher's. Reported: milliseconds per call (the median of 20
back-to-back calls, CUDA events) and the bytes read and written per second.

    python benchmarks/bench_quantize.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton

from machine import machine  # benchmarks/machine.py
from timing import seconds_per_call  # benchmarks/timing.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.model import load_model_config  # noqa: E402
from workers import fp8_triton  # noqa: E402
from workers.fp8 import EPS, FP8_MAX  # noqa: E402


def _uses(model: str, tokens: int) -> dict:
    """name -> the kernel's inputs for one use: x, group, silu_mul, row weights, scatter destinations, output rows."""
    config = load_model_config(model)
    hidden, width, k = config.hidden_size, config.moe.moe_intermediate_size, config.moe.num_experts_per_tok
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    pairs = tokens * k
    return {
        "experts-input-scattered": (x, hidden, False, None, torch.randperm(pairs, device="cuda").view(tokens, k), pairs),
        "experts-input": (x, hidden, False, None, None, tokens),
        "experts-activation": (
            torch.randn(pairs, 2 * width, device="cuda").to(torch.bfloat16), width, True, torch.rand(pairs, device="cuda"), None, pairs
        ),
        "linear-1x128": (x, 128, False, None, None, tokens),
    }


def _variants(group: int, silu_mul: bool, chosen: dict) -> dict:
    """name -> compile-time arguments: the launcher's, the two-pass form, and other one-pass tiles."""
    out = {"launcher": chosen, "two-passes": {**chosen, "WIDTH": fp8_triton.CHUNK, "BLOCK_M": 16 if group > 128 else 32, "num_warps": 4}}
    width, loads = triton.next_power_of_2(group), 2 if silu_mul else 1
    for tile in (2048, 4096, 8192, 16384):
        rows = max(1, tile // (width * loads))
        for warps in (2, 4, 8, 16):
            if 4 <= rows * width * loads // (warps * 32) <= 128:  # values per thread
                out[f"rows{rows}-warps{warps}"] = {**chosen, "WIDTH": width, "BLOCK_M": rows, "num_warps": warps}
    return out


def run(model: str, tokens: int) -> dict:
    results = {}
    for name, (x, group, silu_mul, weight, dest, rows) in _uses(model, tokens).items():
        m, k = x.shape[0], x.shape[1] // (2 if silu_mul else 1)
        q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device="cuda")
        scale = torch.empty(k // group, rows, dtype=torch.float32, device="cuda")
        chosen = fp8_triton.quantize_constants(
            group, FP8_MAX, EPS, silu_mul=silu_mul, row_weight=weight is not None, scatter=0 if dest is None else dest.shape[1]
        )
        moved = x.numel() * x.element_size() + q.numel() + scale.numel() * 4 + (weight.numel() * 4 if weight is not None else 0)
        expected, variants = None, {}
        for variant, constants in _variants(group, silu_mul, chosen).items():
            grid = (triton.cdiv(m if dest is not None else rows, constants["BLOCK_M"]), k // group)

            def call(constants=constants, grid=grid):
                fp8_triton._quantize_kernel[grid](
                    x, weight if weight is not None else scale, q, scale, dest if dest is not None else scale,
                    m, rows, k, x.stride(0), q.stride(0), scale.stride(0), **constants,
                )  # fmt: skip

            ms = seconds_per_call(call, 20) * 1e3
            written = (q.view(torch.uint8).clone(), scale.clone())
            expected = expected or written
            same = torch.equal(written[0], expected[0]) and torch.equal(written[1], expected[1])
            variants[variant] = {"ms": round(ms, 4), "tb_per_s": round(moved / ms / 1e9, 3), "same_as_launcher": same}
        shape = {key: chosen[key] for key in ("WIDTH", "BLOCK_M", "num_warps")}
        results[name] = {"rows_in": m, "columns": k, "group": group, "bytes_moved": moved, "launcher": shape, "variants": variants}
        best = min(variants, key=lambda v: variants[v]["ms"])
        print(f"{name}: launcher {variants['launcher']['ms']} ms, two passes {variants['two-passes']['ms']} ms, "
              f"best {best} {variants[best]['ms']} ms")  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3", help="a built-in MoE model: its hidden and expert widths, top-k")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the kernel's timings)")
    result = {
        "benchmark": "FP8 activation quantization kernel", "model": args.model, "tokens": args.tokens,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(("triton",)),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "uses": run(args.model, args.tokens),
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
