"""What the pool hands back (``cluster.pool``): a prefilled request's result, the pool's counters, its
reports of the workers' weights and expert load, and the errors that refuse a request at submit (and
the HTTP error the Serve tier answers with)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from cluster.scheduler import Recovery
from workers.worker import WorkerInfo


class HTTPError(Exception):
    """A request the Serve tier refuses or fails, as the HTTP status it answers and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PromptTooLong(ValueError):
    """A prompt whose KV could never fit in a replica (an HTTP front end answers 413)."""


class DuplicateRequest(ValueError):
    """A request id already in flight or holding KV."""


@dataclass
class PrefillResult:
    """One prefilled request. Its KV stays on the replica's workers while ``kv_kept``."""

    request_id: str
    num_tokens: int
    first_token: int  # greedy: the argmax of the float32 logits (the first maximal one), taken on the worker
    logits: torch.Tensor | None  # [vocab] float32; None when submitted with return_logits=False
    last_hidden: torch.Tensor | None  # [hidden] float32; None when submitted with return_logits=False
    replica: int
    ttft_s: float
    kv_kept: bool
    prompt_digest: str = ""  # kv.frames.prompt_digest of its token ids: a decode server's check of its prompt
    generation: int = 0  # the replica's incarnation that holds the KV (it changes when a worker dies)
    finished: float = field(default_factory=time.monotonic)  # when the prefill finished (time.monotonic)
    cached_tokens: int = 0  # prompt tokens whose KV came from the replica's prefix cache (not computed)
    queue_s: float = 0.0  # of ttft_s, the wait from submission to its first chunk's batch (admission, routing, batching)


def owned_row(row: np.ndarray | None) -> torch.Tensor | None:
    """A result's row (``workers.batch_io.BatchOutput``'s) as a tensor of its own: Ray's arrays are
    read-only views of its store."""
    return None if row is None else torch.from_numpy(row.copy())


@dataclass
class PoolStats:
    """Counters since start: batches run, chunk pieces in them, the seconds from sending a batch to
    its results back in the driver (``batch_s``) and the part of them rank 0 spent in the call
    (``worker_s``: its forward and the results' copy to the host; the rest is Ray's call and the
    results' transfer); requests completed, failed, cancelled, and retried after a replica fault;
    each replica fault (``recoveries``); under PCP the batches per context strategy and the bytes one
    worker received for them. Every submitted request ends up in exactly one of completed, failed
    and cancelled."""

    batches: int = 0
    pieces: int = 0
    batch_s: float = 0.0
    worker_s: float = 0.0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    retried: int = 0
    recoveries: list[Recovery] = field(default_factory=list)
    pcp_strategies: dict[str, int] = field(default_factory=dict)
    pcp_bytes: int = 0


def expert_load_report(loads: list[list[dict[int, int]]]) -> dict[str, dict] | None:
    """Per MoE layer, from each replica's workers' ``moe_load()``: the (token, expert) pairs each rank
    computed, and each replica's imbalance, its busiest rank over its mean (1.0 is even). None for a
    model without MoE layers."""
    if not loads or not loads[0][0]:
        return None
    report = {}
    for layer in sorted(loads[0][0]):
        pairs = [[rank[layer] for rank in replica] for replica in loads]
        imbalance = [round(max(p) * len(p) / sum(p), 3) if sum(p) else None for p in pairs]
        report[str(layer)] = {"pairs_per_rank": pairs, "imbalance": imbalance}
    return report


def weights_report(infos: list[list[WorkerInfo]]) -> dict:
    """How each worker holds its weights (per replica and rank, from their ``WorkerInfo``): the format
    (``fp8`` or a dtype), what runs its FP8 GEMMs, bytes, the bytes it read from the checkpoint, load
    seconds and peak host memory before and after loading."""
    return {
        "format": infos[0][0].weights,
        "bytes_per_rank": [[i.weight_bytes for i in r] for r in infos],
        "experts_per_rank": [[i.experts for i in r] for r in infos] if infos[0][0].experts else None,
        "fp8_gemm": infos[0][0].fp8_gemm,
        "read_bytes_per_rank": [[i.read_bytes for i in r] for r in infos],
        "load_s": [[i.load_s for i in r] for r in infos],
        "peak_host_mib_before_load": [[i.peak_host_mib_before_load for i in r] for r in infos],
        "peak_host_mib": [[i.peak_host_mib for i in r] for r in infos],
    }
