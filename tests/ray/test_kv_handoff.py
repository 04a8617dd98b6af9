"""KV handoff over TCP from a PCP pool (gloo, logical GPUs): round trip, refusals, and failures that
must free the KV on the prefill side and leave the next transfer working."""

import socket
import time

import numpy as np
import pytest
import torch

from cluster.kv_server import KVServer
from cluster.pool import PrefillPool
from configs.pool import PoolConfig
from workers.kv_transfer import KVReceiver, KVTransferError, encode_frame, expect, read_frame, send_frame

CONFIG = PoolConfig(model="tiny", num_layers=2, pcp=2, chunk_tokens=48, block_size=16, worker_cpus=0.5, seed=5, device="cpu")
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def pool(ray_cluster):
    with PrefillPool(CONFIG).start() as pool:
        yield pool


@pytest.fixture(scope="module")
def server(pool):
    with KVServer(pool, token=TOKEN, ack_timeout_s=1.0, io_timeout_s=5.0) as server:
        yield server


def _kept(pool, n=130, request_id=None):
    prompt = np.arange(n) * 11 % 512
    return pool.prefill(prompt, keep_kv=True, request_id=request_id)


def _kv_requests(pool):
    return sum(w["kv_requests"] for w in pool.health()[0])


def _wait_freed(pool, timeout=10.0):
    deadline = time.monotonic() + timeout
    while _kv_requests(pool) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _kv_requests(pool) == 0


def test_a_receiver_gets_the_pools_kv_in_paged_layout_and_its_ack_frees_it(pool, server):
    result = _kept(pool)
    expected = pool.fetch_kv(result)
    receiver = KVReceiver(server.host, server.port, token=TOKEN, model_fingerprint=pool.model_config.fingerprint())
    kv = receiver.fetch(result.request_id)
    assert kv.meta["tokens"] == 130 and kv.meta["layers"] == 2 and kv.meta["block_size"] == 16
    assert kv.meta["shard_map"]["pcp"] == 2 and kv.meta["num_blocks"] == 9
    assert [tuple(layer.shape) for layer in kv.layers] == [(9, 16, 80)] * 2
    assert torch.equal(kv.rows(), expected)
    assert _wait_freed(pool) and pool.kept_result(result.request_id) is None
    with pytest.raises(KVTransferError, match="no kept KV for request"):
        receiver.fetch(result.request_id)  # sent once: it is gone


def test_a_wrong_token_is_refused_and_frees_nothing(pool, server):
    result = _kept(pool)
    with pytest.raises(KVTransferError, match="token does not match"):
        KVReceiver(server.host, server.port, token="guess").fetch(result.request_id)
    assert _kv_requests(pool) == 2  # both PCP workers still hold it
    assert KVReceiver(server.host, server.port, token=TOKEN).fetch(result.request_id).tokens == 130
    assert _wait_freed(pool)


def test_kv_of_another_model_is_refused_by_the_receiver_and_freed_and_the_next_transfer_works(pool, server):
    result = _kept(pool)
    with pytest.raises(KVTransferError, match="is from model .*; this decode server runs 'other'"):
        KVReceiver(server.host, server.port, token=TOKEN, model_fingerprint="other").fetch(result.request_id)
    assert _wait_freed(pool)
    again = _kept(pool)
    assert KVReceiver(server.host, server.port, token=TOKEN).fetch(again.request_id).tokens == 130


def test_a_receiver_that_disconnects_mid_stream_frees_the_kv(pool, server):
    result = _kept(pool)
    before = server.transfers["failed"]
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        send_frame(sock, "hello", {"request_id": result.request_id, "token": TOKEN})
        expect(read_frame(sock, max_payload=0)[0], "begin")
    assert _wait_freed(pool)
    deadline = time.monotonic() + 10
    while server.transfers["failed"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.transfers["failed"] == before + 1
    assert KVReceiver(server.host, server.port, token=TOKEN).fetch(_kept(pool).request_id).tokens == 130


def test_a_receiver_that_never_acks_times_out_and_the_kv_is_freed(pool, server):
    result = _kept(pool)
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        send_frame(sock, "hello", {"request_id": result.request_id, "token": TOKEN})
        for _ in range(1 + 2):  # begin, 2 layers
            read_frame(sock, max_payload=1 << 30)
        expect(read_frame(sock, max_payload=0)[0], "end")
        # no ack: the server gives up after ack_timeout_s and says why
        with pytest.raises(KVTransferError, match="the other side reported: timed out"):
            read_frame(sock, max_payload=0)
    assert _wait_freed(pool)


def test_garbage_on_the_port_is_refused_and_the_server_keeps_serving(pool, server):
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + encode_frame("hello")[:3])
        with pytest.raises(KVTransferError, match="not an mlapool KV frame"):
            read_frame(sock, max_payload=0)
    assert KVReceiver(server.host, server.port, token=TOKEN).fetch(_kept(pool).request_id).tokens == 130
