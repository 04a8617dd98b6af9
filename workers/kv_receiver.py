"""The client a decode server embeds to take a prefilled request's latent KV from a prefill tier:
straight from the workers that hold it, into the decode server's own paged cache.

Nothing here imports Ray: a decode server needs torch, msgpack, this package and, for NIXL, nixl.

    receiver = KVReceiver("10.0.0.5", 7431, token=..., model_fingerprint=config.fingerprint())
    kv = receiver.fetch("req-17")                              # a new [layers, blocks, block_size, 576] cache
    kv = receiver.fetch("req-18", into=cache, block_ids=free)  # or into yours, at block ids you choose

A transfer (the frames of ``workers.kv_transfer``)::

    receiver -> server  hello {request_id, token?, model_fingerprint?, dtype?, block_size?, layers?,
                               width?, max_blocks?, transports}
                (the server refuses, freeing nothing, a receiver whose model, dtype, block size or
                cache shape differs from its own, who offers fewer blocks than the request needs,
                or who speaks none of its transports)
    server -> receiver  begin {request_id, tokens, layers, dtype, block_size, width, num_blocks,
                               model_fingerprint, transport, pcp, shards: [per PCP rank: rows,
                               blocks (its block ids in table order), tcp {host, port, ticket},
                               nixl (its registered region) or None]}
    receiver <- holders the blocks: NIXL READs from every holder at once, or one TCP pull per
                holder (``workers.kv_export``), each straight into the destination blocks
    receiver -> server  ack {request_id}    (or error {message})
    server -> receiver  done {request_id}   (or error {message}: it gave up first, and the KV it freed
                                              may have been overwritten under the transfer)

Block ``j`` of the request (tokens ``j * block_size ...``) is block ``j // pcp`` of PCP rank
``j % pcp``'s table. The server frees the request's KV on the holders after the ack, and also
after an error, a lost connection or ``ack_timeout_s`` (``cluster.kv_server``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from configs.model import DTYPES
from workers.kv_nixl import NixlEndpoint, NixlError, Region, nixl_unavailable
from workers.kv_transfer import KVTransferError, expect, read_frame, read_head, read_payload_into, send_frame, try_send

TRANSPORTS = ("auto", "nixl", "tcp")


@dataclass
class ReceivedKV:
    """A request's latent KV as received: its blocks in ``cache`` at ``block_table`` (token order)."""

    meta: dict[str, Any]
    cache: torch.Tensor  # [layers, num_blocks, block_size, width]: the receiver's (``into``) or a new one
    block_table: list[int]
    transport: str
    transfer_s: float  # from the first byte asked of a holder to the last one in the destination
    bytes: int  # KV bytes moved into the destination

    @property
    def tokens(self) -> int:
        return self.meta["tokens"]

    @property
    def layers(self) -> list[torch.Tensor]:
        """Per layer, the request's blocks in token order ``[num_blocks, block_size, width]`` (a copy)."""
        table = torch.tensor(self.block_table, device=self.cache.device)
        return [layer.index_select(0, table) for layer in self.cache]

    def rows(self) -> torch.Tensor:
        """``[layers, tokens, width]`` in token order (a copy)."""
        return torch.stack([layer.reshape(-1, layer.shape[-1])[: self.tokens] for layer in self.layers])


class KVReceiver:
    """Takes prefilled requests' KV from a prefill tier's KV server (``cluster.kv_server``).

    ``transport``: ``nixl`` (one-sided READs from the holders' registered caches: NVLink, RDMA or
    shared memory, as UCX finds), ``tcp`` (each holder streams its blocks) or ``auto`` (NIXL when it
    is installed here and on the tier, else TCP). ``model_fingerprint``, ``dtype`` and ``block_size``,
    when given, are presented first: a server whose KV differs refuses before anything is committed
    and keeps the KV for a matching receiver. ``device`` is where :meth:`fetch` puts a new cache
    (``cuda:1``, ``cpu``). ``checksum``: TCP data frames carry a CRC32 of their payload too (off by
    default, as in NIXL's, NCCL's and vLLM's and SGLang's KV transfers: TCP checksums its segments,
    and the CRC costs a third of the rate on a 2-core host; control frames are always checked).
    ``max_bytes`` bounds the new cache a fetch without ``into`` may allocate. Keep one receiver per
    decode server process: its NIXL agent, its peers and the caches it registered are reused.
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
        transport: str = "auto",
        device: str | torch.device = "cpu",
        checksum: bool = False,
        timeout_s: float = 60.0,
        max_bytes: int = 1 << 40,
    ) -> None:
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if block_size is not None and (type(block_size) is not int or block_size < 1):
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        missing = nixl_unavailable()
        if transport == "nixl" and missing:
            raise ValueError(f"transport 'nixl' needs NIXL here: {missing}")
        if transport == "auto":
            self.transports = ["tcp"] if missing else ["nixl", "tcp"]
        else:
            self.transports = [transport]
        self.address = (host, port)
        self.token, self.model_fingerprint = token, model_fingerprint
        self.dtype, self.block_size = dtype, block_size
        self.device = torch.device(device)
        self.checksum, self.timeout_s, self.max_bytes = checksum, timeout_s, max_bytes
        self._nixl: NixlEndpoint | None = None

    def fetch(
        self,
        request_id: str,
        into: torch.Tensor | None = None,
        block_ids: Sequence[int] | None = None,
        *,
        on_begin: Callable[[dict], None] | None = None,
    ) -> ReceivedKV:
        """Take ``request_id``'s KV. ``into``: your paged cache ``[layers, num_blocks, block_size, width]``
        (CPU or CUDA; registered with NIXL on first use) with ``block_ids``, one free block per block
        of the request, in token order (more are allowed; the first ones are used). Without ``into`` a
        new cache of the request's size is made on ``device``. ``on_begin(meta)`` is called once the
        server committed, before any data moves. The prefill side frees the KV once this returns."""
        _check_destination(into, block_ids)
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as exc:
            raise KVTransferError(f"cannot reach the KV server at {self.address[0]}:{self.address[1]} ({exc})") from None
        with sock:
            send_frame(sock, "hello", self._hello(request_id, into, block_ids))
            try:
                meta = self._begin(sock, request_id, into)
                if into is not None and len(block_ids) < meta["num_blocks"]:
                    raise KVTransferError(f"the request has {meta['num_blocks']} blocks; {len(block_ids)} block ids were given")
                cache = into if into is not None else self._new_cache(meta)
                table = list(block_ids[: meta["num_blocks"]]) if into is not None else _shard_major(meta["num_blocks"], meta["pcp"])
                if on_begin is not None:
                    on_begin(meta)
                seconds, moved = self._transfer(meta, cache, table, keep_registered=into is not None)
            except Exception as exc:
                try_send(sock, "error", {"message": f"receiver: {exc}"})
                raise exc if isinstance(exc, KVTransferError) else KVTransferError(str(exc)) from exc
            try:  # the server confirms it still held the KV: one that gave up first (ack_timeout_s) says so
                send_frame(sock, "ack", {"request_id": request_id})
                expect(read_frame(sock, max_payload=0)[0], "done")
            except (OSError, KVTransferError) as exc:
                raise KVTransferError(f"the KV server did not confirm the ack ({exc}): the KV may have been freed under the transfer") from None
            return ReceivedKV(meta, cache, table, meta["transport"], seconds, moved)

    # ---- the control connection -------------------------------------------------------------------
    def _hello(self, request_id: str, into: torch.Tensor | None, block_ids) -> dict:
        hello = {
            "request_id": request_id, "token": self.token, "model_fingerprint": self.model_fingerprint,
            "dtype": self.dtype, "block_size": self.block_size, "transports": self.transports,
        }  # fmt: skip
        if into is not None:  # the cache's own facts, checked by the server before it commits
            layers, _, block_size, width = into.shape
            hello.update(dtype=str(into.dtype).removeprefix("torch."), block_size=block_size, layers=layers, width=width, max_blocks=len(block_ids))
        return hello

    def _begin(self, sock: socket.socket, request_id: str, into: torch.Tensor | None) -> dict:
        meta = expect(read_frame(sock, max_payload=0)[0], "begin")
        if meta.get("request_id") != request_id:
            raise KVTransferError(f"asked for request {request_id!r}, the server sent {meta.get('request_id')!r}")
        if self.model_fingerprint is not None and meta.get("model_fingerprint") != self.model_fingerprint:
            raise KVTransferError(f"KV of request {request_id!r} is from model {meta.get('model_fingerprint')!r}; this decode server runs {self.model_fingerprint!r}")
        if DTYPES.get(meta.get("dtype")) is None:
            raise KVTransferError(f"unknown KV dtype {meta.get('dtype')!r}; valid: {', '.join(DTYPES)}")
        sizes = {key: meta.get(key) for key in ("tokens", "layers", "num_blocks", "block_size", "width", "pcp")}
        if not all(type(value) is int and value >= 0 for value in sizes.values()) or not sizes["pcp"]:
            raise KVTransferError(f"the begin frame's sizes are not counts: {sizes}")
        shards = meta.get("shards")
        if not isinstance(shards, list) or len(shards) != sizes["pcp"] or meta.get("transport") not in self.transports:
            raise KVTransferError(f"the begin frame's shards or transport are malformed (transport {meta.get('transport')!r})")
        for rank, shard in enumerate(shards):
            expected = len(range(rank, sizes["num_blocks"], sizes["pcp"]))
            if not isinstance(shard, dict) or not isinstance(shard.get("blocks"), list) or len(shard["blocks"]) != expected:
                raise KVTransferError(f"PCP rank {rank}'s shard does not list its {expected} blocks")
        if into is not None:  # the server checked the hello; a server that did not is not trusted either
            ours = (into.shape[0], into.shape[2], into.shape[3], str(into.dtype).removeprefix("torch."))
            theirs = (sizes["layers"], sizes["block_size"], sizes["width"], meta["dtype"])
            if ours != theirs:
                raise KVTransferError(f"the KV is {theirs} (layers, block size, width, dtype); the cache given is {ours}")
        total = sizes["layers"] * sizes["num_blocks"] * sizes["block_size"] * sizes["width"] * DTYPES[meta["dtype"]].itemsize
        if into is None and total > self.max_bytes:
            raise KVTransferError(f"the request's KV is {total} bytes, over max_bytes={self.max_bytes}")
        return meta

    def _new_cache(self, meta: dict) -> torch.Tensor:
        shape = (meta["layers"], meta["num_blocks"], meta["block_size"], meta["width"])
        return torch.empty(shape, dtype=DTYPES[meta["dtype"]], device=self.device)

    # ---- the data -----------------------------------------------------------------------------------
    def _transfer(self, meta: dict, cache: torch.Tensor, table: list[int], keep_registered: bool) -> tuple[float, int]:
        pcp, layers = meta["pcp"], meta["layers"]
        per_holder = [np.asarray(table[rank::pcp], dtype=np.int64) for rank in range(pcp)]
        moved = sum(len(ids) for ids in per_holder) * layers * cache[0, 0].numel() * cache.element_size()
        if meta["transport"] == "nixl":
            return self._read_nixl(meta, cache, per_holder, keep_registered), moved
        return self._pull_tcp(meta, cache, per_holder), moved

    def _read_nixl(self, meta: dict, cache: torch.Tensor, per_holder: list[np.ndarray], keep_registered: bool) -> float:
        """READ every holder's blocks at once. A caller's cache stays registered for its next fetch;
        one made for this fetch is deregistered after it."""
        if self._nixl is None:
            self._nixl = NixlEndpoint(f"mlapool-receiver-{uuid.uuid4().hex[:12]}", serves=False)
        local = self._nixl.register(cache)
        try:
            pieces = [(Region.from_dict(shard["nixl"]), np.asarray(shard["blocks"], dtype=np.int64), local, ids)
                      for shard, ids in zip(meta["shards"], per_holder)]  # fmt: skip
            if cache.is_cuda:
                torch.cuda.synchronize(cache.device)  # nothing of ours still writes the destination
            return self._nixl.read(pieces, meta["layers"], self.timeout_s)
        except (NixlError, TypeError) as exc:
            raise KVTransferError(str(exc)) from None
        finally:
            if not keep_registered:
                self._nixl.deregister(cache)

    def _pull_tcp(self, meta: dict, cache: torch.Tensor, per_holder: list[np.ndarray]) -> float:
        errors: list[BaseException | None] = [None] * len(per_holder)

        def pull(rank: int) -> None:
            try:
                _pull_one(meta, rank, cache, per_holder[rank], self.checksum, self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 -- handed to the calling thread
                errors[rank] = exc

        started = time.perf_counter()
        threads = [threading.Thread(target=pull, args=(rank,), daemon=True) for rank in range(len(per_holder)) if len(per_holder[rank])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        failed = [(rank, exc) for rank, exc in enumerate(errors) if exc is not None]
        if failed:
            raise KVTransferError("; ".join(f"holder {rank}: {exc}" for rank, exc in failed))
        if cache.is_cuda:
            torch.cuda.synchronize(cache.device)
        return time.perf_counter() - started


def _pull_one(meta: dict, rank: int, cache: torch.Tensor, dest: np.ndarray, checksum: bool, timeout_s: float) -> None:
    """One holder's TCP pull: its ``blocks`` frames, each read straight into the destination blocks
    when they are consecutive in a host cache; else through host buffers (two pinned ones for a GPU
    cache, so the copy of one piece to the device overlaps the receipt of the next)."""
    tcp, layers = meta["shards"][rank]["tcp"], meta["layers"]
    try:
        sock = socket.create_connection((tcp["host"], tcp["port"]), timeout=timeout_s)
    except OSError as exc:
        raise KVTransferError(f"cannot reach it at {tcp['host']}:{tcp['port']} ({exc})") from None
    done = np.zeros((layers, len(dest)), dtype=bool)
    staging = _Staging(cache)
    with sock, torch.cuda.stream(torch.cuda.Stream(cache.device)) if cache.is_cuda else contextlib.nullcontext():
        send_frame(sock, "pull", {"request_id": meta["request_id"], "ticket": tcp["ticket"], "checksum": checksum})
        while (head := read_head(sock)).header["kind"] == "blocks":
            layer, first, count = (head.header.get(key) for key in ("layer", "first", "count"))
            if not all(type(v) is int for v in (layer, first, count)) or not (0 <= layer < layers and count > 0 and 0 <= first and first + count <= len(dest)):
                raise KVTransferError(f"blocks frame out of range: layer {layer}, blocks {first}+{count} of {len(dest)}")
            if done[layer, first : first + count].any():
                raise KVTransferError(f"blocks {first}+{count} of layer {layer} were sent twice")
            ids = dest[first : first + count]
            run = count == 1 or bool((np.diff(ids) == 1).all())
            if run and not cache.is_cuda:
                read_payload_into(sock, head, [_bytes(cache[layer, ids[0] : ids[0] + count])])
            else:
                piece = staging.next(count)
                read_payload_into(sock, head, [_bytes(piece)])
                staging.store(cache, layer, ids, piece, run)
            done[layer, first : first + count] = True
        expect(head.header, "end")
        read_payload_into(sock, head, [])
        staging.drain()
    if not done.all():
        raise KVTransferError(f"the stream ended with {int((~done).sum())} of {done.size} blocks missing")


class _Staging:
    """Host buffers for blocks that cannot be read in place: one, or two pinned ones taking turns for
    a GPU cache (a buffer is reused once its copy to the device is done)."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cuda = cache.is_cuda
        self.block_shape, self.dtype = tuple(cache.shape[2:]), cache.dtype
        self.buffers: list[torch.Tensor | None] = [None, None] if self.cuda else [None]
        self.copied: list[torch.cuda.Event | None] = [None] * len(self.buffers)
        self.turn = 0

    def next(self, count: int) -> torch.Tensor:
        """A ``[count, block_size, width]`` piece of the next buffer, free to be written."""
        self.turn = (self.turn + 1) % len(self.buffers)
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()
        buffer = self.buffers[self.turn]
        needed = count * int(np.prod(self.block_shape))
        if buffer is None or buffer.numel() < needed:
            buffer = self.buffers[self.turn] = torch.empty(needed, dtype=self.dtype, pin_memory=self.cuda)
        return buffer[:needed].view(count, *self.block_shape)

    def store(self, cache: torch.Tensor, layer: int, ids: np.ndarray, piece: torch.Tensor, run: bool) -> None:
        if run:
            cache[layer, ids[0] : ids[0] + len(ids)].copy_(piece, non_blocking=True)
        else:
            cache[layer].index_copy_(0, torch.from_numpy(ids).to(cache.device, non_blocking=True), piece.to(cache.device, non_blocking=True))
        if self.cuda:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()

    def drain(self) -> None:
        for event in self.copied:
            if event is not None:
                event.synchronize()


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def _shard_major(num_blocks: int, pcp: int) -> list[int]:
    """Block ids for a new cache that put each PCP rank's blocks in one run (one READ descriptor per
    layer and holder): request block ``j`` goes to ``offset(j % pcp) + j // pcp``."""
    counts = [len(range(rank, num_blocks, pcp)) for rank in range(pcp)]
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return [int(offsets[j % pcp] + j // pcp) for j in range(num_blocks)]


def _check_destination(into: torch.Tensor | None, block_ids) -> None:
    if into is None:
        if block_ids is not None:
            raise ValueError("block_ids need a cache to point into: pass into=your [layers, num_blocks, block_size, width] cache")
        return
    if not isinstance(into, torch.Tensor) or into.dim() != 4 or not into.is_contiguous():
        raise ValueError(f"into must be a contiguous [layers, num_blocks, block_size, width] tensor, got {getattr(into, 'shape', into)!r}")
    if block_ids is None or not len(block_ids):
        raise ValueError("into needs block_ids: the free blocks of your cache to fill, one per block of the request")
    ids = list(block_ids)
    if any(type(i) is not int and not isinstance(i, np.integer) for i in ids) or min(ids) < 0 or max(ids) >= into.shape[1]:
        raise ValueError(f"block_ids must be integers in [0, {into.shape[1]}), got {ids[:8]}{'...' if len(ids) > 8 else ''}")
    if len(set(ids)) != len(ids):
        raise ValueError("block_ids must not repeat a block")
