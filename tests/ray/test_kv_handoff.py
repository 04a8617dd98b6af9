"""KV handoff from a TP=2 x PCP=2 pool (gloo, logical GPUs): to a decode server outside the cluster
(``KVReceiver``: the holders' caches mapped into its process, NIXL READs from them, or TCP pulls) and to a decode actor's
point-to-point link. Round trips into receiver-chosen blocks, refusals that free nothing, and
failures -- a holder killed mid-transfer, a receiver that disappears or never acknowledges -- that
give a reason on both sides, free the KV, and leave the next transfer working, with no block leaked."""

import dataclasses
import logging
import os
import re
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
from kv.receiver import KVReceiver
from kv.frames import KVTransferError, encode_frame, expect, prompt_digest, read_frame, send_frame

CONFIG = PoolConfig(model="tiny", num_layers=2, tp=2, pcp=2, chunk_tokens=48, block_size=16, worker_cpus=0.25, seed=5, device="cpu")
TOKEN = "s3cret"
TRANSPORTS = ["mapped", "nixl", "tcp"]


@pytest.fixture(scope="module")
def pool(ray_cluster):
    with PrefillPool(CONFIG).start() as pool:
        yield pool


@pytest.fixture(scope="module")
def server(pool):
    # a transfer must end within ack_timeout_s: generous on a loaded 2-core machine (NIXL registers a
    # receiver's cache on first use); the test of a receiver that never acks uses a server of its own
    with KVServer(pool, token=TOKEN, ack_timeout_s=30.0, io_timeout_s=5.0) as server:
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


def _no_block_leaked(pool):
    """Every worker's free blocks are back to its capacity."""
    capacity = [info.kv_blocks for info in pool.worker_infos[0]]
    return _wait_freed(pool) and [w["kv_free_blocks"] for w in pool.health()[0]] == capacity


def _receiver(server, pool, transport="auto", **kwargs):
    return KVReceiver(server.host, server.port, token=TOKEN, model_fingerprint=pool.model_config.fingerprint(), transport=transport, **kwargs)


def test_the_pool_serves_its_shards_from_the_holders(pool):
    infos = pool.worker_infos[0]
    served = ("mapped", "nixl", "tcp")
    assert [info.kv_transports for info in infos] == [served, (), served, ()]  # TP rank 0 of each PCP rank
    assert pool.kv_source(_kept(pool, 20)).transports == served
    pool.release(pool.kept_results()[0])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receiver_takes_the_kv_into_its_cache_at_the_blocks_it_chose_bit_for_bit(pool, server, transport):
    result = _kept(pool)
    expected = pool.fetch_kv(result)  # the holders' rows, gathered as Ray objects: another path
    cache = torch.full((2, 24, 16, 80), float("nan"))
    ids = [int(i) for i in np.random.default_rng(1).permutation(24)[:9]]  # 130 tokens: 9 blocks
    kv = _receiver(server, pool, transport).fetch(result.request_id, into=cache, block_ids=ids)
    assert kv.transport == transport and kv.cache is cache and kv.block_table == ids
    assert kv.meta["tokens"] == 130 and kv.meta["pcp"] == 2 and kv.meta["num_blocks"] == 9
    received = cache[:, ids].reshape(2, -1, 80)[:, :130]
    assert torch.equal(received, expected)
    others = [b for b in range(24) if b not in ids]
    assert cache[:, others].isnan().all()  # nothing else written
    assert _no_block_leaked(pool) and pool.kept_result(result.request_id) is None
    with pytest.raises(KVTransferError, match="no kept KV for request"):
        _receiver(server, pool, transport).fetch(result.request_id)  # sent once: it is gone


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("block_size, start", [(5, 0), (16, 0), (64, 0), (5, 37), (64, 64)])
def test_per_layer_caches_of_any_block_size_get_every_row_where_their_table_says(pool, server, transport, block_size, start):
    """vLLM's layout: one [num_blocks, block_size, width] tensor per layer, its own block size (the pool's
    is 16); rows before ``start`` (the decode side's own prefix) are left alone."""
    result = _kept(pool)
    expected = pool.fetch_kv(result)
    needed = -(-130 // block_size)
    layers = [torch.full((needed + 7, block_size, 80), float("nan")) for _ in range(2)]
    ids = [int(i) for i in np.random.default_rng(block_size).permutation(needed + 7)[:needed]]
    kv = _receiver(server, pool, transport).fetch(
        result.request_id, into=layers, block_ids=ids, start=start, prompt_digest=result.prompt_digest
    )
    assert kv.cache is layers and kv.block_size == block_size and kv.bytes == (130 - start) * 80 * 4 * 2
    for layer, want in zip(layers, expected):
        rows = layer[ids].reshape(-1, 80)
        assert torch.equal(rows[start:130], want[start:]) and rows[:start].isnan().all() and rows[130:].isnan().all()
        others = [b for b in range(needed + 7) if b not in ids]
        assert layer[others].isnan().all()
    assert _no_block_leaked(pool)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receiver_without_a_cache_gets_a_new_one_of_the_requests_size(pool, server, transport):
    result = _kept(pool, 75)
    expected = pool.fetch_kv(result)
    kv = _receiver(server, pool, transport).fetch(result.request_id)
    assert tuple(kv.cache.shape) == (2, 5, 16, 80) and torch.equal(kv.rows(), expected)
    assert [tuple(layer.shape) for layer in kv.layers] == [(5, 16, 80)] * 2
    assert kv.bytes == 2 * 75 * 80 * 4 and kv.transfer_s > 0  # the rows of its tokens, not the last block's padding
    assert _no_block_leaked(pool)


def test_a_ticket_issued_ahead_holds_the_receiver_until_the_prefill_is_done(pool, server):
    """The OpenAI endpoint's order: the decode server asks for the KV while the pool still prefills
    (here 700 tokens in chunks of 48: 15 batches); it gets the finished rows, then nothing is held."""
    prompt = np.arange(700) * 7 % 512
    future = pool.submit(prompt, keep_kv=True, request_id="ahead-1")
    ticket = server.ticket_ahead("ahead-1", prompt.tolist())
    assert ticket["tokens"] == 700 and ticket["prompt_digest"] == prompt_digest(prompt) and ticket["request_id"] == "ahead-1"
    layers = [torch.full((50, 16, 80), float("nan")) for _ in range(2)]
    kv = _receiver(server, pool).fetch("ahead-1", into=layers, block_ids=list(range(44)), prompt_digest=ticket["prompt_digest"])
    assert future.done() and kv.tokens == 700
    again = pool.prefill(prompt, keep_kv=True)  # its full blocks are ahead-1's, the last one recomputed
    assert again.cached_tokens == 688
    for layer, want in zip(layers, pool.fetch_kv(again)):
        torch.testing.assert_close(layer[:44].reshape(-1, 80)[:700], want, atol=1e-5, rtol=1e-5)
    pool.release(pool.kept_results()[0])
    assert _no_block_leaked(pool)


def test_a_ticket_issued_ahead_with_the_first_token_sends_it_with_done(pool, server):
    """The endpoint's early forward: the ticket carries the tier's first token, which the server sends
    with ``done`` once the endpoint hands it over (the copy does not wait for it); a request discarded
    before that gets its ``done`` at once, without a token, not after ``ack_timeout_s``."""
    import threading

    prompt = np.arange(300) * 3 % 512
    future = pool.submit(prompt, keep_kv=True, request_id="ahead-first")
    ticket = server.ticket_ahead("ahead-first", prompt.tolist(), first_token=True)
    assert ticket["first_token"] is True and "first_token" not in server.ticket_ahead("ahead-none", [1, 2, 3])
    got = {}
    fetching = threading.Thread(target=lambda: got.update(kv=_receiver(server, pool).fetch("ahead-first", prompt_digest=ticket["prompt_digest"])))
    fetching.start()
    future.result(timeout=60)
    time.sleep(0.5)  # the receiver has its rows and waits for done
    assert fetching.is_alive()
    server.first_token("ahead-first", 417)
    fetching.join(30)
    assert got["kv"].first_token == 417 and got["kv"].tokens == 300

    result = _kept(pool, 90, request_id="ahead-discarded")
    server.ticket_ahead("ahead-discarded", np.arange(90) * 11 % 512, first_token=True)
    fetching = threading.Thread(target=lambda: got.update(late=_receiver(server, pool).fetch("ahead-discarded")))
    started = time.monotonic()
    fetching.start()
    while "ahead-discarded" not in server._busy and time.monotonic() - started < 10:  # admitted: discard no longer frees it under the transfer
        time.sleep(0.01)
    server.discard(result)  # the client left: the transfer under way ends now, its KV freed after it
    fetching.join(30)
    assert got["late"].first_token is None and time.monotonic() - started < 10
    assert _wait_freed(pool) and _no_block_leaked(pool)


def test_a_ticket_issued_ahead_whose_prefill_is_cancelled_is_refused_with_the_reason(pool, server):
    prompt = np.arange(900) % 512
    cancelled = pool.counts()["cancelled"]
    future = pool.submit(prompt, keep_kv=True, request_id="ahead-2")
    ticket = server.ticket_ahead("ahead-2", prompt.tolist())
    future.cancel()
    with pytest.raises(KVTransferError, match="'ahead-2' was cancelled before its prefill finished|no kept KV for request 'ahead-2'"):
        _receiver(server, pool).fetch("ahead-2", prompt_digest=ticket["prompt_digest"])
    deadline = time.monotonic() + 30
    while pool.counts()["cancelled"] == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)  # its scheduler takes it out before its next chunk
    assert pool.counts()["cancelled"] == cancelled + 1 and _no_block_leaked(pool)


def _refused(server, request_id, **receiver):
    refused = server.transfers["refused"]
    with pytest.raises(KVTransferError) as info:
        KVReceiver(server.host, server.port, **receiver).fetch(request_id)
    assert server.transfers["refused"] == refused + 1
    return str(info.value)


@pytest.mark.parametrize("presented, message", [
    ({"token": "guess"}, "token does not match"),
    ({"token": TOKEN, "model_fingerprint": "other"}, "the receiver expects model_fingerprint 'other'; this prefill pool's KV has '[0-9a-f]+'"),
    ({"token": TOKEN, "dtype": "bfloat16"}, "the receiver expects dtype 'bfloat16'; this prefill pool's KV has 'float32'"),
], ids=["token", "model", "dtype"])  # fmt: skip
def test_a_receiver_for_another_model_or_dtype_is_refused_before_anything_is_sent_and_frees_nothing(
    pool, server, presented, message
):
    result = _kept(pool)
    assert re.search(message, _refused(server, result.request_id, **presented))
    assert _kv_requests(pool) == CONFIG.workers_per_replica  # still held: a matching receiver gets it at once
    assert _receiver(server, pool).fetch(result.request_id).tokens == 130
    assert _no_block_leaked(pool)


def test_a_cache_of_another_shape_or_with_too_few_blocks_is_refused_and_frees_nothing(pool, server):
    result = _kept(pool)
    receiver = _receiver(server, pool)
    with pytest.raises(KVTransferError, match="the receiver expects width 64; this prefill pool's KV has 80"):
        receiver.fetch(result.request_id, into=torch.zeros(2, 20, 16, 64), block_ids=list(range(9)))
    with pytest.raises(KVTransferError, match="the receiver expects layers 3; this prefill pool's KV has 2"):
        receiver.fetch(result.request_id, into=torch.zeros(3, 20, 16, 80), block_ids=list(range(9)))
    with pytest.raises(KVTransferError, match="request 'req-\\d+' has 130 tokens; the receiver's blocks hold 64"):
        receiver.fetch(result.request_id, into=torch.zeros(2, 20, 16, 80), block_ids=[0, 1, 2, 3])
    with pytest.raises(KVTransferError, match="request 'req-\\d+' was prefilled for another prompt than the receiver's"):
        receiver.fetch(result.request_id, prompt_digest=prompt_digest([1, 2, 3]))
    with socket.create_connection((server.host, server.port), timeout=5) as sock:  # a transport nobody serves
        send_frame(sock, "hello", {"request_id": result.request_id, "token": TOKEN, "transports": ["carrier-pigeon"]})
        with pytest.raises(KVTransferError, match="the receiver takes KV over \\['carrier-pigeon'\\]; this pool's workers serve it over \\['mapped', 'nixl', 'tcp'\\]"):
            read_frame(sock, max_payload=0)
    assert _kv_requests(pool) == CONFIG.workers_per_replica
    assert receiver.fetch(result.request_id, into=torch.zeros(2, 20, 16, 80), block_ids=list(range(9))).tokens == 130
    assert _no_block_leaked(pool)


def test_an_unknown_request_and_a_forged_pull_ticket_are_refused(pool, server):
    assert "no kept KV for request 'nope'" in _refused(server, "nope", token=TOKEN)
    result = _kept(pool, 40)
    kv_holder = pool.kv_source(result).holders[0]
    offer = ray.get(kv_holder.describe_kv.remote(result.request_id, "tcp"))
    with socket.create_connection((offer["tcp"]["host"], offer["tcp"]["port"]), timeout=5) as sock:
        send_frame(sock, "pull", {"request_id": result.request_id, "ticket": "0" * 32})
        with pytest.raises(KVTransferError, match="unknown or expired KV pull ticket"):
            read_frame(sock, max_payload=0)
    pool.release(result)
    assert _no_block_leaked(pool)


def _kill(actor) -> None:
    """Kill an actor and return once its process is gone (Ray marks it dead before the process exits)."""
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise AssertionError(f"worker process {pid} still runs 30 s after ray.kill")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_holder_killed_mid_transfer_fails_it_with_a_reason_on_both_sides_and_the_pool_recovers(pool, server, transport, caplog):
    result = _kept(pool)
    holder = pool.kv_source(result).holders[1]
    failed = server.transfers["failed"]
    with caplog.at_level(logging.WARNING, logger="cluster.kv_server"), pytest.raises(KVTransferError, match="holder 1"):
        _receiver(server, pool, transport).fetch(result.request_id, on_begin=lambda meta: _kill(holder))
    deadline = time.monotonic() + 10
    while server.transfers["failed"] == failed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.transfers["failed"] == failed + 1
    assert any(f"KV transfer of {result.request_id!r}" in r.getMessage() and "holder 1" in r.getMessage() for r in caplog.records)
    assert pool.prefill(np.arange(70)).num_tokens == 70  # the dead worker's replica is replaced, the prompt retried
    assert _no_block_leaked(pool)
    assert _receiver(server, pool, transport).fetch(_kept(pool).request_id).tokens == 130


def test_a_receiver_that_disappears_after_the_begin_frees_the_kv(pool, server):
    result = _kept(pool)
    before = server.transfers["failed"]
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        send_frame(sock, "hello", {"request_id": result.request_id, "token": TOKEN, "transports": ["nixl"]})
        expect(read_frame(sock, max_payload=0)[0], "begin")
    deadline = time.monotonic() + 10
    while server.transfers["failed"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.transfers["failed"] == before + 1 and _no_block_leaked(pool)
    assert _receiver(server, pool).fetch(_kept(pool).request_id).tokens == 130


def test_holders_described_after_the_ticket_serve_the_receiver_and_a_description_after_the_transfer_keeps_nothing(pool, server):
    """The OpenAI endpoint issues the ticket without asking the holders where the blocks are, and asks
    once its first token is out (``describe_ahead``): the receiver's begin uses that answer; asked
    again once the KV is gone, nothing is kept for it."""
    result = _kept(pool)
    expected = pool.fetch_kv(result)
    ticket = server.ticket(result, describe=False)
    assert ticket["request_id"] == result.request_id and result.request_id not in server._described
    server.describe_ahead(result)
    assert server._described[result.request_id][0] in ("mapped", "nixl")
    kv = _receiver(server, pool).fetch(result.request_id)
    assert torch.equal(kv.rows(), expected) and result.request_id not in server._described
    server.describe_ahead(result)  # late: the KV was freed with the transfer
    assert result.request_id not in server._described and _no_block_leaked(pool)


def test_a_receiver_that_never_acks_times_out_and_the_kv_is_freed(pool):
    result = _kept(pool)
    with KVServer(pool, token=TOKEN, ack_timeout_s=1.0) as server, socket.create_connection((server.host, server.port), timeout=5) as sock:
        send_frame(sock, "hello", {"request_id": result.request_id, "token": TOKEN})
        expect(read_frame(sock, max_payload=0)[0], "begin")
        # no ack: the server gives up after ack_timeout_s and says why
        with pytest.raises(KVTransferError, match="the other side reported: timed out"):
            read_frame(sock, max_payload=0)
    assert _no_block_leaked(pool)


def test_kv_nobody_claims_is_freed_after_the_ttl_and_a_late_receiver_is_refused(pool):
    with KVServer(pool, unclaimed_ttl_s=0.5) as server:
        result = _kept(pool, 60)
        assert _wait_freed(pool, timeout=10.0) and server.transfers["expired"] == 1
        with pytest.raises(KVTransferError, match="no kept KV for request"):
            KVReceiver(server.host, server.port, model_fingerprint=pool.model_config.fingerprint()).fetch(result.request_id)
    assert pool.prefill(np.arange(20)).num_tokens == 20


def test_a_pool_without_nixl_hands_off_mapped_or_over_tcp_and_refuses_a_receiver_that_speaks_only_nixl(ray_cluster):
    config = CONFIG.replace(tp=1, pcp=1, nixl="off", use_gpus=False)  # beside the module's pool, which holds the logical GPUs
    with PrefillPool(config).start() as plain, KVServer(plain) as server:
        assert plain.worker_infos[0][0].kv_transports == ("mapped", "tcp")
        fingerprint = plain.model_config.fingerprint()
        for transport in ("auto", "tcp"):  # auto: mapped, this receiver being on the holders' host
            result = plain.prefill(np.arange(50), keep_kv=True)
            expected = plain.fetch_kv(result)
            with pytest.raises(KVTransferError, match=r"the receiver takes KV over \['nixl'\]; this pool's workers serve it over \['mapped', 'tcp'\]"):
                KVReceiver(server.host, server.port, model_fingerprint=fingerprint, transport="nixl").fetch(result.request_id)
            kv = KVReceiver(server.host, server.port, model_fingerprint=fingerprint, transport=transport).fetch(result.request_id)
            assert kv.transport == {"auto": "mapped"}.get(transport, transport) and torch.equal(kv.rows(), expected)


def test_garbage_on_the_port_is_refused_and_the_server_keeps_serving(pool, server):
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + encode_frame("hello")[:3])
        with pytest.raises(KVTransferError, match="not an mlapool KV frame"):
            read_frame(sock, max_payload=0)
    assert _receiver(server, pool).fetch(_kept(pool).request_id).tokens == 130
    assert _no_block_leaked(pool)


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
    assert _kv_requests(pool) == 2 * CONFIG.workers_per_replica  # no ack, nothing freed: the KV waits for another receiver
    replacement = _decoder()
    try:
        assert ray.get(replacement.receive.remote(pool.kv_source(second)))["tokens"] == 70
    finally:
        ray.kill(replacement)
    pool.release(first)
    pool.release(second)
    assert _kv_requests(pool) == 0
    assert pool.prefill(np.arange(30)).num_tokens == 30
