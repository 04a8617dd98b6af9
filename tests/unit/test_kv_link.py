"""The KV link (gloo on CPU) between a receiver and an in-process prefill worker: pulls answered by
the worker's link thread, refusals that leave the link usable, a request freed only after its send,
and the holder's side ending when the receiver closes the link."""

import threading
import time

import numpy as np
import pytest
import torch

from configs.pool import PoolConfig
from workers.kv_link import KVLink, KVLinkError
from workers.batch_io import ChunkPiece
from workers.worker import PrefillWorker

CONFIG = PoolConfig(model="tiny", num_layers=2, chunk_tokens=48, block_size=16, seed=3, device="cpu")
CPU = torch.device("cpu")
WIDTH = CONFIG.model_config().attention.latent_dim  # 80 for the tiny model


@pytest.fixture(scope="module")
def worker():
    worker = PrefillWorker(CONFIG, 0)
    worker.setup("127.0.0.1", 0)  # one rank: no process group
    return worker


def _prefill(worker, request_id, tokens):
    ids = np.arange(tokens, dtype=np.int32) * 7 % 512
    for start in range(0, tokens, CONFIG.chunk_tokens):
        worker.prefill([ChunkPiece(request_id, ids[start : start + CONFIG.chunk_tokens], start, tokens)])


def _link(worker, name="link"):
    """The receiver's end of a link the worker has joined as its only holder."""
    joined = []

    def invite(address):
        thread = threading.Thread(target=worker.join_kv_link, args=(name, address, 1, 2, 30.0))
        thread.start()
        joined.append(thread)

    link = KVLink.host(2, CPU, invite, host="127.0.0.1", timeout_s=30.0)
    link.warm_up()
    joined[0].join()
    return link


def _pull(link, request_id, rows, dtype=torch.float32):
    return link.pull(request_id, [rows], 2, dtype, CONFIG.block_size, WIDTH)


def _wait(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_pulls_get_the_paged_kv_and_a_refusal_names_the_request_and_keeps_the_link(worker):
    _prefill(worker, "a", 70)
    _prefill(worker, "b", 20)
    link = _link(worker)
    try:
        for request_id, rows in (("a", 70), ("b", 20), ("a", 70)):
            (shard,), timings = _pull(link, request_id, rows)
            assert shard.blocks.shape[:3] == (2, -(-rows // 16), 16)
            assert torch.equal(shard.row_view(), worker.fetch_kv(request_id).tensor())
            assert set(timings) == {"ask_s", "transfer_s"} and min(timings.values()) >= 0
        with pytest.raises(KVLinkError, match="holder 1: no KV cache for request 'nope' on this worker"):
            _pull(link, "nope", 20)
        with pytest.raises(KVLinkError, match="holder 1: request 'a' here has 70 rows, 2 layers of \\(5, 16, 80\\)"):
            _pull(link, "a", 20)  # a stale or wrong expectation: refused, not misread
        with pytest.raises(KVLinkError, match="the receiver expects 70 rows, 2 layers of \\(5, 16, 80\\) torch.float16"):
            _pull(link, "a", 70, dtype=torch.float16)
        (shard,), _ = _pull(link, "b", 20)  # the same link, still in step
        assert torch.equal(shard.row_view(), worker.fetch_kv("b").tensor())
    finally:
        link.close()
    assert _wait(lambda: not worker.kv_links), "the holder's side did not end when the receiver closed the link"
    with pytest.raises(RuntimeError, match="closed"):
        _pull(link, "a", 70)
    worker.release(["a", "b"])
    assert worker.health()["kv_requests"] == 0


def test_a_request_being_sent_is_freed_only_when_its_send_ends(worker):
    _prefill(worker, "c", 40)
    free = worker.kv.free_blocks
    with worker._kv_shard("c") as (blocks, rows):
        assert rows == 40 and worker.release(["c"]) == 0  # deferred
        assert worker.health()["kv_requests"] == 1 and torch.equal(
            torch.stack(blocks).flatten(1, 2)[:, :40], worker.fetch_kv("c").tensor()
        )
    assert worker.health()["kv_requests"] == 0 and worker.kv.free_blocks == free + 3
    with pytest.raises(KeyError, match="no KV cache for request 'c'"):
        worker.fetch_kv("c")


def test_a_holder_whose_receiver_is_gone_ends_its_side(worker):
    _prefill(worker, "d", 30)
    link = _link(worker, name="short-lived")
    assert "short-lived" in worker.kv_links
    del link  # the receiver's store and group go with it (as when a decode actor dies)
    assert _wait(lambda: "short-lived" not in worker.kv_links, timeout=30.0)
    worker.release(["d"])
