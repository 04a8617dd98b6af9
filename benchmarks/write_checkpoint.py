"""Write a model's seeded random weights as a checkpoint in its release's own format, at real size.

The tensors are the ones a worker draws itself when it has no checkpoint (``workers.weights.
RandomWeights``, same seed, so a worker loading this directory holds exactly the weights of one
drawing them): FP8 ``float8_e4m3fn`` weights with float32 ``weight_scale_inv`` per 128x128 block
where the config has a ``quantization_config``, the other tensors in the dtype a model of ``--dtype``
holds them in (bf16 as in DeepSeek's releases; the routers' ``e_score_correction_bias`` float32). Files of at most ``--file-gib`` with
``model.safetensors.index.json``, the built-in ``config.json`` with ``num_hidden_layers`` set to
the layers written, and a word-level tokenizer over the vocabulary (:func:`write_tokenizer`). Drawn on ``--device`` one tensor at a time (the values equal those workers draw on
the same kind of device: CPU and CUDA generators differ); host memory holds one file's worth.

    python benchmarks/write_checkpoint.py --model deepseek-v3 --num-layers 5 --out /tmp/v3-5layers
    python benchmarks/write_checkpoint.py --model deepseek-v3 --kv-shaped --out /tmp/v3-kv-shaped  # 61 layers, small
    python benchmarks/bench_moe.py --model deepseek-v3 --num-layers 5 --checkpoint /tmp/v3-5layers \\
        --layouts fp8:1 fp8:1:ckpt fp8:4:tp2:ckpt --share-gpus --prompts 1x8192 --repeats 1 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from configs.model import MODELS_DIR, load_model_config
from workers.model import DeepseekPrefillModel
from workers.weights import SCALE, RandomWeights, load_plan

# ``--kv-shaped``: the model's layers and MLA widths (kv_lora_rank + qk_rope_head_dim: its KV per token),
# everything else small, so that a pool and a vLLM server both load DeepSeek-V3's 61 layers on one GPU. Its
# weights are bf16 (no quantization_config): FP8 linears 1,024 wide measure nothing about moving KV, and
# vLLM's DeepGEMM compiles a kernel for each new batch shape it meets (minutes of a run, in eager mode).
KV_SHAPED = {
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256, "num_attention_heads": 16,
    "num_key_value_heads": 16, "q_lora_rank": 512, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
    "topk_group": 2, "quantization_config": None,
}  # fmt: skip


def write_checkpoint(
    model: str, num_layers: int | None, out: Path, *, seed: int, device: str, dtype: torch.dtype, file_bytes: int,
    kv_shaped: bool = False,
) -> dict:  # fmt: skip
    """Write the checkpoint; returns what was written (files, tensors, bytes, seconds). ``kv_shaped``:
    with :data:`KV_SHAPED`'s small widths."""
    started = time.perf_counter()
    overrides = {**(KV_SHAPED if kv_shaped else {}), **({"num_hidden_layers": num_layers} if num_layers else {})}
    config = load_model_config(model, **overrides)
    meta = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, device="meta", dtype=dtype)
    params = dict(meta.named_parameters())
    dtypes = {piece.tensor: params[piece.param].dtype for piece in load_plan(meta, full=True)}
    source = RandomWeights(meta, seed, torch.device(device))
    out.mkdir(parents=True, exist_ok=True)
    weight_map, part, part_bytes, files, total = {}, {}, 0, [], 0

    def flush() -> None:
        nonlocal part, part_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(part, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        files.append(name)
        part, part_bytes = {}, 0

    for name in source.shapes:
        whole = (slice(None), slice(None)) if len(source.shapes[name]) == 2 else (slice(None), None)
        tensors = {name: source.read(name, *whole)}
        if source.is_fp8(name):
            tensors[name + SCALE] = source.read(name + SCALE, slice(None), slice(None))
        else:
            tensors[name] = tensors[name].to(dtypes[name])
        for key, tensor in tensors.items():
            part[key] = tensor.contiguous().cpu()
            part_bytes += tensor.numel() * tensor.element_size()
            total += tensor.numel() * tensor.element_size()
        if part_bytes >= file_bytes:
            flush()
    if part:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    builtin, given = MODELS_DIR / f"{model}.json", Path(model)
    config_file = builtin if builtin.is_file() else given / "config.json" if given.is_dir() else given
    config = {key: value for key, value in {**json.loads(config_file.read_text()), **overrides}.items() if value is not None}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    write_tokenizer(out, config)
    return {"files": len(files), "tensors": len(weight_map), "bytes": total, "seconds": round(time.perf_counter() - started, 1)}


def write_tokenizer(out: Path, config: dict) -> None:
    """A word-level tokenizer over the whole vocabulary (id ``i`` is the word ``w<i>``; the config's
    bos and eos ids are DeepSeek-V3's ``<｜begin▁of▁sentence｜>`` and ``<｜end▁of▁sentence｜>``): the
    release's own tokenizer is not at hand, and servers that detokenize (vLLM, the tier's OpenAI
    endpoint) need one; the same text costs for both. The special tokens are named as the release names
    them, and so are its longest tokens: vLLM refuses a text prompt of more characters than its token
    limit times the longest token's, and with ``<s>`` and ``</s>`` the longest was ``w129279`` (7
    characters, 8 with the space between words): 6 of 16 random 32K-token prompts that fit were refused
    (``history/2026-11-26-h200-serving-partial.json``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
    special = {config.get("bos_token_id", 0): bos, config.get("eos_token_id", 1): eos}
    words = {special.get(i, f"w{i}"): i for i in range(config["vocab_size"])}
    backend = Tokenizer(models.WordLevel(words, unk_token="w2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token="w2").save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3", help="a built-in model name, a config.json or a checkpoint directory")
    parser.add_argument("--num-layers", type=int, default=None, help="write the first N layers only")
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0, help="the workers' seed (PoolConfig.seed) these weights equal")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where tensors are drawn: the kind of device the workers run on")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="of the unquantized tensors: that of the workers that draw the same weights")
    parser.add_argument("--file-gib", type=float, default=4.0, help="the largest file, GiB")
    parser.add_argument("--kv-shaped", action="store_true",
                        help="the model's layers and MLA widths (its KV per token), everything else small and bf16 (KV_SHAPED): the KV load benchmarks' checkpoint")  # fmt: skip
    args = parser.parse_args()
    if args.file_gib <= 0:
        parser.error(f"--file-gib must be > 0, got {args.file_gib}")
    written = write_checkpoint(
        args.model, args.num_layers, args.out, seed=args.seed, device=args.device, dtype=getattr(torch, args.dtype),
        file_bytes=int(args.file_gib * 2**30), kv_shaped=args.kv_shaped,
    )  # fmt: skip
    print(json.dumps({"checkpoint": str(args.out), **written}))


if __name__ == "__main__":
    main()
