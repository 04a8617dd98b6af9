"""KV handoff from a PCP pool (gloo, logical GPUs), over TCP and over a decode actor's point-to-point
link: round trip, refusals, and failures that must give a clear error, free the KV on the prefill
side where the transfer had started, and leave the next transfer working."""

import dataclasses
import socket
import time

import numpy as np
import pytest
import ray
import torch

from cluster.handoff import DecodeActor
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


@pytest.mark.parametrize("presented, message", [
    ({"model_fingerprint": "other"}, "the receiver expects model_fingerprint 'other'; this prefill pool's KV has '[0-9a-f]+'"),
    ({"dtype": "bfloat16"}, "the receiver expects dtype 'bfloat16'; this prefill pool's KV has 'float32'"),
    ({"block_size": 64}, "the receiver expects block_size 64; this prefill pool's KV has 16"),
], ids=["model", "dtype", "block-size"])  # fmt: skip
def test_a_receiver_for_another_model_dtype_or_block_size_is_refused_before_anything_is_sent_and_frees_nothing(
    pool, server, presented, message
):
    result = _kept(pool)
    refused = server.transfers["refused"]
    with pytest.raises(KVTransferError, match=message + r" \(request 'req-\d+' is kept for a matching receiver\)"):
        KVReceiver(server.host, server.port, token=TOKEN, **presented).fetch(result.request_id)
    assert server.transfers["refused"] == refused + 1
    assert _kv_requests(pool) == 2  # still held: the matching receiver gets it at once, not after a timeout
    matching = {"model_fingerprint": pool.model_config.fingerprint(), "dtype": "float32", "block_size": 16}
    assert KVReceiver(server.host, server.port, token=TOKEN, **matching).fetch(result.request_id).tokens == 130
    assert _wait_freed(pool)


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


def test_kv_nobody_claims_is_freed_after_the_ttl_and_a_late_receiver_is_refused(pool):
    with KVServer(pool, unclaimed_ttl_s=0.5) as server:
        result = _kept(pool, 60)
        assert _wait_freed(pool, timeout=10.0) and server.transfers["expired"] == 1
        with pytest.raises(KVTransferError, match="no kept KV for request"):
            KVReceiver(server.host, server.port, model_fingerprint=pool.model_config.fingerprint()).fetch(result.request_id)
    assert pool.prefill(np.arange(20)).num_tokens == 20


def test_garbage_on_the_port_is_refused_and_the_server_keeps_serving(pool, server):
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + encode_frame("hello")[:3])
        with pytest.raises(KVTransferError, match="not an mlapool KV frame"):
            read_frame(sock, max_payload=0)
    assert KVReceiver(server.host, server.port, token=TOKEN).fetch(_kept(pool).request_id).tokens == 130


# ---- inside the cluster: a decode actor's point-to-point link (gloo here, NCCL on GPUs) ------------
def _decoder(**kwargs):
    return ray.remote(DecodeActor).options(num_cpus=0.25).remote(CONFIG, transport="p2p", **kwargs)


def _links(decoder):
    return ray.get(decoder.__ray_call__.remote(lambda self: len(self.links)))


def _holder_links(holder):
    return ray.get(holder.__ray_call__.remote(lambda self: len(self.kv_links)))


def test_p2p_an_unknown_request_is_refused_with_the_holders_reason_and_the_link_stays_in_use(pool):
    decoder = _decoder()
    try:
        result = _kept(pool)
        source = pool.kv_source(result)
        with pytest.raises(ray.exceptions.RayTaskError, match="holder 1: no KV cache for request 'nope'"):
            ray.get(decoder.receive.remote(dataclasses.replace(source, request_id="nope")))
        receipt = ray.get(decoder.receive.remote(source))
        assert receipt["tokens"] == 130 and receipt["transport"] == "p2p"
        assert _links(decoder) == 1 and all(_holder_links(holder) == 1 for holder in source.holders)
        kv = ray.get(decoder.__ray_call__.remote(lambda self: torch.stack(self.states[result.request_id].rows)))
        assert torch.equal(kv, pool.fetch_kv(result))
        pool.release(result)
        assert _kv_requests(pool) == 0
    finally:
        ray.kill(decoder)


def test_p2p_a_pull_is_answered_while_the_holders_run_a_prefill(pool):
    decoder = _decoder()
    try:
        kept = _kept(pool, 90)
        ray.get(decoder.receive.remote(pool.kv_source(kept)))  # the link is open
        busy = pool.submit(np.arange(2000) * 5 % 512)  # 42 chunks of 48: the holders are busy
        while not any(w["kv_requests"] > 1 for w in pool.health()[0]):
            time.sleep(0.01)
        receipt = ray.get(decoder.receive.remote(pool.kv_source(kept)))
        assert not busy.done(), "the pull should not have waited for the busy prefill to finish"
        assert receipt["tokens"] == 90
        kv = ray.get(decoder.__ray_call__.remote(lambda self: torch.stack(self.states[kept.request_id].rows)))
        assert torch.equal(kv, pool.fetch_kv(kept))
        assert busy.result(timeout=120).num_tokens == 2000
        pool.release(kept)
    finally:
        ray.kill(decoder)


def test_p2p_a_dead_decode_actor_ends_the_holders_side_and_another_pulls_the_kv(pool):
    decoder = _decoder(link_timeout_s=20.0)
    first, second = _kept(pool, 40), _kept(pool, 70)
    ray.get(decoder.receive.remote(pool.kv_source(first)))
    holders = pool.kv_source(second).holders
    assert all(_holder_links(holder) == 1 for holder in holders)
    ray.kill(decoder)
    deadline = time.monotonic() + 30
    while any(_holder_links(holder) for holder in holders) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_holder_links(holder) for holder in holders), "the holders kept a link whose receiver is gone"
    assert _kv_requests(pool) == 2 * CONFIG.pcp  # no ack, nothing freed: the KV waits for another receiver
    replacement = _decoder()
    try:
        assert ray.get(replacement.receive.remote(pool.kv_source(second)))["tokens"] == 70
    finally:
        ray.kill(replacement)
    pool.release(first)
    pool.release(second)
    assert _kv_requests(pool) == 0
    assert pool.prefill(np.arange(30)).num_tokens == 30
