"""The prefill pool: TP x PCP replicas of Ray actors, a chunking scheduler and the request API.

    with PrefillPool(PoolConfig(model="tiny", tp=2)).start() as pool:
        result = pool.prefill(token_ids)                  # blocking
        futures = pool.submit_many(prompts)               # queued together: they share batches

Each replica is one placement group of ``tp * pcp`` bundles (``placement``,
by default ``STRICT_PACK``: one node), one actor per bundle, joined in one
process group and split into TP and PCP groups (``workers.pcp``); starting,
calling and stopping one is ``cluster.replica``. Requests wait in one queue for
the whole pool (``cluster.queueing``); a scheduler thread per replica
(``cluster.scheduler``) admits the ones whose KV fits in its free blocks and
runs them chunk by chunk in batches.

Requests are validated at submit (``cluster.queueing.validate_tokens``), before
they join a batch, so a bad request fails alone. The driver owns each replica's KV blocks
(``cluster.prefix_cache``: every PCP rank's, shared by prompts with a common prefix, cached prefixes
evicted LRU for room): a prompt that could never fit is refused at submit, one that does not fit yet
waits for releases (logged once past ``cluster.queueing.KV_WAIT_WARN_S``), and a request goes to
the replica holding most of its prefix (``cluster.routing``). A request's future can
be cancelled (``future.cancel()`` or :meth:`PrefillPool.cancel`): it is taken out
before its next chunk and its KV blocks are freed. A batch that fails (a worker
raised, died or got stuck) replaces its replica; its requests are retried once
(``cluster.scheduler``). ``stats`` counts every outcome, ``stats.recoveries``
times each replacement; the ids, kept results and counters are the books of ``cluster.ledger``.
The result, counter and error types are ``cluster.results``'.
This module, ``cluster.replica`` and ``cluster.handoff`` are the only places that call ``ray.get``/``ray.wait``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError

import numpy as np
import ray
import torch

from cluster.handoff import KVSource, pull_kv
from cluster.ledger import RequestLedger
from cluster.metrics import PoolMetrics
from cluster.prefix_cache import block_hashes, pool_identity
from cluster.queueing import Request, RequestQueue, check_flag, validate_tokens
from cluster.replica import Replica, cause, connect_ray, start_replica, stop_replica
from cluster.results import PoolStats, PrefillResult, PromptTooLong, expert_load_report, owned_row, weights_report
from cluster.scheduler import ReplicaScheduler
from configs.pool import PoolConfig
from kv.frames import prompt_digest
from workers.kv_cache import blocks_for
from workers.pcp_layout import shard_rows
from workers.weights import check_checkpoint_of
from workers.batch_io import BatchOutput, PieceResult
from workers.worker import WorkerInfo

logger = logging.getLogger(__name__)


class PrefillPool:
    def __init__(
        self,
        config: PoolConfig,
        *,
        ray_address: str | None = None,
        start_timeout_s: float = 600.0,
        placement_group=None,
        bundle_offset: int = 0,
        metrics: PoolMetrics | None = None,
    ) -> None:
        """``placement_group``: run the (single) replica's workers in this existing group, worker ``r``
        in bundle ``bundle_offset + r``, instead of creating one (a Ray Serve replica passes its own;
        it is not removed at shutdown). ``metrics``: record requests, TTFT, tokens and queue depth."""
        if placement_group is not None:
            if config.replicas != 1:
                raise ValueError(f"a pool in a given placement group runs one replica, got replicas={config.replicas}")
            bundles = len(placement_group.bundle_specs)
            if bundle_offset < 0 or bundles < bundle_offset + config.workers_per_replica:
                raise ValueError(
                    f"the placement group has {bundles} bundles; TP x PCP = {config.workers_per_replica} workers "
                    f"from bundle {bundle_offset} need {bundle_offset + config.workers_per_replica}"
                )
        self._placement_group, self._bundle_offset = placement_group, bundle_offset
        self.metrics = metrics
        self.config = config
        self.model_config = config.model_config()  # validates the model against TP before any actor starts
        if config.checkpoint:
            check_checkpoint_of(self.model_config, config.checkpoint)  # every tensor, before any actor starts
        self._ray_address = ray_address
        self._start_timeout_s = start_timeout_s
        self.queue = RequestQueue()
        self._replicas: list[Replica] = []
        self.ledger = RequestLedger()
        self.lock = threading.Lock()  # over the replicas' state: blocks, prefix caches, generations
        self._owns_ray = False
        self._use_gpus = False
        self.stopping = False
        self._identity = b""  # the root of the prefix cache's block hashes, once the workers say their dtype

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> PrefillPool:
        cfg = self.config
        self._owns_ray = connect_ray(self._ray_address, cfg.replicas * cfg.workers_per_replica * cfg.worker_cpus)
        use_gpus = cfg.use_gpus
        if self._placement_group is not None:
            use_gpus = self._placement_group.bundle_specs[self._bundle_offset].get("GPU", 0) > 0
        elif use_gpus is None:
            use_gpus = ray.cluster_resources().get("GPU", 0) >= cfg.workers_per_replica
        self._use_gpus = use_gpus
        try:
            for index in range(cfg.replicas):
                self._replicas.append(self.start_replica(index))
        except BaseException:
            self.shutdown()
            raise
        for replica in self._replicas:
            scheduler = ReplicaScheduler(self, replica)
            replica.thread = threading.Thread(target=scheduler.run, name=f"mlapool-replica-{replica.index}", daemon=True)
            replica.thread.start()
        info = self._replicas[0].infos[0]
        self._identity = pool_identity(self.model_config.fingerprint(), info.dtype, info.weights, cfg.block_size)
        if self.metrics is not None:
            self.metrics.started(info.backend, info.device, info.dtype)
        logger.info(
            "prefill pool ready: %d replica(s) x TP=%d PCP=%d, %s on %s (%s), warm-up %.1f s%s",
            cfg.replicas, cfg.tp, cfg.pcp, info.backend, info.device, info.dtype, info.warmup_s,
            f", PCP all-gather {info.pcp_link_gbps} GB/s per worker" if info.pcp_link_gbps else "",
        )  # fmt: skip
        return self

    def shutdown(self) -> None:
        """Stop the schedulers (running requests finish), fail queued requests, and release actors
        and placement groups."""
        self.stopping = True
        for request in self.queue.close():
            self.settle_failed(request, RuntimeError("the prefill pool was shut down"))
        for replica in self._replicas:
            if replica.thread is not None:
                replica.thread.join(timeout=60)
        for replica in self._replicas:
            stop_replica(replica)
        self._replicas.clear()
        if self.metrics is not None:
            self.metrics.close()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> PrefillPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests ----------------------------------------------------------
    def submit(
        self,
        token_ids: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        request_id: str | None = None,
        keep_kv: bool = False,
        return_logits: bool = True,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Future:
        """Queue a prompt; the future resolves to a :class:`PrefillResult`.

        Raises ``TypeError``/``ValueError`` at once for a prompt the model cannot
        take. ``keep_kv`` keeps the latent KV on the workers for :meth:`fetch_kv`
        until :meth:`release`. ``return_logits`` False: the result carries the greedy
        first token only (``logits`` and ``last_hidden`` None), as vLLM returns a sampled
        token, and the vocabulary-sized row never leaves the GPU worker (V3's is 517 KB,
        through Ray's object store at about 1 ms a MB). ``on_progress(done, total)`` is
        called after each chunk.
        """
        self._check_running()
        check_flag("return_logits", return_logits)
        try:
            request = self._admit(token_ids, request_id, keep_kv, return_logits, on_progress)
        except (TypeError, ValueError):
            if self.metrics is not None:
                self.metrics.failed("rejected")
            raise
        return self._enqueue([request])[0]

    def submit_many(
        self,
        prompts: Sequence,
        *,
        keep_kv: bool = False,
        return_logits: bool = True,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[Future]:
        """Queue prompts together; a future per prompt, in order (each as :meth:`submit`'s).

        Every prompt is checked first: one the model cannot take raises ``TypeError``/``ValueError``
        naming its index, and none is queued. Then all enter the queue at once, so an idle replica's
        next batch takes as many of them as fit: submitted one by one, the first would start a batch
        alone while the rest were still being checked, and how they split would depend on timing.
        """
        self._check_running()
        check_flag("return_logits", return_logits)
        requests: list[Request] = []
        for index, token_ids in enumerate(prompts):
            try:
                requests.append(self._admit(token_ids, None, keep_kv, return_logits, on_progress))
            except (TypeError, ValueError) as exc:
                self.ledger.withdraw(requests)  # nothing of this call is queued: its ids are free again
                if self.metrics is not None:
                    self.metrics.failed("rejected")
                raise type(exc)(f"prompt {index} of {len(prompts)}: {exc}") from exc
        return self._enqueue(requests)

    def _check_running(self) -> None:
        if self.stopping or not self._replicas:
            raise RuntimeError("the prefill pool is not running: call start() first")
        if not self.alive:
            raise RuntimeError("the prefill pool has no live replica: every replica failed to restart")

    def _enqueue(self, requests: list[Request]) -> list[Future]:
        """Queue admitted requests together; their futures."""
        for request in requests:
            request.future.add_done_callback(self._finished)
        if self.metrics is not None:
            self.metrics.queued(self.ledger.in_flight)
        if not self.queue.put_many(requests):  # shut down meanwhile
            for request in requests:
                self.settle_failed(request, RuntimeError("the prefill pool was shut down"))
        return [request.future for request in requests]

    def cancel(self, request_id: str) -> bool:
        """Cancel a request that has not finished (the same as its ``future.cancel()``): it is taken
        out before its next chunk and its KV blocks are freed. False if there is no such request
        in flight (unknown, finished, or already cancelled)."""
        request = self.ledger.request(request_id)
        if request is None or request.future.done() or not request.future.cancel():
            return False
        self.queue.notify()
        return True

    def _admit(self, token_ids, request_id: str | None, keep_kv: bool, return_logits: bool, on_progress) -> Request:
        """Validate a prompt and reserve its id."""
        tokens = validate_tokens(token_ids, self.model_config)
        kv_blocks = self._kv_blocks(len(tokens))
        if len(tokens) > self.max_prompt_tokens:
            raise PromptTooLong(
                f"prompt of {len(tokens)} tokens does not fit in the KV cache: it needs {kv_blocks} blocks of "
                f"{self.config.block_size} tokens on a worker (PCP={self.config.pcp} stripes it), a worker holds "
                f"{max(r.kv_blocks for r in self._replicas)}, so the longest prompt is {self.max_prompt_tokens} tokens. "
                "Raise kv_cache_tokens or gpu_memory_utilization, or use a larger pcp"
            )
        names = block_hashes(tokens, self.config.block_size, self._identity) if self.config.prefix_caching else []
        return self.ledger.open(request_id, lambda id_: Request(id_, tokens, Future(), keep_kv, on_progress, names, return_logits=return_logits))

    def _finished(self, future: Future) -> None:
        depth = self.ledger.finished()
        if future.cancelled():
            self.queue.notify()  # its scheduler takes it out now, not at its next batch
        if self.metrics is None:
            return
        self.metrics.queued(depth)
        if future.cancelled():
            self.metrics.failed("cancelled")
            return
        error = future.exception()
        if error is None:
            result = future.result()
            self.metrics.completed(result.num_tokens, result.ttft_s)
        else:
            self.metrics.failed()

    @property
    def alive(self) -> bool:
        """Whether the pool is running with at least one live replica."""
        return not self.stopping and any(r.alive for r in self._replicas)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (queued, waiting for KV, or prefilling)."""
        return self.ledger.in_flight

    @property
    def stats(self) -> PoolStats:
        """The pool's counters since start (``cluster.results.PoolStats``, kept by ``ledger``)."""
        return self.ledger.stats

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt whose KV fits in an empty replica (it grows linearly with PCP)."""
        cfg = self.config
        return max(r.kv_blocks for r in self._replicas) * cfg.block_size * cfg.pcp

    def _kv_blocks(self, tokens: int) -> int:
        """Blocks a request takes on the worker holding the most of it (PCP rank 0 of each TP rank)."""
        cfg = self.config
        return blocks_for(shard_rows(tokens, 0, cfg.pcp, cfg.block_size), cfg.block_size)

    def prefill(self, token_ids, **kwargs) -> PrefillResult:
        """Prefill one prompt and wait for it."""
        return self.submit(token_ids, **kwargs).result()

    def prefill_many(self, prompts: Sequence, **kwargs) -> list[PrefillResult]:
        """Submit every prompt together (:meth:`submit_many`), then wait for all."""
        return [f.result() for f in self.submit_many(prompts, **kwargs)]

    def fetch_kv(self, result: PrefillResult) -> torch.Tensor:
        """The kept latent KV of a request, ``[layers, tokens, latent]`` on the CPU."""
        return pull_kv(self.kv_source(result))

    def kv_source(self, result: PrefillResult) -> KVSource:
        """The workers holding a kept request's KV shards, for a decode actor to pull (``cluster.handoff``)."""
        if not result.kv_kept:
            raise ValueError(f"request {result.request_id!r} was not run with keep_kv=True, or was released")
        replica = self._replica(result.replica)
        if self.kv_lost(result):
            raise RuntimeError(
                f"the KV of request {result.request_id!r} was lost: a worker of replica {replica.index} died "
                "and the replica was restarted"
            )
        tp = self.config.tp  # TP ranks hold the same latent: read TP rank 0 of every PCP rank
        ranks = [p * tp for p in range(self.config.pcp)]
        return KVSource(
            result.request_id, tuple(replica.workers[r] for r in ranks), self.config.block_size, result.num_tokens,
            replica.infos[0].dtype, tuple((replica.infos[r].host_id, replica.infos[r].device_uuid) for r in ranks),
            tuple(t for t in ("mapped", "nixl", "tcp") if all(t in replica.infos[r].kv_transports for r in ranks)),
        )

    def kv_lost(self, result: PrefillResult) -> bool:
        """Whether the replica that held a request's KV was replaced since it was prefilled (a worker
        died: its KV went with it)."""
        return self._replica(result.replica).generation != result.generation

    def release(self, result: PrefillResult) -> None:
        """Free a kept request's KV on its workers (a no-op if its replica restarted since)."""
        replica = self._replica(result.replica)
        released = self.ledger.release(result)  # one release wins, however many callers race (a KV server and the user, say)
        with self.lock:
            held = released and replica.generation == result.generation
            workers = replica.workers
        if held:
            try:
                ray.get([w.release.remote([result.request_id]) for w in workers])
            except ray.exceptions.RayActorError:
                return  # the replica failed meanwhile: its KV is gone with it
            with self.lock:
                if replica.generation == result.generation and replica.prefix is not None:
                    replica.prefix.release(result.request_id)
            self.queue.notify()

    def counts(self) -> dict:
        """The request and fault counters of ``stats``, as plain values."""
        return self.ledger.counts()

    def inject_fault(self, replica: int, rank: int, kind: str, layer: int = 0, after_batches: int = 0) -> None:
        """Chaos testing: make worker ``rank`` of ``replica`` fail inside a coming batch
        (``PrefillWorker.inject_fault``: ``raise``, ``exit`` or ``hang`` at ``layer``)."""
        workers = self._replica(replica).workers
        if not 0 <= rank < len(workers):
            raise ValueError(f"replica {replica} has ranks 0..{len(workers) - 1}, got {rank}")
        ray.get(workers[rank].inject_fault.remote(kind, layer, after_batches), timeout=60)

    def kept_results(self) -> list[PrefillResult]:
        """Every result whose KV is kept on the workers."""
        return self.ledger.kept_results()

    def kept_result(self, request_id: str) -> PrefillResult | None:
        """The result of a request whose KV is kept on the workers (None if none is)."""
        return self.ledger.kept_result(request_id)

    def prefilling(self, request_id: str) -> Future | None:
        """The future of a request still in flight (queued or prefilling), None otherwise (unknown,
        finished, failed or cancelled): a KV server waits on it for a ticket issued ahead."""
        request = self.ledger.request(request_id)
        return None if request is None else request.future

    def health(self) -> list[list[dict]]:
        """Per replica, per worker: readiness and KV held. A replica being replaced after a fault
        (its old workers gone) reports its workers not ready, with the reason."""
        report = []
        for replica in self._replicas:
            try:
                report.append(ray.get([w.health.remote() for w in replica.workers], timeout=60))
            except ray.exceptions.RayActorError as exc:
                down = {"ready": False, "kv_requests": 0, "kv_free_blocks": 0, "down": cause(exc)}
                report.append([{"rank": rank, **down} for rank in range(len(replica.workers))])
        return report

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """The pool's replicas in index order: one being replaced keeps its place with ``prefix`` None,
        one that could not be restarted with ``alive`` False."""
        return tuple(self._replicas)

    @property
    def worker_infos(self) -> list[list[WorkerInfo]]:
        return [r.infos for r in self._replicas]

    def expert_load(self) -> dict[str, dict] | None:
        """Per MoE layer, the (token, expert) pairs each worker (EP rank) of each replica computed since
        start, and each replica's imbalance: its busiest rank over its mean (1.0 is even). None for a
        model without MoE layers."""
        return expert_load_report([ray.get([w.moe_load.remote() for w in r.workers], timeout=60) for r in self._replicas])

    def weights_report(self) -> dict:
        """How each worker holds its weights: the format (``fp8`` or a dtype), what runs its FP8 GEMMs, bytes, the bytes it read
        from the checkpoint, load seconds and peak host memory before and after loading, per replica and rank."""
        return weights_report(self.worker_infos)

    # ---- what the replicas' schedulers report (cluster.scheduler) ------------------------------
    def start_replica(self, index: int, replacing: Replica | None = None) -> Replica:
        """Start replica ``index`` (at start, and in place of a failed one: ``replacing``, whose
        actors are killed, whose placement group and spares the new one takes)."""
        group = replacing.group if replacing is not None and replacing.group is not None else self._placement_group
        return start_replica(
            self.config, index, self._use_gpus, placement_group_=group, owns_group=group is not self._placement_group,
            bundle_offset=self._bundle_offset, timeout_s=self._start_timeout_s, replacing=replacing,
        )

    def requeue(self, request: Request) -> None:
        if not self.queue.put(request, front=True):
            self.settle_failed(request, RuntimeError("the prefill pool was shut down"))

    def prefix_report(self) -> list[dict | None]:
        """Per replica, its KV blocks (in use, cached, free per PCP rank), evictions and prefix-cache
        hit rate since it started (None while it is being replaced)."""
        with self.lock:
            return [r.prefix.report() if r.prefix is not None else None for r in self._replicas]

    def replica_lost(self, replica: Replica, reason: str) -> None:
        """A replica that could not be restarted: if it was the last, fail what is queued."""
        if not self.alive:
            for request in self.queue.close():
                self.settle_failed(request, RuntimeError(f"every replica of the pool is gone; the last: {reason}"))

    def settle_failed(self, request: Request, error: BaseException) -> None:
        """Fail a request (its KV, if any, is already freed or gone)."""
        self.ledger.failed(request)
        _settle(request.future, error=error)

    def drop_cancelled(self, request: Request, replica: Replica | None) -> None:
        """Take out a cancelled request: free its KV blocks on ``replica`` (None: it never ran)."""
        if replica is not None:
            with self.lock:
                replica.pending_tokens -= request.remaining
            self._free(replica, [request])
        self.ledger.dropped(request)

    def complete(self, replica: Replica, report: BatchOutput, done: list[tuple[Request, PieceResult]]) -> None:
        """Finish a batch's finished requests (each with its result in ``report``, the batch's
        ``workers.batch_io.BatchOutput``): free the KV of those not kept (one call per worker for all
        of them), then settle each one's future."""
        freed = [request for request, _ in done if request.cancelled or not request.keep_kv]
        self._free(replica, freed)
        for request, piece in done:
            self._complete_one(replica, request, report, piece, freed=request in freed)

    def _complete_one(self, replica: Replica, request: Request, report: BatchOutput, piece: PieceResult, *, freed: bool) -> None:
        cancelled = request.cancelled and freed  # one cancelled after the free above keeps its KV until released below
        if self.metrics is not None:
            self.metrics.prefix_cache(len(request.tokens), request.cached_tokens)
        result = PrefillResult(
            request_id=request.id,
            num_tokens=len(request.tokens),
            first_token=piece.first_token,
            logits=owned_row(report.logits(piece)),
            last_hidden=owned_row(report.last_hidden(piece)),
            replica=replica.index,
            ttft_s=time.perf_counter() - request.submitted,
            queue_s=(request.started or request.submitted) - request.submitted,
            kv_kept=request.keep_kv and not freed,
            prompt_digest=prompt_digest(request.tokens) if request.keep_kv else "",  # what a decode server checks
            generation=replica.generation,
            cached_tokens=request.cached_tokens,
        )
        if cancelled:
            self.ledger.dropped(request)
        else:
            self.ledger.completed(result)
        if not _settle(request.future, result=result) and not cancelled:  # cancelled since the check above
            self.ledger.cancelled_after_completion()
            self.release(result)

    def _free(self, replica: Replica, requests: list[Request]) -> None:
        """Free requests' KV on the replica's workers, one call per worker for all (actor calls run in
        order: before any later batch)."""
        if not requests:
            return
        for worker in replica.workers:
            worker.release.remote([request.id for request in requests])
        with self.lock:
            if replica.prefix is not None:
                for request in requests:
                    replica.prefix.release(request.id)
        self.queue.notify()

    def _replica(self, index: int) -> Replica:
        for replica in self._replicas:
            if replica.index == index:
                return replica
        raise ValueError(f"replica {index} is not running")


def _settle(future: Future, *, result=None, error: BaseException | None = None) -> bool:
    """Resolve a request's future; False if its caller cancelled it (then the outcome is dropped)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled, also in a race with this call
        return False
    return True
