"""Prefix-aware routing between replicas (cluster.routing): a queued request is left to the replica whose
cache holds more of its prefix, unless that one is overloaded, full, dead or being replaced, or the
request has waited long enough."""

from concurrent.futures import Future

import numpy as np
import pytest

from cluster.prefix_cache import PrefixCache, block_hashes, pool_identity
from cluster.queueing import Request
from cluster.replica import Replica
from cluster.routing import ROUTE_WAIT_S, routed_elsewhere

BLOCK, CHUNK = 4, 32
ROOT = pool_identity("fp", "bfloat16", "bfloat16", BLOCK)
PROMPT = np.arange(20)


def request(tokens=PROMPT, *, named=True) -> Request:
    names = block_hashes(np.asarray(tokens), BLOCK, ROOT) if named else []
    return Request("r", np.asarray(tokens), Future(), keep_kv=False, on_progress=None, names=names)


def replica(index: int, cached=None, blocks: int = 16) -> Replica:
    """A replica with ``blocks`` free blocks whose cache holds ``cached`` (a prompt written and released)."""
    prefix = PrefixCache(blocks, pcp=1, block_size=BLOCK)
    if cached is not None:
        names = block_hashes(np.asarray(cached), BLOCK, ROOT)
        prefix.admit("earlier", len(cached), names)
        prefix.written("earlier", names)
        prefix.release("earlier")
    return Replica(index=index, workers=[], group=None, infos=[], prefix=prefix)


def test_a_request_is_left_to_the_replica_holding_more_of_its_prefix_and_taken_by_it():
    mine, theirs = replica(0), replica(1, cached=PROMPT[:12])
    r = request()
    assert routed_elsewhere(r, mine, [mine, theirs], CHUNK, now=r.submitted)
    assert not routed_elsewhere(r, theirs, [mine, theirs], CHUNK, now=r.submitted)
    # both hold as much: the first to ask takes it
    equal = replica(2, cached=PROMPT[:12])
    assert not routed_elsewhere(r, equal, [equal, theirs], CHUNK, now=r.submitted)


def test_one_replica_a_request_without_names_or_one_that_waited_is_never_routed():
    mine, theirs = replica(0), replica(1, cached=PROMPT[:12])
    r = request()
    assert not routed_elsewhere(r, mine, [mine], CHUNK, now=r.submitted)
    assert not routed_elsewhere(request(named=False), mine, [mine, theirs], CHUNK)
    assert not routed_elsewhere(r, mine, [mine, theirs], CHUNK, now=r.submitted + ROUTE_WAIT_S + 0.01)


@pytest.mark.parametrize("why", ["overloaded", "full", "dead", "being replaced"])
def test_a_request_is_not_left_to_a_replica_that_cannot_take_it_soon(why):
    mine, theirs = replica(0), replica(1, cached=PROMPT[:12], blocks=3 if why == "full" else 16)
    if why == "overloaded":
        theirs.pending_tokens = mine.pending_tokens + CHUNK + 1
    elif why == "dead":
        theirs.alive = False
    elif why == "being replaced":
        theirs.prefix = None
    r = request()
    assert not routed_elsewhere(r, mine, [mine, theirs], CHUNK, now=r.submitted)
    theirs.pending_tokens = mine.pending_tokens + CHUNK  # at the bound it still takes it
    if why == "overloaded":
        assert routed_elsewhere(r, mine, [mine, theirs], CHUNK, now=r.submitted)
