"""Which weight shapes torch's block-scaled FP8 GEMM computes right, and with which scale layout.

For weights ``[N, K]`` in DeepSeek's format (128x128 block scales ``[N/128, K/128]``) and 200 tokens
quantized per 128 columns, ``torch._scaled_mm`` with the weight scales passed ``[K/128, N/128]``
inner-dim-major: with an outer stride of exactly ``K/128`` (a view of the checkpoint's scales) and
padded to a multiple of 4 (16 bytes). Each result is the relative L2 error against the dequantized
weights in float32 (an FP8 GEMM lands near 0.026 here), or torch's refusal. What it found decides
``workers.fp8.block_gemm_shape_ok``.

    python benchmarks/probes/probe_fp8_scale_layout.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ (machine.py, timing.py, ...), the repository

import torch

from machine import machine  # benchmarks/machine.py


from workers.fp8 import block_dequantize, block_gemm_shape_ok, block_quantize, quantize_activations  # noqa: E402

K_SIZES = (128, 256, 384, 512, 640, 1536, 2304, 7168)  # K/128 = 1, 2, 3, 4, 5, 12, 18 (V3's down_proj at TP=8), 56
N_SIZES = (48, 256, 2112)  # one partial block, two blocks, 16.5 blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = {}
    for k in K_SIZES:
        for n in N_SIZES:
            q, scale = block_quantize(torch.randn(n, k, device="cuda") * 0.02)
            x = torch.randn(200, k, device="cuda").to(torch.bfloat16)
            xq, xs = quantize_activations(x, 128, pad_rows_to=4)
            reference = x.float() @ block_dequantize(q, scale, torch.float32).t()
            k_blocks = scale.shape[1]
            layouts = {"exact": scale.t(), "padded": torch.nn.functional.pad(scale, (0, -k_blocks % 4))[:, :k_blocks].t()}
            case = {"block_gemm_shape_ok": block_gemm_shape_ok(k, n)}
            for name, layout in layouts.items():
                try:
                    y = torch._scaled_mm(xq, q.t(), scale_a=xs.t(), scale_b=layout, out_dtype=torch.bfloat16)
                    case[f"{name} (stride {layout.stride(1)})"] = round(((y.float() - reference).norm() / reference.norm()).item(), 4)
                except RuntimeError as exc:
                    case[f"{name} (stride {layout.stride(1)})"] = "refused: " + str(exc).splitlines()[0]
            cases[f"N={n} K={k}"] = case
            print(f"N={n:5d} K={k:5d}", case, flush=True)
    result = {
        "benchmark": "torch._scaled_mm, 1x128 x 128x128 block scales: weight-scale layouts by shape",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(("triton",)),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cases": cases,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
