"""Latent KV rows of the requests a worker is prefilling or holding for handoff.

Each request owns one buffer ``[layers, capacity, latent]`` sized for its whole
prompt when its first chunk arrives; chunks append rows in order. A row is
``[kv_c_normed | k_pe]`` (576 values for DeepSeek), the layout vLLM's MLA
cache stores.
"""

from __future__ import annotations

import torch


class RequestKV:
    def __init__(self, num_layers: int, capacity: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows = torch.empty(num_layers, capacity, width, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.rows.shape[1]

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def append(self, latents: list[torch.Tensor], start: int, stop: int) -> None:
        """Append rows ``[start, stop)`` of every layer's batch latent."""
        count = stop - start
        assert self.length + count <= self.capacity, (self.length, count, self.capacity)
        for layer, latent in enumerate(latents):
            self.rows[layer, self.length : self.length + count] = latent[start:stop]
        self.length += count

    def layer(self, index: int) -> torch.Tensor:
        return self.rows[index, : self.length]


class KVStore:
    """The requests' KV buffers on one worker, by request id."""

    def __init__(self, num_layers: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.width, self.dtype, self.device = num_layers, width, dtype, device
        self._requests: dict[str, RequestKV] = {}

    def bytes_for(self, tokens: int) -> int:
        return self.num_layers * tokens * self.width * torch.finfo(self.dtype).bits // 8

    def reserve(self, request_id: str, capacity: int) -> RequestKV:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} already holds a KV cache on this worker")
        kv = RequestKV(self.num_layers, capacity, self.width, self.dtype, self.device)
        self._requests[request_id] = kv
        return kv

    def get(self, request_id: str) -> RequestKV:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"no KV cache for request {request_id!r} on this worker") from None

    def release(self, request_id: str) -> int:
        kv = self._requests.pop(request_id, None)
        return kv.nbytes if kv is not None else 0

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self._requests.values())
