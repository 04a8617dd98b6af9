"""``PrefillPool.complete``: the end of a batch in the driver. The KV of every finished request that
is not kept is freed in one call per worker, before any future is settled; a kept one stays held and
listed; a request cancelled before the end is counted cancelled and its KV freed with the others."""

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.pool import PrefillPool
from cluster.queueing import Request
from cluster.results import DuplicateRequest
from configs.pool import PoolConfig
from workers.batch_io import BatchOutput, PieceResult


class Worker:
    """A replica's worker as the driver calls it: ``release.remote(ids)``, recorded."""

    def __init__(self):
        self.calls = []
        self.release = SimpleNamespace(remote=self.calls.append)


class Prefix:
    def __init__(self):
        self.released = []

    def release(self, request_id):
        self.released.append(request_id)


def _request(name, keep_kv=False):
    return Request(name, np.arange(8, dtype=np.int32), Future(), keep_kv, None)


def _report(requests):
    """Rank 0's output for a batch finishing ``requests``: each one's greedy token and its row (logits, then the hidden row)."""
    rows = np.tile(np.concatenate([np.arange(5, dtype=np.float32), np.zeros(3, dtype=np.float32)]), (len(requests), 1))
    pieces = [PieceResult(r.id, 4, i) for i, r in enumerate(requests)]
    return BatchOutput(pieces, rows, vocab=5), list(zip(requests, pieces))


def test_a_batchs_finished_requests_are_freed_in_one_call_per_worker_then_settled():
    pool = PrefillPool(PoolConfig(model="tiny"))
    workers, prefix = [Worker(), Worker()], Prefix()
    replica = SimpleNamespace(index=0, generation=3, workers=workers, prefix=prefix)
    plain, kept, cancelled = _request("plain"), _request("kept", keep_kv=True), _request("cancelled", keep_kv=True)
    cancelled.future.cancel()
    for request in (plain, kept, cancelled):
        pool.ledger.open(request.id, lambda _, r=request: r)
    seen_at_settle = []
    plain.future.add_done_callback(lambda _: seen_at_settle.append([list(w.calls) for w in workers]))

    pool.complete(replica, *_report([plain, kept, cancelled]))

    assert [w.calls for w in workers] == [[["plain", "cancelled"]], [["plain", "cancelled"]]]  # one call each, all ids
    assert seen_at_settle == [[[["plain", "cancelled"]], [["plain", "cancelled"]]]]  # freed before the future settled
    assert prefix.released == ["plain", "cancelled"]
    result = plain.future.result()
    assert not result.kv_kept and result.first_token == 4 and result.generation == 3
    assert result.logits.tolist() == [0, 1, 2, 3, 4] and result.last_hidden.tolist() == [0, 0, 0]
    result.logits[0] = 9  # the result's own rows, not views of the batch's (Ray's store is read-only)
    assert kept.future.result().logits[0] == 0
    assert kept.future.result().kv_kept and pool.kept_results() == [kept.future.result()]
    assert (pool.stats.completed, pool.stats.cancelled) == (2, 1)
    assert [pool.ledger.request(r.id) for r in (plain, kept, cancelled)] == [None, None, None]  # none in flight
    with pytest.raises(DuplicateRequest):  # the kept one's id stays taken while its KV is held
        pool.ledger.open("kept", lambda _: kept)
    pool.ledger.open("plain", lambda _: plain)  # the others' are free


def test_a_batch_with_nothing_to_free_calls_no_worker():
    pool = PrefillPool(PoolConfig(model="tiny"))
    workers = [Worker()]
    replica = SimpleNamespace(index=0, generation=0, workers=workers, prefix=Prefix())
    kept = _request("kept", keep_kv=True)
    pool.ledger.open(kept.id, lambda _: kept)
    pool.complete(replica, *_report([kept]))
    assert workers[0].calls == [] and kept.future.result().kv_kept
