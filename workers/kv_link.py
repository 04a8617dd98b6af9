"""A point-to-point link for the KV handoff: a process group of its own between one receiver (rank
0, a decode actor) and the prefill workers that hold a request's shards (ranks 1..N).

It is independent of the pool's process group (its own ``TCPStore``, hosted by the receiver), so a
decode server can join and leave without touching the grid. NCCL between GPUs (NVLink when the
GPUs share a node), gloo on CPU. Every shard goes as a small header, then one tensor per layer in
vLLM's paged MLA layout ``[num_blocks, block_size, width]``:

    receiver:  link = KVLink.host(1 + len(holders), device, invite)  # invite(address): holders join
    holder r:  KVLink.join(address, r, size, device).send_shard(layer_views, rows)
    receiver:  shards, stream_s = link.receive_shards(block_size, width)

The header says how many blocks and rows follow, or that the holder has nothing to send (the
receiver then posts no data receives, so an unknown request cannot hang the link).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

# dtype codes of the header; a receiver rejects codes it does not know
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HEADER = 4  # rows (-1: nothing to send), blocks, layers, dtype code
_TAG = 0


class KVLinkError(RuntimeError):
    """A shard could not be received: the holder had nothing to send, or the shapes disagree."""


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

    def warm_up(self) -> None:
        """Open the receiver-holder connections now (NCCL creates them on first use): every holder
        sends one element. Holders and the receiver all call it."""
        if self.rank == 0:
            buffers = [torch.empty(1, device=self.device) for _ in range(1, self.size)]
            self._wait([self.group.recv([b], src, _TAG) for src, b in enumerate(buffers, start=1)])
        else:
            self._wait([self.group.send([torch.ones(1, device=self.device)], 0, _TAG)])

    def send_shard(self, layers: Sequence[torch.Tensor] | None, rows: int = 0) -> int:
        """Send this holder's shard to the receiver: ``layers`` are ``[num_blocks, block_size, width]``
        each (views of the paged cache are fine), of which the first ``rows`` rows are written; ``None``
        tells the receiver there is nothing (the caller then raises its own error). Returns the bytes."""
        header = torch.full((_HEADER,), -1, dtype=torch.int64)
        if layers is not None:
            dtype = layers[0].dtype
            header = torch.tensor([rows, layers[0].shape[0], len(layers), _DTYPES.index(dtype)], dtype=torch.int64)
        works = [self.group.send([header.to(self.device)], 0, _TAG)]
        for layer in layers or ():
            works.append(self.group.send([layer.contiguous()], 0, _TAG))
        self._wait(works)
        return sum(layer.numel() * layer.element_size() for layer in layers or ())

    def receive_shards(self, block_size: int, width: int) -> tuple[list[KVShard], float]:
        """Every holder's shard, in holder order, and the seconds from the headers' arrival to the last
        byte (the streaming time, without the holders' start-up). Raises :class:`KVLinkError` naming
        each holder that had nothing to send (after receiving what the others sent, so the link stays
        usable)."""
        headers = [torch.empty(_HEADER, dtype=torch.int64, device=self.device) for _ in range(1, self.size)]
        self._wait([self.group.recv([h], src, _TAG) for src, h in enumerate(headers, start=1)])
        started = time.perf_counter()
        shards, works, missing = [], [], []
        for src, header in enumerate(headers, start=1):
            rows, num_blocks, num_layers, dtype_code = header.tolist()
            if rows < 0:
                missing.append(src)
                continue
            if not 0 <= dtype_code < len(_DTYPES) or rows > num_blocks * block_size:
                raise KVLinkError(f"holder {src} sent a malformed header {header.tolist()}")
            blocks = torch.empty(num_layers, num_blocks, block_size, width, dtype=_DTYPES[dtype_code], device=self.device)
            works += [self.group.recv([blocks[layer]], src, _TAG) for layer in range(num_layers)]
            shards.append(KVShard(blocks, rows))
        self._wait(works)
        stream_s = time.perf_counter() - started
        if missing:
            raise KVLinkError(f"holders {missing} of the link had no KV to send")
        return shards, stream_s

    def _wait(self, works) -> None:
        for work in works:
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # NCCL's wait only orders the stream
