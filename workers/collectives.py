"""A replica's process groups (:class:`GroupRank`: a rank's place in one), and tensor collectives under
the names of the running torch: 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
to ``all_gather_single`` and ``reduce_scatter_single`` (the old names are deprecated); older versions
have only the old ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupRank:
    """This rank's place in a group of ranks: ``rank`` of ``size``, ``group`` the torch.distributed group
    (None with one rank). Subclasses name the kind of group (``KIND``) and add its collectives."""

    rank: int = 0
    size: int = 1
    group: Any = None
    KIND: ClassVar[str] = "group"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"{self.KIND} rank {self.rank} is outside 0..{self.size - 1}")


def all_gather_into(buffer: torch.Tensor, send: torch.Tensor, group, *, async_op: bool = False) -> Any:
    """Every rank's ``send`` into ``buffer`` (rank-major); the work handle with ``async_op``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(buffer, send, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, send: torch.Tensor, group) -> None:
    """The sum of every rank's ``send``, this rank's rank-major share of it into ``out``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, send, group=group)


def grid_groups(rank: int, tp: int, pcp: int):
    """This rank's TP group (the same ``pcp_rank``) and PCP group (the same ``tp_rank``; ``rank =
    pcp_rank * tp + tp_rank``), None where the degree is 1. Every rank creates every group, in one order."""
    if pcp == 1:
        return dist.group.WORLD, None
    if tp == 1:
        return None, dist.group.WORLD
    pcp_rank, tp_rank = divmod(rank, tp)
    mine = {}
    for p in range(pcp):
        group = dist.new_group([p * tp + t for t in range(tp)])
        if p == pcp_rank:
            mine["tp"] = group
    for t in range(tp):
        group = dist.new_group([p * tp + t for p in range(pcp)])
        if t == tp_rank:
            mine["pcp"] = group
    return mine["tp"], mine["pcp"]


def expert_parallel_group(world_size: int, device: torch.device, max_ctas: int):
    """The expert-parallel group: every rank of the replica. With ``max_ctas`` on GPUs
    (``PoolConfig.ep_comm_sms``), a communicator of its own whose kernels use at most that many CTAs
    (NCCL's ``maxCTAs``), so the all-to-all fits in the SMs the expert GEMMs beside it leave free; the
    TP and PCP collectives keep NCCL's defaults. Every rank must call it."""
    if device.type != "cuda" or not max_ctas:
        return dist.group.WORLD
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    return dist.new_group(list(range(world_size)), pg_options=options)
