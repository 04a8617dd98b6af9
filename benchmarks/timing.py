"""How the benchmarks time a call."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch


def sync() -> None:
    """Wait for the GPU, where one is in use."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def seconds_per_call(fn, repeats: int = 10, *, synced: bool = False) -> float:
    """Median seconds of one ``fn()`` after a warm-up call: on a GPU its GPU time from CUDA events around
    each of ``repeats`` calls queued back to back (the host launching ahead, as in a forward pass);
    ``synced`` (and on CPU): wall time with the device synchronized around each call (the host's
    launch latency included)."""
    fn()
    if synced or not torch.cuda.is_initialized():
        times = []
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    sync()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def spread_ms(seconds: list[float]) -> dict:
    """p50, p10 and p90 of some timings in milliseconds, and how many there were."""
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)

    return {"p50_ms": round(statistics.median(ordered) * 1e3, 3), "p10_ms": at(0.1), "p90_ms": at(0.9), "n": len(ordered)}


def percentiles(values: list[float]) -> dict:
    """p50 and p99 of some timings (or rates), and how many there were ({} for none)."""
    if not values:
        return {}
    return {"p50": round(float(np.percentile(values, 50)), 4), "p99": round(float(np.percentile(values, 99)), 4), "n": len(values)}
