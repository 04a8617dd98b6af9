"""The pool's request queue (``cluster.queueing``): admission by fit, arrival order, retries alone,
cancellations taken out, no starvation of a request that fits nowhere yet, and a long wait for room logged."""

import logging
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from cluster import queueing
from cluster.queueing import Request, RequestQueue


BLOCKS: dict[str, int] = {}  # request id -> the blocks it takes


def _request(name, blocks, tokens=10):
    BLOCKS[name] = blocks
    return Request(name, np.zeros(tokens, dtype=np.int32), Future(), False, None)


class Replica:
    """A replica's free blocks, reserved as the scheduler does."""

    def __init__(self, free):
        self.free = free

    def reserve(self, request):
        if BLOCKS[request.id] > self.free:
            return False
        self.free -= BLOCKS[request.id]
        return True


def _names(admitted):
    return [request.id for request, _ in admitted]


def test_a_replica_takes_what_fits_it_in_arrival_order_and_leaves_the_rest_to_another():
    queue = RequestQueue()
    for name, blocks in (("big", 8), ("a", 2), ("b", 3), ("c", 1)):
        queue.put(_request(name, blocks))
    small = Replica(free=4)
    admitted, _ = queue.take(small.reserve, budget=100, chunk_tokens=4, alone_ok=True, timeout_s=0)
    assert _names(admitted) == ["a", "c"] and small.free == 1  # "big" and "b" do not fit here
    assert [count for _, count in admitted] == [4, 4]  # the first chunk of each
    roomy = Replica(free=16)
    admitted, _ = queue.take(roomy.reserve, budget=100, chunk_tokens=4, alone_ok=True, timeout_s=0)
    assert _names(admitted) == ["big", "b"] and len(queue) == 0  # the other replica runs them at once


def test_the_token_budget_bounds_a_batch():
    queue = RequestQueue()
    for name in "abc":
        queue.put(_request(name, 1, tokens=30))
    admitted, _ = queue.take(Replica(99).reserve, budget=50, chunk_tokens=32, alone_ok=True, timeout_s=0)
    assert [(r.id, n) for r, n in admitted] == [("a", 30), ("b", 20)]


def test_a_retry_runs_alone_and_nothing_passes_it():
    queue = RequestQueue()
    queue.put(_request("new", 1))
    retry = _request("retry", 1)
    retry.alone = True
    queue.put(retry, front=True)
    replica = Replica(99)
    admitted, _ = queue.take(replica.reserve, budget=100, chunk_tokens=4, alone_ok=False, timeout_s=0)
    assert admitted == []  # a batch with requests already in it does not take a retry, nor anything behind it
    admitted, _ = queue.take(replica.reserve, budget=100, chunk_tokens=4, alone_ok=True, timeout_s=0)
    assert _names(admitted) == ["retry"]  # an empty batch takes it, and only it
    assert _names(queue.take(replica.reserve, budget=100, chunk_tokens=4, alone_ok=False, timeout_s=0)[0]) == ["new"]


def test_cancelled_requests_are_taken_out_and_returned_for_accounting():
    queue = RequestQueue()
    gone, kept = _request("gone", 1), _request("kept", 1)
    queue.put(gone), queue.put(kept)
    assert gone.future.cancel()
    admitted, cancelled = queue.take(Replica(99).reserve, budget=100, chunk_tokens=4, alone_ok=True, timeout_s=0)
    assert _names(admitted) == ["kept"] and cancelled == [gone] and len(queue) == 0


def test_a_request_that_fits_nowhere_is_passed_for_a_while_then_nothing_younger_is_admitted(monkeypatch):
    monkeypatch.setattr(queueing, "STARVATION_S", 0.2)
    queue = RequestQueue()
    queue.put(_request("long", 10))
    queue.put(_request("short-1", 1))
    replica = Replica(free=5)
    assert _names(queue.take(replica.reserve, 100, 4, alone_ok=True, timeout_s=0)[0]) == ["short-1"]
    time.sleep(0.3)
    queue.put(_request("short-2", 1))
    assert queue.take(replica.reserve, 100, 4, alone_ok=True, timeout_s=0)[0] == []  # "long" has waited enough
    replica.free = 10  # KV released
    (long, _), = queue.take(replica.reserve, 100, 4, alone_ok=True, timeout_s=0)[0]
    assert long.id == "long" and 0.3 <= long.blocked_s < 5 and long.blocked_since is None  # its wait for room, for the pool's metrics


def test_a_long_wait_for_room_is_logged_once_naming_kept_kv(monkeypatch, caplog):
    monkeypatch.setattr(queueing, "KV_WAIT_WARN_S", 0.2)
    queue = RequestQueue()
    queue.put(_request("held-out", 10))
    replica = Replica(free=5)  # the rest held by KV nobody releases
    with caplog.at_level(logging.WARNING, logger="cluster.queueing"):
        for _ in range(2):
            assert queue.take(replica.reserve, 100, 4, alone_ok=True, timeout_s=0)[0] == []
        assert caplog.records == []  # not yet
        time.sleep(0.3)
        for _ in range(3):
            assert queue.take(replica.reserve, 100, 4, alone_ok=True, timeout_s=0)[0] == []
    (record,) = caplog.records
    assert "'held-out' (10 tokens) has waited" in record.getMessage() and "PrefillPool.release" in record.getMessage()


def test_take_waits_for_a_request_and_close_returns_the_waiting_ones():
    queue = RequestQueue()
    threading.Timer(0.1, queue.put, args=(_request("late", 1),)).start()
    started = time.monotonic()
    admitted, _ = queue.take(Replica(9).reserve, 100, 4, alone_ok=True, timeout_s=5)
    assert _names(admitted) == ["late"] and time.monotonic() - started < 2
    queue.put(_request("left", 1))
    assert [r.id for r in queue.close()] == ["left"]
    assert not queue.put(_request("after", 1))  # closed: the caller fails it
    assert queue.take(Replica(9).reserve, 100, 4, alone_ok=True, timeout_s=5) == ([], [])  # at once


def test_requests_put_together_are_seen_together_by_a_waiting_replica():
    queue, taken = RequestQueue(), []
    waiting = threading.Thread(target=lambda: taken.append(
        queue.take(Replica(free=100).reserve, budget=100, chunk_tokens=10, alone_ok=True, timeout_s=10)))
    waiting.start()
    time.sleep(0.1)  # the replica waits for work
    assert queue.put_many([_request(name, 1) for name in ("x", "y", "z")])
    waiting.join(timeout=10)
    admitted, _ = taken[0]
    assert _names(admitted) == ["x", "y", "z"]
    queue.close()
    assert not queue.put_many([_request("late", 1)])


def test_a_list_of_ints_is_read_as_the_array_path_reads_it_and_others_fail_as_before():
    """Lists of Python ints are packed in one C call without numpy's type inference (``_int_list``);
    every other prompt takes ``np.asarray``: the same ids, and the same errors naming what is wrong,
    ids past int32 included. An array the caller passes is copied: changing it later changes no request."""
    from configs.model import load_model_config

    model = load_model_config("tiny")
    ids = np.random.default_rng(0).integers(0, 512, 4096)
    got = queueing.validate_tokens(ids.tolist(), model)
    assert got.dtype == np.int32 and np.array_equal(got, ids)
    assert np.array_equal(queueing.validate_tokens([np.int64(3), 4, np.int32(5)], model), [3, 4, 5])
    assert np.array_equal(queueing.validate_tokens([2, True], model), [2, 1])  # as np.asarray reads it
    mine = np.arange(8, dtype=np.int32)
    kept = queueing.validate_tokens(mine, model)
    mine[0] = 7
    assert kept[0] == 0
    for bad, error, message in [
        ([], ValueError, "empty prompt"),
        ([True, False], TypeError, "must be integers, got dtype bool"),
        ([1, 2.5], TypeError, "must be integers, got dtype float64"),
        ([1, "2"], TypeError, "must be integers"),
        ([[1, 2], [3, 4]], ValueError, "flat sequence, got shape"),
        ([1, 1 << 70], TypeError, "must be integers, got dtype object"),
        ([1, 1 << 40], ValueError, f"token id {1 << 40} is outside the vocabulary"),  # past int32: np.asarray reads it
        ([1, -(1 << 31) - 1], ValueError, f"token id {-(1 << 31) - 1} is outside"),
        ([1, 512], ValueError, r"token id 512 is outside the vocabulary \[0, 512\)"),
        ([-1, 2], ValueError, "token id -1 is outside"),
    ]:
        with pytest.raises(error, match=message):
            queueing.validate_tokens(bad, model)
