"""How much chunked prefill changes bf16 results: per layer, against a float32 reference.

Prefills one prompt through the first ``--layers`` layers of a DeepSeek-V3-shaped
model (random weights) three ways on one GPU: bf16 with the selected backend in
one chunk, bf16 in chunks of ``--chunk`` (later chunks attend to the cached
latent rows), and float32 TORCH_SDPA (exact blocked attention) in one chunk as
the reference. Reports, per layer, the max and mean relative error of each
layer's latent KV rows and of the final logits, so a chunking bug shows up as
an error that grows with the chunk count instead of staying at the bf16 level.

    python benchmarks/accuracy_chunked.py --tokens 32768 --chunk 8192 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch

from attention.backends.base import DeviceCapability, MLAPrefillSelectorConfig
from attention.backends.selector import get_mla_prefill_backend
from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from configs.model import load_model_config
from machine import machine  # benchmarks/machine.py
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights


@torch.no_grad()
def prefill(model: DeepseekPrefillModel, tokens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of the last token and every layer's latent rows, prefilling ``chunk`` tokens at a time."""
    latents: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    logits = None
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        batch = plan_prefill_batch([len(piece)], [start], device=tokens.device, backend=model.backend)
        context = [torch.cat(rows) for rows in latents] if start else None
        out = model(piece, batch, context)
        for rows, latent in zip(latents, out.latents):
            rows.append(latent)
        logits = out.logits[0]
    return logits, [torch.cat(rows) for rows in latents]


def _errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (got.float() - ref).abs()
    scale = ref.abs().max()
    return {"max_rel": round((diff.max() / scale).item(), 5), "mean_rel": round((diff.mean() / ref.abs().mean()).item(), 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--backend", default=None, help="bf16 backend (default: the selector's choice)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    device = torch.device(args.device)
    config = load_model_config(args.model, num_hidden_layers=args.layers)
    tokens = torch.randint(0, config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    selector = MLAPrefillSelectorConfig(torch.bfloat16, config.attention.dims)
    backend_cls = get_mla_prefill_backend(selector, DeviceCapability.of(device), args.backend)

    reference = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, dtype=torch.float32, device=device)
    load_weights(reference, None, 0)
    ref_logits, ref_latents = prefill(reference, tokens, args.tokens)
    del reference
    model = DeepseekPrefillModel.create(config, backend_cls, dtype=torch.bfloat16, device=device)
    load_weights(model, None, 0)
    runs = {}
    for name, chunk in (("one_chunk", args.tokens), (f"chunks_of_{args.chunk}", args.chunk)):
        logits, latents = prefill(model, tokens, chunk)
        runs[name] = {
            "logits": _errors(logits, ref_logits),
            "latent_per_layer": [_errors(got, ref) for got, ref in zip(latents, ref_latents)],
            "same_first_token": int(logits.argmax()) == int(ref_logits.argmax()),
        }
        print(name, json.dumps(runs[name]), flush=True)
    one, chunked = runs["one_chunk"], runs[f"chunks_of_{args.chunk}"]
    ratios = [round(c["max_rel"] / o["max_rel"], 3) for c, o in zip(chunked["latent_per_layer"], one["latent_per_layer"])]
    print("per-layer latent max error, chunked over one chunk:", ratios, flush=True)
    payload = {
        "benchmark": "accuracy_chunked",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": args.model, "layers": args.layers, "tokens": args.tokens, "backend": backend_cls.name,
        "reference": "float32 TORCH_SDPA (exact blocked attention), one chunk, same weights",
        "errors": "relative to the reference's largest (max_rel) and mean (mean_rel) magnitude",
        "runs": runs,
        "chunked_over_one_chunk_max_error_per_layer": ratios,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
