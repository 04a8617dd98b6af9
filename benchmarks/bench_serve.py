"""The Serve prefill tier under load, over real HTTP, against the same pool called directly.

Starts a local Ray (``ray start --head``), then ``serve run CONFIG`` of a Serve config file with
one application (``cluster.serve:app``). A bounded load generator on the same host sends prompts
of mixed lengths (log-uniform in ``--min-tokens``..``--max-tokens``, random token ids) as msgpack
``POST /prefill`` requests, ``return_logits`` false, in stages of stepped concurrency
(``--stages``: ``CONCURRENCYxREQUESTS``, each stage a closed loop of that many clients). The stage
of the highest concurrency is the measured peak: before it, the load stays at that concurrency
(``scale-up`` requests, counted like the others) until the tier runs ``max_replicas``. Every
``--handoff-every``-th request asks for a KV ticket, which a ``KVReceiver`` redeems at once.

Throughout, a thread records the tier's running replicas (``serve.status()``, every 0.5 s) and
scrapes Ray's Prometheus endpoint (every 2 s: the pool's TTFT histogram, queue depth and tokens/s,
and Serve's replica gauges). After the last stage it waits for the tier to scale back to
``min_replicas`` (and 5 s more), stops ``serve run``, and starts a :class:`PrefillPool` of the same pool config
with ``max_replicas`` replicas on the same GPUs: it runs the peak stage's prompts at the same
concurrency (``direct_tokens_per_s``, against ``tier_tokens_per_s``), and prefills every ticketed
prompt alone with ``keep_kv``: its ``fetch_kv`` is compared with the KV the receiver took.

Writes the result JSON (machine, date, command, per-request records, replica and metrics
timelines) and, with matplotlib, a plot of the replica count and the p99 TTFT over time.

    python benchmarks/bench_serve.py --config deploy/serve-gpu-bench.yaml --out serve.json --plot serve.png
    python benchmarks/bench_serve.py --config deploy/serve-tiny.yaml --min-tokens 16 --max-tokens 512 \\
        --stages 1x8,2x8,4x24,2x8,1x8 --out serve-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

# replicas and handles report their load every 0.5 s instead of 10 (read by Serve's processes)
ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "OMP_NUM_THREADS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    # the local head, the serve CLI and this driver share a token (token authentication, as a cluster should run)
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(16),
    # the KV server's token of deploy/serve-gpu-bench.yaml ({env: MLAPOOL_KV_TOKEN}): one drawn for the run unless given
    "MLAPOOL_KV_TOKEN": os.environ.get("MLAPOOL_KV_TOKEN") or secrets.token_hex(16),
}
os.environ.update(ENV)  # before Ray is imported: it reads its settings then

import aiohttp
import msgpack
import numpy as np
import ray
import torch
import yaml
from ray import serve

from cluster.pool import PrefillPool
from configs.serve import ServeConfig
from kv.receiver import KVReceiver

from machine import machine  # benchmarks/machine.py

METRICS = ("ray_mlapool_ttft_seconds_count", "ray_mlapool_ttft_seconds_sum", "ray_mlapool_queue_depth",
           "ray_mlapool_prefill_tokens_per_second", "ray_mlapool_prefill_tokens_total",
           "ray_serve_deployment_replica_healthy", "ray_serve_num_ongoing_http_requests")  # fmt: skip


def parse_stages(text: str) -> list[tuple[int, int]]:
    stages = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if not match or not all(int(g) > 0 for g in match.groups()):
            raise SystemExit(f"--stages: {item!r} is not CONCURRENCYxREQUESTS with both positive (e.g. 4x32)")
        stages.append((int(match[1]), int(match[2])))
    return stages


def load_config(path: Path) -> tuple[ServeConfig, int, str]:
    """The one application's ServeConfig, the HTTP port and the application name of a Serve config file."""
    raw = yaml.safe_load(path.read_text())
    apps = raw.get("applications") or []
    if len(apps) != 1 or apps[0].get("import_path") != "cluster.serve:app":
        raise SystemExit(f"{path}: expected one application with import_path cluster.serve:app")
    return ServeConfig.from_dict(apps[0].get("args") or {}), int(raw.get("http_options", {}).get("port", 8000)), apps[0]["name"]


class Recorder(threading.Thread):
    """Samples the tier's running replicas and scrapes Ray's Prometheus endpoint until stopped."""

    def __init__(self, app: str, deployment: str, metrics_url: str, t0: float) -> None:
        super().__init__(name="recorder", daemon=True)
        self.app, self.deployment, self.metrics_url, self.t0 = app, deployment, metrics_url, t0
        self.replicas: list[tuple[float, int]] = []
        self.scrapes: list[dict] = []
        self.stop = threading.Event()

    def running(self) -> int:
        try:
            status = serve.status().applications[self.app].deployments[self.deployment]
        except (KeyError, AttributeError):
            return 0
        return status.replica_states.get("RUNNING", 0)

    def run(self) -> None:
        last_scrape = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            self.replicas.append((round(now - self.t0, 2), self.running()))
            if now - last_scrape >= 2.0:
                last_scrape = now
                self.scrapes.append({"t": round(now - self.t0, 2), **scrape(self.metrics_url)})
            self.stop.wait(0.5)


def scrape(url: str) -> dict[str, float]:
    """The sums of the series in ``METRICS`` on a Prometheus text endpoint (absent ones left out)."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError as exc:
        return {"error": str(exc)}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


async def run_stage(session, url, prompts, concurrency, label, t0, records, tickets) -> tuple[float, float]:
    """Send ``prompts`` with ``concurrency`` clients; return the stage's (start, end) times."""
    queue = list(reversed(prompts))

    async def client() -> None:
        while queue:
            request_id, tokens, handoff = queue.pop()
            body = msgpack.packb({"token_ids": tokens, "request_id": request_id, "return_logits": False, "handoff": handoff})
            sent = time.monotonic()
            try:
                async with session.post(f"{url}/prefill", data=body, headers={"content-type": "application/msgpack"}) as response:
                    status, answer = response.status, msgpack.unpackb(await response.read())
            except Exception as exc:  # noqa: BLE001 -- recorded as a failed request
                status, answer = 0, {"error": f"{type(exc).__name__}: {exc}"}
            done = time.monotonic()
            records.append({
                "stage": label, "concurrency": concurrency, "tokens": len(tokens), "status": status,
                "sent_s": round(sent - t0, 4), "ttft_s": round(done - sent, 4), "server_ttft_s": answer.get("ttft_s"),
                "error": answer.get("error"),
            })  # fmt: skip
            if status == 200 and handoff:
                tickets.append((tokens, answer["ticket"], await asyncio.to_thread(fetch_ticket, answer["ticket"])))

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return start - t0, time.monotonic() - t0


def fetch_ticket(ticket: dict):
    receiver = KVReceiver(ticket["host"], ticket["port"], token=os.environ["MLAPOOL_KV_TOKEN"], model_fingerprint=ticket["model_fingerprint"], transport="tcp")
    started = time.monotonic()
    try:
        kv = receiver.fetch(ticket["request_id"])
    except Exception as exc:  # noqa: BLE001 -- recorded
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"rows": kv.rows(), "fetch_s": time.monotonic() - started, "bytes": kv.bytes}


async def drive_tier(url, stages, make, max_replicas, recorder, t0, scale_timeout_s) -> tuple[list, list, dict]:
    records, tickets, peak = [], [], {}
    peak_index = max(range(len(stages)), key=lambda i: stages[i][0])
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        for index, (concurrency, count) in enumerate(stages):
            label = f"{index}:{concurrency}x{count}"
            if index == peak_index:  # hold the peak's load until the tier has scaled out
                deadline = time.monotonic() + scale_timeout_s
                while recorder.running() < max_replicas and time.monotonic() < deadline:
                    await run_stage(session, url, make(concurrency), concurrency, "scale-up", t0, records, tickets)
                peak["prompts"] = make(count)
                peak["replicas_at_start"] = recorder.running()
                start, end = await run_stage(session, url, peak["prompts"], concurrency, label, t0, records, tickets)
                peak.update(stage=label, concurrency=concurrency, start_s=start, end_s=end, replicas_at_end=recorder.running())
            else:
                await run_stage(session, url, make(count), concurrency, label, t0, records, tickets)
    return records, tickets, peak


def direct_run(pool: PrefillPool, prompts, concurrency: int) -> tuple[float, list[float]]:
    """The peak's prompts through the pool itself, ``concurrency`` clients in a closed loop."""
    queue = list(prompts)
    queue.reverse()
    lock, ttfts = threading.Lock(), []

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                _, tokens, _ = queue.pop()
            sent = time.monotonic()
            pool.submit(tokens).result()
            ttfts.append(time.monotonic() - sent)

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as threads:
        for future in [threads.submit(client) for _ in range(concurrency)]:
            future.result()
    return time.monotonic() - start, ttfts


def percentiles(values) -> dict:
    if not values:
        return {}
    return {f"p{q}": round(float(np.percentile(values, q)), 4) for q in (50, 90, 99)}


def first_difference(got: torch.Tensor, ours: torch.Tensor) -> list[int | None]:
    """Per layer, the first token whose latent row differs (None: the layer is equal). A request
    the tier ran in several chunks agrees up to its first chunk boundary in every layer but 0."""
    rows = (got != ours).any(dim=2)
    return [int(layer.nonzero()[0]) if layer.any() else None for layer in rows]


def stage_summary(records: list[dict]) -> dict:
    """Requests, failures, client TTFT percentiles and tokens/s (first send to last answer) of one stage."""
    ok = [r for r in records if r["status"] == 200]
    span = max(r["sent_s"] + r["ttft_s"] for r in records) - min(r["sent_s"] for r in records)
    return {"requests": len(records), "failed": len(records) - len(ok), "ttft_s": percentiles([r["ttft_s"] for r in ok]),
            "tokens_per_s": round(sum(r["tokens"] for r in ok) / span, 1)}  # fmt: skip


def wait_for(predicate, timeout_s: float, step_s: float = 0.5) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(step_s)
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="Serve config file with one cluster.serve:app application")
    parser.add_argument("--stages", default="1x16,2x24,4x32,8x64,4x32,2x24,1x16", help="CONCURRENCYxREQUESTS, comma-separated (default: %(default)s)")
    parser.add_argument("--min-tokens", type=int, default=1024, help="shortest prompt (default: 1024)")
    parser.add_argument("--max-tokens", type=int, default=32768, help="longest prompt (default: 32768)")
    parser.add_argument("--handoff-every", type=int, default=8, help="every N-th request asks for a KV ticket (default: 8)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: this host's, at most 16)")
    parser.add_argument("--num-gpus", type=int, default=None, help="GPUs of the local Ray (default: torch's count)")
    parser.add_argument("--scale-timeout-s", type=float, default=300.0, help="longest wait for a scale-up or a scale-down (default: 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of replicas and p99 TTFT over time (needs matplotlib)")
    args = parser.parse_args()
    stages = parse_stages(args.stages)
    if not 0 < args.min_tokens <= args.max_tokens:
        raise SystemExit(f"need 0 < --min-tokens <= --max-tokens, got {args.min_tokens}, {args.max_tokens}")
    config, port, app_name = load_config(args.config)
    model = config.pool.model_config()
    if args.max_tokens > model.max_position_embeddings:
        raise SystemExit(f"--max-tokens {args.max_tokens} is over the model's {model.max_position_embeddings} positions")
    gen = np.random.default_rng(args.seed)
    serial = iter(range(1 << 30))

    def make(count: int) -> list[tuple[str, list[int], bool]]:
        lengths = np.exp(gen.uniform(np.log(args.min_tokens), np.log(args.max_tokens + 1), size=count)).astype(int)
        prompts = []
        for n in lengths:
            i = next(serial)
            prompts.append((f"bench-{i}", gen.integers(0, model.vocab_size, size=int(n)).tolist(), i % args.handoff_every == 0))
        return prompts

    env = dict(os.environ)
    gcs, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    num_gpus = args.num_gpus if args.num_gpus is not None else torch.cuda.device_count()
    num_cpus = args.num_cpus or min(16, os.cpu_count() or 2)
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={gcs.split(':')[1]}",
                    f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}", f"--metrics-export-port={metrics_port}",
                    "--include-dashboard=false", "--disable-usage-stats"], env=env, check=True)  # fmt: skip
    served = None
    logs = args.out.with_suffix(".serve.log")
    try:
        ray.init(address=gcs, logging_level="WARNING")
        t0 = time.monotonic()
        with logs.open("w") as log:
            served = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", str(args.config), f"--address={gcs}"],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        recorder = Recorder(app_name, config.name, f"http://127.0.0.1:{metrics_port}/metrics", t0)
        recorder.start()
        up_s = wait_for(lambda: served.poll() is not None or (recorder.running() >= config.min_replicas and _answers(url)), args.scale_timeout_s)
        if up_s is None or served.poll() is not None:
            raise SystemExit(f"the tier did not come up in {args.scale_timeout_s} s; see {logs}")
        records, tickets, peak = asyncio.run(drive_tier(url, stages, make, config.max_replicas, recorder, t0, args.scale_timeout_s))
        load_end = time.monotonic() - t0
        down_s = wait_for(lambda: recorder.running() <= config.min_replicas, args.scale_timeout_s)
        time.sleep(5.0)  # and it stays there
        recorder.stop.set()
        recorder.join()
        final_replicas = recorder.running()
        served.send_signal(signal.SIGINT)  # serve run shuts the application down
        served.wait(timeout=120)
        gpus_free = wait_for(lambda: ray.available_resources().get("GPU", 0) >= num_gpus, 120)
        if gpus_free is None:
            raise SystemExit("the tier's GPUs were not released after serve run stopped")

        pool_config = dataclasses.replace(config.pool, replicas=config.max_replicas)
        pool = PrefillPool(pool_config).start()
        try:
            direct_run(pool, peak["prompts"][: 2 * peak["concurrency"]], peak["concurrency"])  # warm-up, as the tier's was
            direct_s, direct_ttfts = direct_run(pool, peak["prompts"], peak["concurrency"])
            checks = []
            for tokens, ticket, got in tickets:
                if "error" in got:
                    checks.append({"request_id": ticket["request_id"], "error": got["error"]})
                    continue
                result = pool.prefill(tokens, keep_kv=True)
                ours = pool.fetch_kv(result)
                pool.release(result)
                scale = ours.float().abs().amax(dim=(1, 2)).clamp_min(1e-12)
                error = ((got["rows"].float() - ours.float()).abs().amax(dim=(1, 2)) / scale).tolist()
                checks.append({"request_id": ticket["request_id"], "tokens": len(tokens), "fetch_s": round(got["fetch_s"], 4),
                               "bytes": got["bytes"], "layer_rel_max_err": [round(e, 6) for e in error],
                               "layer0_equal": bool(torch.equal(got["rows"][0], ours[0])),
                               "first_differing_token": first_difference(got["rows"], ours)})  # fmt: skip
        finally:
            pool.shutdown()
    finally:
        if served is not None and served.poll() is None:
            os.killpg(served.pid, signal.SIGKILL)
        ray.shutdown()
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], env=env, capture_output=True)

    ok = [r for r in records if r["status"] == 200]
    peak_records = [r for r in records if r["stage"] == peak["stage"]]
    peak_tokens = sum(len(t) for _, t, _ in peak["prompts"])
    tier_rate = peak_tokens / (peak["end_s"] - peak["start_s"])
    direct_rate = peak_tokens / direct_s
    replicas = [n for _, n in recorder.replicas]
    changes = [{"t_s": t, "from": n, "to": m} for (_, n), (t, m) in zip(recorder.replicas, recorder.replicas[1:]) if m != n]
    kv_errors = [e for c in checks for e in c.get("layer_rel_max_err", [])]
    result = {
        "benchmark": "serve tier under stepped HTTP load vs the pool called directly",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(("ray", "fastapi", "flash_attn", "flashinfer")),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config_file": str(args.config),
        "serve_config": dataclasses.asdict(config),
        "stages": args.stages,
        "prompt_tokens": {"min": args.min_tokens, "max": args.max_tokens, "distribution": "log-uniform"},
        "requests": len(records),
        "failed_requests": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:10],
        "ttft_s": percentiles([r["ttft_s"] for r in ok]),
        "p99_ttft_s": percentiles([r["ttft_s"] for r in ok]).get("p99"),
        "server_ttft_s": percentiles([r["server_ttft_s"] for r in ok]),
        "by_stage": {stage: stage_summary([r for r in records if r["stage"] == stage]) for stage in dict.fromkeys(r["stage"] for r in records)},
        "tier_tokens_per_s": round(tier_rate, 1),
        "direct_tokens_per_s": round(direct_rate, 1),
        "tier_vs_direct": round(tier_rate / direct_rate, 4),
        "peak": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in peak.items() if k != "prompts"}
        | {"requests": len(peak_records), "tokens": peak_tokens, "tier_ttft_s": percentiles([r["ttft_s"] for r in peak_records]),
           "direct_ttft_s": percentiles(direct_ttfts), "direct_s": round(direct_s, 3), "direct_replicas": config.max_replicas},
        "tier_up_s": round(up_s, 2),
        "load_end_s": round(load_end, 2),
        "scale_down_wait_s": None if down_s is None else round(down_s, 2),
        "max_replicas_seen": max(replicas),
        "final_replicas": final_replicas,
        "replica_changes": changes,
        "kv_tickets": {"fetched": sum("error" not in c for c in checks), "failed": sum("error" in c for c in checks),
                       "max_layer_rel_err": max(kv_errors, default=None), "layer0_equal": all(c.get("layer0_equal", False) for c in checks),
                       "checks": checks},  # fmt: skip
        "replicas_timeline": recorder.replicas,
        "metrics_scrapes": recorder.scrapes,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("requests", "failed_requests", "p99_ttft_s", "tier_tokens_per_s", "direct_tokens_per_s",
                                            "tier_vs_direct", "max_replicas_seen", "final_replicas", "replica_changes")}, indent=1))  # fmt: skip
    print("kv tickets:", {k: v for k, v in result["kv_tickets"].items() if k != "checks"})
    if args.plot is not None:
        plot(result, args.plot)


def _answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(f"{url}/", timeout=5).status == 200
    except OSError:
        return False


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, counts = zip(*result["replicas_timeline"])
    done = sorted((r["sent_s"] + r["ttft_s"], r["ttft_s"]) for r in result["records"] if r["status"] == 200)
    window, p99_t, p99 = 10.0, [], []
    for t in np.arange(0, done[-1][0] + window, window / 2):
        values = [v for end, v in done if t - window < end <= t]
        if values:
            p99_t.append(t)
            p99.append(float(np.percentile(values, 99)))
    fig, left = plt.subplots(figsize=(8, 3.5))
    left.step(times, counts, where="post", color="tab:blue", label="running replicas")
    left.set_xlabel("time since serve run (s)")
    left.set_ylabel("replicas", color="tab:blue")
    left.set_yticks(range(max(counts) + 2))
    right = left.twinx()
    right.plot(p99_t, p99, color="tab:red", marker=".", label="p99 TTFT (10 s window)")
    right.set_ylabel("p99 TTFT seen by the client (s)", color="tab:red")
    fig.suptitle(f"{result['machine'].get('gpu', 'CPU')}: {result['requests']} requests, stages {result['stages']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
