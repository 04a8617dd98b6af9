"""One load per vLLM decode instance of several tensor-parallel ranks: rank 0 of the TP group pulls
a request's rows from the prefill tier and relays them to the other ranks over a process group of
the connector's own.

In vLLM's MLA every TP rank holds the whole latent cache (there is no head dimension to split), and
the instance's one scheduler gives every rank the same block ids. So one copy of the KV crosses the
network per instance: the leader (TP rank 0) loads as a one-rank instance does (``kv.receiver``),
then copies the loaded rows out of its cache into a staging buffer of at most ``RELAY_BYTES``, chunk
by chunk, and broadcasts each chunk; every other rank (a follower) writes the chunk into the same
blocks of its own cache, and only then reports the request's load done. vLLM counts a load finished
once every rank has reported it, and recomputes the blocks any rank reports as failed on all of them,
so no rank decodes from a half-filled cache: a failed load on the leader is relayed as a failure.

Why one rank pulls and broadcasts rather than every rank pulling 1/TP of the rows and all-gathering
them: a ticket is claimed once (the KV server hands a request's KV to one receiver and frees it on its
ack), so a split pull would need the server to count parts; and on one host (the ``mapped`` transport)
nothing crosses a network at all. Where each GPU has a NIC of its own a split pull would divide the
network time by TP; that is to be measured on the two-GPU machine.

Why a group of its own: vLLM's TP group carries its forward's collectives from its main thread; a
relay's collectives come from a thread of their own, at any time, and would interleave with them
differently on each rank. The leader decides the order (loads as they finish, not as they were
asked), so a load still waiting for its prefill never holds up the relay of another. Headers go over
gloo; rows over NCCL where the cache is on a GPU (NVLink), else over the same gloo group.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, as the connector's

RELAY_BYTES = 64 << 20  # the staging buffer of each rank: one chunk of rows, every layer


def loaded_blocks(block_ids: list[int], start: int, end: int, block_size: int) -> set[int]:
    """The blocks holding tokens ``start`` to ``end`` of a request whose blocks are ``block_ids``
    (token order): those vLLM recomputes when their load failed."""
    return set(block_ids[start // block_size : -(-end // block_size)])


@dataclass(frozen=True)
class Relayed:
    """A load as the leader relays it: vLLM's request, its blocks (token order, from token 0), the
    tokens loaded (``start`` to ``end``), and whether the leader's load failed."""

    request_id: str
    block_ids: list[int]
    start: int
    end: int
    failed: bool


class TPRelay:
    """The relay of one rank of a TP group (``ranks``: the group's global ranks, leader first).

    The leader calls :meth:`send` after each of its loads; a follower's thread receives them and
    calls ``on_received(request_id, failed_block_ids)`` once its cache holds the rows (or the leader's
    load failed: every loaded block is reported failed)."""

    def __init__(self, layers: list[torch.Tensor], block_size: int, ranks: list[int], rank: int,
                 on_received: Callable[[str, set[int]], None]) -> None:  # fmt: skip
        self.layers, self.block_size, self.ranks, self.rank = layers, block_size, list(ranks), rank
        self.leads = rank == self.ranks[0]
        self.on_received = on_received
        self.device = layers[0].device
        # every rank of the TP group (and only they) creates these, in this order
        self.control = dist.new_group(self.ranks, backend="gloo", use_local_synchronization=True)
        self.data = self.control if self.device.type == "cpu" else dist.new_group(self.ranks, backend="nccl", use_local_synchronization=True)
        width, itemsize = layers[0].shape[-1], layers[0].element_size()
        self.chunk_tokens = max(1, RELAY_BYTES // (len(layers) * width * itemsize))
        self.staging = torch.empty(len(layers) * self.chunk_tokens * width, dtype=layers[0].dtype, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.sends: queue.SimpleQueue[Relayed | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._lead if self.leads else self._follow, name="mlapool-kv-relay", daemon=True)
        self.thread.start()

    def send(self, relayed: Relayed) -> None:
        """The leader: relay one finished load (its rows, or its failure) to the followers."""
        self.sends.put(relayed)

    def close(self) -> None:
        """The leader tells the followers to stop (they wait for its headers until then)."""
        if self.leads:
            self.sends.put(None)

    # ---- both sides ----------------------------------------------------------------------------------
    def _slots(self, item: Relayed, begin: int, end: int) -> torch.Tensor:
        """The cache rows (of a layer seen as ``[blocks * block_size, width]``) of tokens ``begin`` to ``end``."""
        position = torch.arange(begin, end)
        table = torch.tensor(item.block_ids)
        return (table[position // self.block_size] * self.block_size + position % self.block_size).to(self.device)

    def _chunks(self, item: Relayed):
        """``(rows of the cache, the staging buffer seen as [layers, tokens, width])`` per chunk."""
        width = self.layers[0].shape[-1]
        for begin in range(item.start, item.end, self.chunk_tokens):
            end = min(item.end, begin + self.chunk_tokens)
            yield self._slots(item, begin, end), self.staging[: len(self.layers) * (end - begin) * width].view(len(self.layers), end - begin, width)

    def _on_stream(self):
        if self.stream is None:
            return nullcontext()
        torch.cuda.set_device(self.device)
        return torch.cuda.stream(self.stream)

    # ---- leader ----------------------------------------------------------------------------------------
    def _lead(self) -> None:
        with self._on_stream():
            while True:
                item = self.sends.get()
                dist.broadcast_object_list([item], src=self.ranks[0], group=self.control)
                if item is None:
                    return
                if item.failed:
                    continue
                started, error = time.perf_counter(), None
                for slots, rows in self._chunks(item):
                    try:
                        for layer, out in zip(self.layers, rows):
                            torch.index_select(layer.view(-1, layer.shape[-1]), 0, slots, out=out)
                    except Exception as exc:  # noqa: BLE001 -- the chunks still go (the followers wait for them); the trailer says
                        error = error or repr(exc)
                    dist.broadcast(rows, src=self.ranks[0], group=self.data)
                if self.stream is not None:
                    self.stream.synchronize()
                dist.broadcast_object_list([error], src=self.ranks[0], group=self.control)  # the trailer: None, or why the rows are wrong
                if error is not None:
                    logger.warning("request %s: relaying its rows failed, every rank recomputes them: %s", item.request_id, error)
                else:
                    logger.info("request %s: %d tokens relayed to %d other TP ranks in %.5f s", item.request_id, item.end - item.start,
                                len(self.ranks) - 1, time.perf_counter() - started)  # fmt: skip

    # ---- follower --------------------------------------------------------------------------------------
    def _follow(self) -> None:
        with self._on_stream():
            while True:
                header: list[Relayed | None] = [None]
                dist.broadcast_object_list(header, src=self.ranks[0], group=self.control)
                item = header[0]
                if item is None:
                    return
                loaded = loaded_blocks(item.block_ids, item.start, item.end, self.block_size)
                if item.failed:
                    self.on_received(item.request_id, loaded)
                    continue
                started, error = time.perf_counter(), None
                for slots, rows in self._chunks(item):
                    dist.broadcast(rows, src=self.ranks[0], group=self.data)
                    try:
                        for layer, got in zip(self.layers, rows):
                            layer.view(-1, layer.shape[-1]).index_copy_(0, slots, got)
                    except Exception as exc:  # noqa: BLE001 -- the remaining chunks are still taken, to stay in step
                        error = error or repr(exc)
                if self.stream is not None:
                    self.stream.synchronize()  # the rows are in the cache before vLLM hears of them
                trailer: list[str | None] = [None]
                dist.broadcast_object_list(trailer, src=self.ranks[0], group=self.control)
                error = error or trailer[0]
                if error is not None:
                    logger.warning("request %s: the rows relayed from TP rank %d are not whole, every rank recomputes them: %s",
                                   item.request_id, self.ranks[0], error)  # fmt: skip
                else:
                    logger.info("request %s: %d tokens received from TP rank %d in %.5f s", item.request_id, item.end - item.start,
                                self.ranks[0], time.perf_counter() - started)  # fmt: skip
                self.on_received(item.request_id, loaded if error is not None else set())
