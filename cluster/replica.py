"""One replica of the prefill pool on Ray: its placement group, its ``tp * pcp`` worker actors and
their process group, and the spare workers that replace them after a fault; starting it, one SPMD
call on all its workers, stopping it. Also connecting to
(or starting) Ray, and naming the error behind a Ray failure in one line.

With ``cluster.pool`` and ``cluster.handoff``, the only module that calls ``ray.get``/``ray.wait``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from configs.pool import PoolConfig
from cluster.prefix_cache import PrefixCache
from workers.worker import SAFE_NCCL_ENV, PrefillWorker, WorkerInfo

logger = logging.getLogger(__name__)
MAX_CAUSE_CHARS = 300
KV_GROUP = "kv"  # the workers' concurrency group for the KV server's calls (describe_kv)
FA4_CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


@dataclass
class Replica:
    """A started replica and the pool's scheduling state of it."""

    index: int
    workers: list
    group: object  # the placement group the pool created for it (None: one it was given)
    infos: list[WorkerInfo]
    thread: threading.Thread | None = None
    generation: int = 0
    alive: bool = True
    prefix: PrefixCache | None = None  # its KV blocks and cached prefixes (None while it is being replaced)
    pending_tokens: int = 0  # prompt tokens its scheduler has admitted and not prefilled yet
    start_s: dict | None = None  # how long starting it took: worker processes (to the first call), setup, warm-up, loading
    spares: Spares | None = None  # worker processes ready to replace this replica's (PoolConfig.spare_workers)

    @property
    def kv_blocks(self) -> int:
        return min(info.kv_blocks for info in self.infos)


@dataclass
class Spares:
    """One spare worker process per rank of a replica, in the replica's bundles with no resources of
    their own (a spare sees all of its node's GPUs), each importing what a worker's setup imports
    first (``PrefillWorker.preload``). When the replica fails, its actors are killed and the spares
    take the failed ranks' places and GPUs (``PrefillWorker.promote``): the replacement skips starting
    processes and importing its kernel library. Spares still preloading (a second fault soon after
    the first) are promoted once they are ready (a worker runs its calls in order): they are further
    along than new processes would be. Only spares whose preload failed are replaced by new ones."""

    workers: list
    ready: list  # the preload calls

    def failed(self) -> bool:
        """Whether a spare's preload has failed so far (raised, or its process died)."""
        done, _ = ray.wait(self.ready, num_returns=len(self.ready), timeout=0)
        try:
            ray.get(done)
        except ray.exceptions.RayError as exc:
            logger.warning("a spare worker failed to preload, so a replacement starts new ones: %s", cause(exc))
            return True
        return False

    def kill(self) -> None:
        for worker in self.workers:
            ray.kill(worker)


def wants_spares(config: PoolConfig, use_gpus: bool, infos: list[WorkerInfo]) -> bool:
    """Whether a replica whose workers said ``infos`` keeps spares: "on", or "auto" and its workers compute
    on the GPUs they hold. Workers pinned to the CPU on GPU resources (logical GPUs, as the CPU tests
    run) start no spares: what a spare saves is a GPU worker's start (CUDA, the kernel library), and
    spares importing on the workers' own cores slow them."""
    return config.spare_workers == "on" or (config.spare_workers == "auto" and use_gpus and infos[0].device.startswith("cuda"))


def start_spares(config: PoolConfig, group, bundle_offset: int, use_gpus: bool) -> Spares:
    """Start the spares of a replica placed in ``group`` (returns at once; they preload meanwhile)."""
    workers = _start_workers(config, group, bundle_offset, use_gpus, spares=True)
    return Spares(workers, [w.preload.remote() for w in workers])


def _start_workers(config: PoolConfig, group, bundle_offset: int, use_gpus: bool, *, spares: bool = False) -> list:
    """One worker actor per bundle of the replica, rank ``r`` in bundle ``bundle_offset + r``. Spares
    take no resources and no rank, and see all of the node's GPUs (a promoted one takes the failed
    rank's GPU itself); so do workers on shared GPUs (Ray may give two ranks one GPU: rank r takes
    GPU r itself)."""
    options = {}
    if use_gpus and (spares or config.worker_gpus < 1):
        options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    # the "kv" group answers the KV server (where a request's blocks are) while a prefill batch runs
    actor = ray.remote(concurrency_groups={KV_GROUP: 2})(PrefillWorker)
    return [
        actor.options(
            num_cpus=0 if spares else config.worker_cpus,
            num_gpus=config.worker_gpus if use_gpus and not spares else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_offset + rank),
            **options,
        ).remote(config, None if spares else rank, _worker_env(config, use_gpus))
        for rank in range(config.workers_per_replica)
    ]


def start_replica(
    config: PoolConfig,
    index: int,
    use_gpus: bool,
    *,
    placement_group_=None,
    owns_group: bool = False,
    bundle_offset: int = 0,
    timeout_s: float,
    replacing: Replica | None = None,
) -> Replica:
    """Reserve the replica's bundles (or use ``placement_group_``'s, from ``bundle_offset`` on; removed
    with the replica when ``owns_group``), start one worker actor per bundle and set them up (process
    group, weights, KV cache, warm-up); raises ``RuntimeError`` with the reason, leaving nothing
    behind, when any of that fails. ``replacing``: the failed replica (its actors killed, its group
    kept), whose spares, unless one failed to preload, become the workers (waiting for any still
    preloading); its spares are used up either way."""
    spares = replacing.spares if replacing is not None else None
    if spares is not None and spares.failed():
        spares.kill()
        spares = None
    bundle = {"CPU": config.worker_cpus, **({"GPU": config.worker_gpus} if use_gpus else {})}
    owned = placement_group_ is None or owns_group
    if placement_group_ is None:
        name = f"mlapool-{uuid.uuid4().hex[:8]}-{index}"
        group = placement_group([bundle] * config.workers_per_replica, strategy=config.placement, name=name)
    else:
        group = placement_group_
    if placement_group_ is None and not fits_now(bundle, config.workers_per_replica, config.placement):
        logger.warning(
            "replica %d needs %d x %s (%s), more than the cluster's nodes have now; waiting up to %.0f s "
            "for an autoscaler to add them", index, config.workers_per_replica, bundle, config.placement, timeout_s,
        )  # fmt: skip
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        if owned:
            remove_placement_group(group)
        raise RuntimeError(
            f"replica {index} needs {config.workers_per_replica} x {bundle} ({config.placement}); the cluster has "
            f"{ray.available_resources()} available. Lower tp, pcp or replicas, or add nodes."
        )
    started = time.perf_counter()
    if spares is not None:  # in the failed ranks' bundles, on their GPUs; after their preload
        workers = spares.workers
        uuids = [info.device_uuid for info in replacing.infos]
        promoted = [w.promote.remote(rank, uuids[rank]) for rank, w in enumerate(workers)]
    else:
        workers, promoted = _start_workers(config, group, bundle_offset, use_gpus), []
    try:
        ray.get(promoted, timeout=timeout_s)
        addr, port = ray.get(workers[0].rendezvous_address.remote(), timeout=timeout_s)
        processes_s = time.perf_counter() - started
        infos = ray.get([w.setup.remote(addr, port) for w in workers], timeout=timeout_s)
    except BaseException as exc:
        for worker in workers:
            ray.kill(worker)
        if owned:
            remove_placement_group(group)
        raise RuntimeError(f"replica {index} failed to start: {cause(exc)}") from exc
    replica = Replica(index, workers, group if owned else None, infos)
    replica.prefix = PrefixCache(replica.kv_blocks, config.pcp, config.block_size, enabled=config.prefix_caching)
    if wants_spares(config, use_gpus, infos):
        replica.spares = start_spares(config, group, bundle_offset, use_gpus)
    replica.start_s = {
        "spares": spares is not None,  # the workers were spares started before the fault
        "processes": round(processes_s, 2),
        "setup": round(time.perf_counter() - started - processes_s, 2),
        "warmup": max(info.warmup_s for info in infos),
        "load": max(info.load_s for info in infos),
        # each step of the workers' setup, the slowest worker's (workers.worker.PrefillWorker.setup)
        "setup_steps": {step: max(info.start_phases_s[step] for info in infos) for step in infos[0].start_phases_s},
    }
    logger.info("replica %d started: %s s", index, replica.start_s)
    return replica


def stop_replica(replica: Replica, keep_group: bool = False) -> None:
    """Kill the replica's actors (at once: a rank blocked in a collective is not waited for) and,
    unless ``keep_group`` (a replacement takes its bundles and spares), its spares and placement group."""
    for worker in replica.workers:
        ray.kill(worker)
    if keep_group:
        return
    if replica.spares is not None:
        replica.spares.kill()
        replica.spares = None
    if replica.group is not None:  # None: a group the pool was given, not its own
        remove_placement_group(replica.group)


def _worker_env(config: PoolConfig, use_gpus: bool) -> dict[str, str]:
    """Variables a worker sets before it touches NCCL, not as a runtime_env: actors without one of
    their own start in Ray's pre-started worker processes (a replica replaced after a fault is up sooner)."""
    env = {**SAFE_NCCL_ENV, **{k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    # FA4 (CuTe DSL) kernels compiled once per node, not per process: a replacement replica's workers
    # load them from disk instead of compiling them again in their warm-up
    env.setdefault(FA4_CACHE_ENV, os.environ.get(FA4_CACHE_ENV, "1"))
    if not use_gpus:
        env["OMP_NUM_THREADS"] = str(max(1, int(config.worker_cpus)))
    return env


class BatchTimeout(RuntimeError):
    """An SPMD call that did not finish in time (a rank is stuck)."""


def gather(refs: list, timeout_s: float | None = None) -> list:
    """Results of one SPMD call, in order. Raises as soon as any worker fails (its error, or
    ``RayActorError`` if it died): the others may be blocked in a collective with the failed one
    and would never return. Raises :class:`BatchTimeout` when the call outlives ``timeout_s``."""
    pending, results = list(refs), {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        if len(pending) == 1:  # the last (or only) one: fetched as it lands, one call fewer than wait + get
            try:
                results[pending[0]] = ray.get(pending[0], timeout=wait_s)
            except ray.exceptions.GetTimeoutError:
                raise BatchTimeout(f"1 of {len(refs)} workers did not finish within {timeout_s:g} s") from None
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if not ready:
            raise BatchTimeout(f"{len(pending)} of {len(refs)} workers did not finish within {timeout_s:g} s")
        results[ready[0]] = ray.get(ready[0])  # raises the worker's error, or RayActorError if it died
    return [results[ref] for ref in refs]


def fits_now(bundle: dict, count: int, placement: str) -> bool:
    """Whether the cluster's live nodes could hold ``count`` bundles now (one node for STRICT_PACK)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if placement == "STRICT_PACK":
        return any(all(node.get(k, 0) >= v * count for k, v in bundle.items()) for node in nodes)
    return all(sum(node.get(k, 0) for node in nodes) >= v * count for k, v in bundle.items())


def connect_ray(address: str | None, cpus_needed: float) -> bool:
    """Use a running Ray, connect to ``address``/``$RAY_ADDRESS``, or start an embedded one. True if started here."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    if address:
        ray.init(address=address, **kwargs)
        return False
    # Ray (2.52+) enables token authentication for a cluster ray.init starts and warns about it on
    # every run; this embedded cluster is local to the process, so keep the default and drop the notice
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = notice.level
    notice.setLevel(logging.ERROR)
    try:
        ray.init(num_cpus=max(os.cpu_count() or 1, int(np.ceil(cpus_needed))), **kwargs)
    finally:
        notice.setLevel(level)
    return True


def cause(exc: BaseException) -> str:
    """One line naming the innermost error of a Ray failure (the worker's own exception):
    its type, the first line of its message and, for Ray's long reports, the last."""
    inner = getattr(exc, "cause", None) or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    text = " ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else ""
    if isinstance(inner, ray.exceptions.RayActorError):  # Ray's account of a death runs to a paragraph
        text = text.split(" Some common causes include")[0]
    return f"{type(inner).__name__}: {text[:MAX_CAUSE_CHARS]}"
