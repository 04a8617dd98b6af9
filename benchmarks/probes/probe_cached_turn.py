"""Where a cached turn's fixed costs go: Ray's timeline of the worker's calls during single requests on
one GPU, a turn whose 12K history is cached (1,138 new tokens) and a cold prompt of the same length.

    PYTHONPATH=<gpu site>:. python benchmarks/probes/probe_cached_turn.py --checkpoint /tmp/v3-5layers

Prints, per request, its TTFT and queueing; the pool's steps in this process (``name>`` entering,
``name<`` leaving, in ms after the submission): admission (validation and block hashes), the batch,
the SPMD call (``gather``), completion, freeing the blocks (``free``, the ``release`` calls) and
settling the future; and every worker event that started during it (the name, its start in ms after
the submission, its length in ms): ``task:deserialize_arguments``, ``task:execute`` and
``task:store_outputs`` of the ``prefill`` call, and the ``release`` of a request's blocks.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ (machine.py, timing.py, ...), the repository

import numpy as np

from bench_prefix_cache import one_gpu_config  # benchmarks/bench_prefix_cache.py: Ray, the GPU environment



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint (benchmarks/write_checkpoint.py writes one)")
    parser.add_argument("--history", type=int, default=12288)
    parser.add_argument("--new", type=int, default=1138)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a small model, to compare the host's part")
    parser.add_argument("--chunk", type=int, default=4096, help="the pool's chunk_tokens (default 4096)")
    parser.add_argument("--kv-cache-tokens", type=int, default=1 << 21, help="the worker's KV cache (default 2097152, as bench_prefix_cache)")
    args = parser.parse_args()

    import ray

    import cluster.pool
    import cluster.scheduler
    from cluster.pool import PrefillPool

    marks = []
    for owner, name, label in [(PrefillPool, "_admit", "admit"), (cluster.scheduler.ReplicaScheduler, "_run_batch", "batch"),
                               (cluster.scheduler, "gather", "gather"), (PrefillPool, "complete", "complete"),
                               (PrefillPool, "_free", "free"), (cluster.pool, "_settle", "settle")]:  # fmt: skip
        setattr(owner, name, _marked(getattr(owner, name), label, marks))

    config = one_gpu_config(args.checkpoint, args.device, kv_cache_tokens=args.kv_cache_tokens, chunk_tokens=args.chunk, max_batch_tokens=args.chunk)
    vocab, rng, runs = config.model_config().vocab_size, np.random.default_rng(0), []
    with PrefillPool(config).start() as pool:
        pool.prefill(rng.integers(0, vocab, size=args.chunk))  # warm-up
        for kind in ("turn", "cold"):
            for _ in range(args.repeats):
                history = rng.integers(0, vocab, size=args.history)
                if kind == "turn":
                    pool.prefill(history)  # the previous turn: caches the history
                    prompt = np.concatenate([history, rng.integers(0, vocab, size=args.new)])
                else:
                    prompt = rng.integers(0, vocab, size=args.history + args.new)
                marks.clear()
                started = time.time()
                result = pool.prefill(prompt)
                runs.append((kind, started, time.time(), result, list(marks)))
        time.sleep(2)  # the timeline's last events
        timeline = ray.timeline()
    for kind, started, ended, result, steps in runs:
        events = sorted(
            ((e["name"], round((float(e["ts"]) - started * 1e6) / 1e3, 2), round(float(e.get("dur", 0)) / 1e3, 2))
             for e in timeline if e.get("ph") == "X" and started * 1e6 <= float(e["ts"]) <= ended * 1e6),
            key=lambda event: event[1],
        )  # fmt: skip
        pool_steps = " ".join(f"{name}:{(at - started) * 1e3:.2f}" for name, at in steps)
        print(kind, f"ttft {result.ttft_s * 1e3:.2f} ms queue {result.queue_s * 1e3:.2f} ms", pool_steps, events, flush=True)
    ray.shutdown()


def _marked(function, label: str, marks: list):
    """``function``, appending ``(label + ">", time)`` and ``(label + "<", time)`` around each call."""

    def marked(*args, **kwargs):
        marks.append((label + ">", time.time()))
        try:
            return function(*args, **kwargs)
        finally:
            marks.append((label + "<", time.time()))

    return marked


if __name__ == "__main__":
    main()
