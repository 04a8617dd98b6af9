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
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
from chaos_decode import MODEL, start_tier  # noqa: E402 -- benchmarks/chaos_decode.py: the CPU tier of the decode tests
from hf_models import write_vllm_checkpoint  # noqa: E402 -- tests/hf_models.py
from machine import machine  # noqa: E402 -- benchmarks/machine.py
from ray import serve  # noqa: E402
from timing import percentiles  # noqa: E402 -- benchmarks/timing.py


def latencies(url: str, seconds: float | None = None, during=None) -> list[float]:
    """``GET /`` latencies: for ``seconds``, or while ``during()`` runs on another thread."""
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
    return out


def summary(seconds: list[float]) -> dict:
    """p50, p99 and the longest, in milliseconds, and how many."""
    return {**percentiles([s * 1e3 for s in seconds]), "max": round(max(seconds) * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=32768, help="words (tokens) of each posted prompt (default 32768)")
    parser.add_argument("--posts", type=int, default=10, help="prompts posted one after the other (default 10)")
    args = parser.parse_args()
    checkpoint = Path(tempfile.mkdtemp(prefix="tokenize-stall-"))
    write_vllm_checkpoint(checkpoint, seed=3)
    try:
        url = start_tier(checkpoint, [SimpleNamespace(url="http://127.0.0.1:9")])  # a decode server never reached: every prompt is refused first
        body = json.dumps({"model": MODEL, "prompt": " ".join(f"w{(i * 37) % 500}" for i in range(args.tokens)), "max_tokens": 4}).encode()
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
                  "posting_s": round(time.perf_counter() - started, 2), "idle_ms": summary(idle), "while_tokenizing_ms": summary(busy)}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({k: report[k] for k in ("post_statuses", "posting_s", "idle_ms", "while_tokenizing_ms")}))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
