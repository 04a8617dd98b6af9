"""How far the pool's bf16 latent rows of layer 0 are from float64 under each way of rounding them:
why the rows vLLM loaded from the tier were farther from the truth than vLLM's own prefill's.

On one H100 (``2026-11-26-h100-vllm-decode-truth.json``) the rows vLLM held after the tier's load were
0.0037 from float32 at layer 0 (relative L2) where vLLM's own prefill's were 0.0029. A row of layer 0
is the embedding through ``input_layernorm``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm`` (its latent
part) and the rope (its rope part), so the rounding of these decides it. Computed here on the truth
checkpoint of ``bench_vllm_truth.py`` (``tests/hf_models.write_vllm_checkpoint``, seed 1, bf16 weights
as there), for ``--prompts`` random prompts of ``--tokens`` tokens, against float64:

- ``norms rounded twice``: each RMS norm as DeepSeek's reference rounds it (the normalized row rounded,
  then times the weight and rounded again), the pool's rounding until 2026-11-26;
- ``the pool's modules``: ``attention.mla.RMSNorm`` (rounded once: the weight applied in float32) and
  ``RotaryEmbedding.rotate_``, a bf16 GEMM;
- ``projection in float32, rounded once``: the projection's output kept in float32 (bf16 inputs), the
  norm and the rope in float32, one rounding at the end: the least rounding a bf16 cache allows;
- with ``--pool``, the pool itself (``PrefillPool``, its rows as ``bench_vllm_truth.py`` takes them) in
  bf16 and in float32 (the truth run's reference).

    python benchmarks/probes/probe_row_rounding.py --device cuda --pool --out row-rounding.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]

from machine import machine  # noqa: E402  benchmarks/machine.py


def pool_rows(checkpoint: Path, prompts: list[torch.Tensor], device: str) -> dict[str, list[torch.Tensor]]:
    """Layer 0's rows as the pool itself computes and keeps them, bf16 and float32
    (``bench_vllm_truth.truth_rows``), in a Ray of its own."""
    import ray
    from bench_vllm_truth import truth_rows

    ray.init(address="local", num_cpus=4, num_gpus=1 if device == "cuda" else 0)
    ids = [prompt.tolist() for prompt in prompts]
    out = {f"the pool itself, {dtype}": [rows[0] for rows in truth_rows(checkpoint, ids, device, dtype)] for dtype in ("bfloat16", "float32")}
    ray.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--pool", action="store_true", help="also the rows of the pool itself (PrefillPool, Ray), bf16 and float32")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from safetensors.torch import load_file

    from attention.mla import RMSNorm
    from configs.model import load_model_config
    from hf_models import write_vllm_checkpoint

    checkpoint = Path(tempfile.mkdtemp(prefix="row-rounding-"))
    write_vllm_checkpoint(checkpoint, seed=1, dtype=torch.bfloat16, max_positions=max(4096, args.tokens))  # bf16 weights, as the truth run's
    config = load_model_config(checkpoint).attention
    weights = {k: v for f in checkpoint.glob("*.safetensors") for k, v in load_file(f).items()}
    layer, device, rank = "model.layers.0.", torch.device(args.device), config.kv_lora_rank
    embed, w_kv = weights["model.embed_tokens.weight"].to(device), weights[layer + "self_attn.kv_a_proj_with_mqa.weight"].to(device)
    w_in, w_kvn = weights[layer + "input_layernorm.weight"].to(device), weights[layer + "self_attn.kv_a_layernorm.weight"].to(device)
    eps, rope = config.rms_norm_eps, config.rotary_embedding
    torch.backends.cuda.matmul.allow_tf32 = False

    def norm_once(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        xf = x.double() if dtype == torch.float64 else x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(xf.dtype)).to(dtype)

    def norm_twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # DeepSeek's reference: normalized, rounded, times the weight, rounded
        xf = x.float()
        return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float() * w.to(x.dtype).float()).to(x.dtype)

    def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # the pool's rope math in x's precision
        cos, sin = rope.cos_sin(positions)
        cos, sin, a, b = cos.to(x.dtype), sin.to(x.dtype), x[:, 0::2], x[:, 1::2]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)

    def rows(ids: torch.Tensor, way: str) -> torch.Tensor:
        positions = torch.arange(ids.numel(), device=device)
        if way == "truth":
            x = norm_once(embed[ids].double(), w_in, torch.float64)
            kv = x @ w_kv.double().T
            return torch.cat([norm_once(kv[:, :rank], w_kvn, torch.float64), rotate(kv[:, rank:], positions)], dim=-1)
        bf = torch.bfloat16
        x = embed[ids].to(bf)
        if way == "the pool's modules":
            ln_in, ln_kv = RMSNorm(x.shape[-1], eps, dtype=bf, device=device), RMSNorm(rank, eps, dtype=bf, device=device)
            ln_in.weight.data.copy_(w_in), ln_kv.weight.data.copy_(w_kvn)
            with torch.no_grad():
                latent = torch.nn.functional.linear(ln_in(x), w_kv.to(bf))
                latent[:, :rank] = ln_kv(latent[:, :rank])
                cos, sin = rope.cos_sin(positions)
                rope.rotate_(latent[:, rank:], cos, sin)
            return latent
        if way == "norms rounded twice":
            kv = torch.nn.functional.linear(norm_twice(x, w_in), w_kv.to(bf))
            return torch.cat([norm_twice(kv[:, :rank], w_kvn), rotate(kv[:, rank:].float(), positions).to(bf)], dim=-1)
        kv = norm_once(x, w_in, bf).float() @ w_kv.to(bf).float().T  # bf16 values, float32 products and sums (TF32 off)
        return torch.cat([norm_once(kv[:, :rank], w_kvn, torch.float32), rotate(kv[:, rank:], positions)], dim=-1).to(bf)

    ways = ["norms rounded twice", "the pool's modules", "projection in float32, rounded once"]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, embed.shape[0], (args.tokens,), generator=generator) for _ in range(args.prompts)]
    pooled = pool_rows(checkpoint, prompts, args.device) if args.pool else {}
    ways += list(pooled)
    distances: dict[str, dict[str, list[float]]] = {way: {"row": [], "latent": [], "rope": []} for way in ways}
    for k, prompt in enumerate(prompts):
        ids = prompt.to(device)
        truth = rows(ids, "truth")
        for way in ways:
            got = (pooled[way][k].to(device) if way in pooled else rows(ids, way)).double()
            for part, cols in (("row", slice(None)), ("latent", slice(0, rank)), ("rope", slice(rank, None))):
                distances[way][part].append(float((got[:, cols] - truth[:, cols]).norm() / truth[:, cols].norm()))
    results = {way: {part: round(statistics.fmean(v), 6) for part, v in parts.items()} for way, parts in distances.items()}
    report = {"what": "layer 0's latent rows in bf16 under each rounding, relative L2 from float64 (mean over prompts)",
              "date": datetime.date.today().isoformat(), "machine": machine(), "command": " ".join(sys.argv), "prompts": args.prompts,
              "tokens": args.tokens, "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
