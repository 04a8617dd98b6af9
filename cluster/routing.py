"""Prefix-aware routing between a pool's replicas: whether a replica's scheduler should leave a queued
request to another replica whose prefix cache holds more of it (``cluster.scheduler`` asks, under the
pool's lock, before it admits a request)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from cluster.queueing import Request
from cluster.replica import Replica

ROUTE_WAIT_S = 0.5  # how long a request may wait in the queue for the replica holding its prefix


def routed_elsewhere(request: Request, replica: Replica, replicas: Sequence[Replica], chunk_tokens: int, *, now: float | None = None) -> bool:
    """Whether ``replica`` should leave ``request`` to another of ``replicas``. The rule: a request goes
    to the replica whose cache holds the longest prefix of it, unless that replica has more than
    ``chunk_tokens`` more prompt tokens waiting to be prefilled than ``replica`` (overloaded), or no
    room for the request now; a request that has waited ``ROUTE_WAIT_S`` in the queue (``now``:
    ``time.perf_counter()``) goes to whichever replica takes it first."""
    now = time.perf_counter() if now is None else now
    if len(replicas) == 1 or not request.names or now - request.submitted > ROUTE_WAIT_S:
        return False
    mine = replica.prefix.cached_tokens(request.names, len(request.tokens))
    for other in replicas:
        if other is replica or other.prefix is None or not other.alive:
            continue
        theirs = other.prefix.cached_tokens(request.names, len(request.tokens))
        if (
            theirs > mine
            and other.pending_tokens <= replica.pending_tokens + chunk_tokens
            and other.prefix.fits(len(request.tokens), request.names)
        ):
            return True
    return False
