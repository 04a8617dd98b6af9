"""How long the tier's replica event loop stalls while long text prompts are tokenized: the latency of
``GET /`` (answered on that loop) asked in a loop, idle and while over-long text completions are
posted (tokenized, then refused for their length, so no prefill or decode server is involved). The
loop relays every client's stream, so a stall here is a gap in every answer's tokens (their ITL).

    python benchmarks/probes/probe_tokenize_stall.py --out benchmarks/results/history/<date>-cpu-tokenize-stall.json

On the CPU, with the tiny checkpoint of the vLLM tests (its word-level tokenizer) and a local Ray.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
from hf_models import write_vllm_checkpoint  # noqa: E402 -- tests/hf_models.py
from machine import machine  # noqa: E402 -- benchmarks/machine.py
from ray import serve  # noqa: E402

from cluster.serve import build_app  # noqa: E402
from configs.pool import PoolConfig  # noqa: E402
from configs.serve import ServeConfig  # noqa: E402
from workers.worker import rendezvous_address  # noqa: E402


def latencies(url: str, seconds: float | None = None, during=None) -> list[float]:
    """``GET /`` latencies, sorted: for ``seconds``, or while ``during()`` runs on another thread."""
    out, stop = [], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            urllib.request.urlopen(url + "/", timeout=60).read()
            out.append(time.perf_counter() - started)

    poller = threading.Thread(target=poll)
    poller.start()
    if during is None:
        time.sleep(seconds)
    else:
        during()
    stop.set()
    poller.join()
    return sorted(out)


def summary(sorted_s: list[float]) -> dict:
    def pct(q: float) -> float:
        return round(sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1e3, 1)

    return {"n": len(sorted_s), "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": round(sorted_s[-1] * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=32768, help="words (tokens) of each posted prompt (default 32768)")
    parser.add_argument("--posts", type=int, default=10, help="prompts posted one after the other (default 10)")
    args = parser.parse_args()
    checkpoint = Path(tempfile.mkdtemp(prefix="tokenize-stall-"))
    write_vllm_checkpoint(checkpoint, seed=3)
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    try:
        port = rendezvous_address()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        pool = PoolConfig(checkpoint=str(checkpoint), kv_cache_tokens=8192, chunk_tokens=128, block_size=32, worker_cpus=0.2, device="cpu", use_gpus=True)
        config = ServeConfig(pool=pool, name="stall", decode_servers=("http://127.0.0.1:9",), served_model_name="m", replica_cpus=0.1)  # never reached
        serve.run(build_app(config), name="stall", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"model": "m", "prompt": " ".join(f"w{(i * 37) % 500}" for i in range(args.tokens)), "max_tokens": 4}).encode()
        statuses: list[int] = []

        def post() -> None:
            for _ in range(args.posts):
                request = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
                try:
                    statuses.append(urllib.request.urlopen(request, timeout=120).status)
                except urllib.error.HTTPError as exc:
                    statuses.append(exc.code)

        latencies(url, 1.0)  # warm
        idle = latencies(url, 3.0)
        started = time.perf_counter()
        busy = latencies(url, during=post)
        report = {"what": "the tier replica's event loop: GET / latency idle and while over-long text prompts are tokenized",
                  "date": datetime.date.today().isoformat(), "machine": machine(), "command": " ".join(sys.argv),
                  "prompt_tokens": args.tokens, "posts": args.posts, "post_statuses": sorted(set(statuses)),
                  "posting_s": round(time.perf_counter() - started, 2), "idle": summary(idle), "while_tokenizing": summary(busy)}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({k: report[k] for k in ("post_statuses", "posting_s", "idle", "while_tokenizing")}))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
