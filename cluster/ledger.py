"""The pool's books on its requests (``cluster.pool``): which ids are taken, which results still hold
KV on the workers, how many requests are unfinished, and the outcome counters (``PoolStats``).

An id is taken from its submission until its request ends, and on while its result holds KV
(``keep_kv``) until that is released: a second request with the same id is refused at submit
(``DuplicateRequest``). Every submitted request is counted exactly once as completed, failed or
cancelled, whichever thread settles it (a replica's scheduler, the caller cancelling, the pool
shutting down). The books have their own lock, taken only inside these methods and never while
the pool's lock over its replicas (``PrefillPool.lock``) is held by the same caller, so the two
never nest.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from cluster.queueing import Request
from cluster.results import DuplicateRequest, PoolStats, PrefillResult
from cluster.scheduler import Recovery


class RequestLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._live: dict[str, Request | None] = {}  # ids in flight (their request) or holding KV (None)
        self._kept: dict[str, PrefillResult] = {}  # results whose KV stays on the workers
        self._in_flight = 0
        self.stats = PoolStats()

    # ---- a request's id, from submission on -------------------------------------------------
    def open(self, request_id: str | None, make: Callable[[str], Request]) -> Request:
        """Take ``request_id`` (None: a fresh ``req-N``) for the request ``make(id)`` builds, and count
        it in flight. ``TypeError`` for an id that is not a non-empty string, ``DuplicateRequest`` for
        one already taken."""
        with self._lock:
            request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
            if not isinstance(request_id, str) or not request_id:
                raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
            if request_id in self._live:
                raise DuplicateRequest(f"request id {request_id!r} is already in flight or holds KV; ids must be unique")
            request = make(request_id)
            self._live[request_id] = request
            self._in_flight += 1
        return request

    def withdraw(self, requests: list[Request]) -> None:
        """Give back the ids of requests opened but never queued (a refused ``submit_many``): they
        are not counted in any outcome."""
        with self._lock:
            for request in requests:
                del self._live[request.id]
            self._in_flight -= len(requests)

    def finished(self) -> int:
        """One request's future is done (however it ended); the requests still unfinished."""
        with self._lock:
            self._in_flight -= 1
            return self._in_flight

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (queued, waiting for KV, or prefilling)."""
        with self._lock:
            return self._in_flight

    def request(self, request_id: str) -> Request | None:
        """The request of an id in flight, None otherwise (unknown, ended, or holding KV only)."""
        with self._lock:
            return self._live.get(request_id)

    # ---- how a request ends -----------------------------------------------------------------
    def failed(self, request: Request) -> None:
        """A request failed (counted cancelled if its caller had cancelled it)."""
        with self._lock:
            self._live.pop(request.id, None)
            if request.cancelled:
                self.stats.cancelled += 1
            else:
                self.stats.failed += 1

    def dropped(self, request: Request) -> None:
        """A cancelled request taken out, before it finished or as it finished with its KV freed."""
        with self._lock:
            self._live.pop(request.id, None)
            self.stats.cancelled += 1

    def completed(self, result: PrefillResult) -> None:
        """A request's prefill finished with ``result``: counted completed, its id kept taken while
        ``result.kv_kept``."""
        with self._lock:
            self.stats.completed += 1
            if result.kv_kept:
                self._live[result.request_id] = None
                self._kept[result.request_id] = result
            else:
                self._live.pop(result.request_id, None)

    def cancelled_after_completion(self) -> None:
        """A request counted completed whose caller cancelled it before its future was settled."""
        with self._lock:
            self.stats.completed -= 1
            self.stats.cancelled += 1

    def release(self, result: PrefillResult) -> bool:
        """Forget a result's kept KV; whether this call is the one that released it (of any number of
        callers racing, one is)."""
        with self._lock:
            held, result.kv_kept = result.kv_kept, False
            if self._live.get(result.request_id, 0) is None:
                del self._live[result.request_id]
            self._kept.pop(result.request_id, None)
        return held

    # ---- kept KV ------------------------------------------------------------------------------
    def kept_results(self) -> list[PrefillResult]:
        with self._lock:
            return list(self._kept.values())

    def kept_result(self, request_id: str) -> PrefillResult | None:
        with self._lock:
            return self._kept.get(request_id)

    # ---- counters -----------------------------------------------------------------------------
    def counts(self) -> dict:
        """The request and fault counters, as plain values."""
        with self._lock:
            stats = self.stats
            return {
                "completed": stats.completed, "failed": stats.failed, "cancelled": stats.cancelled,
                "retried": stats.retried, "replica_faults": len(stats.recoveries),
            }  # fmt: skip

    def count_batch(self, pieces: int) -> None:
        with self._lock:
            self.stats.batches += 1
            self.stats.pieces += pieces

    def count_time(self, batch_s: float, worker_s: float) -> None:
        with self._lock:
            self.stats.batch_s += batch_s
            self.stats.worker_s += worker_s

    def count_pcp(self, strategy: str, received_bytes: int) -> None:
        with self._lock:
            self.stats.pcp_strategies[strategy] = self.stats.pcp_strategies.get(strategy, 0) + 1
            self.stats.pcp_bytes += received_bytes

    def record_recovery(self, recovery: Recovery) -> None:
        with self._lock:
            self.stats.recoveries.append(recovery)
            self.stats.retried += recovery.retried
