"""Tensor collectives under the names of the running torch: 2.13 renamed ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` to ``all_gather_single`` and ``reduce_scatter_single`` (the old names are
deprecated); older versions have only the old ones."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_gather_into(buffer: torch.Tensor, send: torch.Tensor, group, *, async_op: bool = False) -> Any:
    """Every rank's ``send`` into ``buffer`` (rank-major); the work handle with ``async_op``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(buffer, send, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, send: torch.Tensor, group) -> None:
    """The sum of every rank's ``send``, this rank's rank-major share of it into ``out``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, send, group=group)
