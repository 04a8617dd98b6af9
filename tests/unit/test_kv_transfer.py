"""The KV handoff's frames, and the receiver against bad input from a server or a holder (socket
pairs and fake peers, no Ray)."""

import random
import socket
import struct
import threading

import numpy as np
import pytest
import torch

from kv.receiver import KVReceiver, _shard_major
from kv.frames import (
    VERSION,
    KVTransferError,
    encode_frame,
    read_frame,
    read_head,
    read_payload_into,
    send_frame,
    tensor_buffer,
)


def _read(data: bytes, max_payload: int = 1 << 20):
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        return read_frame(b, max_payload=max_payload)


def test_a_frame_round_trips_its_payload_parts_into_the_readers_buffers():
    rows = torch.randn(3, 16, 9).to(torch.bfloat16)
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, "blocks", {"layer": 3}, [tensor_buffer(rows[:1]), tensor_buffer(rows[1:])])
        head = read_head(b)
        into = torch.empty_like(rows)
        read_payload_into(b, head, [tensor_buffer(into[:2]), tensor_buffer(into[2:])])  # other cuts, same bytes
    assert head.header == {"kind": "blocks", "layer": 3} and torch.equal(into, rows)


def test_the_payload_checksum_is_the_senders_choice_and_the_header_is_always_checked():
    checked = bytearray(encode_frame("blocks", {"layer": 0}, b"\x01" * 64))
    unchecked = bytearray(encode_frame("blocks", {"layer": 0}, b"\x01" * 64, checksum=False))
    payload_at = len(checked) - 4 - 64
    for frame in (checked, unchecked):
        frame[payload_at] ^= 0xFF
    with pytest.raises(KVTransferError, match="checksum mismatch"):
        _read(bytes(checked))
    assert _read(bytes(unchecked))[1][0] == 0xFE  # TCP's own checksums are all that cover it
    unchecked[22] ^= 0xFF  # in the msgpack header
    with pytest.raises(KVTransferError, match="checksum mismatch|not valid msgpack|must be a map"):
        _read(bytes(unchecked))


def test_corrupted_truncated_and_foreign_frames_are_refused_with_the_reason():
    frame = bytearray(encode_frame("layer", {"layer": 0}, b"\x01" * 64))
    corrupted = bytes(frame[:40]) + bytes([frame[40] ^ 0xFF]) + bytes(frame[41:])
    with pytest.raises(KVTransferError, match="checksum mismatch"):
        _read(corrupted)
    with pytest.raises(KVTransferError, match="connection closed mid-frame"):
        _read(bytes(frame[:-10]))
    newer = bytes(frame[:4]) + struct.pack("!H", VERSION + 1) + bytes(frame[6:])
    with pytest.raises(KVTransferError, match=f"version {VERSION + 1} is not supported; this side speaks version {VERSION}"):
        _read(newer)
    with pytest.raises(KVTransferError, match="not an mlapool KV frame"):
        _read(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(KVTransferError, match="payload of 64 bytes exceeds the limit of 10"):
        _read(bytes(frame), max_payload=10)
    with pytest.raises(KVTransferError, match="the other side reported: out of memory"):
        _read(encode_frame("error", {"message": "out of memory"}))


def test_fuzz_random_and_truncated_frames_never_escape_as_other_errors():
    rng = random.Random(0)
    valid = encode_frame("begin", {"request_id": "r", "tokens": 5, "layers": 2}, b"payload" * 30)
    for trial in range(300):
        kind = trial % 3
        if kind == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80)))
        elif kind == 1:
            data = valid[: rng.randrange(len(valid))]
        else:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        try:
            _read(data)
        except KVTransferError:
            pass  # the only failure allowed


def test_a_receiver_times_out_on_a_silent_server_and_reports_an_unreachable_one():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    thread.start()
    with pytest.raises(KVTransferError, match="timed out waiting for the other side"):
        KVReceiver("127.0.0.1", port, timeout_s=0.5).fetch("r")
    thread.join()
    accepted[0][0].close()
    listener.close()
    with pytest.raises(KVTransferError, match=f"cannot reach the KV server at 127.0.0.1:{port}"):
        KVReceiver("127.0.0.1", port, timeout_s=0.5).fetch("r")


# ---- fake peers ---------------------------------------------------------------------------------
def _serve_once(handle, done: threading.Event | None = None) -> int:
    """A one-connection server running ``handle(conn)`` (then setting ``done``); returns its port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                try:
                    handle(conn)
                except (KVTransferError, OSError):
                    pass
        if done is not None:
            done.set()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


class Outcome(list):
    """What a fake server heard: the hello, then the receiver's last word (ack or error)."""

    def __init__(self):
        super().__init__()
        self.done = threading.Event()

    @property
    def last(self) -> dict:
        assert self.done.wait(5), "the fake server never heard the receiver's last word"
        return self[-1]


def _fake_server(begin: dict, outcome: Outcome, confirm: bool = True) -> int:
    """Reads the hello, sends ``begin``, records the receiver's last word (ack or error) and, after an
    ack, confirms it (``done``) or says it gave up first."""

    def handle(conn):
        outcome.append(read_frame(conn, max_payload=0)[0])
        send_frame(conn, "begin", begin)
        try:
            outcome.append(read_frame(conn, max_payload=0)[0])
        except KVTransferError as exc:
            outcome.append({"kind": "error", "message": str(exc)})
            return
        if confirm:
            send_frame(conn, "done", {"request_id": begin["request_id"]})
        else:  # a server that gave up before the ack
            send_frame(conn, "error", {"message": "timed out waiting for the other side"})

    return _serve_once(handle, outcome.done)


def _fake_holder(frames) -> int:
    """Reads the pull, then sends ``frames`` (callables of the connection, or bytes)."""

    def handle(conn):
        read_frame(conn, max_payload=0)
        for frame in frames:
            conn.sendall(frame) if isinstance(frame, bytes) else frame(conn)

    return _serve_once(handle)


def _begin(rows: torch.Tensor, holder_port: int, **changes) -> dict:
    """A one-holder (PCP 1), one-layer begin frame for ``rows`` [tokens, width] float32, block size 16."""
    blocks = -(-rows.shape[0] // 16)
    return {
        "request_id": "r", "tokens": rows.shape[0], "layers": 1, "dtype": "float32", "block_size": 16,
        "width": rows.shape[1], "num_blocks": blocks, "model_fingerprint": "m", "transport": "tcp", "pcp": 1,
        "shards": [{"rows": rows.shape[0], "blocks": list(range(blocks)), "nixl": None,
                    "tcp": {"host": "127.0.0.1", "port": holder_port, "ticket": "t"}}],
        **changes,
    }  # fmt: skip


def _blocks_frame(rows: torch.Tensor, first: int, count: int, layer: int = 0) -> bytes:
    paged = torch.zeros(-(-rows.shape[0] // 16) * 16, rows.shape[1])
    paged[: rows.shape[0]] = rows
    piece = paged.view(-1, 16, rows.shape[1])[first : first + count]
    return encode_frame("blocks", {"layer": layer, "first": first, "count": count}, tensor_buffer(piece))


def _receiver(port: int, **kwargs) -> KVReceiver:
    return KVReceiver("127.0.0.1", port, transport="tcp", timeout_s=5, **kwargs)


def test_a_receiver_whose_ack_is_not_confirmed_does_not_return_the_kv():
    rows = torch.randn(40, 2)
    holder = _fake_holder([_blocks_frame(rows, 0, 3), encode_frame("end", {"request_id": "r"})])
    outcome = Outcome()
    with pytest.raises(KVTransferError, match="did not confirm the ack .*timed out.*may have been freed"):
        _receiver(_fake_server(_begin(rows, holder), outcome, confirm=False)).fetch("r")
    assert outcome.last["kind"] == "ack"


def test_a_receiver_takes_a_holders_blocks_straight_into_its_cache_at_the_ids_it_chose():
    rows = torch.randn(40, 2)
    holder = _fake_holder([_blocks_frame(rows, 2, 1), _blocks_frame(rows, 0, 2), encode_frame("end", {"request_id": "r"})])
    outcome = Outcome()
    cache = torch.full((1, 8, 16, 2), -1.0)
    kv = _receiver(_fake_server(_begin(rows, holder), outcome)).fetch("r", into=cache, block_ids=[5, 6, 1])
    assert torch.equal(kv.rows()[0], rows) and torch.equal(cache[0, 6], rows[16:32]) and torch.equal(cache[0, 1, :8], rows[32:])
    assert (cache[0, [0, 2, 3, 4, 7]] == -1).all()  # no other block touched
    last = outcome.last
    hello = outcome[0]
    assert hello["max_tokens"] == 48 and hello["layers"] == 1 and hello["width"] == 2 and hello["dtype"] == "float32"
    assert last["kind"] == "ack"


@pytest.mark.parametrize(
    "frames, match",
    [
        (lambda rows: [_blocks_frame(rows, 2, 2)], "blocks frame out of range"),
        (lambda rows: [_blocks_frame(rows, 0, 1, layer=1)], "blocks frame out of range"),
        (lambda rows: [_blocks_frame(rows, 0, 2), _blocks_frame(rows, 1, 1)], "were sent twice"),
        (lambda rows: [_blocks_frame(rows, 0, 2), encode_frame("end", {})], "1 of 3 blocks missing"),
        (lambda rows: [_blocks_frame(rows, 0, 2)], "connection closed mid-frame"),
        (lambda rows: [encode_frame("error", {"message": "unknown or expired KV pull ticket"})], "expired KV pull ticket"),
    ],
    ids=["past-the-shard", "no-such-layer", "twice", "missing", "holder-gone", "holder-refuses"],
)
def test_a_receiver_refuses_a_holder_that_sends_other_blocks_than_promised_and_tells_the_server(frames, match):
    rows = torch.randn(40, 2)
    outcome = Outcome()
    port = _fake_server(_begin(rows, _fake_holder(frames(rows))), outcome)
    with pytest.raises(KVTransferError, match=f"holder 0: .*{match}"):
        _receiver(port).fetch("r")
    assert outcome.last["kind"] == "error" and match.split()[0] in outcome.last["message"]


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_blocks": "2"}, "sizes are not counts"),
        ({"layers": -1}, "sizes are not counts"),
        ({"pcp": 0}, "sizes are not counts"),
        ({"transport": "carrier-pigeon"}, "shards or transport are malformed"),
        ({"shards": []}, "shards or transport are malformed"),
        ({"num_blocks": 9}, "PCP rank 0's shard does not list its 9 blocks"),
        ({"dtype": "float128"}, "unknown KV dtype 'float128'"),
        ({"model_fingerprint": "other"}, "is from model 'other'; this decode server runs 'm'"),
    ],
)
def test_a_receiver_refuses_a_begin_frame_it_cannot_trust_before_allocating_anything(changes, match):
    outcome = Outcome()
    port = _fake_server(_begin(torch.randn(40, 2), 1, **changes), outcome)
    with pytest.raises(KVTransferError, match=match):
        _receiver(port, model_fingerprint="m").fetch("r")
    assert outcome.last["kind"] == "error"


def test_a_receiver_bounds_what_a_new_cache_may_cost():
    outcome = Outcome()
    port = _fake_server(_begin(torch.randn(40, 2), 1, num_blocks=1 << 40), outcome)
    with pytest.raises(KVTransferError, match="does not list its 1099511627776 blocks"):
        _receiver(port).fetch("r")
    outcome = Outcome()
    port = _fake_server(_begin(torch.randn(40, 2), 1), outcome)
    with pytest.raises(KVTransferError, match="is 384 bytes, over max_bytes=100"):
        _receiver(port, max_bytes=100).fetch("r")
    assert outcome.last["kind"] == "error"


def test_bad_destinations_and_options_are_refused_before_connecting():
    receiver = KVReceiver("127.0.0.1", 1)
    cache = torch.zeros(2, 8, 16, 4)
    for kwargs, match in [
        ({"block_ids": [0]}, "block_ids need a cache"),
        ({"into": cache}, "into needs block_ids"),
        ({"into": cache[:, :, :, :2], "block_ids": [0]}, "contiguous"),
        ({"into": torch.zeros(8, 16), "block_ids": [0]}, "contiguous \\[layers, num_blocks, block_size, width\\]"),
        ({"into": [cache[0], cache[1, :4]], "block_ids": [0]}, "layer 1 of into is \\(4, 16, 4\\)"),
        ({"into": [cache[0, :, :, :2]], "block_ids": [0]}, "layer 0 of into .* contiguous"),
        ({"into": "cache", "block_ids": [0]}, "or a list of per-layer tensors, got str"),
        ({"into": cache, "block_ids": [0], "start": -1}, "start must be a non-negative integer"),
        ({"into": cache, "block_ids": [0, 8]}, r"integers in \[0, 8\), got \[0, 8\]"),
        ({"into": cache, "block_ids": [1, 1]}, "must not repeat"),
    ]:
        with pytest.raises(ValueError, match=match):
            receiver.fetch("r", **kwargs)
    with pytest.raises(ValueError, match="transport must be one of auto, mapped, nixl, tcp"):
        KVReceiver("h", 1, transport="rdma")
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of"):
        KVReceiver("h", 1, dtype="fp8")


def test_a_new_caches_block_ids_keep_each_holders_blocks_in_one_run():
    table = _shard_major(9, 2)
    assert table == [0, 5, 1, 6, 2, 7, 3, 8, 4]
    for rank in range(2):
        ids = np.array(table[rank::2])
        assert (np.diff(ids) == 1).all()


@pytest.mark.parametrize("seed", range(6))
def test_place_rows_sends_each_token_from_its_holders_row_to_the_destinations_row(seed):
    """``kv.receiver.place_rows`` (built block by block) against the rule said token by token: token
    ``t`` is row ``t % B`` of pool block ``t // B``, held by PCP rank ``(t // B) % pcp`` as its
    ``(t // B) // pcp``-th block, and goes to row ``t % b`` of destination block ``table[t // b]``;
    tokens before ``start`` are not sent; a holder listing more blocks than the request uses, a
    destination table longer than needed."""
    from kv.receiver import place_rows

    rng = np.random.default_rng(seed)
    for _ in range(40):
        pcp, pool_block, block = int(rng.integers(1, 5)), int(rng.choice([4, 16, 64])), int(rng.choice([3, 16, 64, 128]))
        tokens = int(rng.integers(1, 700))
        start = int(rng.integers(0, tokens + 1))
        pool_blocks = -(-tokens // pool_block)
        shards = [{"blocks": rng.permutation(5000)[: len(range(r, pool_blocks, pcp)) + int(rng.integers(0, 2))].tolist()} for r in range(pcp)]
        table = rng.permutation(5000)[: -(-tokens // block) + int(rng.integers(0, 3))].tolist()
        placed = place_rows({"block_size": pool_block, "pcp": pcp, "tokens": tokens, "shards": shards}, block, table, start)
        for rank, part in enumerate(placed):
            mine = [t for t in range(start, tokens) if (t // pool_block) % pcp == rank]
            assert part.src.tolist() == [shards[rank]["blocks"][(t // pool_block) // pcp] * pool_block + t % pool_block for t in mine]
            assert part.dst.tolist() == [table[t // block] * block + t % block for t in mine]
            by_block = np.full((len(shards[rank]["blocks"]), pool_block), -1)
            for t in mine:
                by_block[(t // pool_block) // pcp, t % pool_block] = table[t // block] * block + t % block
            assert np.array_equal(part.by_block, by_block)
