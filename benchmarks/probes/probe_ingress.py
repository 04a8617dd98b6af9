"""Probe: the tier's fixed cost per request (the client's TTFT less the pool's) through Serve's HTTP proxy,
and, with Ray Serve's throughput-optimized mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: the ingress
replica serves HTTP itself, its handlers on the replica's own event loop), at the replica's port.

    python benchmarks/probes/probe_ingress.py --out probe-ingress.json                 # CPU, a tiny checkpoint
    python benchmarks/probes/probe_ingress.py --device cuda --checkpoint /tmp/v3-5layers --out probe-ingress.json

Each way starts Ray and the tier (``bench_vllm_decode.start_tier``) in a process of its own (Serve
reads the mode as it starts) and sends ``--requests`` streamed completions of ``--tokens`` token ids
with ``max_tokens`` 1 and temperature 0, one at a time (``bench_vllm_decode.complete``): the tier
answers them alone (its first token ends them), so no decode server is involved. The pool's TTFT of
each comes from the tier's ``GET /`` (``bench_vllm_decode.tier_report``), matched by request id.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO), str(REPO / "tests")]  # machine.py and bench_vllm_decode.py, the repository, hf_models.py

WAYS = {"serve-proxy": "proxy", "replica-port (RAY_SERVE_THROUGHPUT_OPTIMIZED=1)": "replica"}  # bench_vllm_decode.start_tier's ingress


def one_way(args) -> dict:
    """Run in the child: the tier up, the requests through ``args.at``, the fixed costs."""
    from bench_vllm_decode import MODEL, complete, start_tier, tier_report

    tier = start_tier(types.SimpleNamespace(device=args.device, kv_cache_tokens=1 << 16, moe_rounding="reference", pool_memory=0.9, ingress=args.at),
                      args.checkpoint, "http://127.0.0.1:9", "float32" if args.device == "cpu" else "bfloat16")  # fmt: skip
    vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    body = lambda: {"model": MODEL, "prompt": [random.randrange(5, vocab) for _ in range(args.tokens)], "max_tokens": 1,  # noqa: E731
                    "temperature": 0, "return_token_ids": True}  # fmt: skip
    for _ in range(5):  # warm-up
        complete(tier, body())
    answers = [complete(tier, body()) for _ in range(args.requests)]
    timeline = tier_report(tier)["handoff_timeline"]
    client = [a["ttft_s"] for a in answers]
    pool = [timeline[a["id"].removeprefix("cmpl-")]["pool_ttft_s"] for a in answers]
    ms = lambda xs: round(statistics.median(xs) * 1e3, 2)  # noqa: E731
    return {"client_ttft_ms_p50": ms(client), "pool_ttft_ms_p50": ms(pool), "fixed_cost_ms_p50": ms([c - p for c, p in zip(client, pool)]),
            "requests": len(client)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cpu")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint both ways load (default on the CPU: the tests' tiny DeepSeek-width one)")
    parser.add_argument("--tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--requests", type=int, default=40, help="timed requests per way (default 40)")
    parser.add_argument("--at", choices=["proxy", "replica"], help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.at is not None:
        print(json.dumps(one_way(args)), flush=True)
        return
    if args.checkpoint is None:
        if args.device != "cpu":
            parser.error("--checkpoint is needed on the GPU (benchmarks/write_checkpoint.py writes one)")
        from hf_models import tiny_vllm_checkpoint

        args.checkpoint = tiny_vllm_checkpoint(Path(tempfile.mkdtemp(prefix="probe-ingress-")), 0)
    from machine import machine  # benchmarks/machine.py

    report = {"what": "the tier's fixed cost per request (client TTFT less the pool's), Serve's proxy against the replica's own port",
              "date": datetime.date.today().isoformat(), "machine": machine(), "command": " ".join(sys.argv), "tokens": args.tokens, "results": {}}  # fmt: skip
    for way, at in WAYS.items():
        child = [sys.executable, __file__, "--out", str(args.out), "--device", args.device, "--checkpoint", str(args.checkpoint), "--tokens",
                 str(args.tokens), "--requests", str(args.requests), "--at", at]  # fmt: skip
        done = subprocess.run(child, capture_output=True, text=True, timeout=900)  # start_tier sets the mode's environment
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        report["results"][way] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-2000:]}
        print(way, report["results"][way], flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
