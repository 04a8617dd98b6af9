"""The TCP transport of ``kv.receiver``: one stream per holder (``workers.kv_export`` serves it), each
piece read straight into the destination rows where they are one run in a host cache, else through
host buffers (two pinned ones for a GPU cache, the copy of one piece to the device overlapping the
receipt of the next) and scattered to its rows. The fallback where neither a mapped copy nor NIXL
reaches the holders: no per-block round trips, a frame per run of blocks."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import torch

from kv.frames import KVTransferError, expect, read_head, read_payload_into, send_frame


def pull_tcp(meta: dict, layers: list[torch.Tensor], by_block: list[np.ndarray], checksum: bool, timeout_s: float) -> float:
    """Pull a request's rows from every holder at once over TCP, one stream per holder (its ``begin``
    shard's ``tcp`` address and ticket), into ``layers``: ``by_block[rank]`` gives, per row of that
    holder's blocks in table order, the destination row in a layer (``-1``: none). Seconds taken;
    ``KVTransferError`` naming every holder that failed."""
    errors: list[BaseException | None] = [None] * len(by_block)

    def pull(rank: int) -> None:
        try:
            _pull_one(meta, rank, layers, by_block[rank], checksum, timeout_s)
        except BaseException as exc:  # noqa: BLE001 -- handed to the calling thread
            errors[rank] = exc

    started = time.perf_counter()
    threads = [threading.Thread(target=pull, args=(rank,), daemon=True) for rank in range(len(by_block)) if (by_block[rank] >= 0).any()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [(rank, exc) for rank, exc in enumerate(errors) if exc is not None]
    if failed:
        raise KVTransferError("; ".join(f"holder {rank}: {exc}" for rank, exc in failed))
    if layers[0].is_cuda:
        torch.cuda.synchronize(layers[0].device)
    return time.perf_counter() - started


def _pull_one(meta: dict, rank: int, layers: list[torch.Tensor], by_block: np.ndarray, checksum: bool, timeout_s: float) -> None:
    """One holder's TCP pull: its ``blocks`` frames, each read straight into the destination rows
    when they are one run in a host cache; else through host buffers (two pinned ones for a GPU
    cache, so the copy of one piece to the device overlaps the receipt of the next) and scattered."""
    tcp, num_layers = meta["shards"][rank]["tcp"], meta["layers"]
    try:
        sock = socket.create_connection((tcp["host"], tcp["port"]), timeout=timeout_s)
    except OSError as exc:
        raise KVTransferError(f"cannot reach it at {tcp['host']}:{tcp['port']} ({exc})") from None
    done = np.zeros((num_layers, len(by_block)), dtype=bool)
    device = layers[0].device
    staging = _Staging(meta["block_size"], layers[0])
    flats = [layer.view(-1, layer.shape[-1]) for layer in layers]
    with sock, torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext():
        send_frame(sock, "pull", {"request_id": meta["request_id"], "ticket": tcp["ticket"], "checksum": checksum})
        while (head := read_head(sock)).header["kind"] == "blocks":
            layer, first, count = (head.header.get(key) for key in ("layer", "first", "count"))
            if not all(type(v) is int for v in (layer, first, count)) or not (0 <= layer < num_layers and count > 0 and 0 <= first and first + count <= len(by_block)):
                raise KVTransferError(f"blocks frame out of range: layer {layer}, blocks {first}+{count} of {len(by_block)}")
            if done[layer, first : first + count].any():
                raise KVTransferError(f"blocks {first}+{count} of layer {layer} were sent twice")
            rows = by_block[first : first + count].reshape(-1)
            whole_run = bool((rows >= 0).all()) and (len(rows) == 1 or bool((np.diff(rows) == 1).all()))
            if whole_run and device.type != "cuda":
                read_payload_into(sock, head, [_bytes(flats[layer][rows[0] : rows[0] + len(rows)])])
            else:
                piece = staging.next(count)
                read_payload_into(sock, head, [_bytes(piece)])
                staging.store(flats[layer], rows, piece, whole_run)
            done[layer, first : first + count] = True
        expect(head.header, "end")
        read_payload_into(sock, head, [])
        staging.drain()
    if not done.all():
        raise KVTransferError(f"the stream ended with {int((~done).sum())} of {done.size} blocks missing")


class _Staging:
    """Host buffers for pieces that cannot be read in place: one, or two pinned ones taking turns for
    a GPU cache (a buffer is reused once its copy to the device is done)."""

    def __init__(self, pool_block_size: int, like: torch.Tensor) -> None:
        self.cuda = like.is_cuda
        self.rows_per_block, self.width, self.dtype = pool_block_size, like.shape[-1], like.dtype
        self.buffers: list[torch.Tensor | None] = [None, None] if self.cuda else [None]
        self.copied: list[torch.cuda.Event | None] = [None] * len(self.buffers)
        self.turn = 0

    def next(self, count: int) -> torch.Tensor:
        """``[count x pool block size, width]`` rows of the next buffer, free to be written."""
        self.turn = (self.turn + 1) % len(self.buffers)
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()
        buffer = self.buffers[self.turn]
        rows = count * self.rows_per_block
        if buffer is None or buffer.numel() < rows * self.width:
            buffer = self.buffers[self.turn] = torch.empty(rows * self.width, dtype=self.dtype, pin_memory=self.cuda)
        return buffer[: rows * self.width].view(rows, self.width)

    def store(self, flat: torch.Tensor, rows: np.ndarray, piece: torch.Tensor, whole_run: bool) -> None:
        """Put ``piece``'s rows at ``rows`` of the layer ``flat`` (``-1``: a row nobody wants)."""
        if whole_run:
            flat[rows[0] : rows[0] + len(rows)].copy_(piece, non_blocking=True)
        else:
            wanted = np.flatnonzero(rows >= 0)
            source = piece if len(wanted) == len(rows) else piece[torch.from_numpy(wanted)]
            index = torch.from_numpy(rows[wanted]).to(flat.device, non_blocking=True)
            flat.index_copy_(0, index, source.to(flat.device, non_blocking=True))
        if self.cuda:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()

    def drain(self) -> None:
        for event in self.copied:
            if event is not None:
                event.synchronize()


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")
