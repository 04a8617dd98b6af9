"""``cluster.ledger.RequestLedger``: the pool's ids, kept results and outcome counters. An id is taken
from submission until its request ends and on while its KV is kept; every request is counted once;
of racing releases one wins."""

import threading
from concurrent.futures import Future

import numpy as np
import pytest

from cluster.ledger import RequestLedger
from cluster.queueing import Request
from cluster.results import DuplicateRequest, PrefillResult


def _open(ledger, request_id=None, keep_kv=False):
    return ledger.open(request_id, lambda id_: Request(id_, np.arange(4, dtype=np.int32), Future(), keep_kv, None))


def _result(request, kv_kept):
    return PrefillResult(request.id, 4, 1, None, None, replica=0, ttft_s=0.0, kv_kept=kv_kept)


def test_ids_are_given_when_absent_refused_when_taken_and_checked_for_type():
    ledger = RequestLedger()
    first, second = _open(ledger), _open(ledger)
    assert (first.id, second.id) == ("req-0", "req-1") and ledger.in_flight == 2
    _open(ledger, "mine")
    with pytest.raises(DuplicateRequest, match="'mine' is already in flight"):
        _open(ledger, "mine")
    for bad in ("", 7):
        with pytest.raises(TypeError, match="non-empty string"):
            _open(ledger, bad)
    assert ledger.in_flight == 3  # refused ids are not counted


def test_withdrawn_requests_free_their_ids_and_count_in_no_outcome():
    ledger = RequestLedger()
    requests = [_open(ledger, f"r{i}") for i in range(3)]
    ledger.withdraw(requests)
    assert ledger.in_flight == 0 and ledger.request("r0") is None
    _open(ledger, "r0")
    assert ledger.counts() == {"completed": 0, "failed": 0, "cancelled": 0, "retried": 0, "replica_faults": 0}


def test_each_ending_is_counted_once_and_a_kept_result_holds_its_id_until_released():
    ledger = RequestLedger()
    plain, kept, failed, dropped, late = (_open(ledger, name) for name in ("plain", "kept", "failed", "dropped", "late"))
    ledger.completed(_result(plain, kv_kept=False))
    kept_result = _result(kept, kv_kept=True)
    ledger.completed(kept_result)
    ledger.failed(failed)
    ledger.dropped(dropped)
    late.future.cancel()
    ledger.failed(late)  # a request its caller cancelled counts cancelled, not failed
    assert ledger.counts() == {"completed": 2, "failed": 1, "cancelled": 2, "retried": 0, "replica_faults": 0}
    assert [ledger.request(n) for n in ("plain", "kept", "failed")] == [None, None, None]
    assert ledger.kept_results() == [kept_result] and ledger.kept_result("kept") is kept_result
    _open(ledger, "plain")  # an ended request's id is free again
    with pytest.raises(DuplicateRequest):
        _open(ledger, "kept")
    assert ledger.release(kept_result) and not kept_result.kv_kept
    assert not ledger.release(kept_result)  # released once
    assert ledger.kept_results() == []
    _open(ledger, "kept")
    ledger.cancelled_after_completion()
    assert (ledger.stats.completed, ledger.stats.cancelled) == (1, 3)


def test_of_many_racing_releases_exactly_one_wins():
    ledger = RequestLedger()
    result = _result(_open(ledger, "held", keep_kv=True), kv_kept=True)
    ledger.completed(result)
    wins, start = [], threading.Barrier(8)

    def release():
        start.wait()
        wins.append(ledger.release(result))

    threads = [threading.Thread(target=release) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(wins) == [False] * 7 + [True]


def test_finished_counts_down_what_is_in_flight():
    ledger = RequestLedger()
    for _ in range(3):
        _open(ledger)
    assert [ledger.finished(), ledger.finished()] == [2, 1] and ledger.in_flight == 1
