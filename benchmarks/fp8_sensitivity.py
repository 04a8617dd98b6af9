"""How far an FP8 model's outputs move when its input moves by one bf16 rounding (CPU, emulated FP8 GEMMs).

A DeepSeek-V3-like model at small width (hidden 512, 8 heads, 5 layers: 3 dense + 2 MoE with 256
experts, top-8 of 4 groups; the project's seeded random weights in DeepSeek's FP8 format) prefills
one prompt in bf16 twice: as is, and with every embedding row multiplied by ``1 + 2^-9 * N(0, 1)``
(the size of a bf16 rounding: what computing attention in other pieces, or summing experts in
another order, does). Once with the weights dequantized (bf16 GEMMs), once with FP8 GEMMs (torch's
block-scaled and row-wise recipes, emulated on the CPU by ``tests/fp8_emulation.py``). Reported:
the relative L2 change of each layer's latent KV and of the logits, and FP8 against bf16.

Why: on the GPU, FP8 runs of a DeepSeek-V3 slice differ between layouts whose attention is split
differently by ~8% (KV) while layouts computing identical inputs agree to 0.25%; this shows the
first is what FP8 activation quantization does to a bf16-sized difference (a value next to a
rounding boundary moves a whole FP8 step, 6-12%), not a fault of a layout.

    python benchmarks/fp8_sensitivity.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fp8_emulation  # noqa: E402 -- CPU stand-ins for torch's FP8 GEMMs

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend  # noqa: E402
from attention.mla import plan_prefill_batch  # noqa: E402
from configs.model import load_model_config, model_config_from_dict  # noqa: E402
from workers.model import DeepseekPrefillModel  # noqa: E402
from workers.weights import load_weights  # noqa: E402


def relative_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return round(((x.float() - ref.float()).norm() / ref.float().norm()).item(), 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    fp8_emulation.install()
    raw = dict(load_model_config("deepseek-v3").source)
    raw.update(hidden_size=512, intermediate_size=1024, moe_intermediate_size=128, num_attention_heads=8,
               q_lora_rank=256, num_hidden_layers=5, vocab_size=2048)  # fmt: skip
    config = model_config_from_dict(raw, name="deepseek-v3-narrow")
    tokens = torch.randint(0, config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    batch = plan_prefill_batch([args.tokens])
    result = {
        "benchmark": __doc__.split("\n\n")[0],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": {k: raw[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
                                      "first_k_dense_replace")},  # fmt: skip
        "perturbation": "embedding rows x (1 + 2^-9 N(0, 1))",
    }  # fmt: skip
    unperturbed = {}
    torch.set_grad_enabled(False)
    for name, fp8 in (("bf16", False), ("fp8", True)):
        model = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, dtype=torch.bfloat16, fp8=fp8)
        load_weights(model, None, 0)
        base = model(tokens, batch)
        embedding = model.model.embed_tokens.weight
        noise = 1 + 2**-9 * torch.randn(embedding.shape, generator=torch.Generator().manual_seed(1))
        embedding.copy_((embedding.float() * noise).to(embedding.dtype))
        moved = model(tokens, batch)
        unperturbed[name] = base
        result[f"{name}: perturbed vs not"] = {
            "kv_rel_l2_per_layer": [relative_l2(a, b) for a, b in zip(moved.latents, base.latents)],
            "logits_rel_l2": relative_l2(moved.logits, base.logits),
        }
    result["fp8 vs bf16"] = {
        "kv_rel_l2_per_layer": [relative_l2(a, b) for a, b in zip(unperturbed["fp8"].latents, unperturbed["bf16"].latents)],
        "logits_rel_l2": relative_l2(unperturbed["fp8"].logits, unperturbed["bf16"].logits),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if ":" in k or " vs " in k}, indent=1))


if __name__ == "__main__":
    main()
