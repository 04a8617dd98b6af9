"""One load per vLLM decode instance of several tensor-parallel ranks: rank 0 of the TP group pulls
a request's rows from the prefill tier and relays them to the other ranks.

In vLLM's MLA every TP rank holds the whole latent cache (there is no head dimension to split), and
the instance's one scheduler gives every rank the same block ids. So one copy of the KV crosses the
network per instance: the leader (TP rank 0) loads as a one-rank instance does (``kv.receiver``),
then tells the other ranks (followers) which blocks now hold the request's rows; each follower copies
them into the same blocks of its own cache and only then reports the request's load done. vLLM counts
a load finished once every rank has reported it, and recomputes the blocks any rank reports as failed
on all of them, so no rank decodes from a half-filled cache: a failed load on the leader is relayed as
a failure.

How the rows move, chosen once when the ranks start (every follower must be able to, else all stage):
- ``mapped``: the ranks' GPUs are on one host and reach each other (peer access). Each follower maps
  the leader's per-layer caches once (CUDA IPC, ``kv.mapped``) and copies a request's rows of every
  layer with one kernel (``kv.mapped_triton.copy_between``), straight from the leader's blocks into
  its own: no staging, no collective, one launch however many layers and chunks. The leader's blocks
  are stable meanwhile: vLLM runs the request only after every rank reported.
- ``staged``: otherwise (ranks on several hosts, caches in host memory). The leader gathers the rows
  into a staging buffer of at most ``RELAY_BYTES``, chunk by chunk, and broadcasts each chunk (NCCL
  where the cache is on a GPU, else gloo); each follower scatters the chunk into its blocks. On a GPU
  the gather and the scatter are one kernel per chunk (``kv.mapped_triton``), not one op per layer.
Measured on two H100s (2026-11-26, vLLM 0.26 TP2, 61 layers x 32K: 2.1 GiB): the staged relay as it
was, 35 chunks of 61 ``index_select`` on the leader and 61 ``index_copy_`` on the follower each, issued
from a Python thread inside vLLM's worker processes, took 0.47 s (4.4 GiB/s), against 3 ms for the
load itself. Now a load issues a handful of calls (``mapped``), or a handful per chunk (``staged``).

Why one rank pulls rather than every rank pulling 1/TP of the rows: a ticket is claimed once (the KV
server hands a request's KV to one receiver and frees it on its ack), so a split pull would need the
server to count parts; and on one host (the ``mapped`` transport) nothing crosses a network at all.
Where each GPU has a NIC of its own a split pull would divide the network time by TP.

Why a group of its own: vLLM's TP group carries its forward's collectives from its main thread; a
relay's collectives come from a thread of their own, at any time, and would interleave with them
differently on each rank. The leader decides the order (loads as they finish, not as they were
asked), so a load still waiting for its prefill never holds up the relay of another. Headers go over
gloo; staged rows over NCCL where the cache is on a GPU (NVLink), else over the same gloo group.
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

from kv.mapped import MappedError, MappedRegion, Mapper, share_cache
from kv.receiver import token_rows

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, as the connector's

RELAY_BYTES = 64 << 20  # the staging buffer of each rank: one chunk of rows, every layer


def loaded_blocks(block_ids: list[int], start: int, end: int, block_size: int) -> set[int]:
    """The blocks holding tokens ``start`` to ``end`` of a request whose blocks are ``block_ids``
    (token order): those vLLM recomputes when their load failed."""
    return set(block_ids[start // block_size : -(-end // block_size)])


@dataclass(frozen=True)
class Relayed:
    """A load as the leader relays it: vLLM's request, its blocks (token order, from token 0), the
    tokens loaded (``start`` to ``end``), whether the leader's load failed, and the tier's request id
    and first token that came with it (``kv.vllm_first_token``: every rank samples, so every rank
    files it)."""

    request_id: str
    block_ids: list[int]
    start: int
    end: int
    failed: bool
    first_token: tuple[str, int] | None = None


class TPRelay:
    """The relay of one rank of a TP group (``ranks``: the group's global ranks, leader first).

    The leader calls :meth:`send` after each of its loads; a follower's thread receives them and
    calls ``on_received(relayed, failed_block_ids)`` once its cache holds the rows (or the leader's
    load failed: every loaded block is reported failed). ``mapped``: whether followers may map the
    leader's caches (False: always staged); :attr:`mode` says which path the group took."""

    def __init__(self, layers: list[torch.Tensor], block_size: int, ranks: list[int], rank: int,
                 on_received: Callable[[Relayed, set[int]], None], mapped: bool = True) -> None:  # fmt: skip
        self.layers, self.block_size, self.ranks, self.rank = layers, block_size, list(ranks), rank
        self.leads = rank == self.ranks[0]
        self.on_received = on_received
        self.device = layers[0].device
        self.width = layers[0].shape[-1]
        self.rows = layers[0].shape[0] * block_size  # rows of each of this rank's caches (a block past them is refused)
        # every rank of the TP group (and only they) creates these, in this order
        self.control = dist.new_group(self.ranks, backend="gloo", use_local_synchronization=True)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.stream is not None:  # Triton only where the caches are on a GPU
            from kv import mapped_triton

            self.kernels = mapped_triton
        self.table = None if self.stream is None else self.kernels.address_table(layers)  # this rank's caches, for the kernels
        self.leader_rows = 0  # mapped: rows of each of the leader's caches (a block past them is refused)
        self.leader_table: torch.Tensor | None = None
        self.mode = self._agree_on_mode(mapped)
        self.chunk_tokens = max(1, RELAY_BYTES // (len(layers) * self.width * layers[0].element_size()))
        if self.mode == "staged":
            self.data = self.control if self.stream is None else dist.new_group(self.ranks, backend="nccl", use_local_synchronization=True)
            self.staging = torch.empty(len(layers) * self.chunk_tokens * self.width, dtype=layers[0].dtype, device=self.device)
            self.in_order = None if self.stream is None else torch.arange(self.chunk_tokens, device=self.device)
        if self.stream is not None:
            self._warm()
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
    def _agree_on_mode(self, mapped: bool) -> str:
        """``mapped`` if every follower mapped the leader's caches, else ``staged`` (a collective of the
        group: the leader offers its caches' CUDA IPC handles, each follower says whether it mapped them)."""
        offer: list[list[dict] | None] = [None]
        if self.leads and mapped and self.stream is not None:
            try:
                offer[0] = [share_cache(layer.unsqueeze(0)).as_dict() for layer in self.layers]
            except (ValueError, RuntimeError) as exc:  # a cache torch cannot share (not contiguous, say)
                logger.warning("TP rank %d: the ranks relay KV rows through a staging buffer; its caches cannot be shared: %s", self.rank, exc)
        dist.broadcast_object_list(offer, src=self.ranks[0], group=self.control)
        ok, reason = self.leads, None
        if not self.leads and offer[0] is not None:
            try:
                self._map_leader(offer[0])
                ok = True
            except (MappedError, RuntimeError) as exc:
                reason = str(exc)
        votes: list[tuple[bool, str | None]] = [(False, None)] * len(self.ranks)
        dist.all_gather_object(votes, (ok, reason), group=self.control)
        if offer[0] is not None and all(vote for vote, _ in votes):
            return "mapped"
        if offer[0] is not None:
            logger.warning("TP rank %d: the ranks relay KV rows through a staging buffer; a rank could not map the leader's caches: %s",
                           self.rank, "; ".join(why for vote, why in votes if not vote and why))  # fmt: skip
        self.leader_table = self._mapper = None  # any mapping this rank made goes
        return "staged"

    def _warm(self) -> None:
        """Compile the kernel this rank's relay runs on scratch rows, so that the first load does not
        wait for Triton's compiler."""
        scratch = [torch.zeros(16, self.width, dtype=self.layers[0].dtype, device=self.device) for _ in range(2)]
        rows, table = torch.arange(16, device=self.device), self.kernels.address_table(scratch)
        if self.mode == "mapped":
            if not self.leads:
                self.kernels.copy_between(table, table.flip(0), scratch[0], rows, self.width)
        elif self.leads:
            self.kernels.gather_rows(scratch, table, rows, torch.empty(2, 16, self.width, dtype=scratch[0].dtype, device=self.device), rows)
        else:
            self.kernels.copy_rows(torch.stack(scratch), scratch, table, rows, rows)
        torch.cuda.synchronize(self.device)

    def _map_leader(self, regions: list[dict]) -> None:
        mapper = Mapper()
        leader = [mapper.open(MappedRegion.from_dict(region), self.device)[0] for region in regions]
        if len(leader) != len(self.layers) or any(cache.shape[-1] != self.width or cache.dtype != self.layers[0].dtype for cache in leader):
            raise MappedError(f"the leader's caches are {len(leader)} layers of {tuple(leader[0].shape)} {leader[0].dtype}; this rank's "
                              f"{len(self.layers)} of {tuple(self.layers[0].shape)} {self.layers[0].dtype}")  # fmt: skip
        self._mapper, self.leader_rows = mapper, min(cache.shape[0] for cache in leader)  # the mapper keeps the mappings open
        self.leader_table = self.kernels.address_table(leader)

    def _check_inside(self, item: Relayed, rows: int, whose: str) -> None:
        """Refuse a load whose blocks lie past ``rows`` rows of a cache (a kernel reads where it is told)."""
        last = max(item.block_ids[item.start // self.block_size : -(-item.end // self.block_size)])
        if (last + 1) * self.block_size > rows:
            raise ValueError(f"block {last} is past {whose} cache of {rows // self.block_size} blocks")

    def _slots(self, item: Relayed, begin: int, end: int) -> torch.Tensor:
        """The cache rows (of a layer seen as ``[blocks * block_size, width]``) of tokens ``begin`` to ``end``."""
        return torch.from_numpy(token_rows(item.block_ids, self.block_size, begin, end)).to(self.device)

    def _chunks(self, item: Relayed):
        """``(rows of the cache, the staging buffer seen as [layers, tokens, width])`` per chunk."""
        for begin in range(item.start, item.end, self.chunk_tokens):
            end = min(item.end, begin + self.chunk_tokens)
            yield self._slots(item, begin, end), self.staging[: len(self.layers) * (end - begin) * self.width].view(len(self.layers), end - begin, self.width)

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
                if item.failed or self.mode == "mapped":  # mapped: each follower copies from this rank's blocks itself
                    continue
                started, error = time.perf_counter(), None
                try:
                    self._check_inside(item, self.rows, "this rank's")
                except ValueError as exc:
                    error = repr(exc)
                for slots, rows in self._chunks(item):
                    if error is None:  # after an error the chunks still go (the followers wait for them); the trailer says
                        try:
                            self._gather(slots, rows)
                        except Exception as exc:  # noqa: BLE001 -- said in the trailer
                            error = repr(exc)
                    dist.broadcast(rows, src=self.ranks[0], group=self.data)
                if self.stream is not None:
                    self.stream.synchronize()
                dist.broadcast_object_list([error], src=self.ranks[0], group=self.control)  # the trailer: None, or why the rows are wrong
                if error is not None:
                    logger.warning("request %s: relaying its rows failed, every rank recomputes them: %s", item.request_id, error)
                else:
                    logger.info("request %s: %d tokens relayed to %d other TP ranks in %.5f s", item.request_id, item.end - item.start,
                                len(self.ranks) - 1, time.perf_counter() - started)  # fmt: skip

    def _gather(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        if self.table is not None:
            self.kernels.gather_rows(self.layers, self.table, slots, rows, self.in_order[: len(slots)])
        else:
            for layer, out in zip(self.layers, rows):
                torch.index_select(layer.view(-1, self.width), 0, slots, out=out)

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
                    self.on_received(item, loaded)
                    continue
                started = time.perf_counter()
                error = self._copy_from_leader(item) if self.mode == "mapped" else self._take_chunks(item)
                if error is not None:
                    logger.warning("request %s: the rows relayed from TP rank %d are not whole, every rank recomputes them: %s",
                                   item.request_id, self.ranks[0], error)  # fmt: skip
                else:
                    logger.info("request %s: %d tokens received from TP rank %d (%s) in %.5f s", item.request_id, item.end - item.start,
                                self.ranks[0], self.mode, time.perf_counter() - started)  # fmt: skip
                self.on_received(item, loaded if error is not None else set())

    def _copy_from_leader(self, item: Relayed) -> str | None:
        """Mapped: the request's rows of every layer from the leader's blocks into this rank's, one kernel."""
        try:
            self._check_inside(item, self.leader_rows, "the leader's")
            self._check_inside(item, self.rows, "this rank's")
            slots = self._slots(item, item.start, item.end)
            self.kernels.copy_between(self.leader_table, self.table, self.layers[0], slots, self.width)
            self.stream.synchronize()  # the rows are in the cache before vLLM hears of them
        except Exception as exc:  # noqa: BLE001 -- a failed copy is a failed load (vLLM recomputes), never a dead relay
            return repr(exc)
        return None

    def _take_chunks(self, item: Relayed) -> str | None:
        """Staged: every chunk the leader broadcasts, scattered into this rank's blocks; the leader's trailer."""
        try:
            self._check_inside(item, self.rows, "this rank's")
            error = None
        except ValueError as exc:
            error = repr(exc)
        for slots, rows in self._chunks(item):
            dist.broadcast(rows, src=self.ranks[0], group=self.data)
            if error is not None:  # the remaining chunks are still taken, to stay in step
                continue
            try:
                if self.table is not None:
                    self.kernels.copy_rows(rows, self.layers, self.table, self.in_order[: len(slots)], slots)
                else:
                    for layer, got in zip(self.layers, rows):
                        layer.view(-1, self.width).index_copy_(0, slots, got)
            except Exception as exc:  # noqa: BLE001 -- said with the trailer's
                error = repr(exc)
        if self.stream is not None:
            self.stream.synchronize()  # the rows are in the cache before vLLM hears of them
        trailer: list[str | None] = [None]
        dist.broadcast_object_list(trailer, src=self.ranks[0], group=self.control)
        return error or trailer[0]
