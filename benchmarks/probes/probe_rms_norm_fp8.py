"""Probe: the norm that writes FP8 rows (``attention.rms_norm_triton._rms_norm_fp8_kernel``, behind
``workers.fp8.FP8RMSNorm``) at DeepSeek-V3's prefill shapes on one GPU, by launch configuration.

    python benchmarks/probes/probe_rms_norm_fp8.py --out probe.json

The layer profile of a 16x4K batch (2026-11-29, H200) put its calls that add the residual stream at
about 3.1 TB/s, 65% of the card's bandwidth, where the plain norm kernel had reached 88% (an estimate
from the profile's totals: timed alone by this probe they ran at 3.8 TB/s,
``2026-11-29-h200-probe-rms-norm-fp8.json``). Per case
(``--tokens`` rows: a layer's first norm on the float32 stream, an add into it with its norm, and
``q_a_layernorm``'s bf16 rows of 1536) this times the kernel at each ``BLOCK_M`` x ``num_warps`` of
``--configs`` and the launcher's own choice, and the two passes it replaced (the plain norm,
then ``workers.fp8.quantize_activations``), as GPU time per call (CUDA events, p50,
``timing.seconds_per_call``) and the bytes each moves per second; and whether each configuration's FP8
bytes and scales are the launcher's (a reduction split another way may round a scale differently).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/, the repository

import torch
from machine import machine  # benchmarks/machine.py
from timing import seconds_per_call  # benchmarks/timing.py

from attention import rms_norm_triton
from workers.fp8 import BLOCK, EPS, FP8_MAX, quantize_activations

CASES = {  # name: (width, the input's dtype, adds into the float32 residual stream)
    "7168-float32-rows": (7168, torch.float32, False),
    "7168-add": (7168, torch.bfloat16, True),
    "1536-bf16-rows": (1536, torch.bfloat16, False),
}


def norm(x, weight, residual, rows: int, block_m: int | None = None, num_warps: int | None = None):
    """The launcher (``rms_norm_triton.rms_norm_fp8``), at ``block_m`` rows a program and ``num_warps`` where given."""
    constants = {} if block_m is None else {"BLOCK_M": block_m, "num_warps": num_warps}
    return rms_norm_triton.rms_norm_fp8(x, weight, 1e-6, residual, group=BLOCK, rows=rows, fp8_max=FP8_MAX, scale_eps=EPS, constants=constants)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=65536, help="rows (default 65536: a 16x4K batch)")
    parser.add_argument("--configs", nargs="+", default=["1x8", "1x16", "1x32", "2x16", "2x32"],
                        help="BLOCK_M x num_warps (default: 1x8 1x16 1x32 2x16 2x32; the launcher's own choice is always timed)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    configs = []
    for text in args.configs:
        block_m, _, warps = text.partition("x")
        if not (block_m.isdigit() and warps.isdigit()):
            parser.error(f"--configs {text!r}: expected BLOCK_MxNUM_WARPS, e.g. 2x32")
        configs.append((int(block_m), int(warps)))
    report = {"probe": "the FP8-row norm kernel by launch configuration", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "command": " ".join(sys.argv), "tokens": args.tokens, "cases": {}}  # fmt: skip
    for name, (width, dtype, add) in CASES.items():
        x = torch.randn(args.tokens, width, device="cuda").to(dtype)
        weight = (1 + 0.1 * torch.randn(width, device="cuda")).to(torch.bfloat16)
        stream = torch.randn(args.tokens, width, device="cuda") if add else None
        moved = x.numel() * x.element_size() + x.numel() * (1 + 4 / BLOCK) + (2 * stream.numel() * 4 if add else 0)  # in, FP8 rows and scales out, the stream in and out
        chosen = rms_norm_triton.rms_norm_constants(width, per_thread=rms_norm_triton.FP8_PER_THREAD)
        want = norm(x, weight, None if stream is None else stream.clone(), args.tokens)
        entry = {"width": width, "input": str(dtype).removeprefix("torch."), "adds_residual": add, "gigabytes": round(moved / 1e9, 3),
                 "launcher_choice": f"{chosen['BLOCK_M']}x{chosen['num_warps']}", "configs": {}}  # fmt: skip
        for block_m, warps in dict.fromkeys([*configs, (chosen["BLOCK_M"], chosen["num_warps"])]):
            residual = None if stream is None else stream.clone()
            q, scale = norm(x, weight, residual, args.tokens, block_m, warps)
            same = bool(torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale, want[1]))
            seconds = seconds_per_call(lambda: norm(x, weight, residual, args.tokens, block_m, warps), args.repeats)  # the stream grows: its values do not matter here
            entry["configs"][f"{block_m}x{warps}"] = {"ms": round(seconds * 1e3, 4), "tb_per_s": round(moved / seconds / 1e12, 2), "bytes_equal_to_launcher": same}
        residual = None if stream is None else stream.clone()

        def two_passes():
            rows = rms_norm_triton.rms_norm(x, weight, 1e-6) if residual is None else rms_norm_triton.add_rms_norm(x, residual, weight, 1e-6)
            return quantize_activations(rows, BLOCK)

        entry["norm_then_quantize_ms"] = round(seconds_per_call(two_passes, args.repeats) * 1e3, 4)
        report["cases"][name] = entry
        best = min(entry["configs"].items(), key=lambda item: item[1]["ms"])
        print(f"{name}: launcher {entry['launcher_choice']} {entry['configs'][entry['launcher_choice']]['ms']} ms, "
              f"best {best[0]} {best[1]['ms']} ms ({best[1]['tb_per_s']} TB/s), two passes {entry['norm_then_quantize_ms']} ms", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
