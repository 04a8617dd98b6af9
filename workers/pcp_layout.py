"""Where a request's tokens are computed and its KV stored under prefill context parallelism (PCP).

Pure functions of the batch, so every rank (and the driver, which sizes and reassembles the KV)
agrees without talking; the layer that uses them is ``workers.pcp``. P is the PCP degree.

Zigzag split. Each request's new tokens of a step are cut into ``2P`` near-equal
segments; rank ``r`` computes segments ``r`` and ``2P-1-r`` (head and tail), so
every rank gets the same causal work. The last segment, which holds the last
token, is always non-empty and belongs to rank 0.

Whole requests. A request without cached context that is small next to its
batch (at most half of one rank's share of the batch's context-free tokens) is
not split: it goes whole to one rank, the least loaded one, largest requests
first (:func:`assign_requests`). A batch of many short prompts is so spread over
the ranks as data parallelism would spread it, with no prefix attention and no
key up-projection repeated on every rank; the ranks holding their last tokens
send their logits to rank 0. Long prompts and chunks over cached context stay
zigzag.

Striped KV. Block ``j`` (``block_size`` tokens) of a request's latent KV lives
on PCP rank ``j % P``: a rank stores every ``P``-th block, in order, so its shard
grows by appending and the longest prompt that fits grows linearly with ``P``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def zigzag_segments(num_tokens: int, size: int) -> list[tuple[int, int]]:
    """``2 * size`` contiguous ``(start, stop)`` segments of ``range(num_tokens)``, sizes differing by
    at most one; the last ones are the longer, so the final token's segment is never empty."""
    parts = 2 * size
    base, extra = divmod(num_tokens, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i >= parts - extra else 0))
    return list(zip(bounds, bounds[1:]))


def rank_segments(num_tokens: int, rank: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The head and tail segments rank ``rank`` computes."""
    segments = zigzag_segments(num_tokens, size)
    return segments[rank], segments[2 * size - 1 - rank]


def assign_requests(seq_lens: Sequence[int], context_lens: Sequence[int], size: int) -> list[int | None]:
    """Per request of a batch, the rank that computes all of its new tokens, or None (zigzag over every
    rank): see the module docstring. A pure function of the batch, so every rank agrees."""
    owners: list[int | None] = [None] * len(seq_lens)
    fresh = [i for i, c in enumerate(context_lens) if c == 0]
    share = sum(seq_lens[i] for i in fresh) / (2 * size)
    load = [0] * size
    for i in sorted((i for i in fresh if seq_lens[i] <= share), key=lambda i: (-seq_lens[i], i)):
        owners[i] = min(range(size), key=lambda r: (load[r], r))
        load[owners[i]] += seq_lens[i]
    return owners


def request_segments(num_tokens: int, owner: int | None, rank: int, size: int) -> tuple[tuple[int, int], ...]:
    """The segments of a request that ``rank`` computes: its zigzag pair, or all of it on its owner."""
    if owner is None:
        return rank_segments(num_tokens, rank, size)
    return ((0, num_tokens),) if owner == rank else ()


def shard_rows(num_tokens: int, rank: int, size: int, block_size: int) -> int:
    """How many of a request's first ``num_tokens`` KV rows PCP rank ``rank`` stores."""
    blocks, rest = divmod(num_tokens, block_size)
    rows = (blocks // size + (1 if rank < blocks % size else 0)) * block_size
    return rows + (rest if blocks % size == rank else 0)


def shard_positions(num_tokens: int, rank: int, size: int, block_size: int) -> torch.Tensor:
    """Token positions (ascending) of the rows rank ``rank`` stores, among the first ``num_tokens``."""
    positions = torch.arange(num_tokens)
    return positions[(positions // block_size) % size == rank]


def interleave_shards(shards: list[torch.Tensor], block_size: int) -> torch.Tensor:
    """Reassemble a request's KV from its PCP shards ``[layers, rows_r, W]`` (rank order) into
    ``[layers, tokens, W]`` in token order (a single shard is already in order: returned as is)."""
    if len(shards) == 1:
        return shards[0]
    size = len(shards)
    tokens = sum(shard.shape[1] for shard in shards)
    out = shards[0].new_empty(shards[0].shape[0], tokens, shards[0].shape[2])
    for rank, shard in enumerate(shards):
        expected = shard_rows(tokens, rank, size, block_size)
        if shard.shape[1] != expected:
            raise ValueError(f"PCP rank {rank} returned {shard.shape[1]} KV rows; a {tokens}-token request has {expected}")
        out[:, shard_positions(tokens, rank, size, block_size)] = shard
    return out
