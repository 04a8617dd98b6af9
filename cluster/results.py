"""What the pool hands back (``cluster.pool``): a prefilled request's result, the pool's counters, and
the errors that refuse a request at submit (and the HTTP error the Serve tier answers with)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from cluster.scheduler import Recovery


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
