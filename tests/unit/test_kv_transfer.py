"""The KV handoff frames and the receiver against bad input (socket pairs, no Ray)."""

import random
import socket
import struct
import threading

import pytest
import torch

from workers.kv_transfer import (
    VERSION,
    KVReceiver,
    KVTransferError,
    encode_frame,
    paged,
    read_frame,
    tensor_buffer,
    tensor_from_bytes,
)


def _read(data: bytes, max_payload: int = 1 << 20):
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        return read_frame(b, max_payload=max_payload)


def test_a_frame_round_trips_with_its_payload():
    blocks = paged(torch.randn(70, 9).to(torch.bfloat16), 16)
    assert blocks.shape == (5, 16, 9) and torch.equal(blocks[4, 6:], torch.zeros(10, 9, dtype=torch.bfloat16))
    header, payload = _read(encode_frame("layer", {"layer": 3, "shape": [5, 16, 9]}, tensor_buffer(blocks)))
    assert header == {"kind": "layer", "layer": 3, "shape": [5, 16, 9]}
    assert torch.equal(tensor_from_bytes(payload, torch.bfloat16, header["shape"]), blocks)


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
    with pytest.raises(KVTransferError, match="layer payload has 3 bytes; shape \\[2\\] of torch.float32 needs 8"):
        tensor_from_bytes(b"abc", torch.float32, [2])


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


def _fake_server(*frames: bytes) -> int:
    """A one-connection server that reads the hello, then sends ``frames``; returns its port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                read_frame(conn, max_payload=0)
                for frame in frames:
                    conn.sendall(frame)
                try:
                    read_frame(conn, max_payload=0)  # the receiver's error or ack
                except KVTransferError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


BEGIN = {"request_id": "r", "tokens": 20, "layers": 1, "dtype": "float32", "block_size": 16, "width": 2, "num_blocks": 2}


@pytest.mark.parametrize(
    "begin, layer, match",
    [
        ({**BEGIN, "num_blocks": 1 << 40}, None, "over max_layer_bytes=1048576"),
        ({**BEGIN, "num_blocks": "2"}, None, "sizes are not counts"),
        ({**BEGIN, "layers": -1}, None, "sizes are not counts"),
        (BEGIN, {"layer": 0, "shape": [1, 16, 4]}, "expected layer 0 of shape \\[2, 16, 2\\], got layer 0 of \\[1, 16, 4\\]"),
        (BEGIN, {"layer": 1, "shape": [2, 16, 2]}, "expected layer 0 of shape"),
    ],
)
def test_a_receiver_refuses_sizes_it_was_not_promised_before_allocating_them(begin, layer, match):
    frames = [encode_frame("begin", begin)]
    if layer is not None:
        frames.append(encode_frame("layer", layer, bytes(2 * 16 * 2 * 4)))
    port = _fake_server(*frames)
    with pytest.raises(KVTransferError, match=match):
        KVReceiver("127.0.0.1", port, timeout_s=5, max_layer_bytes=1 << 20).fetch("r")


def test_a_receiver_takes_a_well_formed_transfer_without_copying_the_payload_twice():
    rows = torch.randn(20, 2)
    port = _fake_server(
        encode_frame("begin", BEGIN),
        encode_frame("layer", {"layer": 0, "shape": [2, 16, 2]}, tensor_buffer(paged(rows, 16))),
        encode_frame("end", {"request_id": "r", "layers": 1}),
    )
    kv = KVReceiver("127.0.0.1", port, timeout_s=5).fetch("r")
    assert torch.equal(kv.rows()[0], rows) and kv.layers[0].is_contiguous()
