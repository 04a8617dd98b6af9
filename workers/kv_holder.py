"""What a prefill worker does with the KV it holds: hand it off, and free it.

:class:`KVHolder` is the part of ``workers.worker.PrefillWorker`` that serves the paged latent
cache (``self.kv``) to decode servers and decode actors while prefill batches go on:

* ``fetch_kv``: the rows as a host array (Ray objects, for a decode actor or ``pool.fetch_kv``);
* ``join_kv_link``: a decode actor's point-to-point link (``workers.kv_link``), answered by a thread;
* ``describe_kv``: where a request's blocks are, for a decode server outside the cluster, which then
  takes them itself (``workers.kv_export``: NIXL READs of the registered cache, or TCP pulls);
* ``holds_kv``: whether it still holds a request's KV (after a receiver copied it from the mapped cache);
* ``release``: free a request's blocks (deferred while a link or a TCP pull is sending them).

Threads read the cache while prefill runs: the block tables change under ``_kv_lock``, a request
being sent is freed only when its sends finish, and a finished request's KV is marked by a CUDA
event that a send (or a ``describe_kv``) waits for. Nothing here imports Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from configs.pool import PoolConfig
from workers.kv_cache import PagedKVCache
from workers.kv_export import KVExporter
from workers.kv_link import KVLink
from kv.nixl import NixlEndpoint, nixl_unavailable
from kv.frames import HostKV

logger = logging.getLogger(__name__)


class KVHolder:
    """KV holding and handoff state and methods of a prefill worker (a mixin: the worker sets ``kv``,
    ``config`` and ``rank`` and calls :meth:`_init_kv_holder` in its constructor and
    :meth:`_start_export` once its cache exists)."""

    kv: PagedKVCache
    config: PoolConfig
    rank: int

    def _init_kv_holder(self, config: PoolConfig, rank: int, tp_rank: int) -> None:
        self.kv_links: dict[str, KVLink] = {}
        self.export: KVExporter | None = None  # serves this worker's KV shards to decode servers (TP rank 0 only)
        # NIXL's agent takes about half a second to start (UCX): it starts now, beside the worker's setup
        self._nixl: Future | None = None
        if tp_rank == 0 and config.nixl != "off" and nixl_unavailable() is None:
            starter = ThreadPoolExecutor(1, thread_name_prefix="nixl-start")
            self._nixl = starter.submit(NixlEndpoint, f"mlapool-{os.getpid()}-{rank}-{uuid.uuid4().hex[:8]}", serves=True)
            starter.shutdown(wait=False)
        self._kv_lock = threading.Lock()
        self._kv_sending: Counter[str] = Counter()
        self._kv_free_after_send: set[str] = set()
        self._kv_ready: dict[str, torch.cuda.Event] = {}

    def fetch_kv(self, request_id: str) -> HostKV:
        """This worker's latent rows of a request, ``[layers, rows, latent]`` on the host."""
        layers = self.kv.blocks.shape[0]
        return HostKV.of(torch.stack([self.kv.rows(request_id, layer) for layer in range(layers)]))

    def join_kv_link(self, name: str, address: tuple[str, int], rank: int, size: int, timeout_s: float) -> None:
        """Join a decode actor's point-to-point link (``workers.kv_link``) as ``rank``. Returns once
        the connection to the receiver is open; a thread then answers the receiver's pulls until
        the link closes."""
        link = KVLink.join(address, rank, size, self.kv.blocks.device, timeout_s)
        link.warm_up()
        self.kv_links[name] = link
        link.serve(self._kv_shard, on_close=lambda: self.kv_links.pop(name, None))

    def describe_kv(self, request_id: str, transport: str) -> dict:
        """Where this worker's shard of a kept request is, for a decode server to take it over
        ``transport`` (``KVExporter.offer``). Called by the KV server in the ``kv`` concurrency group,
        beside a running prefill batch; returns once the request's KV is complete in memory."""
        if self.export is None:
            raise RuntimeError(f"worker {self.rank} exports no KV (only TP rank 0 of each PCP rank holds shards to hand off)")
        with self._kv_lock:
            ready = self._kv_ready.get(request_id)
            blocks, rows = self.kv.block_table(request_id), self.kv.length(request_id)
        if ready is not None:
            ready.synchronize()
        return self.export.offer(request_id, blocks, rows, transport)

    def holds_kv(self, request_id: str) -> bool:
        """Whether this worker still holds a request's KV (the KV server asks after a mapped copy)."""
        with self._kv_lock:
            return self.kv.holds(request_id)

    def _start_export(self) -> KVExporter:
        """The KV export: NIXL when ``config.nixl`` allows and it is installed (else TCP only, said once)."""
        endpoint = self._nixl.result() if self._nixl is not None else None  # started in __init__; raises what NIXL raised
        if endpoint is None:
            reason = "disabled by the pool config (nixl='off')" if self.config.nixl == "off" else nixl_unavailable()
            if self.config.nixl == "on":
                raise RuntimeError(f"pool config nixl='on' but NIXL cannot be used on {socket.gethostname()}: {reason}")
            if self.rank == 0:
                logger.info("KV handoff to decode servers over TCP only: %s", reason)
        host = socket.gethostbyname(socket.gethostname())
        return KVExporter(self.kv, self._kv_shard, name=f"worker-{self.rank}", host=host, nixl=endpoint)

    @contextlib.contextmanager
    def _kv_shard(self, request_id: str) -> Iterator[tuple[list[torch.Tensor], int]]:
        """A kept request's paged blocks per layer and its rows, for a thread to send (a link's, a TCP pull's): the
        request cannot be freed meanwhile, and the thread's stream first waits for its KV."""
        with self._kv_lock:
            ready = self._kv_ready.get(request_id)
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            blocks, rows = self.kv.block_views(request_id), self.kv.length(request_id)
            self._kv_sending[request_id] += 1
        try:
            yield blocks, rows
        finally:
            with self._kv_lock:
                self._kv_sending[request_id] -= 1
                if not self._kv_sending[request_id]:
                    del self._kv_sending[request_id]
                    if request_id in self._kv_free_after_send:
                        self._kv_free_after_send.discard(request_id)
                        self.kv.release(request_id)

    def release(self, request_ids: Sequence[str]) -> int:
        """Free the requests' KV; returns the blocks freed (a request a link is sending is freed
        when the send ends, and not counted)."""
        freed = 0
        with self._kv_lock:
            for request_id in request_ids:
                self._kv_ready.pop(request_id, None)
                if self._kv_sending[request_id]:
                    self._kv_free_after_send.add(request_id)
                else:
                    freed += self.kv.release(request_id)
        return freed
