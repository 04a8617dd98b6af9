"""One MoE layer through vLLM's own kernels and through ours (both roundings), on one GPU: how many
output values agree bit for bit, and how long each takes (wall time, the GPU synchronized around each call).

    PYTHONPATH=/tmp/vllm-site:. python benchmarks/probes/probe_vllm_moe.py --out moe.json

vLLM's path is its CUDA path for a bf16 DeepSeek-V3 MoE layer (``workers.moe_vllm`` lists the steps):
the gate as a bf16 linear layer, its fused ``grouped_topk`` kernel (``routed_scaling_factor`` 1), its
Triton ``fused_experts`` (the routing weight in the down GEMM, ``moe_sum``), the sum times the factor,
plus the shared expert (``silu_and_mul`` between two bf16 linear layers). Ours is ``workers.moe.MoE``
with the same weights, ``rounding="reference"`` and ``"vllm"``. Shapes: the tests' DeepSeek-width
tiny checkpoint (16 experts, top-4 in 2 of 4 groups), a wider one with top-8, and one DeepSeek-V3
layer (256 experts of 2048, hidden 7168) for the time each takes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ (machine.py, timing.py, ...), the repository

import torch
import torch.nn.functional as F

from machine import machine  # benchmarks/machine.py
from timing import seconds_per_call  # benchmarks/timing.py


from configs.model import MoEConfig  # noqa: E402
from workers.model import DenseMLP  # noqa: E402
from workers.moe import MoE  # noqa: E402

SHAPES = {  # name: hidden, MoEConfig fields
    "tiny-checkpoint": (256, dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, n_group=4, topk_group=2)),
    "top8": (1024, dict(n_routed_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, n_group=8, topk_group=4)),
    "deepseek-v3": (7168, dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8, topk_group=4)),
}


def vllm_layer(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer as vLLM 0.26 computes it, from vLLM's own ops."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    config = moe.config
    logits = F.linear(x, moe.gate.weight)
    weights, ids = ops.grouped_topk(
        logits, config.n_group, config.topk_group, config.num_experts_per_tok, config.norm_topk_prob, 1.0, moe.gate.e_score_correction_bias, 1
    )  # fmt: skip
    routed = fused_experts(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids)
    routed *= config.routed_scaling_factor
    shared = moe.shared_experts
    gate_up = F.linear(x, shared.gate_up_proj.weight)
    act = torch.empty(x.shape[0], gate_up.shape[1] // 2, dtype=x.dtype, device=x.device)
    torch.ops._C.silu_and_mul(act, gate_up)
    return F.linear(act, shared.down_proj.weight) + routed, (weights, ids)


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    diff = (ours.float() - theirs.float()).abs()
    return {"equal_fraction": round(float((ours == theirs).float().mean()), 6), "max_abs_diff": float(diff.max()),
            "relative_l2": float(diff.norm() / theirs.float().norm())}  # fmt: skip


def probe(name: str, tokens: int, seed: int) -> dict:
    hidden, fields = SHAPES[name]
    config = MoEConfig(**fields, n_shared_experts=1, routed_scaling_factor=2.5)
    torch.manual_seed(seed)
    layers = {}
    for rounding in ("reference", "vllm"):
        shared = DenseMLP(hidden, config.moe_intermediate_size, dtype=torch.bfloat16, device="cuda")
        layers[rounding] = MoE(config, hidden, shared_experts=shared, dtype=torch.bfloat16, rounding=rounding, device="cuda")
    with torch.no_grad():
        for param in layers["reference"].parameters():
            param.normal_(0, 0.05)
        layers["reference"].gate.e_score_correction_bias.normal_(0, 0.5)
        layers["vllm"].load_state_dict(layers["reference"].state_dict())
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        want, (weights, ids) = vllm_layer(layers["vllm"], x)
        our_weights, our_ids = layers["vllm"].gate(x)
        row = {"hidden": hidden, **fields, "tokens": tokens,
               "routing_ids_equal_fraction": round(float((our_ids == ids.long()).all(dim=1).float().mean()), 6),
               "routing_weights_max_abs_diff": float((our_weights - weights).abs().max())}  # fmt: skip
        for rounding, layer in layers.items():
            row[f"output_{rounding}_vs_vllm"] = agreement(layer(x), want)
            row[f"ms_ours_{rounding}"] = round(seconds_per_call(lambda: layer(x), synced=True) * 1e3, 3)  # synced: "vllm" waits for its row counts
        row["ms_vllm_kernels"] = round(seconds_per_call(lambda layer=layers["vllm"]: vllm_layer(layer, x), synced=True) * 1e3, 3)
    print(name, json.dumps(row), flush=True)
    layers.clear()  # the weights go before the next shape's
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import vllm

    results = {name: probe(name, args.tokens, args.seed) for name in args.shapes}
    args.out.write_text(json.dumps({
        "what": "one bf16 DeepSeek-V3 MoE layer: vLLM's kernels against workers.moe.MoE (reference and vllm rounding)",
        "date": datetime.date.today().isoformat(), "machine": machine(), "vllm_version": vllm.__version__,
        "command": "benchmarks/probes/probe_vllm_moe.py " + " ".join(sys.argv[1:]), "results": results,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
