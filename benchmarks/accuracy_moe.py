"""MoE models on a GPU (bf16, and FP8 GEMMs for the FP8 checkpoint) against the reference on the CPU.

The tiny DeepSeek MoE checkpoints of the tests (``tests/hf_models.py``: V3 routing with a correction
bias, V2 routing without q LoRA, V3 in DeepSeek's FP8 block format with two 128-column blocks per
row) are prefilled on the GPU in one chunk and in chunks of ``--chunk`` tokens, and decoded greedily
from the prefilled latent KV by the reference decoder on the same GPU. Reported per model and mode:
the largest logit error relative to the largest logit of transformers' float32 model on the CPU (on
the dequantized weights for FP8), whether the first token agrees, and the 1 + 8 greedy tokens against
transformers' ``generate``.

    python benchmarks/accuracy_moe.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_models import save_fp8, tiny_fp8_moe, tiny_moe  # noqa: E402 -- the tests' model builders

from attention.backends.base import DeviceCapability, MLAPrefillSelectorConfig  # noqa: E402
from attention.backends.selector import get_mla_prefill_backend  # noqa: E402
from attention.mla import plan_prefill_batch  # noqa: E402
from configs.model import load_model_config  # noqa: E402
from workers.decode import ReferenceDecoder  # noqa: E402
from workers.model import DeepseekPrefillModel  # noqa: E402
from workers.weights import load_weights  # noqa: E402

STEPS = 8


def prefill(model, tokens: torch.Tensor, chunk: int):
    """Chunked prefill of one prompt: logits of its last token and its latent rows ``[layers, T, W]``."""
    latents, logits = None, None
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        batch = plan_prefill_batch([len(piece)], [start], device=tokens.device, backend=model.backend)
        out = model(piece, batch, list(latents) if latents is not None else None)
        new = torch.stack(out.latents)
        latents = new if latents is None else torch.cat([latents, new], dim=1)
        logits = out.logits[0]
    return logits, latents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of this script (float32)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompt = torch.arange(1, args.tokens + 1) * 13 % 320
    result = {
        "benchmark": "tiny MoE models on the GPU against transformers on the CPU (float32)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None, "torch": torch.__version__,
                    "python": platform.python_version()},  # fmt: skip
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "prompt_tokens": args.tokens, "chunk_tokens": args.chunk, "models": {},
    }  # fmt: skip
    scratch = Path(tempfile.mkdtemp())
    for name in ("v3", "v2", "v3-fp8"):
        path = scratch / name
        if name == "v3-fp8":
            hf = save_fp8(tiny_fp8_moe(seed=7), path, scratch / "dequantized")
        else:
            hf = tiny_moe(name, seed=6)
            hf.save_pretrained(path)
        with torch.no_grad():
            expected_logits = hf(prompt[None]).logits[0, -1]
            expected = hf.generate(prompt[None], max_new_tokens=STEPS + 1, do_sample=False)[0, args.tokens :].tolist()
        config = load_model_config(path)
        backend_cls = get_mla_prefill_backend(MLAPrefillSelectorConfig(dtype, config.attention.dims), DeviceCapability.of(device))
        runs = {}
        for mode in ("bf16", "fp8") if config.quantization and device.type == "cuda" else (str(dtype).removeprefix("torch."),):
            model = DeepseekPrefillModel.create(config, backend_cls, dtype=dtype, fp8=mode == "fp8", device=device)
            load_weights(model, path)
            for chunk in (args.tokens, args.chunk):
                logits, kv = prefill(model, prompt.to(device), chunk)
                error = ((logits.float().cpu() - expected_logits).abs().max() / expected_logits.abs().max()).item()
                tokens = ReferenceDecoder(model).generate(kv, int(logits.argmax()), STEPS)
                runs[f"{mode}, chunks of {chunk}"] = {
                    "logits_max_rel_err": error,
                    "same_first_token": int(logits.argmax()) == expected[0],
                    "greedy_tokens": tokens, "same_greedy_tokens": tokens == expected,
                }  # fmt: skip
                print(name, mode, chunk, runs[f"{mode}, chunks of {chunk}"], flush=True)
        result["models"][name] = {"backend": backend_cls.name, "transformers_tokens": expected, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
