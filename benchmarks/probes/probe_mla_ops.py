"""The MLA layer's element-wise steps on one GPU, each against the torch-ops form it replaced.

At DeepSeek-V3's shapes for ``--tokens`` tokens (128 heads, 64 rope dims, hidden 7168): the rotation
of the queries' rope part (``RotaryEmbedding.rotate_``: the Triton kernel against the torch ops, in
DeepSeek's interleaved pairs and the NeoX halves) and of the latent rows' ``k_pe``; the key rows
built from the up-projection and ``k_pe`` (``attention.mla_triton`` against two copies into one
buffer and ``torch.cat`` of the strided parts); the RMSNorm of the hidden rows
(``attention.mla.RMSNorm``'s kernel against separate float32 ops rounded once at the end, torch's fused
normalization then the weight, and torch's op with the weight inside, which rounds once too), with the
fraction of values equal to the separate ops' (until 2026-11-26 the kernel and these ops rounded twice,
as DeepSeek's reference does). Milliseconds per call (median of 20 back-to-back calls).

    python benchmarks/probes/probe_mla_ops.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ (machine.py, timing.py, ...), the repository

import torch
import torch.nn.functional as F

from machine import machine  # benchmarks/machine.py
from timing import seconds_per_call  # benchmarks/timing.py


from attention.mla_triton import build_keys  # noqa: E402
from attention.mla import RMSNorm  # noqa: E402
from configs.model import load_model_config  # noqa: E402


def _ms(fn) -> float:
    return round(seconds_per_call(fn, 20) * 1e3, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    attention = load_model_config("deepseek-v3").attention
    dims, heads, tokens = attention.dims, attention.num_heads, args.tokens
    nope, lora = attention.qk_nope_head_dim, attention.kv_lora_rank
    rope = attention.rotary_embedding
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(tokens, heads, dims.qk_head_dim, **bf16)
    latent = torch.randn(tokens, attention.latent_dim, **bf16)
    cos, sin = rope.cos_sin(torch.arange(tokens, device="cuda"))
    result = {"rotate_ms": {}}
    for name, rows in (("queries", q[..., nope:]), ("latent", latent[:, lora:])):
        for impl in ("torch", "triton"):
            result["rotate_ms"][f"{name}-{impl}"] = _ms(lambda rows=rows, impl=impl: rope.rotate_(rows, cos, sin, impl=impl))
    rope.interleaved = False
    result["rotate_ms"]["queries-neox-triton"] = _ms(lambda: rope.rotate_(q[..., nope:], cos, sin, impl="triton"))
    rope.interleaved = True

    kv = torch.randn(tokens, heads, nope + attention.v_head_dim, **bf16)
    k_nope, k_pe = kv[..., :nope], latent[:, None, lora:]

    def copies() -> torch.Tensor:
        k = kv.new_empty(tokens, heads, dims.qk_head_dim)
        k[..., :nope].copy_(k_nope)
        k[..., nope:].copy_(k_pe)
        return k

    def cat() -> torch.Tensor:
        return torch.cat([k_nope, k_pe.expand(tokens, heads, -1)], dim=-1)

    def kernel() -> torch.Tensor:
        return build_keys(kv, latent[:, lora:], nope)

    same = torch.equal(kernel(), copies()) and torch.equal(kernel(), cat())
    result["keys_ms"] = {"kernel": _ms(kernel), "two-copies": _ms(copies), "cat": _ms(cat), "all-equal": same}

    hidden = torch.randn(tokens, attention.hidden_size, **bf16)
    norm = RMSNorm(attention.hidden_size, **bf16)
    norm.weight.data.normal_(1.0, 0.1)

    def separate_ops() -> torch.Tensor:  # the RMSNorm in float32 ops, rounded once
        xf = hidden.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()).to(hidden.dtype)

    result["rms_norm_ms"] = {
        "kernel": _ms(lambda: norm(hidden)), "separate-float32-ops": _ms(separate_ops),
        "torch-fused-then-weight": _ms(lambda: norm.weight * F.rms_norm(hidden, norm.weight.shape, eps=norm.eps)),
        "torch-fused-weight-inside": _ms(lambda: F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.eps)),
        "kernel-values-equal-to-separate-ops": (norm(hidden) == separate_ops()).float().mean().item(),
        "weight-inside-values-equal-to-separate-ops": (
            F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.eps) == separate_ops()
        ).float().mean().item(),
    }  # fmt: skip
    result = {
        "benchmark": "MLA element-wise steps", "tokens": tokens, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(("triton",)), "command": " ".join([Path(sys.executable).name, *sys.argv]), **result,
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
