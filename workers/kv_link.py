"""A point-to-point link for the KV handoff: a process group of its own between one receiver (rank
0, a decode actor) and the prefill workers that hold a request's shards (ranks 1..N).

It is independent of the pool's process group (its own ``TCPStore``, hosted by the receiver), so a
decode server can join and leave without touching the grid. NCCL between GPUs (NVLink when the
GPUs share a node), gloo on CPU:

    receiver:  link = KVLink.host(1 + len(holders), device, invite)  # invite(address): holders join
    holder r:  KVLink.join(address, r, size, device).serve(shard)    # a thread answers every pull
    receiver:  shards, timings = link.pull(request_id, block_size, width)

A pull is asked for through the link's store: the receiver writes ``pull/<n>`` and every holder's
serving thread, blocked reading that key, wakes up (a store round trip, well under a millisecond,
instead of a Ray call each way). The thread sends from a CUDA stream of its own, so a pull does not queue behind the
holder's prefill batches; it waits only for the request's own KV (``shard`` arranges that).

Each holder sends a small header, then one tensor per layer in vLLM's paged MLA layout
``[num_blocks, block_size, width]``. The header says how many blocks and rows follow, or that the
holder has nothing to send; it then leaves its reason in the store, the receiver posts no data
receives, and the link stays usable. The receiver's :meth:`close` ends every holder's thread; a
holder whose receiver is gone, or whose send fails, ends its own.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# dtype codes of the header; a receiver rejects codes it does not know
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HEADER = 4  # rows (-1: nothing to send), blocks, layers, dtype code
_TAG = 0
_CLOSE = b""  # the value of a pull key that closes the link
_IDLE = timedelta(hours=1)  # a holder's wait for the next pull (it loops; close() wakes it at once)

# what a holder serves: request id -> a context holding (layer views, rows written) while they are
# sent; KeyError(reason) when it has no such request
ShardSource = Callable[[str], ContextManager[tuple[Sequence[torch.Tensor], int]]]


class KVLinkError(RuntimeError):
    """A pull was refused: a holder had no such request. The link stays usable."""


@dataclass(frozen=True)
class KVShard:
    """One holder's part of a request: ``blocks [layers, num_blocks, block_size, width]`` whose
    first ``rows`` rows (flattened over blocks) are written."""

    blocks: torch.Tensor
    rows: int

    def row_view(self) -> torch.Tensor:
        layers, num_blocks, block_size, width = self.blocks.shape
        return self.blocks.view(layers, num_blocks * block_size, width)[:, : self.rows]


class KVLink:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.address: tuple[str, int] | None = None  # set on the receiver's end
        self._store = store  # the receiver's store must outlive the group
        self._pulls = 0  # the next pull's number, on every end
        self._closed = threading.Event()
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, timeout)

    @classmethod
    def host(
        cls,
        size: int,
        device: torch.device,
        invite: Callable[[tuple[str, int]], None],
        host: str | None = None,
        timeout_s: float = 300.0,
    ) -> "KVLink":
        """The receiver's end (rank 0). It hosts the store on a free port of ``host`` (default: this
        node's address) and calls ``invite(address)``, which must get every holder to :meth:`join`
        without waiting for it (the group forms once all have joined)."""
        if size < 2:
            raise ValueError(f"a KV link needs the receiver and at least one holder, got size={size}")
        host = host or socket.gethostbyname(socket.gethostname())
        store = dist.TCPStore(host, 0, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        address = (host, store.port)
        invite(address)
        link = cls(store, 0, size, device, timeout_s)
        link.address = address
        return link

    @classmethod
    def join(cls, address: tuple[str, int], rank: int, size: int, device: torch.device, timeout_s: float = 300.0) -> "KVLink":
        """A holder's end (rank >= 1) of the link hosted at ``address``."""
        if not 1 <= rank < size:
            raise ValueError(f"a holder's rank must be in [1, {size}), got {rank}")
        store = dist.TCPStore(address[0], address[1], size, False, timeout=timedelta(seconds=timeout_s))
        return cls(store, rank, size, device, timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def warm_up(self) -> None:
        """Open the receiver-holder connections now (NCCL creates them on first use): every holder
        sends one element. Holders and the receiver all call it."""
        if self.rank == 0:
            buffers = [torch.empty(1, device=self.device) for _ in range(1, self.size)]
            self._wait([self.group.recv([b], src, _TAG) for src, b in enumerate(buffers, start=1)])
        else:
            self._wait([self.group.send([torch.ones(1, device=self.device)], 0, _TAG)])

    # ---- the holder's end ------------------------------------------------------------------------
    def serve(self, shard: ShardSource, on_close: Callable[[], None] = lambda: None) -> threading.Thread:
        """Answer every pull from a thread of this holder until the link closes; ``on_close`` is
        called then (the receiver closed it, or is gone, or a send failed)."""
        if self.rank == 0:
            raise RuntimeError("the receiver's end pulls; only holders serve")
        thread = threading.Thread(target=self._serve, args=(shard, on_close), name=f"kv-link-holder-{self.rank}", daemon=True)
        thread.start()
        return thread

    def _serve(self, shard: ShardSource, on_close: Callable[[], None]) -> None:
        stream = contextlib.nullcontext()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            stream = torch.cuda.stream(torch.cuda.Stream(self.device))
        try:
            self._store.set_timeout(_IDLE)  # a get blocks until the key is set
            with stream:
                while not self.closed:
                    key = f"pull/{self._pulls}"
                    try:
                        request_id = self._store.get(key)
                    except dist.DistStoreError:  # an idle hour: wait again
                        continue
                    if request_id == _CLOSE:
                        break
                    self._send(shard, request_id.decode())
                    # after the send, off the receiver's path: the last holder to answer clears the key
                    if self._store.add(f"answered/{self._pulls}", 1) == self.size - 1:
                        self._store.delete_key(key)
                        self._store.delete_key(f"answered/{self._pulls}")
                    self._pulls += 1
        except Exception as error:  # the receiver is gone, or a send failed: the link is dead
            if not self.closed:
                logger.warning("KV link holder %d: closing after %s: %s", self.rank, type(error).__name__, error)
        finally:
            self._closed.set()
            on_close()

    def _send(self, shard: ShardSource, request_id: str) -> None:
        try:
            with shard(request_id) as (layers, rows):
                self._send_shard(layers, rows)
        except KeyError as refusal:  # nothing to send: say why, then an empty header
            reason = refusal.args[0] if refusal.args else f"no KV for request {request_id!r}"
            self._store.set(f"refused/{self._pulls}/{self.rank}", str(reason))
            self._send_shard(None)

    def _send_shard(self, layers: Sequence[torch.Tensor] | None, rows: int = 0) -> None:
        header = torch.full((_HEADER,), -1, dtype=torch.int64)
        if layers is not None:
            dtype = layers[0].dtype
            header = torch.tensor([rows, layers[0].shape[0], len(layers), _DTYPES.index(dtype)], dtype=torch.int64)
        works = [self.group.send([header.to(self.device)], 0, _TAG)]
        for layer in layers or ():
            works.append(self.group.send([layer.contiguous()], 0, _TAG))
        self._wait(works)

    # ---- the receiver's end ----------------------------------------------------------------------
    def pull(self, request_id: str, block_size: int, width: int) -> tuple[list[KVShard], dict[str, float]]:
        """Every holder's shard of ``request_id``, in holder order, and where the time went:
        ``ask_s`` (writing the pull's key), ``headers_s`` (until every holder's header is in) and
        ``stream_s`` (from there to the last byte). Raises :class:`KVLinkError` with each refusing
        holder's reason, after receiving what the others sent, so the link stays usable."""
        if self.rank != 0:
            raise RuntimeError("only the receiver's end (rank 0) pulls")
        if self.closed:
            raise RuntimeError("this KV link is closed")
        if not request_id:
            raise ValueError("a pull needs a request id")
        number = self._pulls
        started = time.perf_counter()
        self._store.set(f"pull/{number}", request_id)
        self._pulls += 1
        asked = time.perf_counter()
        shards, headers_in, refused = self._receive_shards(block_size, width)
        timings = {"ask_s": asked - started, "headers_s": headers_in - asked, "stream_s": time.perf_counter() - headers_in}
        if refused:
            reasons = []
            for rank in refused:
                key = f"refused/{number}/{rank}"
                reasons.append(f"holder {rank}: {self._store.get(key).decode()}")
                self._store.delete_key(key)
            raise KVLinkError("; ".join(reasons))
        return shards, timings

    def _receive_shards(self, block_size: int, width: int) -> tuple[list[KVShard], float, list[int]]:
        """The shards, when the last header came in (``perf_counter``), and the holders that refused."""
        headers = [torch.empty(_HEADER, dtype=torch.int64, device=self.device) for _ in range(1, self.size)]
        self._wait([self.group.recv([h], src, _TAG) for src, h in enumerate(headers, start=1)])
        started = time.perf_counter()
        shards, works, refused = [], [], []
        for src, header in enumerate(headers, start=1):
            rows, num_blocks, num_layers, dtype_code = header.tolist()
            if rows < 0:
                refused.append(src)
                continue
            if not 0 <= dtype_code < len(_DTYPES) or rows > num_blocks * block_size:
                raise RuntimeError(f"holder {src} sent a malformed header {header.tolist()}")
            blocks = torch.empty(num_layers, num_blocks, block_size, width, dtype=_DTYPES[dtype_code], device=self.device)
            works += [self.group.recv([blocks[layer]], src, _TAG) for layer in range(num_layers)]
            shards.append(KVShard(blocks, rows))
        self._wait(works)
        return shards, started, refused

    def close(self) -> None:
        """End the link from the receiver's end: every holder's serving thread stops at once (it is
        blocked on the next pull's key, which now says so)."""
        if self.rank != 0:
            raise RuntimeError("a link is closed by its receiver; a holder's end closes when the receiver goes")
        if not self.closed:
            self._closed.set()
            self._store.set(f"pull/{self._pulls}", _CLOSE)

    # ---- both ends -------------------------------------------------------------------------------
    def _wait(self, works) -> None:
        for work in works:
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # NCCL's wait only orders the stream
