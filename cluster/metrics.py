"""Prometheus metrics of a prefill pool, through Ray (``ray.util.metrics``).

Ray exports them on every node's metrics port with the ``ray_`` prefix, next to Ray's own, so
the Prometheus and Grafana set-up of a Ray cluster picks them up as they are:

    ray_mlapool_ttft_seconds            histogram  time from submit to the last chunk's logits
    ray_mlapool_queue_seconds           histogram  time from submit to the request's first batch
    ray_mlapool_kv_wait_seconds         histogram  of that, the wait of a request that no replica took when
                                                   first considered (its KV did not fit in the free blocks, or
                                                   it was kept for the replica holding more of its prefix)
    ray_mlapool_batch_seconds           histogram  one batch on a replica's workers, as its scheduler saw it
    ray_mlapool_prefill_tokens_total    counter    prompt tokens prefilled (rate() = tokens/s)
    ray_mlapool_prefill_tokens_per_second  gauge   prompt tokens/s over the last ``window_s``
    ray_mlapool_requests_total          counter    requests by ``status`` (ok, failed, rejected)
    ray_mlapool_queue_depth             gauge      requests submitted and not finished
    ray_mlapool_kv_bytes_shipped_total  counter    KV bytes handed off (``transport``: mapped, nixl, tcp to a decode server; file from a batch job)
    ray_mlapool_prefix_cache_query_tokens_total  counter  prompt tokens of finished requests
    ray_mlapool_prefix_cache_hit_tokens_total    counter  of them, taken from the prefix cache
                                                         (hit rate = rate(hit) / rate(query))
    ray_mlapool_prefix_cache_evictions_total     counter  cached blocks evicted for room
    ray_mlapool_backend_info            gauge      1, tagged with the backend, device and dtype in use
    ray_mlapool_decode_server_events_total  counter  a decode server ``ejected`` (it failed), ``readmitted``
                                                     (it answers /health again), an answer ``resumed`` on
                                                     it after another broke it off, or one whose first token
                                                     it did not make the tier's (``diverged``: it runs without
                                                     ``kv.vllm_first_token``'s processor); tagged ``server``
    ray_mlapool_decode_resume_stall_seconds  histogram  a streamed answer broken off by its decode server:
                                                     from the break seen to the next server's first token

Every series carries the ``pool`` tag (the pool's name: a Serve deployment, a job, ...).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from ray.util import metrics

# TTFT buckets (s): from a short prompt of a small model to a 512K-token prompt
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# a resumption's stall (s): a re-prefill of a short answer on a GPU to a long one's on a loaded CPU
STALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# a batch (s): a short prompt's replayed CUDA graph to a 32K chunk of a big model on a CPU
BATCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class PoolMetrics:
    def __init__(self, pool: str, window_s: float = 10.0) -> None:
        self.tags = {"pool": pool}
        keys = ("pool",)
        self.ttft = metrics.Histogram("mlapool_ttft_seconds", "Time to first token of a prefill request (s)", TTFT_BUCKETS, keys)
        self.queue = metrics.Histogram("mlapool_queue_seconds", "Time from submit to a request's first batch (s)", TTFT_BUCKETS, keys)
        self.kv_wait = metrics.Histogram("mlapool_kv_wait_seconds", "A request's wait for room in a replica's KV cache (s)", TTFT_BUCKETS, keys)
        self.batch = metrics.Histogram("mlapool_batch_seconds", "One batch on a replica's workers (s)", BATCH_BUCKETS, keys)
        self.tokens = metrics.Counter("mlapool_prefill_tokens", "Prompt tokens prefilled", keys)
        self.tokens_per_s = metrics.Gauge("mlapool_prefill_tokens_per_second", f"Prompt tokens/s over the last {window_s:g} s", keys)
        self.requests = metrics.Counter("mlapool_requests", "Prefill requests by outcome", (*keys, "status"))
        self.queue_depth = metrics.Gauge("mlapool_queue_depth", "Prefill requests submitted and not finished", keys)
        self.kv_bytes = metrics.Counter("mlapool_kv_bytes_shipped", "Latent KV bytes handed off", (*keys, "transport"))
        self.prefix_queries = metrics.Counter("mlapool_prefix_cache_query_tokens", "Prompt tokens of finished requests", keys)
        self.prefix_hits = metrics.Counter("mlapool_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache", keys)
        self.evictions = metrics.Counter("mlapool_prefix_cache_evictions", "Cached KV blocks evicted for room", keys)
        self.backend = metrics.Gauge("mlapool_backend_info", "The MLA prefill backend in use (value 1)", (*keys, "backend", "device", "dtype"))
        self.decode_events = metrics.Counter("mlapool_decode_server_events", "Decode servers ejected, readmitted, answers resumed on them",
                                             (*keys, "event", "server"))  # fmt: skip
        self.resume_stall = metrics.Histogram("mlapool_decode_resume_stall_seconds", "A streamed answer's break to its next server's first token (s)",
                                              STALL_BUCKETS, keys)  # fmt: skip
        self.window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._depth = 0
        self._backend_tags: dict[str, str] | None = None
        self._closed = threading.Event()

    def started(self, backend: str, device: str, dtype: str) -> None:
        """Record the backend in use and start re-reporting the gauges every ``window_s / 5`` s, so they
        stay exported while the pool is idle (Ray's metrics agent evicts gauge series that are not
        refreshed) and the tokens/s gauge falls to 0 when no work arrives."""
        self._backend_tags = {**self.tags, "backend": backend, "device": device, "dtype": dtype}
        threading.Thread(target=self._report, name="mlapool-metrics", daemon=True).start()
        self._set_gauges()

    def close(self) -> None:
        self._closed.set()

    def queued(self, depth: int) -> None:
        self._depth = depth
        self.queue_depth.set(depth, tags=self.tags)

    def completed(self, tokens: int, ttft_s: float) -> None:
        self.ttft.observe(ttft_s, tags=self.tags)
        self.tokens.inc(tokens, tags=self.tags)
        self.requests.inc(1, tags={**self.tags, "status": "ok"})
        with self._lock:
            self._recent.append((time.monotonic(), tokens))
        self._set_gauges()

    def started_batch(self, queue_s: float, kv_wait_s: float) -> None:
        """A request's first batch: its time in the queue and, where it did not fit at first, its part of
        that spent waiting for KV room."""
        self.queue.observe(queue_s, tags=self.tags)
        if kv_wait_s > 0:
            self.kv_wait.observe(kv_wait_s, tags=self.tags)

    def ran_batch(self, seconds: float) -> None:
        self.batch.observe(seconds, tags=self.tags)

    def _set_gauges(self) -> None:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            recent = sum(t for _, t in self._recent)
        self.tokens_per_s.set(recent / self.window_s, tags=self.tags)
        self.queue_depth.set(self._depth, tags=self.tags)
        if self._backend_tags is not None:
            self.backend.set(1, tags=self._backend_tags)

    def _report(self) -> None:
        while not self._closed.wait(self.window_s / 5):
            self._set_gauges()

    def failed(self, status: str = "failed") -> None:
        self.requests.inc(1, tags={**self.tags, "status": status})

    def prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix_queries.inc(prompt_tokens, tags=self.tags)
        if cached_tokens:
            self.prefix_hits.inc(cached_tokens, tags=self.tags)

    def evicted(self, blocks: int) -> None:
        self.evictions.inc(blocks, tags=self.tags)

    def decode_event(self, event: str, server: str) -> None:
        self.decode_events.inc(1, tags={**self.tags, "event": event, "server": server})

    def resume_stalled(self, seconds: float) -> None:
        self.resume_stall.observe(seconds, tags=self.tags)

    def shipped(self, nbytes: int, transport: str) -> None:
        self.kv_bytes.inc(nbytes, tags={**self.tags, "transport": transport})
