"""Probe: how often does the pool's first greedy token equal the float32 truth's with a bf16 head,
and with the float32 one (``workers.model.float32_logits``)? On the CPU, no GPU needed.

    python benchmarks/probes/probe_head_precision.py --seeds 1 2:one-scale 3:one-scale --prompts 150 --out probe.json

For each seed, a DeepSeek-width MoE checkpoint in bf16 (``tests/hf_models.write_vllm_checkpoint``, as
``bench_vllm_truth.py`` draws them), the pool's model in bf16 on the CPU, and ``--prompts`` random
prompts of ``--min-len`` to ``--max-len`` tokens. The truth is transformers' ``DeepseekV3ForCausalLM``
in float32 on the same weights. The pool's logits are the float32 head's; the bf16 head's are
computed from the same last rows as the model computed them before the float32 head (the final
norm's output rounded once to bf16, times the bf16 ``lm_head``, its output in bf16). Reported per
seed: the first tokens equal to the truth's for each head, and for each prompt where either differs,
the truth's top-two margin and top logit (near-ties against bf16's spacing there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "tests")]

import numpy as np
import torch
import torch.nn.functional as F
from bench_vllm_truth import checkpoint_specs
from machine import machine  # benchmarks/machine.py

VOCAB = 508  # write_vllm_checkpoint's words; its special ids are left out of the prompts


def first_tokens(seed: int, one_scale: bool, prompts: int, lengths: tuple[int, int], folder: Path) -> dict:
    from hf_models import write_vllm_checkpoint
    from transformers import DeepseekV3ForCausalLM

    from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
    from attention.mla import plan_prefill_batch
    from configs.model import load_model_config
    from workers.model import DeepseekPrefillModel
    from workers.weights import load_weights

    path = folder / f"seed{seed}"
    write_vllm_checkpoint(path, seed=seed, dtype=torch.bfloat16, one_scale=one_scale)
    truth = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = DeepseekPrefillModel.create(load_model_config(path), TorchSDPAPrefillBackend, dtype=torch.bfloat16)
    load_weights(model, path)
    gen = np.random.default_rng(seed)
    equal = {"bf16_head": 0, "float32_head": 0}
    differing = []
    for p in range(prompts):
        ids = torch.from_numpy(gen.integers(0, VOCAB, size=int(gen.integers(lengths[0], lengths[1] + 1))))
        with torch.no_grad():
            top = truth(ids[None]).logits[0, -1].topk(2)
            out = model(ids, plan_prefill_batch([len(ids)]))
            bf16_head = F.linear(out.last_hidden.bfloat16(), model.lm_head.weight)
        want = int(top.indices[0])
        got = {"bf16_head": int(bf16_head[0].float().argmax()), "float32_head": int(out.logits[0].argmax())}
        for head, token in got.items():
            equal[head] += token == want
        if any(token != want for token in got.values()):
            margin, top_logit = float(top.values[0] - top.values[1]), float(top.values[0])
            differing.append({"prompt": p, "truth_margin": round(margin, 7), "truth_top_logit": round(top_logit, 5), **{h: t == want for h, t in got.items()}})
    return {"seed": seed, "one_scale": one_scale, "prompts": prompts, "first_tokens_equal_to_truth": equal, "differing": differing}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs="+", default=["1", "2:one-scale", "3:one-scale"], help="SEED or SEED:one-scale, as bench_vllm_truth.py's --checkpoints")
    parser.add_argument("--prompts", type=int, default=150)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    seeds = checkpoint_specs(parser, "--seeds", args.seeds)
    with tempfile.TemporaryDirectory() as folder:
        rows = []
        for seed, one_scale in seeds:
            rows.append(first_tokens(seed, one_scale, args.prompts, (args.min_len, args.max_len), Path(folder)))
            print(f"seed {seed}{' one-scale' if one_scale else ''}: first tokens equal to float32's: {rows[-1]['first_tokens_equal_to_truth']}", flush=True)
    result = {
        "what": "the pool's first greedy token against the float32 truth, bf16 head against float32 head",
        "date": datetime.date.today().isoformat(), "machine": machine(), "command": " ".join(sys.argv),
        "engine_dtype": "bfloat16", "prompt_tokens": [args.min_len, args.max_len], "seeds": rows,
        "totals": {head: sum(r["first_tokens_equal_to_truth"][head] for r in rows) for head in ("bf16_head", "float32_head")},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["totals"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
