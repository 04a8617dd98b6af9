"""A holder's side of the KV handoff to decode servers outside the cluster: the worker serves its own
shards, so no KV goes through the driver.

Each worker that holds shards (TP rank 0 of every PCP rank) keeps a :class:`KVExporter`:

- **NIXL** (when installed): its whole paged cache is registered with the process's NIXL agent at
  start. A receiver told where a request's blocks are READs them itself; this process does nothing.
- **mapped** (a receiver on this host): the cache is shared as it is, by CUDA IPC on a GPU or as the
  shared-memory file it lives in on the CPU (``kv.mapped``); each offer carries the handle, and the
  receiver copies the rows out itself. This process does nothing either.
- **TCP**: a listener on a free port. A receiver connects, presents the one-time ticket the KV server
  got for it (:meth:`KVExporter.offer`), and gets the request's blocks of every layer as ``blocks``
  frames (``kv.frames``) of at most ``PIECE_BYTES``: straight from the cache's memory on
  the CPU, through two pinned host buffers on a GPU (the copy of the next piece overlaps the send
  of this one), on a CUDA stream of the sending thread's own, so prefill batches go on meanwhile.

    holder -> blocks {layer, first, count} + count blocks of that layer, the request's blocks
              first .. first+count-1 in this worker's block-table order
    holder -> end    {request_id, layers}

The KV server asks each holder for a request's block table through :meth:`offer` before it tells the
receiver anything; a request being sent over TCP is freed only when its send ends (``shard``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import ContextManager

import torch

from workers.kv_cache import PagedKVCache
from kv.mapped import share_cache
from kv.nixl import NixlEndpoint, Region
from kv.frames import KVTransferError, expect, read_frame, send_frame, tensor_buffer, try_send

logger = logging.getLogger(__name__)

PIECE_BYTES = 8 << 20
TICKET_TTL_S = 600.0  # an offer not pulled by then is forgotten (the KV server's own timeout is shorter)

# request id -> a context holding (per-layer block views in table order, rows written) while they are sent
ShardSource = Callable[[str], ContextManager[tuple[Sequence[torch.Tensor], int]]]


class KVExporter:
    def __init__(self, kv: PagedKVCache, shard: ShardSource, *, name: str, host: str, nixl: NixlEndpoint | None) -> None:
        self.kv, self._shard = kv, shard
        self.region: Region | None = nixl.register(kv.blocks) if nixl is not None else None
        self._nixl = nixl  # kept alive with its registration
        self.mapped = self._share(name)  # shared once: the handle is the same for every request
        self._tickets: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-kv-export", daemon=True).start()

    @property
    def transports(self) -> tuple[str, ...]:
        return ("mapped",) * (self.mapped is not None) + ("nixl",) * (self.region is not None) + ("tcp",)

    def _share(self, name: str) -> dict | None:
        """The cache as receivers on this host map it (``kv.mapped``): a GPU cache by CUDA IPC, a host
        cache by its shared-memory file (``PagedKVCache(shared=True)``); None where it cannot be."""
        try:
            return share_cache(self.kv.blocks, self.kv.shared_path).as_dict()
        except (ValueError, RuntimeError) as exc:  # no room in /dev/shm; an allocator CUDA IPC cannot share
            logger.info("%s: KV not offered mapped to receivers on this host: %s", name, exc)
            return None

    def offer(self, request_id: str, blocks: list[int], rows: int, transport: str) -> dict:
        """What a receiver needs to take this worker's shard of ``request_id`` over ``transport``: its
        block ids (table order) and rows, and the mapped or NIXL region they are in or a one-time
        ticket for a TCP pull."""
        if transport not in self.transports:
            raise ValueError(f"this worker serves KV over {', '.join(self.transports)}, not {transport!r}")
        offer = {"rows": rows, "blocks": blocks, "tcp": None, "nixl": None, "mapped": None}
        if transport == "mapped":
            offer["mapped"] = self.mapped
        elif transport == "nixl":
            offer["nixl"] = self.region.as_dict()
        else:
            ticket, now = secrets.token_hex(16), time.monotonic()
            with self._lock:
                self._tickets = {t: entry for t, entry in self._tickets.items() if entry[1] > now}
                self._tickets[ticket] = (request_id, now + TICKET_TTL_S)
            offer["tcp"] = {"host": self.address[0], "port": self.address[1], "ticket": ticket}
        return offer

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    # ---- TCP pulls ------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kv-export-pull", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(60.0)
            try:
                pull = expect(read_frame(conn, max_payload=0)[0], "pull")
                request_id = self._redeem(pull.get("ticket"), pull.get("request_id"))
                conn.settimeout(None)
                self._send(conn, request_id, bool(pull.get("checksum", False)))
            except (KVTransferError, KeyError) as exc:
                try_send(conn, "error", {"message": str(exc).strip("'\"")})
            except OSError as exc:  # the receiver went away mid-stream: it reports that to the KV server
                logger.warning("KV pull stopped: %s", exc)

    def _redeem(self, ticket, request_id) -> str:
        with self._lock:
            entry = self._tickets.pop(ticket, None) if isinstance(ticket, str) else None
        if entry is None or entry[1] < time.monotonic():
            raise KVTransferError("unknown or expired KV pull ticket (each offer admits one pull)")
        if request_id != entry[0]:
            raise KVTransferError(f"the ticket is for request {entry[0]!r}, not {request_id!r}")
        return request_id

    def _send(self, conn: socket.socket, request_id: str, checksum: bool) -> None:
        cuda = self.kv.blocks.is_cuda
        stream = torch.cuda.Stream(self.kv.blocks.device) if cuda else None
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext(), self._shard(request_id) as (views, _rows):
            pieces = list(_pieces(views))
            if cuda:
                self._send_staged(conn, views, pieces, checksum)
            else:
                for layer, first, count in pieces:
                    payload = tensor_buffer(views[layer][first : first + count])
                    send_frame(conn, "blocks", {"layer": layer, "first": first, "count": count}, payload, checksum=checksum)
        send_frame(conn, "end", {"request_id": request_id, "layers": len(views)})

    def _send_staged(self, conn: socket.socket, views, pieces: list[tuple[int, int, int]], checksum: bool) -> None:
        """GPU blocks through two pinned host buffers: piece i+1 is copied while piece i is sent."""
        block_bytes = views[0][0].numel() * views[0].element_size() if len(views[0]) else 0
        staging = [torch.empty(max(PIECE_BYTES, block_bytes), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        copied = [torch.cuda.Event(), torch.cuda.Event()]

        def copy(i: int) -> None:
            layer, first, count = pieces[i]
            source = views[layer][first : first + count].reshape(-1).view(torch.uint8)
            staging[i % 2][: count * block_bytes].copy_(source, non_blocking=True)
            copied[i % 2].record()

        if pieces:
            copy(0)
        for i, (layer, first, count) in enumerate(pieces):
            if i + 1 < len(pieces):
                copy(i + 1)  # its buffer's previous piece (i - 1) was sent: send_frame returns when it is
            copied[i % 2].synchronize()
            payload = tensor_buffer(staging[i % 2][: count * block_bytes])
            send_frame(conn, "blocks", {"layer": layer, "first": first, "count": count}, payload, checksum=checksum)


def _pieces(views: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(layer, first block, count)`` of at most ``PIECE_BYTES`` (one block at least), layer by layer."""
    if not len(views) or not len(views[0]):
        return []
    block_bytes = views[0][0].numel() * views[0].element_size()
    step = max(1, PIECE_BYTES // block_bytes)
    return [(layer, first, min(step, len(view) - first)) for layer, view in enumerate(views) for first in range(0, len(view), step)]
