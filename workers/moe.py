"""DeepSeek's mixture-of-experts MLP, with the routed experts split over a replica (expert parallelism).

Legend: T tokens on this rank, H hidden, I expert width, E routed experts (E_r on this rank), k experts
per token, W ranks of the EP group (every worker of a replica), P (token, expert) pairs.

    out = shared_experts(x) + sum_j w_j * expert_{e_j}(x),   expert(x) = down(silu(gate(x)) * up(x))

Routing (float32, :func:`route`; the rules are ``configs.model.MoEConfig``'s) gives every token its
experts ``e [T, k]`` and weights ``w [T, k]``. Rank ``r`` holds the experts
``[r*E/W, (r+1)*E/W)``, as two stacked tensors ``gate_up_proj [E_r, 2I, H]`` and
``down_proj [E_r, H, I]`` (transformers' layout), and runs them as grouped GEMMs: torch's
``_grouped_mm`` in bf16 and ``_scaled_grouped_mm`` in FP8 (one CUTLASS kernel for all experts, no
host sync; FP8 weights then carry one scale per output row and activations one per token, the only
FP8 recipe it has on SM90; measured against the alternatives in
``benchmarks/results/2026-11-22-h200-grouped-gemm-candidates.json``).

Expert parallelism, per micro-batch of tokens:

    1. counts: for each rank r, the tokens with an expert there and the pairs they make; one
       all-to-all of these counts and one host sync for the split sizes
    2. dispatch (all-to-all): each token's row goes once to every rank holding one of its
       experts, with its local expert ids there (-1: none) and weights (FP8 rows + scale in FP8)
    3. the receiving rank sorts the pairs by expert, runs the grouped GEMMs and sums each row's
       weighted pairs (the routing weight is applied before ``down``, which is linear)
    4. combine (all-to-all back, bf16): each token gets one partial sum per rank, added in fp32

Both sums read each row once and add in float32 (:func:`gather_sum`, a Triton kernel on CUDA).

No (token, expert) pair is computed twice. With two micro-batches (``micro_batches=2``) the dispatch
of the second and the combine of the first run while the experts of the other compute (as
DeepSeek's prefill does), with one host sync for both; on one NVLink node one micro-batch is faster
(see ``configs.pool.PoolConfig.ep_micro_batches``). With one rank the same code runs without the
all-to-alls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from configs.model import MoEConfig
from workers.fp8 import FP8, quantize_activations

MIN_MICRO_BATCH_TOKENS = 256  # below this a second micro-batch costs more in launches than it hides


@dataclass(frozen=True)
class EPGroup:
    """This rank's place in the expert-parallel group (``group`` is a torch.distributed group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} is outside 0..{self.size - 1}")

    def experts(self, num_experts: int, rank: int | None = None) -> range:
        """The routed experts ``rank`` (default: this one) holds: a contiguous share, sizes differing by at most one."""
        r = self.rank if rank is None else rank
        return range(r * num_experts // self.size, (r + 1) * num_experts // self.size)


def gather_sum(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, *, impl: str = "auto") -> torch.Tensor:
    """``out [T, H]`` in ``dtype`` with ``out[t] = sum_j src[index[t, j]]`` (float32 accumulation) over the
    slots whose ``index [T, S]`` is not -1. A Triton kernel on CUDA (``workers.moe_triton``), torch ops
    elsewhere; ``impl`` forces one ("triton" on CPU tensors needs ``TRITON_INTERPRET=1``)."""
    if impl == "triton" or (impl == "auto" and src.is_cuda):
        if impl == "triton" and not (src.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the interpreter on CPU)")
        from workers.moe_triton import gather_sum as kernel

        return kernel(src.contiguous(), index.contiguous(), dtype)
    padded = torch.cat([src, src.new_zeros(1, src.shape[1])])  # row -1 reads zeros
    rows = padded.index_select(0, torch.where(index >= 0, index, src.shape[0]).reshape(-1))
    return rows.view(*index.shape, src.shape[1]).sum(dim=1, dtype=torch.float32).to(dtype)


# ---- routing -------------------------------------------------------------------------------------
def route(logits: torch.Tensor, config: MoEConfig, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights ``[T, k]`` (float32) and expert ids ``[T, k]`` (int64) from router logits ``[T, E]``.

    ``bias`` is ``e_score_correction_bias`` (``noaux_tc``: used to choose experts, not to weigh them).
    """
    logits = logits.float()
    scores = torch.sigmoid(logits) if config.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    tokens, k = scores.shape[0], config.num_experts_per_tok
    if config.topk_method == "noaux_tc":
        choice = scores + bias if bias is not None else scores
        if config.grouped:
            grouped = choice.view(tokens, config.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            choice = _keep_groups(choice, group_scores, config, float("-inf"))
        ids = choice.topk(k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * config.routed_scaling_factor, ids
    if config.grouped:  # group_limited_greedy
        group_scores = scores.view(tokens, config.n_group, -1).amax(dim=-1)
        scores = _keep_groups(scores, group_scores, config, 0.0)
    weights, ids = scores.topk(k, dim=-1, sorted=False)
    if k > 1 and config.norm_topk_prob:
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
    return weights * config.routed_scaling_factor, ids


def _keep_groups(scores: torch.Tensor, group_scores: torch.Tensor, config: MoEConfig, fill: float) -> torch.Tensor:
    """``scores [T, E]`` with every expert outside each token's ``topk_group`` best groups set to ``fill``."""
    best = group_scores.topk(config.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep.repeat_interleave(config.n_routed_experts // config.n_group, dim=1)
    return scores.masked_fill(~keep, fill)


class Router(nn.Module):
    """The gate: ``weight [E, H]`` (never quantized) and, for ``noaux_tc``, ``e_score_correction_bias [E]``."""

    def __init__(self, config: MoEConfig, hidden: int, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        if config.topk_method == "noaux_tc":
            bias = torch.empty(config.n_routed_experts, dtype=torch.float32, device=device)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(weights [T, k] float32, ids [T, k])``; the logits are float32 (bf16 inputs
        multiply exactly in fp32 and accumulate in fp32, as a float32 GEMM of them does)."""
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            logits = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(x.float(), self.weight.float())
        return route(logits, self.config, self.e_score_correction_bias)


# ---- the experts held here -------------------------------------------------------------------------
class Experts(nn.Module):
    """This rank's routed experts, stacked: ``gate_up_proj [E_r, 2I, H]``, ``down_proj [E_r, H, I]``.

    ``fp8``: the weights are ``float8_e4m3fn`` with ``gate_up_proj_scale [E_r, 2I]`` and
    ``down_proj_scale [E_r, H]`` (one scale per output row), run by ``_scaled_grouped_mm``.
    """

    def __init__(self, num_local: int, hidden: int, intermediate: int, *, dtype: torch.dtype, fp8: bool, device=None) -> None:
        super().__init__()
        self.fp8, self.intermediate = fp8, intermediate
        stored = {"dtype": FP8 if fp8 else dtype, "device": device}
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden, **stored), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, intermediate, **stored), requires_grad=False)
        if fp8:
            f32 = {"dtype": torch.float32, "device": device}
            self.gate_up_proj_scale = nn.Parameter(torch.empty(num_local, 2 * intermediate, **f32), requires_grad=False)
            self.down_proj_scale = nn.Parameter(torch.empty(num_local, hidden, **f32), requires_grad=False)

    @property
    def num_local(self) -> int:
        return self.gate_up_proj.shape[0]

    def prepare(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The rows to dispatch for tokens ``x [T, H]``: ``[x]``, or in FP8 ``[q [T, H] (bytes), scale [T]]``
        (quantized once per token, before the rows are copied to their experts)."""
        if not self.fp8:
            return [x]
        q, scale = quantize_activations(x, x.shape[1])
        return [q.view(torch.uint8), scale[0]]

    def forward(self, rows: list[torch.Tensor], weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """``rows`` (as :meth:`prepare` makes them) of ``P`` pairs sorted by local expert (``offs [E_r]``:
        the end of each expert's pairs, int32), times the pairs' routing ``weights [P]`` -> ``[P, H]``."""
        if not self.fp8:
            (x,) = rows
            gate_up = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs)
            h = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :] * weights[:, None].to(x.dtype)
            return torch._grouped_mm(h, self.down_proj.transpose(-2, -1), offs=offs)
        q, scale = rows[0].view(FP8), rows[1]
        gate_up = torch._scaled_grouped_mm(
            q, self.gate_up_proj.transpose(-2, -1), scale, self.gate_up_proj_scale, offs=offs, out_dtype=torch.bfloat16
        )
        hq, hscale = quantize_activations(gate_up, self.intermediate, silu_mul=True, row_weight=weights)
        return torch._scaled_grouped_mm(
            hq, self.down_proj.transpose(-2, -1), hscale[0], self.down_proj_scale, offs=offs, out_dtype=torch.bfloat16
        )


# ---- the layer ------------------------------------------------------------------------------------
class MoE(nn.Module):
    """One MoE MLP on one rank: ``gate`` (the router), this rank's ``experts`` and the TP shard of the
    ``shared_experts`` (an MLP module given by the caller; None without shared experts).

    :meth:`forward` runs all of it on the same tokens (one rank, or every rank of a TP group with
    the same tokens, its result then a partial sum of the shared part); the model splits tokens over
    TP ranks itself and calls :meth:`routed` and ``shared_experts`` apart. ``pairs`` counts the
    (token, expert) pairs this rank's experts have computed (the worker's expert-load report).
    """

    def __init__(
        self,
        config: MoEConfig,
        hidden: int,
        *,
        ep: EPGroup = EPGroup(),
        shared_experts: nn.Module | None = None,
        dtype: torch.dtype,
        fp8: bool = False,
        micro_batches: int = 1,
        device=None,
    ) -> None:
        super().__init__()
        if micro_batches not in (1, 2):
            raise ValueError(f"EP micro-batches must be 1 or 2, got {micro_batches!r}")
        self.config, self.ep, self.micro_batches = config, ep, micro_batches
        local = ep.experts(config.n_routed_experts)
        self.first_expert = local.start
        self.gate = Router(config, hidden, dtype=dtype, device=device)
        self.experts = Experts(len(local), hidden, config.moe_intermediate_size, dtype=dtype, fp8=fp8, device=device)
        self.shared_experts = shared_experts
        self.pairs = 0  # (token, expert) pairs computed here (reset by the worker after its warm-up)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def expert_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``owner [E]``: the rank holding each expert; ``first [W]``: each rank's first expert."""
        if self._tables is None or self._tables[0].device != device:
            ranges = [self.ep.experts(self.config.n_routed_experts, r) for r in range(self.ep.size)]
            owner = torch.cat([torch.full((len(r),), i, dtype=torch.int64) for i, r in enumerate(ranges)])
            self._tables = owner.to(device), torch.tensor([r.start for r in ranges], device=device)
        return self._tables

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for tokens ``x [T, H]`` held by this rank (every rank of the
        EP group calls it, each with its own tokens)."""
        weights, ids = self.gate(x)
        rows = self.experts.prepare(x)
        if self.ep.size == 1:
            local_ids = ids - self.first_expert
            return self._compute(rows, local_ids, weights, ids.numel()).to(x.dtype)
        return self._expert_parallel(x, rows, ids, weights)

    def _compute(self, rows: list[torch.Tensor], local_ids: torch.Tensor, weights: torch.Tensor, pairs: int) -> torch.Tensor:
        """Rows ``[N, ...]`` with their local expert ids ``[N, k]`` (-1: not here) and weights ``[N, k]``,
        ``pairs`` of the ids valid -> the weighted sum of each row's experts ``[N, H]``."""
        n, k = local_ids.shape
        flat = local_ids.reshape(-1)
        if pairs == flat.numel():
            pair_index = torch.arange(pairs, device=flat.device)
        else:  # a known size: no host sync
            pair_index = torch.nonzero_static(flat >= 0, size=pairs).squeeze(1)
        experts = flat[pair_index]
        pair_index = pair_index[torch.argsort(experts, stable=True)]
        offs = torch.bincount(experts, minlength=self.experts.num_local).cumsum(0).to(torch.int32)
        self.pairs += pairs
        dtype = torch.bfloat16 if self.experts.fp8 else rows[0].dtype
        if not pairs:
            return rows[0].new_zeros(n, self.experts.down_proj.shape[1], dtype=dtype)
        y = self.experts([r.index_select(0, pair_index // k) for r in rows], weights.reshape(-1)[pair_index], offs)
        # where each (row, slot)'s output is in y, or -1
        where = torch.full((n * k,), -1, dtype=torch.int64, device=y.device).index_copy_(
            0, pair_index, torch.arange(pairs, device=y.device)
        )
        return gather_sum(y, where.view(n, k), dtype)

    def _expert_parallel(self, x: torch.Tensor, rows: list[torch.Tensor], ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        parts = 2 if self.micro_batches == 2 and tokens >= 2 * MIN_MICRO_BATCH_TOKENS else 1
        bounds = [tokens * i // parts for i in range(parts + 1)]
        plans = [_Dispatch(self, ids[a:b], weights[a:b]) for a, b in zip(bounds, bounds[1:])]
        _exchange_counts(plans, self.ep)
        sent = [plan.send([r[a:b] for r in rows]) for plan, a, b in zip(plans, bounds, bounds[1:])]
        returns = []
        for plan, work in zip(plans, sent):
            received = work()
            y = self._compute(received[:-1], *plan.unpack_meta(received[-1]), plan.recv_pairs)
            returns.append(plan.send_back(y))
        return torch.cat([plan.combine(work(), x.dtype) for plan, work in zip(plans, returns)])


class _Dispatch:
    """One micro-batch's trip to the experts' ranks and back (see the module docstring)."""

    def __init__(self, moe: MoE, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.ep = moe.ep
        self.tokens, self.k = ids.shape
        size = self.ep.size
        owner_of, first = moe.expert_tables(ids.device)
        self.owner = owner_of[ids]  # [T, k]
        goes = torch.zeros(self.tokens, size, dtype=torch.bool, device=ids.device).scatter_(1, self.owner, True)
        self.goes_flat = goes.t().reshape(-1)  # [W * T]: (rank, token), rank-major
        pairs = torch.bincount(self.owner.reshape(-1), minlength=size)
        self.counts = torch.stack([goes.sum(dim=0), pairs], dim=1)  # [W, 2]: rows and pairs per destination
        self.ids, self.weights, self.first = ids, weights, first

    def set_counts(self, send: list[list[int]], recv: list[list[int]]) -> None:
        self.send_rows = [rows for rows, _ in send]
        self.recv_rows = [rows for rows, _ in recv]
        self.recv_pairs = sum(pairs for _, pairs in recv)
        # (rank, token) of every row sent, rank-major: a known count, so no host sync
        self.slots = torch.nonzero_static(self.goes_flat, size=sum(self.send_rows)).squeeze(1)
        self.token = self.slots % max(self.tokens, 1)

    def send(self, rows: list[torch.Tensor]):
        """Start the dispatch of ``rows`` (each ``[T, ...]``) and the pairs' local ids and weights; returns
        a function that waits and gives the received ``rows`` plus the packed metadata, in rank order."""
        rank = self.slots // max(self.tokens, 1)
        mine = self.owner.index_select(0, self.token) == rank[:, None]
        local_ids = torch.where(mine, self.ids.index_select(0, self.token) - self.first[rank][:, None], -1)
        meta = torch.cat([local_ids.to(torch.int32), self.weights.index_select(0, self.token).float().view(torch.int32)], dim=1)
        return _all_to_all([*(r.index_select(0, self.token) for r in rows), meta], self.send_rows, self.recv_rows, self.ep)

    def unpack_meta(self, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return meta[:, : self.k].long(), meta[:, self.k :].contiguous().view(torch.float32)

    def send_back(self, y: torch.Tensor):
        return _all_to_all([y], self.recv_rows, self.send_rows, self.ep)

    def combine(self, received: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Every rank's partial sums of this micro-batch's tokens -> their sum ``[T, H]`` (fp32 accumulation)."""
        (y,) = received
        where = torch.full((self.ep.size * self.tokens,), -1, dtype=torch.int64, device=y.device)
        where.index_copy_(0, self.slots, torch.arange(len(self.slots), device=y.device))
        return gather_sum(y, where.view(self.ep.size, self.tokens).t(), dtype)


def _exchange_counts(plans: list[_Dispatch], ep: EPGroup) -> None:
    """One all-to-all of every micro-batch's row and pair counts, and one host sync for all of them."""
    send = torch.cat([plan.counts for plan in plans], dim=1)  # [W, 2 * micro-batches]: row r goes to rank r
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    send_host, recv_host = torch.stack([send, recv]).tolist()
    for i, plan in enumerate(plans):
        plan.set_counts([row[2 * i : 2 * i + 2] for row in send_host], [row[2 * i : 2 * i + 2] for row in recv_host])


def _all_to_all(tensors: list[torch.Tensor], send_rows: list[int], recv_rows: list[int], ep: EPGroup):
    """Start one all-to-all per tensor (rows split by ``send_rows``; FP8 moved as bytes); returns a
    function that waits for them and gives the received tensors."""
    works, outs = [], []
    for tensor in tensors:
        out = tensor.new_empty(sum(recv_rows), *tensor.shape[1:])
        works.append(dist.all_to_all_single(out, tensor.contiguous(), recv_rows, send_rows, group=ep.group, async_op=True))
        outs.append(out)

    def wait() -> list[torch.Tensor]:
        for work in works:
            work.wait()
        return outs

    return wait
