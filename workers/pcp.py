"""Prefill context parallelism (PCP): the prompt's tokens and its latent KV cache spread over a group.

Legend: P the PCP degree, r this rank in the PCP group, T the batch's new tokens
(its "chunk"), T_r those this rank computes, C the cached context rows of the
batch, N this rank's heads, W = kv_lora_rank + qk_rope_head_dim (576).

Grid. A replica has ``tp * pcp`` workers; global rank ``pcp_rank * tp + tp_rank``.
Ranks with the same ``pcp_rank`` form a TP group (they split heads), ranks with
the same ``tp_rank`` a PCP group (they split tokens). Everything below happens
inside one PCP group, for one TP rank's heads.

Where each request's new tokens are computed (zigzag segments, or whole requests on one rank) and
where its KV blocks are stored (striped) is ``workers.pcp_layout``'s.

Per layer, for the batch (two strategies for the cached context):

    q_r, latent_r = project(hidden_r)                 this rank's tokens
    latent        = all-gather(latent_r)              [T, W]: the chunk's keys, and the rows to store
    o, lse        = causal attention of each segment over itself (keys: latent_r, no wait)
    (o, lse)      = merge(o, attention of each segment over the new tokens before it)

    sharded (the design card's): the context stays where it is
        q        = all-gather(q_r)                    queries of requests with context
        o', lse' = attention of q over this rank's own shard (non-causal)
        all-to-all of (o', lse'): each rank gets every rank's partials of its own queries
        (o, lse) = merge_attn_states_many(o, o'_0 .. o'_{P-1})        (float32, locally)
    gather (what vLLM's PCP does): the queries stay where they are
        context  = all-gather(every rank's shard)     [C, W]
        (o, lse) = merge(o, attention of q_r over the whole context)

    out_r = o_proj(o)

Bytes a rank receives per layer, beside the latent's ``T * W * e * (P-1)/P``
(``e`` the element size): sharded ``T * N * (Dqk*e + Dv*e + 4) * (P-1)/P``,
flat in the context length; gather ``C * W * e * (P-1)/P``, growing with it,
and every rank then up-projects the whole context (``C * 2 * Lkv * N * (P+V)``
FLOPs, ``(P-1)/P`` of them repeated work). For DeepSeek (W = 576) sharded moves
fewer bytes once ``C > 0.56 * N * T``: at TP=1 (N = 128) a context about 70
chunks long, at TP=8 about 9 chunks.

The partials travel as one all-to-all of ``o'`` with its LSE packed into the
same rows, and are merged in float32 by the receiver. The alternative --
all-gather the LSEs, rescale, reduce-scatter ``o'`` -- moves the same ``o'``
bytes plus a second collective, and would sum bf16 partials inside NCCL;
measured on 4 H200s for 8K query rows: 0.74 ms against 1.75 ms (float32
reduce) and 0.77 ms (bf16 reduce); for 32K rows 2.5 against 6.6 and 2.7 ms.

A cost model (:class:`PCPCostModel`) estimates each strategy's time per batch
from those bytes at the measured link bandwidth, plus the gather's repeated
up-projection at the measured rate (GEMM and K/V writes); ``auto`` picks the
cheaper, and the user can force one. Collectives are started asynchronously: the latent, query
and context gathers run under the causal attention of the new tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from attention.backends.base import MLADimensions, MLAPrefillBackend
from attention.mla import MLAAttention, offsets, plan_context_chunks
from attention.merge import merge_attn_states_many
from configs.pool import PCP_STRATEGIES
from workers.collectives import GroupRank, all_gather_into
from workers.pcp_layout import assign_requests, request_segments, shard_rows


# ---- the group -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PCPGroup(GroupRank):
    """This rank's place in its PCP group."""

    KIND: ClassVar[str] = "PCP"

    def all_gather(self, rows: torch.Tensor, padded: int) -> tuple[Any, torch.Tensor]:
        """Start gathering every rank's ``rows [n_r, ...]`` (``n_r <= padded``) into ``[P * padded, ...]``;
        returns ``(work, buffer)``; rank ``s``'s rows start at ``s * padded``."""
        send = rows.new_zeros(padded, *rows.shape[1:])
        send[: rows.shape[0]] = rows
        buffer = rows.new_empty(self.size * padded, *rows.shape[1:])
        return all_gather_into(buffer, send, self.group, async_op=True), buffer

    def all_to_all(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> tuple[Any, torch.Tensor]:
        """Start an all-to-all of ``rows``, sliced by ``send_counts`` per destination; returns ``(work, buffer)``."""
        buffer = rows.new_empty(sum(recv_counts), *rows.shape[1:])
        work = dist.all_to_all_single(buffer, rows, recv_counts, send_counts, group=self.group, async_op=True)
        return work, buffer


# ---- cost model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PCPCostModel:
    """Per-batch time estimates of the two context strategies from measured rates.

    ``link_bytes_per_s``: bytes a rank receives per second in a PCP all-gather;
    ``up_projection_rows_per_s``: latent rows a rank up-projects to K/V per
    second (the GEMM and the K/V writes), which the gather strategy repeats on
    every rank. Both are measured once at setup (:func:`measure_cost_model`) and
    agreed on by every rank.
    """

    link_bytes_per_s: float
    up_projection_rows_per_s: float

    def estimate(self, comm_bytes: float, extra_rows: float) -> float:
        return comm_bytes / self.link_bytes_per_s + extra_rows / self.up_projection_rows_per_s


@torch.no_grad()
def measure_cost_model(pcp: PCPGroup, world_group, attn: MLAAttention) -> PCPCostModel:
    """Time an all-gather of latent rows on the PCP group and ``attn``'s up-projection; every rank
    of ``world_group`` ends with the slowest rank's figures, so all pick the same strategy."""
    device = attn.kv_a_layernorm.weight.device
    rows = 16384 if device.type == "cuda" else 1024
    latent = torch.randn(rows, attn.config.latent_dim, device=device).to(attn.dtype)
    comm = median_time(lambda: pcp.all_gather(latent, rows)[0].wait(), device)
    up = median_time(lambda: attn.up_project(latent), device)
    rates = torch.tensor(
        [(pcp.size - 1) * latent.numel() * latent.element_size() / comm, rows / up], dtype=torch.float64, device=device
    )
    if world_group is not None:
        dist.all_reduce(rates, op=dist.ReduceOp.MIN, group=world_group)
    link, up_rows = rates.tolist()
    return PCPCostModel(link_bytes_per_s=link, up_projection_rows_per_s=up_rows)


def median_time(fn, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (synchronizing CUDA)."""
    fn()  # warm-up (connections, kernels)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return max(sorted(times)[repeats // 2], 1e-9)


# ---- the per-batch plan ---------------------------------------------------------------------------
@dataclass(frozen=True)
class CommEstimate:
    """Bytes one rank receives per layer (averaged over the group) per strategy, and the context
    rows the gather strategy up-projects on a rank beyond its share."""

    latent_bytes: float
    sharded_bytes: float
    gather_bytes: float
    gather_extra_rows: float


class PCPPlan:
    """Everything one PCP rank needs to run a batch, built once and shared by every layer.

    ``seq_lens``/``context_lens`` describe the batch's requests (new and cached
    tokens); the plan is a pure function of them, the group shape, the model
    dims and the (agreed) cost model, so every rank computes its own plan, and
    the same strategy, without talking. ``num_heads`` are this rank's (TP) heads;
    ``backend``, when given, has its kernels planned here for the batch.
    """

    def __init__(
        self,
        seq_lens: list[int],
        context_lens: list[int],
        *,
        pcp: PCPGroup,
        block_size: int,
        num_heads: int,
        dims: MLADimensions,
        latent_width: int,
        element_size: int,
        workspace_tokens: int | None,
        device: torch.device,
        strategy: str = "auto",
        cost_model: PCPCostModel | None = None,
        backend: MLAPrefillBackend | None = None,
    ) -> None:
        if strategy not in PCP_STRATEGIES:
            raise ValueError(f"PCP strategy {strategy!r} is not one of {', '.join(PCP_STRATEGIES)}")
        if strategy == "auto" and cost_model is None:
            raise ValueError("PCP strategy 'auto' needs a cost model (measure_cost_model), or force sharded/gather")
        self.seq_lens, self.context_lens = tuple(seq_lens), tuple(context_lens)
        self.pcp = pcp
        size, rank = pcp.size, pcp.rank
        starts = offsets(self.seq_lens)

        # Each rank's tokens (indices into the batch), request after request: zigzag head then tail, or
        # a whole request on its owner.
        owners = assign_requests(self.seq_lens, self.context_lens, size)
        segments = [[request_segments(n, o, r, size) for n, o in zip(self.seq_lens, owners)] for r in range(size)]
        local_ranges = [[(s + a, s + b) for s, segs in zip(starts, segments[r]) for a, b in segs] for r in range(size)]
        piece_counts = [[sum(b - a for a, b in segs) for segs in segments[r]] for r in range(size)]
        self.local_counts = [sum(counts) for counts in piece_counts]
        self.padded = max(self.local_counts)
        self.local_index = _ranges(local_ranges[rank], device)
        positions = torch.cat(
            [torch.arange(c, c + n, device=device) for n, c in zip(self.seq_lens, self.context_lens)]
        )
        self.positions = positions.index_select(0, self.local_index)
        # all-gather buffer (rank-major, padded) -> batch order
        self.gathered_to_batch = torch.empty(starts[-1], dtype=torch.int64, device=device)
        for r in range(size):
            slots = torch.arange(r * self.padded, r * self.padded + self.local_counts[r], device=device)
            self.gathered_to_batch[_ranges(local_ranges[r], device)] = slots

        # Causal new-token attention of each non-empty local segment [a, b) of a request, in two
        # parts merged by LSE: the diagonal block (its own tokens, causal: the keys are this rank's
        # own latent rows, up-projected before the gather lands) and, when a > 0, the prefix
        # [0, a) of the request's new tokens (non-causal, keys from the gathered latent). Two
        # well-shaped kernels beat one ragged bottom-right causal call by ~6% at 128K tokens.
        q_lens, prefix_q, prefix_lens, prefix_keys = [], [], [], []
        local = 0
        for s, segs in zip(starts, segments[rank]):
            for a, b in segs:
                if b > a:
                    q_lens.append(b - a)
                    if a > 0:
                        prefix_q.append((local, local + b - a))
                        prefix_lens.append(a)
                        prefix_keys.append((s, s + a))
                    local += b - a
        self.new_cu_q = torch.tensor(offsets(q_lens), dtype=torch.int32, device=device)
        self.new_max_q = max(q_lens, default=0)
        self.prefix_q_index = _ranges(prefix_q, device)
        self.prefix_key_index = _ranges(prefix_keys, device)
        # one chunk: the new tokens' keys are up-projected at once, as without PCP (the workspace
        # bound is for cached context)
        self.prefix_chunks = plan_context_chunks(
            [b - a for a, b in prefix_q], prefix_lens, workspace_tokens=None, device=device
        )

        # Logits: a request's last token ends its owner's share of it, or rank 0's (the zigzag tail).
        local_start = offsets(piece_counts[rank])
        self.last_owner = [owner or 0 for owner in owners]
        self.last_token_index = _index([local_start[i + 1] - 1 for i, o in enumerate(self.last_owner) if o == rank], device)

        # KV rows this rank stores: those in its blocks, per request, as indices into the batch.
        self.store_index = []
        for s, n, c in zip(starts, self.seq_lens, self.context_lens):
            p = torch.arange(c, c + n, device=device)
            self.store_index.append(p[(p // block_size) % size == rank] - c + s)

        # Cached context: requests with any, and their rows on each rank.
        ctx = [i for i, c in enumerate(self.context_lens) if c > 0]
        self.shard_lens = [[shard_rows(self.context_lens[i], r, size, block_size) for i in ctx] for r in range(size)]
        self.local_ctx_index = _ranges([(local_start[i], local_start[i + 1]) for i in ctx], device)
        self.ctx_counts = [sum(piece_counts[r][i] for i in ctx) for r in range(size)]

        # What each strategy costs, and the choice.
        per_rank = lambda total: total * (size - 1) / size  # noqa: E731 -- received, averaged over the ranks
        total_ctx, total_ctx_q = sum(self.context_lens), sum(self.ctx_counts)
        self.estimate = CommEstimate(
            latent_bytes=per_rank(starts[-1] * latent_width * element_size),
            sharded_bytes=per_rank(total_ctx_q * num_heads * ((dims.qk_head_dim + dims.v_head_dim) * element_size + 4)),
            gather_bytes=per_rank(total_ctx * latent_width * element_size),
            gather_extra_rows=per_rank(total_ctx),
        )
        if not ctx:
            self.strategy = "none"
        elif strategy != "auto":
            self.strategy = strategy
        else:
            sharded = cost_model.estimate(self.estimate.sharded_bytes, 0.0)
            gather = cost_model.estimate(self.estimate.gather_bytes, self.estimate.gather_extra_rows)
            self.strategy = "sharded" if sharded <= gather else "gather"

        self.context_chunks = ()
        if self.strategy == "sharded":
            # every query of a request with context (gathered; grouped by request) over this rank's
            # own shard; the partials then go back to the rank that owns each query
            self.padded_ctx = max(self.ctx_counts)
            group_ranges, q_group_lens = [], []
            for k, i in enumerate(ctx):
                for r in range(size):
                    offset = r * self.padded_ctx + sum(piece_counts[r][m] for m in ctx[:k])
                    group_ranges.append((offset, offset + piece_counts[r][i]))
                q_group_lens.append(sum(piece_counts[r][i] for r in range(size)))
            self.sharded_q_index = _ranges(group_ranges, device)
            self.context_chunks = plan_context_chunks(
                q_group_lens, self.shard_lens[rank], workspace_tokens=workspace_tokens, device=device
            )
            where = torch.empty(size * self.padded_ctx, dtype=torch.int64, device=device)
            where[self.sharded_q_index] = torch.arange(len(self.sharded_q_index), device=device)
            to_owners = [(d * self.padded_ctx, d * self.padded_ctx + self.ctx_counts[d]) for d in range(size)]
            self.a2a_send_index = where[_ranges(to_owners, device)]
        elif self.strategy == "gather":
            # this rank's queries of each request with context over all of that request's rows
            self.padded_shard = max(sum(lens) for lens in self.shard_lens)
            keep = [k for k, i in enumerate(ctx) if piece_counts[rank][i] > 0]
            rows = []
            for k in keep:
                for r in range(size):
                    offset = r * self.padded_shard + sum(self.shard_lens[r][:k])
                    rows.append((offset, offset + self.shard_lens[r][k]))
            self.gather_context_index = _ranges(rows, device)
            self.gather_q_index = _ranges([(local_start[ctx[k]], local_start[ctx[k] + 1]) for k in keep], device)
            self.context_chunks = plan_context_chunks(
                [piece_counts[rank][ctx[k]] for k in keep],
                [self.context_lens[ctx[k]] for k in keep],
                workspace_tokens=workspace_tokens,
                device=device,
            )

        if backend is not None:
            backend.clear_plans()
            if self.local_counts[rank]:
                backend.plan(self.new_cu_q, self.new_cu_q, causal=True)
            for chunk in self.prefix_chunks + self.context_chunks:
                backend.plan(chunk.cu_seqlens_q, chunk.cu_seqlens_k, causal=False)

    @property
    def num_tokens(self) -> int:
        """Tokens this rank computes (its share of the batch)."""
        return self.local_counts[self.pcp.rank]

    def gather_last(self, rows: torch.Tensor) -> torch.Tensor:
        """Every request's last-token row ``[B, ...]`` in batch order, from the rows ``[B_r, ...]`` of the
        requests whose last token this rank holds (a collective of the PCP group; only needed when some
        last tokens are not on rank 0)."""
        if not any(self.last_owner):
            return rows
        counts = [self.last_owner.count(r) for r in range(self.pcp.size)]
        work, buffer = self.pcp.all_gather(rows, max(counts))
        seen = [0] * self.pcp.size
        where = []
        for owner in self.last_owner:
            where.append(owner * max(counts) + seen[owner])
            seen[owner] += 1
        work.wait()
        return buffer.index_select(0, _index(where, rows.device))

    @property
    def comm_bytes_per_layer(self) -> float:
        """Bytes a rank receives per layer under the chosen strategy (averaged over the group)."""
        extra = {"sharded": self.estimate.sharded_bytes, "gather": self.estimate.gather_bytes}.get(self.strategy, 0.0)
        return self.estimate.latent_bytes + extra


def _index(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def _ranges(pairs, device: torch.device) -> torch.Tensor:
    """The concatenation of ``range(a, b)`` for every ``(a, b)`` in ``pairs``, as an int64 tensor."""
    parts = [torch.arange(a, b, device=device) for a, b in pairs if b > a]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)


# ---- the layer -------------------------------------------------------------------------------------
def context_parallel_attention(
    attn: MLAAttention, hidden: torch.Tensor, plan: PCPPlan, context: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MLA layer on this rank's tokens ``hidden [T_r, hidden]``.

    ``context [C_r, W]`` holds this rank's shard of the batch's cached rows
    (requests with context, in batch order). Returns ``out [T_r, hidden]`` (a
    partial sum under TP) and the batch's latent ``[T, W]`` in batch order.
    """
    pcp, backend = plan.pcp, attn.backend
    heads, dv = attn.num_heads, attn.config.v_head_dim
    q, latent = attn.project(hidden, plan.positions)
    latent_work, latent_buf = pcp.all_gather(latent, plan.padded)
    if plan.strategy == "sharded":
        q_work, q_buf = pcp.all_gather(q.index_select(0, plan.local_ctx_index), plan.padded_ctx)
    elif plan.strategy == "gather":
        ctx_work, ctx_buf = pcp.all_gather(context, plan.padded_shard)

    if plan.num_tokens:  # the diagonal blocks, while the gathers are in flight
        k, v = attn.up_project(latent)
        o, lse = backend.run_prefill_new_tokens(
            q, k, v, plan.new_cu_q, plan.new_max_q, True, cu_seqlens_k=plan.new_cu_q, max_seqlen_k=plan.new_max_q
        )
    else:
        o = q.new_zeros(0, heads, dv)
        lse = torch.empty(heads, 0, device=q.device)
    latent_work.wait()
    batch_latent = latent_buf.index_select(0, plan.gathered_to_batch)
    if plan.prefix_chunks:  # each segment's queries over the request's new tokens before it
        _attend_subset(attn, q, o, lse, plan.prefix_q_index, plan.prefix_chunks, batch_latent.index_select(0, plan.prefix_key_index))

    if plan.strategy == "sharded":
        q_work.wait()
        q_ctx = q_buf.index_select(0, plan.sharded_q_index)
        o_part = q_ctx.new_zeros(q_ctx.shape[0], heads, dv)
        lse_part = torch.full((heads, q_ctx.shape[0]), float("-inf"), device=q.device)
        attn.attend_context(q_ctx, o_part, lse_part, plan.context_chunks, context)
        packed = pack_partials(o_part, lse_part).index_select(0, plan.a2a_send_index)
        work, buf = pcp.all_to_all(packed, plan.ctx_counts, [plan.ctx_counts[pcp.rank]] * pcp.size)
        work.wait()
        sel = plan.local_ctx_index
        if sel.numel():
            o_parts, lse_parts = unpack_partials(buf, pcp.size, heads, dv, o.dtype)
            merged, _ = merge_attn_states_many(
                torch.cat([o.index_select(0, sel)[None], o_parts]), torch.cat([lse.index_select(1, sel)[None], lse_parts])
            )
            o.index_copy_(0, sel, merged)
    elif plan.strategy == "gather":
        ctx_work.wait()
        rows = ctx_buf.index_select(0, plan.gather_context_index)
        _attend_subset(attn, q, o, lse, plan.gather_q_index, plan.context_chunks, rows)
    return attn.output(o), batch_latent


def _attend_subset(attn: MLAAttention, q, o, lse, index: torch.Tensor, chunks, keys: torch.Tensor) -> None:
    """Fold non-causal attention of the queries ``q[index]`` over ``keys`` (latent rows, per
    ``chunks``) into ``o``/``lse`` in place (no gather and scatter when ``index`` is every row)."""
    if index.numel() == q.shape[0]:  # indices are ascending and unique: every row, in order
        attn.attend_context(q, o, lse, chunks, keys)
        return
    o_sel, lse_sel = o.index_select(0, index), lse.index_select(1, index)
    attn.attend_context(q.index_select(0, index), o_sel, lse_sel, chunks, keys)
    o.index_copy_(0, index, o_sel)
    lse.index_copy_(1, index, lse_sel)


def pack_partials(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``o [T,N,V]`` and ``lse [N,T]`` float32 as one byte row per token (one all-to-all, not two)."""
    rows = o.shape[0]
    return torch.cat([o.reshape(rows, -1).view(torch.uint8), lse.t().contiguous().view(torch.uint8)], dim=1)


def unpack_partials(buf: torch.Tensor, size: int, heads: int, dv: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_partials` for ``size`` equal blocks: ``o [size,T,N,V]``, ``lse [size,N,T]``."""
    o_bytes = heads * dv * torch.empty((), dtype=dtype).element_size()
    rows = buf.shape[0] // size
    o = buf[:, :o_bytes].contiguous().view(dtype).view(size, rows, heads, dv)
    lse = buf[:, o_bytes:].contiguous().view(torch.float32).view(size, rows, heads).transpose(1, 2)
    return o, lse
