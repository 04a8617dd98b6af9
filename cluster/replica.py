"""One replica of the prefill pool on Ray: its placement group, its ``tp * pcp`` worker actors and
their process group; starting it, one SPMD call on all its workers, stopping it. Also connecting to
(or starting) Ray, and naming the error behind a Ray failure in one line.

With ``cluster.pool`` and ``cluster.handoff``, the only module that calls ``ray.get``/``ray.wait``.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from configs.pool import PoolConfig
from workers.worker import SAFE_NCCL_ENV, PrefillWorker, WorkerInfo

logger = logging.getLogger(__name__)


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
    free_blocks: int = 0  # the driver's mirror of the workers' free KV blocks
    waiting: Any = None  # the pool's request taken from the queue, admitted once its KV fits

    @property
    def kv_blocks(self) -> int:
        return min(info.kv_blocks for info in self.infos)


def start_replica(
    config: PoolConfig, index: int, use_gpus: bool, *, placement_group_=None, bundle_offset: int = 0, timeout_s: float
) -> Replica:
    """Reserve the replica's bundles (or use ``placement_group_``'s, from ``bundle_offset`` on), start one
    worker actor per bundle and set them up (process group, weights, KV cache, warm-up); raises
    ``RuntimeError`` with the reason, leaving nothing behind, when any of that fails."""
    bundle = {"CPU": config.worker_cpus, **({"GPU": 1} if use_gpus else {})}
    owned = placement_group_ is None
    if owned:
        name = f"mlapool-{uuid.uuid4().hex[:8]}-{index}"
        group = placement_group([bundle] * config.workers_per_replica, strategy=config.placement, name=name)
    else:
        group = placement_group_
    if owned and not fits_now(bundle, config.workers_per_replica, config.placement):
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
    env = {**SAFE_NCCL_ENV, **{k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    if not use_gpus:
        env["OMP_NUM_THREADS"] = str(max(1, int(config.worker_cpus)))
    actor = ray.remote(PrefillWorker)
    workers = [
        actor.options(
            num_cpus=config.worker_cpus,
            num_gpus=1 if use_gpus else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_offset + rank),
            runtime_env={"env_vars": env},
        ).remote(config, rank)
        for rank in range(config.workers_per_replica)
    ]
    try:
        addr, port = ray.get(workers[0].rendezvous_address.remote(), timeout=timeout_s)
        infos = ray.get([w.setup.remote(addr, port) for w in workers], timeout=timeout_s)
    except BaseException as exc:
        for worker in workers:
            ray.kill(worker)
        if owned:
            remove_placement_group(group)
        raise RuntimeError(f"replica {index} failed to start: {cause(exc)}") from exc
    replica = Replica(index, workers, group if owned else None, infos)
    replica.free_blocks = replica.kv_blocks
    return replica


def stop_replica(replica: Replica) -> None:
    for worker in replica.workers:
        ray.kill(worker)
    if replica.group is not None:  # None: a group the pool was given, not its own
        remove_placement_group(replica.group)


def gather(refs: list) -> list:
    """Results of one SPMD call, in order. Raises as soon as any worker fails: the others may be
    blocked in a collective with the failed one and would never return."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)  # raises the worker's error, or RayActorError if it died
    return ray.get(refs)


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
    ray.init(num_cpus=max(os.cpu_count() or 1, int(np.ceil(cpus_needed))), **kwargs)
    return True


def cause(exc: BaseException) -> str:
    """One line naming the innermost error of a Ray failure (the worker's own exception):
    its type, the first line of its message and, for Ray's long reports, the last."""
    inner = getattr(exc, "cause", None) or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    text = " ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else ""
    return f"{type(inner).__name__}: {text}"
