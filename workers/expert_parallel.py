"""Expert parallelism's plumbing: the EP group, the trip of a MoE layer's rows to their experts' ranks
and back (:class:`Dispatch`, by ``torch.distributed`` all-to-alls: NCCL on GPUs, gloo on CPU), and the
SM carveout of kernels that run beside an all-to-all. ``workers.moe`` orders the work
(``configs.pool.PoolConfig.ep_schedule``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from workers.collectives import GroupRank


@dataclass(frozen=True)
class EPGroup(GroupRank):
    """This rank's place in the expert-parallel group."""

    KIND: ClassVar[str] = "EP"

    def experts(self, num_experts: int, rank: int | None = None) -> range:
        """The routed experts ``rank`` (default: this one) holds: a contiguous share, sizes differing by at most one."""
        r = self.rank if rank is None else rank
        return range(r * num_experts // self.size, (r + 1) * num_experts // self.size)


@contextmanager
def sm_carveout(sms: int, device: torch.device):
    """Kernels launched inside leave ``sms`` SMs to a collective running beside them (torch's SM
    carveout, read by its grouped GEMMs and cuBLAS at launch). Without it a persistent GEMM launched
    next to an NCCL kernel runs in two waves: the CTAs whose SMs the collective holds start only when
    it ends (2 x H200: the experts' GEMMs 11.4 -> 13.9 ms beside the all-to-all,
    ``benchmarks/results/2026-11-22-2xh200-moe-profile-ep2-mb*.json``). A no-op off CUDA or for 0."""
    if sms <= 0 or device.type != "cuda":
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


class Dispatch:
    """One micro-batch's trip to the experts' ranks and back (see the module docstring). With
    ``keep_local`` the rows for this rank's own experts stay here (the ``local-first`` schedule)."""

    def __init__(
        self, ep: EPGroup, tables: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, weights: torch.Tensor, *, keep_local: bool = False
    ) -> None:  # fmt: skip
        self.ep, self.keep_local = ep, keep_local
        self.tokens, self.k = ids.shape
        size = self.ep.size
        owner_of, first = tables  # the rank of each expert, each rank's first expert
        self.owner = owner_of[ids]  # [T, k]
        goes = torch.zeros(self.tokens, size, dtype=torch.bool, device=ids.device).scatter_(1, self.owner, True)
        owners = self.owner.reshape(-1)  # a scatter-add, not torch.bincount: that waits for the GPU to size its output
        pairs = torch.zeros(size, dtype=torch.int64, device=ids.device).scatter_add_(0, owners, torch.ones_like(owners))
        self.counts = torch.stack([goes.sum(dim=0), pairs], dim=1)  # [W, 2]: rows and pairs per destination
        if keep_local:
            self.here = goes[:, self.ep.rank].clone()
            goes[:, self.ep.rank] = False
        self.goes_flat = goes.t().reshape(-1)  # [W * T]: (rank, token), rank-major
        self.ids, self.weights, self.first = ids, weights, first

    def set_counts(self, send: list[list[int]], recv: list[list[int]]) -> None:
        if self.keep_local:  # this rank's own rows and pairs: not sent
            me = self.ep.rank
            self.local_pairs = send[me][1]
            send, recv = list(send), list(recv)
            send[me] = recv[me] = [0, 0]
        self.send_rows = [rows for rows, _ in send]
        self.recv_rows = [rows for rows, _ in recv]
        self.recv_pairs = sum(pairs for _, pairs in recv)
        # (rank, token) of every row sent, rank-major: a known count, so no host sync
        self.slots = torch.nonzero_static(self.goes_flat, size=sum(self.send_rows)).squeeze(1)
        self.token = self.slots % max(self.tokens, 1)
        # [T, W]: where each (token, rank) row is in the dispatch buffer, -1 where none goes
        places = torch.full((self.ep.size * self.tokens,), -1, dtype=torch.int64, device=self.slots.device)
        places.index_copy_(0, self.slots, torch.arange(len(self.slots), device=self.slots.device))
        self.places = places.view(self.ep.size, self.tokens).t()

    def local_ids(self) -> torch.Tensor:
        """``[T, k]``: each pair's expert id on this rank where this rank holds it, else -1."""
        return torch.where(self.owner == self.ep.rank, self.ids - self.first[self.ep.rank], -1)

    def send(self, rows: list[torch.Tensor], *, gathered: bool = False):
        """Start the dispatch of ``rows`` (each ``[T, ...]``, or with ``gathered`` already the dispatch
        buffer's rows, in ``places`` order) and the pairs' local ids and weights; returns a
        function that waits and gives the received ``rows`` plus the packed metadata, in rank order."""
        rank = self.slots // max(self.tokens, 1)
        mine = self.owner.index_select(0, self.token) == rank[:, None]
        local_ids = torch.where(mine, self.ids.index_select(0, self.token) - self.first[rank][:, None], -1)
        meta = torch.cat([local_ids.to(torch.int32), self.weights.index_select(0, self.token).float().view(torch.int32)], dim=1)
        if not gathered:
            rows = [r.index_select(0, self.token) for r in rows]
        return all_to_all([*rows, meta], self.send_rows, self.recv_rows, self.ep)

    def unpack_meta(self, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return meta[:, : self.k].long(), meta[:, self.k :].contiguous().view(torch.float32)

    def send_back(self, y: torch.Tensor, out: torch.Tensor | None = None):
        return all_to_all([y], self.recv_rows, self.send_rows, self.ep, outs=None if out is None else [out])

    def combine_index(self, local: bool = False) -> torch.Tensor:
        """``[T, W]``: where each rank's partial sum of each token is, -1 where that rank has none: in
        the combine's received rows (they come back in ``places`` order), or with ``local`` in a buffer whose first ``T`` rows are this
        rank's own partial sums and whose other rows are the received ones (the local-first schedule)."""
        where = torch.where(self.places >= 0, self.places + (self.tokens if local else 0), -1)
        if local:
            where[:, self.ep.rank] = torch.where(self.here, torch.arange(self.tokens, device=where.device), -1)
        return where


def exchange_counts(plans: list[Dispatch], ep: EPGroup) -> None:
    """One all-to-all of every micro-batch's row and pair counts, and one host sync for all of them."""
    send = torch.cat([plan.counts for plan in plans], dim=1)  # [W, 2 * micro-batches]: row r goes to rank r
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    send_host, recv_host = torch.stack([send, recv]).tolist()
    for i, plan in enumerate(plans):
        plan.set_counts([row[2 * i : 2 * i + 2] for row in send_host], [row[2 * i : 2 * i + 2] for row in recv_host])


def all_to_all(tensors: list[torch.Tensor], send_rows: list[int], recv_rows: list[int], ep: EPGroup, outs=None):
    """Start one all-to-all per tensor (rows split by ``send_rows``; FP8 moved as bytes) into ``outs``
    (default: new tensors); returns a function that waits for them and gives the received tensors."""
    works = []
    if outs is None:
        outs = [tensor.new_empty(sum(recv_rows), *tensor.shape[1:]) for tensor in tensors]
    for tensor, out in zip(tensors, outs):
        works.append(dist.all_to_all_single(out, tensor.contiguous(), recv_rows, send_rows, group=ep.group, async_op=True))

    def wait() -> list[torch.Tensor]:
        for work in works:
            work.wait()
        return outs

    return wait
