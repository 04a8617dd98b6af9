"""The paged latent KV cache of one worker.

Per layer the cache is ``[num_blocks, block_size, latent]`` -- the layout vLLM's
MLA decode reads -- with one row per token: ``[kv_c_normed | k_pe]`` (576 values
for DeepSeek). A request has a list of blocks (its block table), given for its
whole prompt when its first chunk arrives, so a request that has started never
runs out of cache. Token ``i`` of a request lives in block
``table[i // block_size]`` at offset ``i % block_size``.

Capacity is fixed when the worker starts. The driver owns the blocks
(``cluster.prefix_cache``): it sends each request's table, whose first blocks may
already hold rows another request wrote (a cached prefix, shared read-only), and
admits only requests that fit. Without a table (the worker's own warm-up) the
lowest blocks no request uses are taken.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv.mapped import shared_host_tensor, unlink_shared


class KVCacheFull(RuntimeError):
    """Not enough free blocks for a request (the driver's admission control should prevent this)."""


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class _Entry:
    ids: list[int]  # the request's block table, on the host
    slots: np.ndarray  # int64 [capacity]: flat row index of every token of the request, on the host
    first: int | None  # the first block when the table is one ascending run, else None
    length: int = 0  # rows written so far
    device_slots: torch.Tensor | None = None  # ``slots`` on the cache's device, copied when first read there

    @property
    def capacity(self) -> int:
        return len(self.slots)


class PagedKVCache:
    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, width: int, dtype: torch.dtype, device: torch.device,
        *, shared: bool = False,
    ) -> None:  # fmt: skip
        """``shared``: on the CPU, the blocks live in a shared-memory file (``shared_path``) that a
        receiver on this host maps (``kv.mapped``), where ``/dev/shm`` has the room; GPU memory is
        shared by CUDA IPC as it is."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV cache needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        shape = (num_layers, num_blocks, block_size, width)
        mapped = shared_host_tensor(shape, dtype) if shared and torch.device(device).type == "cpu" else None
        self.blocks, self.shared_path = mapped if mapped is not None else (torch.empty(shape, dtype=dtype, device=device), None)
        if self.shared_path is not None:
            weakref.finalize(self, unlink_shared, self.shared_path)  # a killed worker's file goes at the next start
        self._rows = self.blocks.view(num_layers, num_blocks * block_size, width)
        # per block, the tables that hold it (a shared prefix is in several): an array, not a dict, because a
        # GPU's cache has ~10^5 blocks, and finding the unused ones or dropping released ones by walking a dict
        # cost ~15 ms a request (two EP ranks' 16x4K batches 0.58 -> 1.07 s on 2 x H200, 2026-11-28)
        self._refs = np.zeros(num_blocks, dtype=np.int32)
        self._requests: dict[str, _Entry] = {}

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, width: int, dtype: torch.dtype) -> int:
        return num_layers * block_size * width * (torch.finfo(dtype).bits // 8)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[1]

    @property
    def free_blocks(self) -> int:
        """Blocks in no request's table (cached prefix blocks the driver keeps are among them)."""
        return int(np.count_nonzero(self._refs == 0))

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def reserve(self, request_id: str, tokens: int, block_ids: Sequence[int] | None = None, filled: int = 0) -> None:
        """Give ``request_id`` blocks for ``tokens`` rows: ``block_ids`` (the driver's table, whose
        first ``filled`` rows are already written: a cached prefix), or the lowest unused blocks."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} already holds a KV cache on this worker")
        need = blocks_for(tokens, self.block_size)
        if block_ids is None:
            ids = np.flatnonzero(self._refs == 0)[:need].tolist()
            if len(ids) < need:
                raise KVCacheFull(
                    f"request {request_id!r} needs {need} KV blocks of {self.block_size} tokens; "
                    f"{self.free_blocks} of {self.num_blocks} are free"
                )
        else:
            ids = [int(b) for b in block_ids]
            if len(ids) != need or not all(0 <= b < self.num_blocks for b in ids) or not 0 <= filled <= tokens:
                raise ValueError(f"request {request_id!r}: a table of {len(ids)} blocks for {tokens} rows ({need} blocks of {self.block_size}, {filled} filled) in a cache of {self.num_blocks}")
        # the slots on the host: a device tensor per request here cost a copy and a host sync each, ~0.45 ms of
        # an idle GPU per request at the start of every batch (16 prompts of 4K: 7 ms, one H200, 2026-11-29)
        positions = np.arange(tokens)
        slots = np.asarray(ids, dtype=np.int64)[positions // self.block_size] * self.block_size + positions % self.block_size
        run = ids == list(range(ids[0], ids[0] + need)) if ids else False
        np.add.at(self._refs, ids, 1)
        self._requests[request_id] = _Entry(ids, slots, ids[0] if run else None, filled)

    def append(self, request_id: str, latents: list[torch.Tensor], rows: slice | torch.Tensor) -> None:
        """Append rows ``rows`` (a slice or an index tensor) of every layer's batch latent ``[T, width]``."""
        self.append_many(latents, [(request_id, rows)])

    def append_many(self, latents: list[torch.Tensor], parts: Sequence[tuple[str, slice | torch.Tensor]]) -> None:
        """Append each ``(request_id, rows)`` of ``parts`` (rows: a slice or an index tensor of every layer's
        batch latent ``[T, width]``): one copy of the slots to the device and one write per layer for all."""
        if not parts:
            return
        total = latents[0].shape[0]
        slots, sources = [], []
        for request_id, rows in parts:
            entry = self._entry(request_id)
            count = len(range(*rows.indices(total))) if isinstance(rows, slice) else rows.numel()
            assert entry.length + count <= entry.capacity, (request_id, entry.length, count, entry.capacity)
            slots.append(entry.slots[entry.length : entry.length + count])
            sources.append(rows)
        target = self._to_device(np.concatenate(slots))
        index = _as_one_slice(sources, total)
        if index is None:
            device = latents[0].device
            index = torch.cat([r.to(device) if isinstance(r, torch.Tensor) else torch.arange(*r.indices(total), device=device) for r in sources])
        for layer, latent in enumerate(latents):
            self._rows[layer].index_copy_(0, target, latent[index])
        for (request_id, _), part in zip(parts, slots):
            self._requests[request_id].length += len(part)

    def holds(self, request_id: str) -> bool:
        return request_id in self._requests

    def length(self, request_id: str) -> int:
        return self._entry(request_id).length

    def rows(self, request_id: str, layer: int, count: int | None = None) -> torch.Tensor:
        """The first ``count`` (default: all written) rows of a request in one layer, ``[count, width]``."""
        entry = self._entry(request_id)
        count = entry.length if count is None else count
        return self._rows[layer].index_select(0, self._device_slots(entry)[:count])

    def block_table(self, request_id: str) -> list[int]:
        """A request's block ids, in the order its rows fill them (no device sync)."""
        return list(self._entry(request_id).ids)

    def block_views(self, request_id: str) -> list[torch.Tensor]:
        """A request's blocks, ``[n_blocks, block_size, width]`` per layer, in block-table order: views
        of the cache when the table is one ascending run (no copy), gathered copies otherwise."""
        entry = self._entry(request_id)
        if entry.first is not None:
            return list(self.blocks[:, entry.first : entry.first + len(entry.ids)])
        blocks = self._to_device(np.asarray(entry.ids, dtype=np.int64))
        return [layer.index_select(0, blocks) for layer in self.blocks]

    def release(self, request_id: str) -> int:
        """Free a request's blocks; returns how many (0 if it held none)."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return 0
        np.subtract.at(self._refs, entry.ids, 1)
        return len(entry.ids)

    def _device_slots(self, entry: _Entry) -> torch.Tensor:
        if entry.device_slots is None:
            entry.device_slots = self._to_device(entry.slots)
        return entry.device_slots

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the cache's device; to a GPU from pinned memory, queued on the stream: a copy
        from pageable memory would wait for every kernel queued before it (the forward, when rows are
        written after it)."""
        tensor = torch.from_numpy(array)
        if self.blocks.device.type != "cuda":
            return tensor.to(self.blocks.device)
        return tensor.pin_memory().to(self.blocks.device, non_blocking=True)

    def _entry(self, request_id: str) -> _Entry:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"no KV cache for request {request_id!r} on this worker") from None


def _as_one_slice(rows: list[slice | torch.Tensor], total: int) -> slice | None:
    """The slices ``rows`` as one, where they follow each other with step 1 (a batch's pieces in order);
    else None."""
    if not all(isinstance(r, slice) for r in rows):
        return None
    spans = [r.indices(total) for r in rows]
    if any(step != 1 for _, _, step in spans) or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return None
    return slice(spans[0][0], spans[-1][1])
