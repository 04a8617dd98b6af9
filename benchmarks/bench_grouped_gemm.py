"""Which GEMMs run DeepSeek's experts and FP8 linear layers on this GPU: the candidates, timed on the
model's own shapes.

Experts (DeepSeek-V3: hidden 7168, expert width 2048, top-8 of 256): for ``--tokens`` tokens routed
uniformly at random over ``--experts`` local experts, the up/gate GEMM ``[m_e, 7168] x [7168, 4096]``
and the down GEMM ``[m_e, 2048] x [2048, 7168]`` of every expert, by

- ``grouped_bf16``: ``torch._grouped_mm`` (one CUTLASS grouped kernel, no host sync);
- ``grouped_fp8_rowwise``: ``torch._scaled_grouped_mm``, per-token activation scales and
  per-output-row weight scales (the only FP8 recipe torch's grouped GEMM has on SM90);
- ``loop_fp8_block``: one ``torch._scaled_mm`` per expert with DeepSeek's recipe (1x128 activation
  scales, 128x128 weight scales: the checkpoint's own), host-side expert offsets;
- ``loop_fp8_1x128``: the same with the weight scales expanded to 1x128 (exact for 128x128 blocks);
- ``grouped_fp8_block_deepgemm``: DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` (DeepSeek's recipe,
  the checkpoint's 128x128 weight blocks, one kernel for all experts) on the rows placed in its
  contiguous layout as the pool's ``fp8_gemm: deep_gemm`` places them (``workers.deepgemm``;
  ``padded_rows``: the layout's rows; the TF/s count the real rows).

Dense FP8 linear layers: ``torch._scaled_mm`` with both block recipes, and DeepGEMM's ``fp8_gemm_nt``
(``fp8_deepgemm``), against bf16 ``torch.mm`` for each V3 projection at ``--tokens`` rows, plus the
cost of quantizing the activations per token per 128 columns with torch ops.

DeepGEMM is the package ``deep_gemm`` (``workers.deepgemm.load``; ``run_vllm_gpu.sh``'s install links
vLLM's build of it); without it its candidates say so in the results.

    python benchmarks/bench_grouped_gemm.py --tokens 16384 65536 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from workers import deepgemm

HIDDEN, EXPERT, TOPK = 7168, 2048, 8
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
DENSE = {  # name: (out, in) of DeepSeek-V3's linear layers at TP=1
    "q_a_proj": (1536, 7168),
    "q_b_proj": (24576, 1536),
    "kv_a_proj_with_mqa": (576, 7168),
    "kv_b_proj": (32768, 512),
    "o_proj": (7168, 16384),
    "gate_up_proj": (36864, 7168),
    "down_proj": (7168, 18432),
}


def bench(fn, repeats: int = 20) -> float:
    """Median seconds of ``fn`` (CUDA events), after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> FP8 and float32 scales ``[M, K/128]`` (column-major, as ``_scaled_mm`` takes them)."""
    m, k = x.shape
    groups = x.view(m, k // 128, 128).float()
    scale = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    q = (groups / scale[..., None]).to(FP8).view(m, k)
    return q, scale.t().contiguous().t()


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> FP8 and 128x128 block scales ``[ceil(N/128), K/128]``."""
    n, k = w.shape
    pad = -n % 128
    blocks = torch.nn.functional.pad(w.float(), (0, 0, 0, pad)).view((n + pad) // 128, 128, k // 128, 128)
    scale = blocks.abs().amax((1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view(n + pad, k)[:n].to(FP8)
    return q, scale


def weight_scale_128x128(scale: torch.Tensor) -> torch.Tensor:
    """128x128 block scales ``[N/128, K/128]`` as ``_scaled_mm`` takes them: ``[L4, N/128]``, K blocks padded to 4."""
    kb = scale.shape[1]
    padded = torch.nn.functional.pad(scale, (0, -kb % 4))
    return padded.t()


def weight_scale_1x128(scale: torch.Tensor, n: int) -> torch.Tensor:
    """128x128 block scales expanded to one scale per output row and 128 columns, ``[N, K/128]`` column-major."""
    return scale.repeat_interleave(128, dim=0)[:n].t().contiguous().t()


API = {}


def scaled_mm(a, b, scale_a, scale_b):
    """Block-scaled FP8 ``a @ b`` in bf16; the recipe is read off the scales' shapes. Uses
    ``torch._scaled_mm`` (recipes inferred) or, where that refuses, ``F.scaled_mm`` (recipes named)."""
    if API.get("v") != 2:
        try:
            out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
            API["v"] = 1
            return out
        except RuntimeError:
            if API.get("v") == 1:
                raise
    F = torch.nn.functional
    recipe_b = F.ScalingType.BlockWise1x128 if scale_b.shape[0] == b.shape[1] else F.ScalingType.BlockWise128x128
    API["v"] = 2
    return F.scaled_mm(a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b, recipe_b, output_dtype=torch.bfloat16)


def expert_counts(tokens: int, experts: int, gen: torch.Generator) -> list[int]:
    """Rows per expert of ``tokens`` tokens routed top-8 uniformly at random, each rounded up to a
    multiple of 4 (the per-expert ``_scaled_mm`` needs it for its column-major activation scales)."""
    ids = torch.rand(tokens, experts, generator=gen).topk(TOPK, dim=-1).indices
    return [-(-c // 4) * 4 for c in torch.bincount(ids.flatten(), minlength=experts).tolist()]


def bench_experts(tokens: int, experts: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    counts = expert_counts(tokens, experts, gen)
    rows = sum(counts)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    bounds = [0, *offs.tolist()]
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, EXPERT, device="cuda", dtype=torch.bfloat16)
    w13 = 0.02 * torch.randn(experts, 2 * EXPERT, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w2 = 0.02 * torch.randn(experts, HIDDEN, EXPERT, device="cuda", dtype=torch.bfloat16)
    flops = 2 * rows * (HIDDEN * 2 * EXPERT + EXPERT * HIDDEN)
    out = {"tokens": tokens, "experts": experts, "routed_rows": rows, "rows_per_expert_mean": rows / experts,
           "rows_per_expert_max": max(counts), "gemm_flops": flops}  # fmt: skip

    def report(name, seconds, ref=None, got=None):
        entry = {"seconds": seconds, "tflops": flops / seconds / 1e12}
        if ref is not None:
            entry["rel_err_vs_bf16"] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        out[name] = entry
        print(f"  {name:22} {seconds * 1e3:8.2f} ms  {entry['tflops']:7.1f} TF/s", entry.get("rel_err_vs_bf16", ""), flush=True)

    ref = {}

    def grouped_bf16():
        ref["a"] = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        ref["b"] = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    report("grouped_bf16", bench(grouped_bf16))

    # row-wise FP8: weights requantized per output row; activations per token
    def rowwise(w):
        scale = w.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # [E, N]
        return (w.float() / scale[..., None]).to(FP8), scale

    w13_r, s13_r = rowwise(w13)
    w2_r, s2_r = rowwise(w2)

    def quant_rows(a):
        s = a.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX
        return (a.float() / s[:, None]).to(FP8), s

    xq, xs = quant_rows(x)
    hq, hs = quant_rows(h)
    got = {}

    def grouped_fp8():
        got["a"] = torch._scaled_grouped_mm(xq, w13_r.transpose(-2, -1), xs, s13_r, offs=offs, out_dtype=torch.bfloat16)
        got["b"] = torch._scaled_grouped_mm(hq, w2_r.transpose(-2, -1), hs, s2_r, offs=offs, out_dtype=torch.bfloat16)

    try:
        report("grouped_fp8_rowwise", bench(grouped_fp8), ref["a"], got["a"])
    except Exception as exc:  # noqa: BLE001 -- a candidate the torch build lacks is reported, the others still run
        out["grouped_fp8_rowwise"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print("  grouped_fp8_rowwise failed:", exc)

    # per-expert loop with DeepSeek's block recipe
    w13_b = [block_quantize(w) for w in w13]
    w2_b = [block_quantize(w) for w in w2]
    xq_b, xs_b = quantize_1x128(x)
    hq_b, hs_b = quantize_1x128(h)
    for name, wscale in (("loop_fp8_block", lambda s, n: weight_scale_128x128(s)), ("loop_fp8_1x128", weight_scale_1x128)):
        s13 = [wscale(s, 2 * EXPERT) for _, s in w13_b]
        s2 = [wscale(s, HIDDEN) for _, s in w2_b]

        def loop():
            parts = []
            for e in range(experts):
                a, b = bounds[e], bounds[e + 1]
                if b > a:
                    sa = xs_b[a:b].t().contiguous().t()
                    parts.append(scaled_mm(xq_b[a:b], w13_b[e][0].t(), sa, s13[e]))
                    scaled_mm(hq_b[a:b], w2_b[e][0].t(), hs_b[a:b].t().contiguous().t(), s2[e])
            got["a"] = torch.cat(parts)

        try:
            report(name, bench(loop, repeats=5), ref["a"], got["a"])
        except Exception as exc:  # noqa: BLE001 -- reported as the candidate's failure
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"  {name} failed:", exc)

    # DeepGEMM's grouped kernel, on the rows placed in its contiguous layout as the pool places them
    try:
        align = deepgemm.load().get_mk_alignment_for_contiguous_layout()
    except RuntimeError as exc:
        out["grouped_fp8_block_deepgemm"] = {"error": str(exc)[:300]}
        return out
    layout = deepgemm.Layout.of(offs, xq_b.shape[0], align)
    a, a_scale = layout.gather([xq_b.view(torch.uint8), xs_b])
    h_pad, h_scale = layout.gather([hq_b.view(torch.uint8), hs_b])
    a, h_pad, m_indices = a.view(FP8), h_pad.view(FP8), layout.m_indices
    w13_d = (torch.stack([q for q, _ in w13_b]), torch.stack([s for _, s in w13_b]))
    w2_d = (torch.stack([q for q, _ in w2_b]), torch.stack([s for _, s in w2_b]))

    def run_deepgemm():
        got["a"] = deepgemm.grouped_gemm(a, a_scale, *w13_d, m_indices)
        deepgemm.grouped_gemm(h_pad, h_scale, *w2_d, m_indices)

    try:
        report("grouped_fp8_block_deepgemm", bench(run_deepgemm), ref["a"], got["a"][layout.at])
        out["grouped_fp8_block_deepgemm"].update(padded_rows=m_indices.numel(), m_alignment=align)
    except Exception as exc:  # noqa: BLE001 -- reported as the candidate's failure
        out["grouped_fp8_block_deepgemm"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print("  grouped_fp8_block_deepgemm failed:", exc)
    return out


def bench_dense(tokens: int) -> dict:
    out = {}
    for name, (n, k) in DENSE.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = 0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        flops = 2 * tokens * n * k
        entry = {"shape": [tokens, n, k], "bf16_s": bench(lambda: x @ w.t())}
        ref = x @ w.t()
        wq, ws = block_quantize(w)
        xq, xs = quantize_1x128(x)
        entry["quantize_activations_s"] = bench(lambda: quantize_1x128(x))
        for recipe, scale_b in (("fp8_block_s", weight_scale_128x128(ws)), ("fp8_1x128_s", weight_scale_1x128(ws, n))):
            try:
                got = scaled_mm(xq, wq.t(), xs, scale_b)
                entry[recipe] = bench(lambda: scaled_mm(xq, wq.t(), xs, scale_b))
                entry[recipe.replace("_s", "_rel_err")] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            except Exception as exc:  # noqa: BLE001 -- reported per recipe
                entry[recipe] = f"{type(exc).__name__}: {exc}"[:300]
        d = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
        try:  # the checkpoint's block scales as they are, the activations' 1x128 scales column-major (as vLLM passes them)
            dg = deepgemm.load()
            dg.fp8_gemm_nt((xq, xs), (wq, ws), d)
            entry["fp8_deepgemm_rel_err"] = ((d.float() - ref.float()).norm() / ref.float().norm()).item()
            entry["fp8_deepgemm_s"] = bench(lambda: dg.fp8_gemm_nt((xq, xs), (wq, ws), d))
        except Exception as exc:  # noqa: BLE001 -- reported per recipe, DeepGEMM missing included
            entry["fp8_deepgemm_s"] = f"{type(exc).__name__}: {exc}"[:300]
        for key in ("bf16_s", "fp8_block_s", "fp8_1x128_s", "fp8_deepgemm_s"):
            if isinstance(entry.get(key), float):
                entry[key.replace("_s", "_tflops")] = flops / entry[key] / 1e12
        out[name] = entry
        print(f"  {name:20} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items() if k != "shape"), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--experts", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = {
        "benchmark": "expert and FP8 GEMM candidates, DeepSeek-V3 shapes",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "python": platform.python_version()},  # fmt: skip
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "experts": [], "dense": {},
    }  # fmt: skip
    for tokens in args.tokens:
        for experts in args.experts:
            print(f"experts={experts} tokens={tokens}", flush=True)
            result["experts"].append(bench_experts(tokens, experts))
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"dense tokens={tokens}", flush=True)
        result["dense"][str(tokens)] = bench_dense(tokens)
        result["scaled_mm_api"] = {1: "torch._scaled_mm", 2: "torch.nn.functional.scaled_mm"}.get(API.get("v"))
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
