"""One replica's scheduler thread: it builds batches from the pool's queue, runs them on the
replica's workers, and recovers the replica when a batch fails.

A batch is the next chunk (at most ``chunk_tokens``) of every request the replica is
prefilling, plus requests admitted from the shared queue (``cluster.queueing``) while the
batch has room and their KV fits in the replica's free blocks. When the replica's previous batch
ran several requests, a batch with room waits ``batch_wait_ms`` for company: the requests just
answered tend to come back together (a chat's next turn, an agent's next call) and a fuller batch
runs the same weights over more tokens. A replica serving one request at a time runs each at once
(the wait would be all of a cached turn's queueing: 2.4 ms of its TTFT on H200). Every worker runs
the batch (SPMD); a request completes with its last chunk. Before each batch, requests whose future
was cancelled are taken out and their KV blocks freed.

Faults. A batch fails when a worker raises, dies, or the batch outlives ``batch_timeout_s``
(a rank stuck in a collective raises after ``collective_timeout_s``). The other workers of the
replica may then be blocked in a collective with the failed one, so the replica is never
reused: its actors are killed at once (which ends every collective and KV link they are in)
and a new replica is started in its place, in the same placement group, from the replica's
spare workers when they are ready (``cluster.replica.Spares``). Its requests go back to the queue first, so the other
replicas take them meanwhile: the failed batch's requests are retried once, each in a batch of
its own (a request that breaks a batch fails alone, with the reason, on its second failure);
the replica's other requests start over. KV kept on the failed replica is lost and reported as
such by ``PrefillPool.kv_source``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray

from cluster.queueing import Request
from cluster.replica import BatchTimeout, Replica, cause, gather, stop_replica
from cluster.routing import routed_elsewhere
from workers.batch_io import ChunkPiece

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # an idle scheduler re-checks the pool (stopping, cancelled requests) this often


@dataclass
class Recovery:
    """One replica fault: what failed, and how long until the replica served again (seconds from
    the fault's detection to the replacement's start, and to its first finished batch)."""

    replica: int
    cause: str
    detected: float  # time.time()
    restart_s: float | None = None
    serving_s: float | None = None
    start_s: dict | None = None  # the replacement's start, by phase (``Replica.start_s``)
    retried: int = 0
    failed: int = 0

    def as_dict(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class ReplicaScheduler:
    def __init__(self, pool, replica: Replica) -> None:
        self.pool, self.replica = pool, replica
        self.active: list[Request] = []
        self._recovering: Recovery | None = None
        self._last_batch_requests = 0

    def run(self) -> None:
        replica, pool = self.replica, self.pool
        while replica.alive:
            batch = self._next_batch()
            if batch is None:
                for request in self.active:
                    pool.settle_failed(request, RuntimeError("the prefill pool was shut down"))
                self.active.clear()
                return
            if batch:
                self._run_batch(batch)

    # ---- building a batch --------------------------------------------------------------------
    def _next_batch(self) -> list[tuple[Request, int]] | None:
        """``(request, tokens)`` pieces of the next batch; None when the pool stops."""
        pool, cfg = self.pool, self.pool.config
        for request in [r for r in self.active if r.cancelled]:
            self.active.remove(request)
            pool.drop_cancelled(request, self.replica)
        budget, batch = cfg.max_batch_tokens, []
        for request in self.active:
            count = min(cfg.chunk_tokens, request.remaining, budget)
            if count == 0:
                break
            batch.append((request, count))
            budget -= count
        if pool.stopping:
            return batch or None  # running requests are drained first; queued ones fail
        solo = any(r.alone for r in self.active)
        # an idle replica waits up to IDLE_WAIT_S for a request; a batch, from its first piece on,
        # waits for company (not the rest of the idle wait) after a batch of several requests
        company_s = cfg.batch_wait_ms / 1000 if self._last_batch_requests > 1 else 0.0
        deadline = time.monotonic() + (company_s if batch else IDLE_WAIT_S)
        while budget > 0 and not solo:
            idle = not batch
            admitted, cancelled = pool.queue.take(
                self._reserve, budget, cfg.chunk_tokens, alone_ok=idle, timeout_s=max(0.0, deadline - time.monotonic())
            )
            for request in cancelled:
                pool.drop_cancelled(request, None)
            for request, count in admitted:
                self.active.append(request)
                batch.append((request, count))
                budget -= count
                solo = request.alone
            if idle and admitted:
                deadline = time.monotonic() + company_s
            if not admitted and (time.monotonic() >= deadline or pool.stopping):
                break
        return batch

    def _reserve(self, request: Request) -> bool:
        """Admit a request here if its blocks fit (its cached prefix shared) and the pool's routing
        does not keep it for a replica holding more of its prefix (``cluster.routing``)."""
        pool, replica = self.pool, self.replica
        with pool.lock:
            if replica.prefix is None or routed_elsewhere(request, replica, pool.replicas, pool.config.chunk_tokens):
                return False
            evictions = replica.prefix.evictions
            cached = replica.prefix.admit(request.id, len(request.tokens), request.names)
            if cached is None:
                return False
            request.cached_tokens = request.done = cached
            request.block_table = tuple(tuple(t) for t in replica.prefix.tables[request.id])
            replica.pending_tokens += request.remaining
            evicted = replica.prefix.evictions - evictions
        if evicted and pool.metrics is not None:
            pool.metrics.evicted(evicted)
        return True

    # ---- running it ---------------------------------------------------------------------------
    def _run_batch(self, batch: list[tuple[Request, int]]) -> None:
        pool, replica = self.pool, self.replica
        pieces = [
            ChunkPiece(r.id, r.tokens[r.done : r.done + count], r.done, len(r.tokens), r.block_table if r.done == r.cached_tokens else None, r.return_logits)
            for r, count in batch
        ]  # fmt: skip
        pool.ledger.count_batch(len(pieces))
        self._last_batch_requests = len(pieces)
        now = time.perf_counter()
        for request, _ in batch:
            if request.started is None:
                request.started = now
                if pool.metrics is not None:
                    pool.metrics.started_batch(now - request.submitted, request.blocked_s)
        try:
            outputs = gather([w.prefill.remote(pieces) for w in replica.workers], timeout_s=pool.config.batch_timeout_s)
        except (ray.exceptions.RayError, BatchTimeout) as exc:
            self._recover([r for r, _ in batch], exc)
            return
        ran_s = time.perf_counter() - now
        if pool.metrics is not None:
            pool.metrics.ran_batch(ran_s)
        if self._recovering is not None:
            self._recovering.serving_s = time.time() - self._recovering.detected
            logger.warning("replica %d serves again %.1f s after its fault", replica.index, self._recovering.serving_s)
            self._recovering = None
        report = outputs[0]
        finished = {result.request_id: result for result in report.results}
        pool.ledger.count_time(ran_s, report.worker_s)
        if report.pcp_strategy is not None:
            pool.ledger.count_pcp(report.pcp_strategy, report.pcp_bytes)
        block_size = pool.config.block_size
        with pool.lock:
            replica.pending_tokens -= sum(count for _, count in batch)
            for request, count in batch:  # the full blocks this chunk completed can serve later prompts
                first = request.done // block_size
                request.done += count
                if replica.prefix is not None:
                    replica.prefix.written(request.id, request.names[first : request.done // block_size], first)
        done = []
        for request, count in batch:
            if request.on_progress is not None:
                try:
                    request.on_progress(request.done, len(request.tokens))
                except Exception:  # noqa: BLE001 -- a caller's callback must not stop the scheduler
                    logger.exception("on_progress of request %r raised; continuing", request.id)
            if request.remaining == 0:
                self.active.remove(request)
                done.append((request, finished[request.id]))
        pool.complete(replica, report, done)

    def _recover(self, batch: list[Request], exc: BaseException) -> None:
        """Replace the replica after a failed batch: requeue or fail its requests, kill its actors,
        start new ones (see the module docstring)."""
        pool, replica = self.pool, self.replica
        reason = cause(exc)
        recovery = Recovery(replica.index, reason, time.time())
        logger.error("replica %d: batch of %d request(s) failed (%s); replacing the replica", replica.index, len(batch), reason)
        with pool.lock:
            replica.generation += 1  # its kept KV is gone from here on
            replica.prefix = None  # nothing is admitted until the new workers are up; their cache starts empty
            replica.pending_tokens = 0
        stop_replica(replica, keep_group=True)  # kill first: a rank blocked in a collective would never return
        retry = []
        for request in self.active:
            request.done = request.cached_tokens = 0
            request.block_table = None
            if request in batch:
                request.attempts += 1
                if request.attempts > 1:
                    recovery.failed += 1
                    pool.settle_failed(request, RuntimeError(
                        f"prefill of {request.id!r} failed twice with its replica; last: {reason}"
                    ))  # fmt: skip
                    continue
                request.alone = True
                recovery.retried += 1
            retry.append(request)
        self.active.clear()
        for request in reversed(retry):  # back at the front, in their order, for any replica
            pool.requeue(request)
        pool.ledger.record_recovery(recovery)
        try:
            fresh = pool.start_replica(replica.index, replacing=replica)
        except Exception as start_exc:  # noqa: BLE001 -- the other replicas go on serving
            logger.error("replica %d could not be restarted: %s", replica.index, cause(start_exc))
            replica.alive = False
            replica.spares = None  # used up or killed by the failed start
            pool.replica_lost(replica, cause(start_exc))
            return
        with pool.lock:
            replica.workers, replica.group, replica.infos = fresh.workers, fresh.group, fresh.infos
            replica.prefix, replica.spares = fresh.prefix, fresh.spares
        recovery.restart_s, recovery.start_s = time.time() - recovery.detected, fresh.start_s
        self._recovering = recovery
        pool.queue.notify()
