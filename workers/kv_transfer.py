"""The KV handoff wire format, and :class:`KVReceiver`, the client a decode server embeds.

Nothing here imports Ray: a decode server needs only torch, msgpack and this package.

Frame (every message, both directions)::

    magic b"MLKV" | version u16 | header_len u32 | payload_len u32 |
    header (msgpack map with "kind") | payload (raw bytes) | crc32(header + payload) u32

All integers are big-endian. A receiver refuses a frame whose magic, version,
sizes or checksum it does not accept, with :class:`KVTransferError` naming why.

A transfer, one request per TCP connection::

    receiver -> hello  {request_id, token?, model_fingerprint?, dtype?, block_size?}
                        (the sender refuses, freeing nothing, a receiver whose model, KV dtype
                        or block size differs from its own)
    sender   -> begin  {request_id, tokens, layers, dtype, block_size, width, num_blocks,
                        model_fingerprint, shard_map}          (or error {message})
    sender   -> layer  {layer, shape} + the layer's rows, vLLM's MLA paged layout
                        [num_blocks, block_size, width] = [kv_c_normed | k_pe], in token order
    sender   -> end    {request_id, layers}
    receiver -> ack    {request_id}                            (or error {message})

The sender frees the request's KV after the ack, or after an error, a
disconnect or a timeout (see ``cluster.kv_server``).
"""

from __future__ import annotations

import socket
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from configs.model import DTYPES

MAGIC = b"MLKV"
VERSION = 1
PREFIX = struct.Struct("!4sHII")
CRC = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 20


class KVTransferError(RuntimeError):
    """A transfer failed: a bad frame, a refused request, a timeout or a lost connection."""


# ---- frames ------------------------------------------------------------------------------------
Payload = bytes | bytearray | memoryview | np.ndarray  # any C-contiguous buffer; sent without a copy


def encode_frame(kind: str, header: dict[str, Any] | None = None, payload: Payload = b"") -> bytes:
    head, view, crc = _frame_parts(kind, header, payload)
    return head + bytes(view) + crc


def send_frame(sock: socket.socket, kind: str, header: dict[str, Any] | None = None, payload: Payload = b"") -> None:
    head, view, crc = _frame_parts(kind, header, payload)
    if view.nbytes:
        sock.sendall(head)
        sock.sendall(view)
        sock.sendall(crc)
    else:
        sock.sendall(head + crc)


def _frame_parts(kind: str, header: dict[str, Any] | None, payload: Payload) -> tuple[bytes, memoryview, bytes]:
    body = msgpack.packb({"kind": kind, **(header or {})}, use_bin_type=True)
    view = memoryview(payload).cast("B")
    return PREFIX.pack(MAGIC, VERSION, len(body), view.nbytes) + body, view, CRC.pack(zlib.crc32(view, zlib.crc32(body)))


def read_frame(sock: socket.socket, *, max_payload: int) -> tuple[dict[str, Any], bytearray]:
    """The next frame's ``(header, payload)``; raises :class:`KVTransferError` for anything malformed.
    The payload is read straight into one buffer of its announced size, so ``max_payload`` also
    bounds what a frame can make this side allocate."""
    magic, version, header_len, payload_len = PREFIX.unpack(_read_exact(sock, PREFIX.size))
    if magic != MAGIC:
        raise KVTransferError(f"not an mlapool KV frame (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise KVTransferError(f"KV frame version {version} is not supported; this side speaks version {VERSION}")
    if header_len > MAX_HEADER_BYTES:
        raise KVTransferError(f"KV frame header of {header_len} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    if payload_len > max_payload:
        raise KVTransferError(f"KV frame payload of {payload_len} bytes exceeds the limit of {max_payload}")
    body = _read_exact(sock, header_len)
    payload = _read_exact(sock, payload_len)
    (crc,) = CRC.unpack(_read_exact(sock, CRC.size))
    if crc != zlib.crc32(payload, zlib.crc32(body)):
        raise KVTransferError("KV frame checksum mismatch: the frame was corrupted in transit")
    try:
        header = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # noqa: BLE001 -- msgpack raises several types for garbage
        raise KVTransferError(f"KV frame header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise KVTransferError("KV frame header must be a map with a 'kind'")
    if header["kind"] == "error":
        raise KVTransferError(f"the other side reported: {header.get('message', 'no reason given')}")
    return header, payload


def expect(header: dict[str, Any], kind: str) -> dict[str, Any]:
    if header["kind"] != kind:
        raise KVTransferError(f"expected a {kind!r} frame, got {header['kind']!r}")
    return header


def _read_exact(sock: socket.socket, count: int) -> bytearray:
    buf = bytearray(count)
    view, got = memoryview(buf), 0
    while got < count:
        try:
            n = sock.recv_into(view[got:], min(count - got, 1 << 24))
        except socket.timeout:
            raise KVTransferError("timed out waiting for the other side") from None
        except OSError as exc:
            raise KVTransferError(f"connection lost ({exc})") from None
        if not n:
            raise KVTransferError(f"connection closed mid-frame ({got} of {count} bytes read)")
        got += n
    return buf


# ---- tensors on the wire and in Ray's object store ----------------------------------------------
def tensor_buffer(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a numpy array that shares its memory (no copy when contiguous)."""
    return tensor.contiguous().view(torch.uint8).numpy()


def tensor_from_bytes(payload: bytearray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor over ``payload`` (shared, not copied: it must be writable, as ``read_frame``'s is)."""
    expected = dtype.itemsize
    for dim in shape:
        expected *= dim
    if len(payload) != expected:
        raise KVTransferError(f"layer payload has {len(payload)} bytes; shape {shape} of {dtype} needs {expected}")
    if not expected:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(shape)


@dataclass
class HostKV:
    """Latent rows on the host as a numpy array of their bytes: Ray moves numpy arrays through its
    object store without pickling them (a torch tensor is pickled, tens of times slower)."""

    data: np.ndarray  # uint8 [..., width * itemsize]
    dtype: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "HostKV":
        return cls(tensor_buffer(tensor.cpu()), str(tensor.dtype).removeprefix("torch."))

    def tensor(self) -> torch.Tensor:
        """The rows as a tensor of their dtype (a copy when the array is read-only, as Ray's are)."""
        dtype = DTYPES[self.dtype]
        if not self.data.size:  # numpy gives empty arrays strides a byte view cannot take
            return torch.empty(*self.data.shape[:-1], self.data.shape[-1] // dtype.itemsize, dtype=dtype)
        data = self.data if self.data.flags.writeable else self.data.copy()
        return torch.from_numpy(data).view(dtype)


def paged(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows ``[tokens, width]`` as vLLM's paged layout ``[num_blocks, block_size, width]`` (zero-padded)."""
    tokens, width = rows.shape
    num_blocks = -(-tokens // block_size)
    out = rows.new_zeros(num_blocks * block_size, width)
    out[:tokens] = rows
    return out.view(num_blocks, block_size, width)


# ---- the receiver ----------------------------------------------------------------------------------
@dataclass
class ReceivedKV:
    """A request's latent KV as received: metadata and one paged tensor per layer."""

    meta: dict[str, Any]
    layers: list[torch.Tensor]  # per layer [num_blocks, block_size, width]

    @property
    def tokens(self) -> int:
        return self.meta["tokens"]

    def rows(self) -> torch.Tensor:
        """``[layers, tokens, width]`` in token order."""
        return torch.stack([layer.reshape(-1, layer.shape[-1])[: self.tokens] for layer in self.layers])


class KVReceiver:
    """Pulls a prefilled request's KV from a prefill tier's KV server (``cluster.kv_server``).

        receiver = KVReceiver("10.0.0.5", 7431, token=..., model_fingerprint=config.fingerprint())
        kv = receiver.fetch("req-17")       # ReceivedKV; the prefill side frees it once acknowledged

    ``model_fingerprint``, ``dtype`` and ``block_size``, when given, are presented to the server
    first: one that holds KV of another model, dtype or block size refuses before sending, and
    keeps the KV for a matching receiver.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        model_fingerprint: str | None = None,
        dtype: str | None = None,
        block_size: int | None = None,
        timeout_s: float = 60.0,
        max_layer_bytes: int = 1 << 36,
    ) -> None:
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if block_size is not None and (type(block_size) is not int or block_size < 1):
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.address = (host, port)
        self.token, self.model_fingerprint = token, model_fingerprint
        self.dtype, self.block_size = dtype, block_size
        self.timeout_s, self.max_layer_bytes = timeout_s, max_layer_bytes

    def fetch(self, request_id: str) -> ReceivedKV:
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as exc:
            raise KVTransferError(f"cannot reach the KV server at {self.address[0]}:{self.address[1]} ({exc})") from None
        with sock:
            send_frame(sock, "hello", {
                "request_id": request_id, "token": self.token, "model_fingerprint": self.model_fingerprint,
                "dtype": self.dtype, "block_size": self.block_size,
            })  # fmt: skip
            try:
                kv = self._receive(sock, request_id)
            except KVTransferError as exc:
                _try_send(sock, "error", {"message": str(exc)})
                raise
            send_frame(sock, "ack", {"request_id": request_id})
            return kv

    def _receive(self, sock: socket.socket, request_id: str) -> ReceivedKV:
        meta = expect(read_frame(sock, max_payload=0)[0], "begin")
        if meta.get("request_id") != request_id:
            raise KVTransferError(f"asked for request {request_id!r}, the server sent {meta.get('request_id')!r}")
        if self.model_fingerprint is not None and meta.get("model_fingerprint") != self.model_fingerprint:
            raise KVTransferError(
                f"KV of request {request_id!r} is from model {meta.get('model_fingerprint')!r}; "
                f"this decode server runs {self.model_fingerprint!r}"
            )
        dtype = DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise KVTransferError(f"unknown KV dtype {meta.get('dtype')!r}; valid: {', '.join(DTYPES)}")
        sizes = {key: meta.get(key) for key in ("layers", "num_blocks", "block_size", "width")}
        if not all(type(value) is int and value >= 0 for value in sizes.values()):
            raise KVTransferError(f"the begin frame's sizes are not counts: {sizes}")
        shape = [sizes["num_blocks"], sizes["block_size"], sizes["width"]]
        layer_bytes = shape[0] * shape[1] * shape[2] * dtype.itemsize
        if layer_bytes > self.max_layer_bytes:
            raise KVTransferError(f"a layer of {shape} {meta['dtype']} is {layer_bytes} bytes, over max_layer_bytes={self.max_layer_bytes}")
        layers = []
        for index in range(sizes["layers"]):
            header, payload = read_frame(sock, max_payload=layer_bytes)
            header = expect(header, "layer")
            if header.get("layer") != index or header.get("shape") != shape:
                raise KVTransferError(f"expected layer {index} of shape {shape}, got layer {header.get('layer')!r} of {header.get('shape')!r}")
            layers.append(tensor_from_bytes(payload, dtype, shape))
        expect(read_frame(sock, max_payload=0)[0], "end")
        return ReceivedKV(meta, layers)


def _try_send(sock: socket.socket, kind: str, header: dict[str, Any]) -> None:
    try:
        send_frame(sock, kind, header)
    except OSError:
        pass  # the other side is already gone
