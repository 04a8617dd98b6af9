"""The client a decode server embeds to take a prefilled request's latent KV from a prefill tier:
straight from the workers that hold it, into the decode server's own paged cache.

Nothing here imports Ray or the prefill model: a decode server needs torch, msgpack, this package
and, for NIXL, nixl.

    receiver = KVReceiver("10.0.0.5", 7431, token=..., model_fingerprint=config.fingerprint())
    kv = receiver.fetch("req-17")                              # a new [layers, blocks, block_size, 576] cache
    kv = receiver.fetch("req-18", into=cache, block_ids=free)  # or into yours, at block ids you choose
    kv = receiver.fetch("req-19", into=vllm_layers, block_ids=table, start=32)  # per-layer caches (vLLM's)

The destination's block size is the decode server's own: rows are placed one by one from the
prefill pool's blocks into the destination's, whatever the two block sizes are (vLLM takes 16 on
the CPU, FlashMLA 64; the pool keeps the size its prefill wants and feeds both). A mapped copy
moves any rows in one kernel on a GPU (``kv.mapped``: the fastest by far on one host), NIXL READs move
runs of rows consecutive on both sides (a whole block or more when the sizes and the block ids
line up), TCP pulls scatter each received piece to its rows.

A transfer (the frames of ``kv.frames``)::

    receiver -> server  hello {request_id, token?, model_fingerprint?, dtype?, layers?, width?,
                               max_tokens?, prompt_digest?, transports, host?, devices?}
                (the server refuses, freeing nothing, a receiver whose model, dtype or cache shape
                differs from its own, whose cache has room for fewer rows than the request has,
                who speaks none of its transports; and one whose prompt is not the prefilled one)
    server -> receiver  begin {request_id, tokens, layers, dtype, block_size, width, num_blocks,
                               model_fingerprint, transport, pcp, shards: [per PCP rank: rows,
                               blocks (its block ids in table order), tcp {host, port, ticket},
                               nixl (its registered region) or None, mapped (its cache's handle) or None]}
    receiver <- holders the rows: copied out of the holders' caches mapped into this process
                (``mapped``: the server offers it when the hello's host is the holders' and, for
                GPU memory, their GPUs are among its devices), NIXL READs from every holder at once,
                or one TCP pull per holder (``workers.kv_export``, ``kv.tcp_pull``), each straight
                into the destination rows
    receiver -> server  ack {request_id, holders_seen}    (or error {message}; holders_seen: a mapped
                                           copy's holders were seen running before and after it)
    server -> receiver  done {request_id, first_token?}   (or error {message}: it gave up first, and
                                              the KV it freed may have been overwritten under the
                                              transfer; first_token: the tier's, for a ticket issued
                                              ahead with it, ``kv.vllm_first_token``)

Block ``j`` of the request (tokens ``j * block_size ...``, the pool's block size) is block
``j // pcp`` of PCP rank ``j % pcp``'s table. The server frees the request's KV on the holders
after the ack, and also after an error, a lost connection or ``ack_timeout_s``
(``cluster.kv_server``).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv.frames import DTYPES, KVTransferError, expect, read_frame, send_frame, try_send
from kv.laps import Laps
from kv.mapped import HolderGone, MappedError, MappedRegion, Mapper, host_identity, reachable_devices
from kv.nixl import NixlEndpoint, NixlError, Region, descriptors, nixl_unavailable, runs
from kv.tcp_pull import pull_tcp

TRANSPORTS = ("auto", "mapped", "nixl", "tcp")


@dataclass
class ReceivedKV:
    """A request's latent KV as received: its rows in ``cache``'s blocks ``block_table`` (token order)."""

    meta: dict[str, Any]
    cache: torch.Tensor | list[torch.Tensor]  # per layer [num_blocks, block_size, width]: ``into`` or a new one
    block_table: list[int]
    block_size: int  # the destination's
    start: int  # rows before it were not moved (the destination had them)
    transport: str
    transfer_s: float  # from the first byte asked of a holder to the last one in the destination
    bytes: int  # KV bytes moved into the destination
    placed: list[HolderRows] = field(default_factory=list, repr=False)  # where each holder's rows went
    steps_s: dict[str, float] | None = None  # connect, begin (hello to begin: the prefill's wait), place, transfer, done (ack to done)
    first_token: int | None = None  # the tier's first token, when the server sent it with done

    @property
    def runs(self) -> int:
        """Runs of rows consecutive on both sides, per layer, over all holders: how scattered the blocks were."""
        return sum(len(runs(part.src, part.dst)[0]) for part in self.placed)

    @property
    def tokens(self) -> int:
        return self.meta["tokens"]

    @property
    def layers(self) -> list[torch.Tensor]:
        """Per layer, the request's blocks in token order ``[num_blocks, block_size, width]`` (a copy)."""
        table = torch.tensor(self.block_table[: -(-self.tokens // self.block_size)], device=self.cache[0].device)
        return [layer.index_select(0, table) for layer in self.cache]

    def rows(self) -> torch.Tensor:
        """``[layers, tokens, width]`` in token order (a copy)."""
        return torch.stack([layer.reshape(-1, layer.shape[-1])[: self.tokens] for layer in self.layers])


@dataclass
class HolderRows:
    """One holder's part of a transfer: its rows in token order and where each goes."""

    src: np.ndarray  # int64 rows of the holder's layer (its block * pool block size + offset)
    dst: np.ndarray  # int64 rows of the destination's layer (block * block size + offset)
    by_block: np.ndarray  # int64 [its blocks, pool block size]: destination row of each row it sends, -1: none


def token_rows(block_table: Sequence[int], block_size: int, begin: int, end: int) -> np.ndarray:
    """The cache rows (``block * block_size + offset``) of tokens ``begin`` to ``end`` of a request whose
    blocks are ``block_table`` (token order), built block by block: no division per token."""
    first = begin // block_size
    table = np.asarray(block_table[first : -(-end // block_size)], dtype=np.int64)
    rows = (table[:, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1)
    return rows[begin - first * block_size : end - first * block_size]


def place_rows(meta: dict, block_size: int, block_table: Sequence[int], start: int) -> list[HolderRows]:
    """Where the rows ``start ... tokens`` of the request go: token ``t`` is row ``t % B`` of pool
    block ``t // B`` (held by PCP rank ``(t // B) % pcp`` as its ``(t // B) // pcp``-th block) and
    goes to row ``t % block_size`` of destination block ``block_table[t // block_size]``. Built block
    by block (a row's index is its block's base plus its offset): with a division and a modulo per
    token it took 1.4 ms for 32K tokens on the 2-core CPU, 0.22 ms so."""
    pool_block, pcp, tokens = meta["block_size"], meta["pcp"], meta["tokens"]
    dst = token_rows(block_table, block_size, 0, tokens)  # by token
    pool_blocks = -(-tokens // pool_block)
    padded = np.full(pool_blocks * pool_block, -1, dtype=np.int64)
    padded[start:tokens] = dst[start:]
    by_token_block = padded.reshape(pool_blocks, pool_block)  # destination row of each pool block's rows, -1: none
    out = []
    for rank, shard in enumerate(meta["shards"]):
        by_block = by_token_block[rank::pcp]  # the rank's blocks in its own order: pool block rank + pcp * k is its k-th
        blocks = np.asarray(shard["blocks"], dtype=np.int64)[: len(by_block)]
        moved = by_block >= 0
        src = (blocks[:, None] * pool_block + np.arange(pool_block, dtype=np.int64))[moved]
        full = np.full((len(shard["blocks"]), pool_block), -1, dtype=np.int64)
        full[: len(by_block)] = by_block
        out.append(HolderRows(src, by_block[moved], full))
    return out


def resolve_transports(transport: str) -> list[str]:
    """The transports a receiver offers for ``transport`` (``auto``: mapped, for holders on this
    host; NIXL where installed; then TCP)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    missing = nixl_unavailable()
    if transport == "nixl" and missing:
        raise ValueError(f"transport 'nixl' needs NIXL here: {missing}")
    if transport == "auto":
        return ["mapped", "tcp"] if missing else ["mapped", "nixl", "tcp"]
    return [transport]


class KVReceiver:
    """Takes prefilled requests' KV from a prefill tier's KV server (``cluster.kv_server``).

    ``transport``: ``mapped`` (holders on this host: their caches mapped into this process, CUDA IPC
    or shared memory, the rows copied out by gather/scatter), ``nixl`` (one-sided READs from the
    holders' registered caches: NVLink, RDMA or shared memory, as UCX finds), ``tcp`` (each holder
    streams its blocks) or ``auto`` (mapped where the server finds the holders on this host, NIXL when
    it is installed here and on the tier, else TCP). ``model_fingerprint`` and ``dtype``, when given,
    are presented first: a server whose KV differs refuses before anything is committed and keeps
    the KV for a matching receiver. ``device`` is where :meth:`fetch` puts a new cache (``cuda:1``,
    ``cpu``). ``checksum``: TCP data frames carry a CRC32 of their payload too (off by default, as in
    NIXL's, NCCL's and vLLM's and SGLang's KV transfers: TCP checksums its segments, and the CRC
    costs a third of the rate on a 2-core host; control frames are always checked). ``max_bytes``
    bounds the new cache a fetch without ``into`` may allocate. Keep one receiver per decode server
    process and KV server: its NIXL agent, its peers and the caches it registered are reused
    (``nixl``: an agent to share with the receivers of other KV servers; ``mapper``: likewise, the
    holders' mapped caches).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        model_fingerprint: str | None = None,
        dtype: str | None = None,
        transport: str = "auto",
        device: str | torch.device = "cpu",
        checksum: bool = False,
        timeout_s: float = 60.0,
        max_bytes: int = 1 << 40,
        nixl: NixlEndpoint | None = None,
        mapper: Mapper | None = None,
    ) -> None:
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.transports = resolve_transports(transport)
        self.address = (host, port)
        self.token, self.model_fingerprint, self.dtype = token, model_fingerprint, dtype
        self.device = torch.device(device)
        self.checksum, self.timeout_s, self.max_bytes = checksum, timeout_s, max_bytes
        self._nixl = nixl
        self._mapper = mapper

    def fetch(
        self,
        request_id: str,
        into: torch.Tensor | Sequence[torch.Tensor] | None = None,
        block_ids: Sequence[int] | None = None,
        *,
        start: int = 0,
        prompt_digest: str | None = None,
        on_begin: Callable[[dict], None] | None = None,
    ) -> ReceivedKV:
        """Take ``request_id``'s KV. ``into``: your paged cache, ``[layers, num_blocks, block_size,
        width]`` or one ``[num_blocks, block_size, width]`` tensor per layer (CPU or CUDA; registered
        with NIXL on first use), with ``block_ids``: the request's blocks in token order, from its
        first token (more are allowed; the first ones are used). ``start``: the rows before it are
        already there and are not moved (a decode server's own prefix cache hit). Without ``into`` a
        new cache of the request's size is made on ``device``, in the pool's block size.
        ``prompt_digest`` (``kv.frames.prompt_digest`` of the prompt's token ids): the server refuses,
        freeing nothing, KV prefilled for another prompt. ``on_begin(meta)`` is called once the
        server committed, before any data moves. The prefill side frees the KV once this returns."""
        layers = _check_destination(into, block_ids, start)
        clock = Laps()
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as exc:
            raise KVTransferError(f"cannot reach the KV server at {self.address[0]}:{self.address[1]} ({exc})") from None
        with sock:
            clock.lap("connect")
            send_frame(sock, "hello", self._hello(request_id, layers, block_ids, prompt_digest))
            try:
                meta = self._begin(sock, request_id, layers)
                clock.lap("begin")
                new = None
                if layers is None:
                    new = self._new_cache(meta)
                    layers = list(new)
                    block_size, table = meta["block_size"], _shard_major(meta["num_blocks"], meta["pcp"])
                else:
                    block_size, table = layers[0].shape[1], list(block_ids)
                    if len(table) * block_size < meta["tokens"] or start > meta["tokens"]:
                        raise KVTransferError(
                            f"the request has {meta['tokens']} tokens; {len(table)} blocks of {block_size} "
                            f"from token {start} cannot hold them"
                        )
                if on_begin is not None:
                    on_begin(meta)
                placed = place_rows(meta, block_size, table, start)
                clock.lap("place")
                seconds, moved, seen = self._transfer(meta, layers, placed, keep_registered=into is not None)
                clock.lap("transfer")
            except Exception as exc:
                try_send(sock, "error", {"message": f"receiver: {exc}"})
                raise exc if isinstance(exc, KVTransferError) else KVTransferError(str(exc)) from exc
            try:  # the server confirms it still held the KV: one that gave up first (ack_timeout_s) says so
                send_frame(sock, "ack", {"request_id": request_id, "holders_seen": seen})  # a mapped copy's holders, seen running
                done = expect(read_frame(sock, max_payload=0)[0], "done")
            except (OSError, KVTransferError) as exc:
                raise KVTransferError(f"the KV server did not confirm the ack ({exc}): the KV may have been freed under the transfer") from None
            clock.lap("done")
            first = done.get("first_token")
            if first is not None and (type(first) is not int or first < 0):
                raise KVTransferError(f"the KV server's first token must be a token id, got {first!r}")
            cache = into if into is not None else new
            return ReceivedKV(meta, cache, table, block_size, start, meta["transport"], seconds, moved, placed, clock.phases, first)

    # ---- the control connection -------------------------------------------------------------------
    def _hello(self, request_id: str, layers: list[torch.Tensor] | None, block_ids, digest: str | None) -> dict:
        hello = {
            "request_id": request_id, "token": self.token, "model_fingerprint": self.model_fingerprint,
            "dtype": self.dtype, "transports": self.transports, "prompt_digest": digest,
        }  # fmt: skip
        if "mapped" in self.transports:  # where the server may let this process map the holders' caches
            on_gpu = layers[0].is_cuda if layers is not None else self.device.type == "cuda"
            hello.update(host=host_identity(), devices=reachable_devices() if on_gpu else [])
        if layers is not None:  # the cache's own facts, checked by the server before it commits
            _, block_size, width = layers[0].shape
            hello.update(dtype=str(layers[0].dtype).removeprefix("torch."), layers=len(layers), width=width, max_tokens=len(block_ids) * block_size)
        return hello

    def _begin(self, sock: socket.socket, request_id: str, layers: list[torch.Tensor] | None) -> dict:
        meta = expect(read_frame(sock, max_payload=0)[0], "begin")
        if meta.get("request_id") != request_id:
            raise KVTransferError(f"asked for request {request_id!r}, the server sent {meta.get('request_id')!r}")
        if self.model_fingerprint is not None and meta.get("model_fingerprint") != self.model_fingerprint:
            raise KVTransferError(f"KV of request {request_id!r} is from model {meta.get('model_fingerprint')!r}; this decode server runs {self.model_fingerprint!r}")
        if DTYPES.get(meta.get("dtype")) is None:
            raise KVTransferError(f"unknown KV dtype {meta.get('dtype')!r}; valid: {', '.join(DTYPES)}")
        sizes = {key: meta.get(key) for key in ("tokens", "layers", "num_blocks", "block_size", "width", "pcp")}
        if not all(type(value) is int and value >= 0 for value in sizes.values()) or not sizes["pcp"] or not sizes["block_size"]:
            raise KVTransferError(f"the begin frame's sizes are not counts: {sizes}")
        if sizes["num_blocks"] * sizes["block_size"] < sizes["tokens"]:
            raise KVTransferError(f"the begin frame's {sizes['num_blocks']} blocks of {sizes['block_size']} cannot hold {sizes['tokens']} tokens")
        shards = meta.get("shards")
        if not isinstance(shards, list) or len(shards) != sizes["pcp"] or meta.get("transport") not in self.transports:
            raise KVTransferError(f"the begin frame's shards or transport are malformed (transport {meta.get('transport')!r})")
        for rank, shard in enumerate(shards):
            expected = len(range(rank, sizes["num_blocks"], sizes["pcp"]))
            if not isinstance(shard, dict) or not isinstance(shard.get("blocks"), list) or len(shard["blocks"]) != expected:
                raise KVTransferError(f"PCP rank {rank}'s shard does not list its {expected} blocks")
        if layers is not None:  # the server checked the hello; a server that did not is not trusted either
            ours = (len(layers), layers[0].shape[2], str(layers[0].dtype).removeprefix("torch."))
            theirs = (sizes["layers"], sizes["width"], meta["dtype"])
            if ours != theirs:
                raise KVTransferError(f"the KV is {theirs} (layers, width, dtype); the cache given is {ours}")
        total = sizes["layers"] * sizes["num_blocks"] * sizes["block_size"] * sizes["width"] * DTYPES[meta["dtype"]].itemsize
        if layers is None and total > self.max_bytes:
            raise KVTransferError(f"the request's KV is {total} bytes, over max_bytes={self.max_bytes}")
        return meta

    def _new_cache(self, meta: dict) -> torch.Tensor:
        shape = (meta["layers"], meta["num_blocks"], meta["block_size"], meta["width"])
        return torch.empty(shape, dtype=DTYPES[meta["dtype"]], device=self.device)

    def _endpoint(self) -> NixlEndpoint:
        if self._nixl is None:
            self._nixl = NixlEndpoint(f"mlapool-receiver-{uuid.uuid4().hex[:12]}", serves=False)
        return self._nixl

    # ---- the data -----------------------------------------------------------------------------------
    def _transfer(self, meta: dict, layers: list[torch.Tensor], placed: list[HolderRows], keep_registered: bool) -> tuple[float, int, bool]:
        """Seconds, KV bytes moved, and whether every holder was seen running through a mapped copy."""
        row_bytes = meta["width"] * DTYPES[meta["dtype"]].itemsize
        moved = sum(len(part.dst) for part in placed) * meta["layers"] * row_bytes
        if meta["transport"] == "mapped":
            seconds, seen = self._copy_mapped(meta, layers, placed)
            return seconds, moved, seen
        if meta["transport"] == "nixl":
            return self._read_nixl(meta, layers, placed, row_bytes, keep_registered), moved, False
        return pull_tcp(meta, layers, [part.by_block for part in placed], self.checksum, self.timeout_s), moved, False

    def _copy_mapped(self, meta: dict, layers: list[torch.Tensor], placed: list[HolderRows]) -> tuple[float, bool]:
        """Copy every holder's rows out of its cache, mapped into this process (``kv.mapped``). A
        holder this process cannot map is not offered ``mapped`` again by this receiver (NIXL or TCP
        then: a container without the host's ``/dev/shm`` or IPC namespace, say)."""
        if self._mapper is None:
            self._mapper = Mapper()
        seconds, seen, regions = 0.0, True, []
        for rank, (shard, part) in enumerate(zip(meta["shards"], placed)):
            try:
                regions.append(MappedRegion.from_dict(shard.get("mapped") or {}))
                took, lived = self._mapper.copy(regions[-1], layers, part.src, part.dst)
            except MappedError as exc:
                for region in regions:
                    self._mapper.forget(region)
                if not isinstance(exc, HolderGone) and len(self.transports) > 1:  # this process cannot map it
                    self.transports = [t for t in self.transports if t != "mapped"]
                    exc = MappedError(f"{exc} (this receiver takes this server's KV over {self.transports} from now on)")
                raise KVTransferError(f"holder {rank}: {exc}") from None
            seconds, seen = seconds + took, seen and lived
        return seconds, seen

    def _read_nixl(self, meta: dict, layers: list[torch.Tensor], placed: list[HolderRows], row_bytes: int, keep_registered: bool) -> float:
        """READ every holder's rows at once, a descriptor per layer and run of rows consecutive on
        both sides. A caller's cache stays registered for its next fetch; one made for this fetch is
        deregistered after it."""
        endpoint = self._endpoint()
        for layer in layers:
            endpoint.register_tensor(layer)
        try:
            local_bases = np.array([layer.data_ptr() for layer in layers], dtype=np.uint64)
            local_device = (layers[0].device.index or 0) if layers[0].is_cuda else 0
            local_memory = "VRAM" if layers[0].is_cuda else "DRAM"
            pieces = []
            for shard, part in zip(meta["shards"], placed):
                remote = Region.from_dict(shard["nixl"])
                src, dst, lengths = runs(part.src, part.dst)
                pieces.append((
                    remote, descriptors(remote.layer_bases(), row_bytes, src, lengths, remote.device),
                    local_memory, descriptors(local_bases, row_bytes, dst, lengths, local_device),
                ))  # fmt: skip
            if layers[0].is_cuda:
                torch.cuda.synchronize(layers[0].device)  # nothing of ours still writes the destination
            return endpoint.read(pieces, self.timeout_s)
        except (NixlError, TypeError) as exc:
            raise KVTransferError(str(exc)) from None
        finally:
            if not keep_registered:
                for layer in layers:
                    endpoint.deregister(layer)


def _shard_major(num_blocks: int, pcp: int) -> list[int]:
    """Block ids for a new cache that put each PCP rank's blocks in one run (one READ descriptor per
    layer and holder): request block ``j`` goes to ``offset(j % pcp) + j // pcp``."""
    counts = [len(range(rank, num_blocks, pcp)) for rank in range(pcp)]
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return [int(offsets[j % pcp] + j // pcp) for j in range(num_blocks)]


def _check_destination(into, block_ids, start: int) -> list[torch.Tensor] | None:
    """The destination's layers, each ``[num_blocks, block_size, width]``, or None for a new cache."""
    if type(start) is not int or start < 0:
        raise ValueError(f"start must be a non-negative integer (a token index), got {start!r}")
    if into is None:
        if block_ids is not None:
            raise ValueError("block_ids need a cache to point into: pass into=your [layers, num_blocks, block_size, width] cache")
        return None
    layers = list(into) if isinstance(into, torch.Tensor) and into.dim() == 4 else into
    if isinstance(into, torch.Tensor) and (into.dim() != 4 or not into.is_contiguous()):
        raise ValueError(f"into must be a contiguous [layers, num_blocks, block_size, width] tensor, got {tuple(into.shape)}")
    if not isinstance(layers, (list, tuple)) or not layers or not all(isinstance(t, torch.Tensor) for t in layers):
        raise ValueError(f"into must be a [layers, num_blocks, block_size, width] tensor or a list of per-layer tensors, got {type(into).__name__}")
    first = layers[0]
    for i, layer in enumerate(layers):
        if layer.dim() != 3 or not layer.is_contiguous() or layer.shape != first.shape or layer.dtype != first.dtype or layer.device != first.device:
            raise ValueError(
                f"layer {i} of into is {tuple(layer.shape)} {layer.dtype} on {layer.device}; every layer must be a contiguous "
                f"[num_blocks, block_size, width] tensor like layer 0's {tuple(first.shape)} {first.dtype} on {first.device}"
            )
    if block_ids is None or not len(block_ids):
        raise ValueError("into needs block_ids: the request's blocks of your cache, in token order")
    ids = list(block_ids)
    if any(type(i) is not int and not isinstance(i, np.integer) for i in ids) or min(ids) < 0 or max(ids) >= first.shape[0]:
        raise ValueError(f"block_ids must be integers in [0, {first.shape[0]}), got {ids[:8]}{'...' if len(ids) > 8 else ''}")
    if len(set(ids)) != len(ids):
        raise ValueError("block_ids must not repeat a block")
    return layers
