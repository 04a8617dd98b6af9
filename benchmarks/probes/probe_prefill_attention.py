"""Probe: MLA prefill attention at DeepSeek-V3's head shapes on one GPU, by kernel: flash-attention 4
(what the pool runs on SM90 when no FA3 is installed), vLLM's own FA3 build (``vllm.vllm_flash_attn``,
what vLLM 0.26 runs for MLA prefill on Hopper) in bfloat16, and the same FA3 on FP8 (e4m3) inputs.

    PYTHONPATH=/tmp/gpu-site:/tmp/vllm-site python benchmarks/probes/probe_prefill_attention.py --out probe.json

Causal varlen attention of ``--cases`` batches (``16x4096``: 16 prompts of 4,096 tokens), 128 heads,
Q/K head dim 192 (128 + 64 rotary), V head dim 128: per kernel its GPU time per call (CUDA events,
p50 of ``--repeats``, ``timing.seconds_per_call``) and its TF/s, and each one's distance (relative L2
over the probed heads) from float32 attention on the same bfloat16 inputs (``--ref-heads`` heads of the first prompt). FP8: Q, K and V quantized with one
scale per head (``amax / 448``), given back to the kernel as its descale factors. The inputs are
random normal rows, so the accuracy is a kernel's rounding only: what FP8 attention does to a real
model's tokens needs a model run against the float32 truth.
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

HEADS, QK_DIM, V_DIM = 128, 192, 128
FP8_MAX = 448.0


def parse_case(text: str) -> tuple[int, int]:
    count, length = text.lower().split("x")
    return int(count), int(length)


def causal_flops(count: int, length: int) -> float:
    """Multiply-adds of causal attention (QK^T and PV over the lower triangle), as FLOPs."""
    return count * length * (length + 1) / 2 * HEADS * (QK_DIM + V_DIM) * 2


def per_head_fp8(x: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, D]`` -> FP8 values and the descale ``[count, H]`` (one scale per head, the same for every prompt)."""
    scale = x.float().abs().amax(dim=(0, 2)).clamp(min=1e-10) / FP8_MAX
    q = (x.float() / scale[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale[None, :].expand(count, -1).contiguous()


def reference(q, k, v, length: int, heads: int, scale: float) -> torch.Tensor:
    """float32 causal attention of the first prompt's first ``heads`` heads: ``[length, heads, V_DIM]``."""
    qf, kf, vf = (t[:length, :heads].float().transpose(0, 1) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    return out.transpose(0, 1)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def kernels(count: int, length: int, scale: float):
    """``{name: (callable(q, k, v) -> out [T, H, V_DIM], input dtype)}`` for what imports here, and the import errors."""
    found, missing = {}, {}
    cu = torch.arange(0, (count + 1) * length, length, dtype=torch.int32, device="cuda")
    common = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": length, "max_seqlen_k": length, "softmax_scale": scale, "causal": True}
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4

        found["fa4_bf16"] = lambda q, k, v: fa4(q, k, v, **common)[0]
    except Exception as exc:  # noqa: BLE001 -- recorded
        missing["fa4_bf16"] = repr(exc)
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func as vfa

        varlen = {**common, "fa_version": 3}
        found["vllm_fa3_bf16"] = lambda q, k, v: vfa(q, k, v, **varlen)
        found["vllm_fa3_fp8"] = lambda q, k, v: vfa(
            q[0], k[0], v[0], q_descale=q[1], k_descale=k[1], v_descale=v[1], **varlen
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 -- recorded
        missing["vllm_fa3"] = repr(exc)
    return found, missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["16x4096", "1x32768"], help="COUNTxLENGTH batches (default 16x4096 1x32768)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per kernel and case (default 10)")
    parser.add_argument("--ref-heads", type=int, default=8, help="heads of the first prompt compared with float32 (default 8)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    scale = QK_DIM**-0.5
    report = {"what": __doc__.split("\n\n")[0], "date": datetime.date.today().isoformat(), "machine": machine(),
              "command": " ".join(sys.argv), "heads": HEADS, "qk_head_dim": QK_DIM, "v_head_dim": V_DIM, "cases": {}}  # fmt: skip
    for case in args.cases:
        count, length = parse_case(case)
        gen = torch.Generator(device="cuda").manual_seed(count * length)
        q, k = (torch.randn(count * length, HEADS, QK_DIM, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(count * length, HEADS, V_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
        ref = reference(q, k, v, length, args.ref_heads, scale)
        found, missing = kernels(count, length, scale)
        entry = {"tflops": causal_flops(count, length) / 1e12, "kernels": {}, "errors": dict(missing)}
        fp8 = [per_head_fp8(t, count) for t in (q, k, v)]
        for name, call in found.items():
            inputs = fp8 if name.endswith("fp8") else [q, k, v]
            try:
                out = call(*inputs)
                ms = seconds_per_call(lambda call=call, inputs=inputs: call(*inputs), args.repeats) * 1e3
            except Exception as exc:  # noqa: BLE001 -- a kernel that does not take these shapes is recorded
                entry["errors"][name] = repr(exc)[:500]
                continue
            entry["kernels"][name] = {"ms_p50": round(ms, 3), "tflops_per_s": round(entry["tflops"] / ms * 1e3, 1),
                                      "rel_l2_vs_float32": round(rel_l2(out[:length, : args.ref_heads], ref), 6)}  # fmt: skip
            print(case, name, entry["kernels"][name], flush=True)
        report["cases"][case] = entry
        del q, k, v, fp8, ref
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
