"""The prefill pool: TP x PCP replicas of Ray actors, a chunking scheduler and the request API.

    with PrefillPool(PoolConfig(model="tiny", tp=2)).start() as pool:
        result = pool.prefill(token_ids)                  # blocking
        futures = [pool.submit(p) for p in prompts]       # concurrent requests share batches

Each replica is one placement group of ``tp * pcp`` bundles (``placement``,
by default ``STRICT_PACK``: one node), one actor per bundle, joined in one
process group and split into TP and PCP groups (``workers.pcp``); starting,
calling and stopping one is ``cluster.replica``. A scheduler
thread per replica builds batches: the next chunk (at most ``chunk_tokens``) of
every request it is prefilling, plus new requests from the shared queue, up to
``max_batch_tokens``; it waits ``batch_wait_ms`` for company when a batch has
room. Every worker of the replica runs the batch (SPMD; under PCP each takes
its share of the chunks); a request completes with its last chunk.

Requests are validated here, before they join a batch, so a bad request fails
alone. The driver mirrors each replica's free KV blocks (of PCP rank 0, which
holds the most of a striped request): a prompt that could never fit is refused
at submit, one that does not fit yet waits for releases. A batch that fails on the workers fails its own requests; the replica
keeps serving. When a worker dies, the requests of its batch fail with that
reason, the replica is restarted in place, and its other in-flight requests are
prefilled again from the start; KV kept on the dead replica is reported lost.
This module, ``cluster.replica`` and ``cluster.handoff`` are the only places that call ``ray.get``/``ray.wait``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from cluster.handoff import KVSource, pull_kv
from cluster.metrics import PoolMetrics
from cluster.replica import Replica, cause, connect_ray, gather, start_replica, stop_replica
from configs.pool import PoolConfig
from workers.kv_cache import blocks_for
from workers.pcp import shard_rows
from workers.weights import check_checkpoint_of
from workers.worker import ChunkPiece, WorkerInfo

logger = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    """A prompt whose KV could never fit in a replica (an HTTP front end answers 413)."""


class DuplicateRequest(ValueError):
    """A request id already in flight or holding KV (an HTTP front end answers 409)."""

_STOP = object()


@dataclass
class PrefillResult:
    """One prefilled request. Its KV stays on the replica's workers while ``kv_kept``."""

    request_id: str
    num_tokens: int
    logits: torch.Tensor  # [vocab] float32
    last_hidden: torch.Tensor  # [hidden] float32
    replica: int
    ttft_s: float
    kv_kept: bool
    generation: int = 0  # the replica's incarnation that holds the KV (it changes when a worker dies)
    finished: float = field(default_factory=time.monotonic)  # when the prefill finished (time.monotonic)

    @property
    def first_token(self) -> int:
        return int(self.logits.argmax())


@dataclass
class PoolStats:
    """Counters since start: batches run, chunk pieces in them, requests completed or failed, and
    under PCP the batches per context strategy and the bytes one worker received for them."""

    batches: int = 0
    pieces: int = 0
    completed: int = 0
    failed: int = 0
    pcp_strategies: dict[str, int] = field(default_factory=dict)
    pcp_bytes: int = 0


@dataclass(eq=False)
class _Request:
    id: str
    tokens: np.ndarray
    future: Future
    keep_kv: bool
    on_progress: Callable[[int, int], None] | None
    kv_blocks: int  # blocks its KV takes on each worker of its replica
    submitted: float = field(default_factory=time.perf_counter)
    done: int = 0

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done


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
        self._in_flight = 0
        self.config = config
        self.model_config = config.model_config()  # validates the model against TP before any actor starts
        if config.checkpoint:
            check_checkpoint_of(self.model_config, config.checkpoint)  # every tensor, before any actor starts
        self._ray_address = ray_address
        self._start_timeout_s = start_timeout_s
        self._queue: queue.Queue = queue.Queue()
        self._replicas: list[Replica] = []
        self._ids = itertools.count()
        self._live: set[str] = set()
        self._kept: dict[str, PrefillResult] = {}  # results whose KV stays on the workers
        self._lock = threading.Lock()
        self._owns_ray = False
        self._use_gpus = False
        self._stopping = False
        self.stats = PoolStats()

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
                self._replicas.append(self._start_replica(index, use_gpus))
        except BaseException:
            self.shutdown()
            raise
        for replica in self._replicas:
            replica.thread = threading.Thread(target=self._serve, args=(replica,), name=f"mlapool-replica-{replica.index}", daemon=True)
            replica.thread.start()
        info = self._replicas[0].infos[0]
        if self.metrics is not None:
            self.metrics.started(info.backend, info.device, info.dtype)
        logger.info(
            "prefill pool ready: %d replica(s) x TP=%d PCP=%d, %s on %s (%s), warm-up %.1f s%s",
            cfg.replicas, cfg.tp, cfg.pcp, info.backend, info.device, info.dtype, info.warmup_s,
            f", PCP all-gather {info.pcp_link_gbps} GB/s per worker" if info.pcp_link_gbps else "",
        )  # fmt: skip
        return self

    def _start_replica(self, index: int, use_gpus: bool) -> Replica:
        return start_replica(
            self.config, index, use_gpus, placement_group_=self._placement_group, bundle_offset=self._bundle_offset,
            timeout_s=self._start_timeout_s,
        )

    def shutdown(self) -> None:
        """Stop the schedulers, fail queued requests, and release actors and placement groups."""
        self._stopping = True
        for _ in self._replicas:
            self._queue.put(_STOP)
        for replica in self._replicas:
            if replica.thread is not None:
                replica.thread.join(timeout=60)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                _settle(item.future, error=RuntimeError("the prefill pool was shut down"))
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
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Future:
        """Queue a prompt; the future resolves to a :class:`PrefillResult`.

        Raises ``TypeError``/``ValueError`` at once for a prompt the model cannot
        take. ``keep_kv`` keeps the latent KV on the workers for :meth:`fetch_kv`
        until :meth:`release`. ``on_progress(done, total)`` is called after each chunk.
        """
        if self._stopping or not self._replicas:
            raise RuntimeError("the prefill pool is not running: call start() first")
        try:
            tokens, kv_blocks, request_id = self._admit(token_ids, request_id)
        except (TypeError, ValueError):
            if self.metrics is not None:
                self.metrics.failed("rejected")
            raise
        request = _Request(request_id, tokens, Future(), keep_kv, on_progress, kv_blocks)
        with self._lock:
            self._in_flight += 1
        request.future.add_done_callback(self._finished)
        if self.metrics is not None:
            self.metrics.queued(self._in_flight)
        self._queue.put(request)
        return request.future

    def _admit(self, token_ids, request_id: str | None) -> tuple[np.ndarray, int, str]:
        """Validate a prompt and reserve its id: its tokens, KV blocks per worker and id."""
        tokens = self._validate_tokens(token_ids)
        kv_blocks = self._kv_blocks(len(tokens))
        if len(tokens) > self.max_prompt_tokens:
            raise PromptTooLong(
                f"prompt of {len(tokens)} tokens does not fit in the KV cache: it needs {kv_blocks} blocks of "
                f"{self.config.block_size} tokens on a worker (PCP={self.config.pcp} stripes it), a worker holds "
                f"{max(r.kv_blocks for r in self._replicas)}, so the longest prompt is {self.max_prompt_tokens} tokens. "
                "Raise kv_cache_tokens or gpu_memory_utilization, or use a larger pcp"
            )
        with self._lock:
            request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
            if not isinstance(request_id, str) or not request_id:
                raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
            if request_id in self._live:
                raise DuplicateRequest(f"request id {request_id!r} is already in flight or holds KV; ids must be unique")
            self._live.add(request_id)
        return tokens, kv_blocks, request_id

    def _finished(self, future: Future) -> None:
        with self._lock:
            self._in_flight -= 1
            depth = self._in_flight
        if self.metrics is None:
            return
        self.metrics.queued(depth)
        error = future.exception()
        if error is None:
            result = future.result()
            self.metrics.completed(result.num_tokens, result.ttft_s)
        else:
            self.metrics.failed()

    @property
    def alive(self) -> bool:
        """Whether the pool is running with at least one live replica."""
        return not self._stopping and any(r.alive for r in self._replicas)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (queued, waiting for KV, or prefilling)."""
        with self._lock:
            return self._in_flight

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
        """Submit every prompt, then wait for all (they are batched together)."""
        futures = [self.submit(p, **kwargs) for p in prompts]
        return [f.result() for f in futures]

    def fetch_kv(self, result: PrefillResult) -> torch.Tensor:
        """The kept latent KV of a request, ``[layers, tokens, latent]`` on the CPU."""
        return pull_kv(self.kv_source(result))

    def kv_source(self, result: PrefillResult) -> KVSource:
        """The workers holding a kept request's KV shards, for a decode actor to pull (``cluster.handoff``)."""
        if not result.kv_kept:
            raise ValueError(f"request {result.request_id!r} was not run with keep_kv=True, or was released")
        replica = self._replica(result.replica)
        if replica.generation != result.generation:
            raise RuntimeError(
                f"the KV of request {result.request_id!r} was lost: a worker of replica {replica.index} died "
                "and the replica was restarted"
            )
        tp = self.config.tp  # TP ranks hold the same latent: read TP rank 0 of every PCP rank
        holders = tuple(replica.workers[p * tp] for p in range(self.config.pcp))
        return KVSource(result.request_id, holders, self.config.block_size, result.num_tokens, replica.infos[0].dtype)

    def release(self, result: PrefillResult) -> None:
        """Free a kept request's KV on its workers (a no-op if its replica restarted since)."""
        replica = self._replica(result.replica)
        with self._lock:  # one release wins, however many callers race (a KV server and the user, say)
            held = replica.generation == result.generation and result.kv_kept
            result.kv_kept = False
            self._live.discard(result.request_id)
            self._kept.pop(result.request_id, None)
        if held:
            ray.get([w.release.remote([result.request_id]) for w in replica.workers])
            with self._lock:
                replica.free_blocks += self._kv_blocks(result.num_tokens)

    def kept_results(self) -> list[PrefillResult]:
        """Every result whose KV is kept on the workers."""
        with self._lock:
            return list(self._kept.values())

    def kept_result(self, request_id: str) -> PrefillResult | None:
        """The result of a request whose KV is kept on the workers (None if none is)."""
        with self._lock:
            return self._kept.get(request_id)

    def health(self) -> list[list[dict]]:
        """Per replica, per worker: readiness and KV held."""
        return [ray.get([w.health.remote() for w in r.workers], timeout=60) for r in self._replicas]

    @property
    def worker_infos(self) -> list[list[WorkerInfo]]:
        return [r.infos for r in self._replicas]

    def expert_load(self) -> dict[str, dict] | None:
        """Per MoE layer, the (token, expert) pairs each worker (EP rank) of each replica computed since
        start, and each replica's imbalance: its busiest rank over its mean (1.0 is even). None for a
        model without MoE layers."""
        loads = [ray.get([w.moe_load.remote() for w in r.workers], timeout=60) for r in self._replicas]
        if not loads or not loads[0][0]:
            return None
        report = {}
        for layer in sorted(loads[0][0]):
            pairs = [[rank[layer] for rank in replica] for replica in loads]
            imbalance = [round(max(p) * len(p) / sum(p), 3) if sum(p) else None for p in pairs]
            report[str(layer)] = {"pairs_per_rank": pairs, "imbalance": imbalance}
        return report

    def weights_report(self) -> dict:
        """How each worker holds its weights: the format (``fp8`` or a dtype), bytes, load seconds and
        peak host memory, per replica and rank."""
        infos = self.worker_infos
        return {
            "format": infos[0][0].weights,
            "bytes_per_rank": [[i.weight_bytes for i in r] for r in infos],
            "experts_per_rank": [[i.experts for i in r] for r in infos] if infos[0][0].experts else None,
            "load_s": [[i.load_s for i in r] for r in infos],
            "peak_host_mib": [[i.peak_host_mib for i in r] for r in infos],
        }

    # ---- scheduling --------------------------------------------------------
    def _serve(self, replica: Replica) -> None:
        active: list[_Request] = []
        while replica.alive:
            batch = self._next_batch(replica, active)
            if batch is None:
                for request in active + ([replica.waiting] if replica.waiting else []):
                    _settle(request.future, error=RuntimeError("the prefill pool was shut down"))
                return
            if batch:
                self._run_batch(replica, batch, active)

    def _next_batch(self, replica: Replica, active: list[_Request]) -> list[tuple[_Request, int]] | None:
        """(request, tokens) pieces for the next batch; None when the pool stops.

        Running requests come first; new ones are admitted in arrival order while
        the batch has room and their KV fits in the replica's free blocks (one that
        does not fit waits, holding back those behind it, until KV is released)."""
        cfg = self.config
        budget = cfg.max_batch_tokens
        batch = []
        for request in active:
            count = min(cfg.chunk_tokens, request.remaining, budget)
            if count == 0:
                break
            batch.append((request, count))
            budget -= count
        if self._stopping and not batch:
            return None  # running requests are drained first; queued and waiting ones fail
        deadline = time.monotonic() + cfg.batch_wait_ms / 1000
        while budget > 0 and not (self._stopping and batch):
            if replica.waiting is None:
                wait = max(0.0, deadline - time.monotonic()) if batch else 0.5
                try:
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    return batch if (batch or not self._stopping) else None
                if item is _STOP:
                    return None if not active else batch
                replica.waiting = item
            request = replica.waiting
            with self._lock:
                fits = request.kv_blocks <= replica.free_blocks
                if fits:
                    replica.free_blocks -= request.kv_blocks
            if not fits:
                if not batch:
                    time.sleep(0.05)  # nothing to run: wait for a release
                return batch
            replica.waiting = None
            active.append(request)
            count = min(cfg.chunk_tokens, request.remaining, budget)
            batch.append((request, count))
            budget -= count
        return batch

    def _run_batch(self, replica: Replica, batch: list[tuple[_Request, int]], active: list[_Request]) -> None:
        pieces = [
            ChunkPiece(r.id, r.tokens[r.done : r.done + count], r.done, len(r.tokens)) for r, count in batch
        ]
        with self._lock:
            self.stats.batches += 1
            self.stats.pieces += len(pieces)
        try:
            outputs = gather([w.prefill.remote(pieces) for w in replica.workers])
        except ray.exceptions.RayActorError as exc:
            self._replace_replica(replica, [r for r, _ in batch], active, exc)
            return
        except Exception as exc:  # noqa: BLE001 -- the batch's requests get the error, the pool goes on
            logger.error("replica %d: batch of %d request(s) failed: %s", replica.index, len(batch), cause(exc))
            failed = [r for r, _ in batch]
            with self._lock:
                self.stats.failed += len(failed)
                replica.free_blocks += sum(r.kv_blocks for r in failed)
            for request in failed:
                active.remove(request)
                self._forget(request)
                _settle(request.future, error=RuntimeError(f"prefill of {request.id!r} failed: {cause(exc)}"))
            for worker in replica.workers:
                worker.release.remote([r.id for r in failed])
            return
        report = outputs[0]
        finished = {result.request_id: result for result in report.results}
        if report.pcp_strategy is not None:
            logger.debug(
                "replica %d: batch of %d piece(s), PCP context strategy %s, %d bytes received per worker",
                replica.index, len(pieces), report.pcp_strategy, report.pcp_bytes,
            )  # fmt: skip
            with self._lock:
                counts = self.stats.pcp_strategies
                counts[report.pcp_strategy] = counts.get(report.pcp_strategy, 0) + 1
                self.stats.pcp_bytes += report.pcp_bytes
        for request, count in batch:
            request.done += count
            if request.on_progress is not None:
                try:
                    request.on_progress(request.done, len(request.tokens))
                except Exception:  # noqa: BLE001 -- a caller's callback must not stop the scheduler
                    logger.exception("on_progress of request %r raised; continuing", request.id)
            if request.remaining == 0:
                active.remove(request)
                self._complete(replica, request, finished[request.id])

    def _replace_replica(self, replica: Replica, failed: list[_Request], active: list[_Request], exc) -> None:
        """A worker died: fail the batch's requests, restart the replica, retry its other requests."""
        logger.error("replica %d: a worker died (%s); restarting the replica", replica.index, cause(exc))
        for request in failed:
            self._forget(request)
            error = RuntimeError(
                f"prefill of {request.id!r} failed: a worker of replica {replica.index} died "
                f"({cause(exc)}); the replica was restarted"
            )
            _settle(request.future, error=error)
        with self._lock:
            self.stats.failed += len(failed)
        retry = [r for r in active if r not in failed]
        if replica.waiting is not None:
            retry.append(replica.waiting)
            replica.waiting = None
        active.clear()
        stop_replica(replica)
        try:
            fresh = self._start_replica(replica.index, self._use_gpus)
        except Exception as start_exc:  # noqa: BLE001 -- the other replicas go on serving
            logger.error("replica %d could not be restarted: %s", replica.index, cause(start_exc))
            replica.alive = False
            for request in retry:
                self._forget(request)
                _settle(request.future, error=RuntimeError(f"replica {replica.index} is gone: {cause(start_exc)}"))
            return
        with self._lock:
            replica.workers, replica.group, replica.infos = fresh.workers, fresh.group, fresh.infos
            replica.generation += 1
            replica.free_blocks = fresh.free_blocks  # the dead replica's KV is gone
        for request in retry:  # their KV died with the worker: prefill them again from the start
            request.done = 0
            self._queue.put(request)

    def _complete(self, replica: Replica, request: _Request, piece) -> None:
        with self._lock:
            self.stats.completed += 1
        if not request.keep_kv:
            for worker in replica.workers:
                worker.release.remote([request.id])  # actor calls run in order: before any later batch
            with self._lock:
                replica.free_blocks += request.kv_blocks
            self._forget(request)
        result = PrefillResult(
            request_id=request.id,
            num_tokens=len(request.tokens),
            logits=piece.logits,
            last_hidden=piece.last_hidden,
            replica=replica.index,
            ttft_s=time.perf_counter() - request.submitted,
            kv_kept=request.keep_kv,
            generation=replica.generation,
        )
        if request.keep_kv:
            with self._lock:
                self._kept[request.id] = result
        _settle(request.future, result=result)

    def _forget(self, request: _Request) -> None:
        with self._lock:
            self._live.discard(request.id)

    def _replica(self, index: int) -> Replica:
        for replica in self._replicas:
            if replica.index == index:
                return replica
        raise ValueError(f"replica {index} is not running")

    def _validate_tokens(self, token_ids) -> np.ndarray:
        config = self.model_config
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.cpu().numpy()
        array = np.asarray(token_ids)
        if array.size == 0:
            raise ValueError("empty prompt: a request needs at least one token id")
        if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
        if array.ndim != 1:
            raise ValueError(f"token ids must be a flat sequence, got shape {array.shape}")
        if array.size > config.max_position_embeddings:
            raise ValueError(
                f"prompt of {array.size} tokens exceeds {config.name}'s maximum of {config.max_position_embeddings} positions"
            )
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= config.vocab_size:
            raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary [0, {config.vocab_size})")
        return array.astype(np.int32)


def _settle(future: Future, *, result=None, error: BaseException | None = None) -> None:
    """Resolve a request's future, unless its caller cancelled it (then the outcome is dropped)."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
