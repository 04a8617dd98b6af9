"""KV handoff inside the Ray cluster: a decode actor pulls a request's KV shards straight from the
prefill workers that hold them, in parallel, as Ray objects.

    source = pool.kv_source(result)                     # who holds which shard
    decoder = ray.remote(DecodeActor).remote(pool.config)
    ray.get(decoder.receive.remote(source))             # returns once the KV is in the actor (the ack)
    pool.release(result)                                # then the prefill side frees it
    tokens = ray.get(decoder.generate.remote(result.request_id, result.first_token, 8))

Each PCP rank's shard (``[layers, rows_r, width]``, read from its TP rank 0) is
one object; the decode actor reassembles them in token order. Outside the
cluster the same KV goes over TCP (``cluster.kv_server``).
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

from configs.pool import PoolConfig
from workers.decode import DecodeState, ReferenceDecoder
from workers.pcp import interleave_shards


@dataclass(frozen=True)
class KVSource:
    """Where a kept request's KV lives: one worker per PCP rank (its TP rank 0), in PCP order."""

    request_id: str
    holders: tuple
    block_size: int
    num_tokens: int


def pull_kv(source: KVSource) -> torch.Tensor:
    """The request's KV ``[layers, tokens, width]`` in token order, every shard fetched at once."""
    shards = ray.get([holder.fetch_kv.remote(source.request_id) for holder in source.holders])
    return shards[0] if len(shards) == 1 else interleave_shards(shards, source.block_size)


class DecodeActor:
    """The reference decoder (``workers.decode``) as a Ray actor, with the pool's model and weights."""

    def __init__(self, config: PoolConfig, device: str = "cpu") -> None:
        from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
        from workers.model import DeepseekPrefillModel
        from workers.weights import load_weights

        model = DeepseekPrefillModel.create(config.model_config(), TorchSDPAPrefillBackend, dtype=torch.float32, device=device)
        load_weights(model, config.checkpoint, config.seed)
        self.decoder = ReferenceDecoder(model)
        self.states: dict[str, DecodeState] = {}

    def receive(self, source: KVSource) -> int:
        """Pull the request's KV into this actor; returns its token count (the acknowledgement)."""
        kv = pull_kv(source)
        if kv.shape[1] != source.num_tokens:
            raise RuntimeError(f"request {source.request_id!r}: got {kv.shape[1]} KV rows, expected {source.num_tokens}")
        self.states[source.request_id] = self.decoder.load(kv)
        return kv.shape[1]

    def generate(self, request_id: str, first_token: int, steps: int) -> list[int]:
        """Greedy decode of ``steps`` tokens after ``first_token``; the request's cache is then dropped."""
        return self.decoder.greedy(self.states.pop(request_id), first_token, steps)
