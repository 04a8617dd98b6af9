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

Both sums read each row once and add in float32 (:func:`gather_sum`, a Triton kernel on CUDA). On one
rank, with no combine to overlap, :meth:`MoE.forward` adds the shared experts' rows in the routed
sum's pass (one rounding, no add of its own).

No (token, expert) pair is computed twice. The combine runs while the caller computes the shared
experts (:meth:`MoE.start_routed`). The schedules (``configs.pool.PoolConfig.ep_schedule``):

- ``all-to-all``: one micro-batch, every row through the all-to-alls (a rank's own rows too);
- ``local-first``: the pairs of a rank's own tokens on its own experts skip the all-to-all and are
  computed while the dispatch of the others is in flight; the combine lands beside them. FP8 experts
  quantize each token once, straight into its dispatch rows and local pair rows;
- ``two-micro-batches``: the dispatch of the second half and the combine of the first run while the
  experts of the other compute (as DeepSeek's prefill does), with one host sync for both.

Kernels running beside an all-to-all leave ``comm_sms`` SMs to it. The all-to-alls, the EP group
and the SM carveout are ``workers.expert_parallel``'s. With one rank the same code runs without the
all-to-alls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attention.kernel_choice import use_triton
from configs.model import EP_SCHEDULES, FP8_GEMM_LIBRARIES, MOE_ROUNDINGS, MoEConfig
from workers import deepgemm, moe_vllm
from workers.activation import silu_mul
from workers.expert_parallel import Dispatch, EPGroup, exchange_counts, sm_carveout
from workers.fp8 import BLOCK, FP8, quantize_activations

def gather_sum(
    src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, *, out: torch.Tensor | None = None, add: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """``out [T, H]`` in ``dtype`` with ``out[t] = add[t] + sum_j src[index[t, j]]`` (float32 accumulation,
    one rounding) over the slots whose ``index [T, S]`` is not -1 (``add``: none when not given; written
    into ``out`` when given). A Triton kernel on CUDA (``workers.moe_triton``), torch ops elsewhere; ``impl``
    forces one ("triton" on CPU tensors needs ``TRITON_INTERPRET=1``)."""
    if use_triton(impl, src):
        from workers.moe_triton import gather_sum as kernel

        return kernel(src, index.contiguous(), dtype, out, add)
    padded = torch.cat([src, src.new_zeros(1, src.shape[1])])  # row -1 reads zeros
    rows = padded.index_select(0, torch.where(index >= 0, index, src.shape[0]).reshape(-1))
    total = rows.view(*index.shape, src.shape[1]).sum(dim=1, dtype=torch.float32)
    result = (total if add is None else total + add.float()).to(dtype)
    return result if out is None else out.copy_(result)


# ---- routing -------------------------------------------------------------------------------------
def route(
    logits: torch.Tensor, config: MoEConfig, bias: torch.Tensor | None = None, *, impl: str = "auto", rounding: str = "reference"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights ``[T, k]`` (float32) and expert ids ``[T, k]`` (int64) from router logits ``[T, E]``.

    ``bias`` is ``e_score_correction_bias`` (``noaux_tc``: used to choose experts, not to weigh them).
    A Triton kernel on CUDA (``workers.moe_triton``), torch ops elsewhere; ``impl`` forces one.
    ``rounding="vllm"`` (``noaux_tc`` only, torch ops) routes as vLLM's fused ``grouped_topk``
    (``workers.moe_vllm``): groups and experts taken best first, ties to the lower index, so a
    token's slots are in decreasing biased score, and the weights left without
    ``routed_scaling_factor`` (applied after the experts' sum).
    """
    if rounding == "reference" and use_triton(impl, logits):
        from workers.moe_triton import route as kernel

        return kernel(logits.float().contiguous(), config, bias)
    pick = _best_first if rounding == "vllm" else _top
    logits = logits.float()
    scores = torch.sigmoid(logits) if config.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    tokens, k = scores.shape[0], config.num_experts_per_tok
    if config.topk_method == "noaux_tc":
        choice = scores + bias if bias is not None else scores
        if config.grouped:
            grouped = choice.view(tokens, config.n_group, config.n_routed_experts // config.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            choice = _keep_groups(choice, group_scores, config, float("-inf"), pick)
        ids = pick(choice, k)
        weights = scores.gather(1, ids)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights if rounding == "vllm" else weights * config.routed_scaling_factor), ids
    if config.grouped:  # group_limited_greedy
        group_scores = scores.view(tokens, config.n_group, config.n_routed_experts // config.n_group).amax(dim=-1)
        scores = _keep_groups(scores, group_scores, config, 0.0, pick)
    weights, ids = scores.topk(k, dim=-1, sorted=False)
    if k > 1 and config.norm_topk_prob:
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
    return weights * config.routed_scaling_factor, ids


def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's ``k`` largest values, in no particular order."""
    return values.topk(k, dim=-1, sorted=False).indices


def _best_first(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's ``k`` largest values, largest first, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def _keep_groups(scores: torch.Tensor, group_scores: torch.Tensor, config: MoEConfig, fill: float, pick=_top) -> torch.Tensor:
    """``scores [T, E]`` with every expert outside each token's ``topk_group`` best groups (chosen by
    ``pick``) set to ``fill``."""
    best = pick(group_scores, config.topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep.repeat_interleave(config.n_routed_experts // config.n_group, dim=1)
    return scores.masked_fill(~keep, fill)


class Router(nn.Module):
    """The gate: ``weight [E, H]`` (never quantized) and, for ``noaux_tc``, ``e_score_correction_bias [E]``."""

    def __init__(self, config: MoEConfig, hidden: int, *, dtype: torch.dtype, rounding: str = "reference", device=None) -> None:
        super().__init__()
        self.config, self.rounding = config, rounding
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        if config.topk_method == "noaux_tc":
            bias = torch.empty(config.n_routed_experts, dtype=torch.float32, device=device)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(weights [T, k] float32, ids [T, k])``; the logits are float32 (bf16 inputs
        multiply exactly in fp32 and accumulate in fp32, as a float32 GEMM of them does), or with
        ``rounding="vllm"`` in ``x``'s dtype (vLLM's gate), routed by :func:`route` as vLLM routes."""
        if self.rounding == "vllm":
            return route(F.linear(x, self.weight), self.config, self.e_score_correction_bias, rounding="vllm")
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            logits = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(x.float(), self.weight.float())
        return route(logits, self.config, self.e_score_correction_bias)


# ---- the experts held here -------------------------------------------------------------------------
class Experts(nn.Module):
    """This rank's routed experts, stacked: ``gate_up_proj [E_r, 2I, H]``, ``down_proj [E_r, H, I]``.

    ``fp8``: the weights are ``float8_e4m3fn``. With ``gemm="torch"`` (of :data:`FP8_GEMM_LIBRARIES`) they carry
    ``gate_up_proj_scale [E_r, 2I]`` and ``down_proj_scale [E_r, H]`` (one scale per output row) and
    run by ``_scaled_grouped_mm`` on per-token activation scales; with ``gemm="deep_gemm"`` (``block``)
    the checkpoint's 128x128 block scales ``[E_r, 2I/128, H/128]`` and ``[E_r, H/128, I/128]``, run by
    DeepGEMM on 1x128 activation scales (``workers.deepgemm``).
    ``rounding="vllm"``: the routing weight multiplies the down GEMM's float32 result
    (:func:`workers.moe_vllm.weighted_down`), not its input.
    """

    def __init__(
        self, num_local: int, hidden: int, intermediate: int, *, dtype: torch.dtype, fp8: bool, rounding: str = "reference",
        gemm: str = "torch", device=None,
    ) -> None:  # fmt: skip
        super().__init__()
        if gemm not in FP8_GEMM_LIBRARIES:
            raise ValueError(f"MoE GEMM {gemm!r} is not one of {', '.join(FP8_GEMM_LIBRARIES)}")
        self.block = fp8 and gemm == "deep_gemm"
        if self.block and not deepgemm.whole_blocks(hidden, intermediate):
            raise ValueError(f"fp8_gemm 'deep_gemm' needs 128-wide blocks: hidden {hidden} and expert width {intermediate} must be multiples of 128")
        self.fp8, self.intermediate, self.rounding = fp8, intermediate, rounding
        stored = {"dtype": FP8 if fp8 else dtype, "device": device}
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden, **stored), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, intermediate, **stored), requires_grad=False)
        if fp8:
            f32 = {"dtype": torch.float32, "device": device}
            if self.block:  # one per 128x128 block, as the checkpoint stores them
                up_scale, down_scale = (2 * intermediate // BLOCK, hidden // BLOCK), (hidden // BLOCK, intermediate // BLOCK)
            else:  # one per output row
                up_scale, down_scale = (2 * intermediate,), (hidden,)
            self.gate_up_proj_scale = nn.Parameter(torch.empty(num_local, *up_scale, **f32), requires_grad=False)
            self.down_proj_scale = nn.Parameter(torch.empty(num_local, *down_scale, **f32), requires_grad=False)

    @property
    def num_local(self) -> int:
        return self.gate_up_proj.shape[0]

    def prepare(self, x: torch.Tensor, scatter_to: torch.Tensor | None = None, rows: int = 0) -> list[torch.Tensor]:
        """The rows to dispatch for tokens ``x [T, H]``: ``[x]``, or in FP8 ``[q [T, H] (bytes), scale]``
        (quantized once per token, before the rows are copied to their experts; ``scale [T]``, or with
        ``block`` 1x128 scales ``[T, H/128]``). In FP8 with ``scatter_to [T, k]`` each token's row is
        quantized straight into the ``rows`` pair rows it names."""
        if not self.fp8:
            return [x]
        q, scale = quantize_activations(x, BLOCK if self.block else x.shape[1], scatter_to=scatter_to, scatter_rows=rows)
        return [q.view(torch.uint8), scale.t() if self.block else scale[0]]

    def layout(self, offs: torch.Tensor, pairs: int) -> deepgemm.Layout | None:
        """Where :meth:`forward` wants ``pairs`` rows sorted by expert (``offs``): DeepGEMM's padded
        contiguous layout for ``block`` experts, None (the pairs' own order) otherwise."""
        return deepgemm.Layout.of(offs, pairs) if self.block else None

    def forward(self, rows: list[torch.Tensor], weights: torch.Tensor, offs: torch.Tensor, layout: deepgemm.Layout | None = None) -> torch.Tensor:
        """``rows`` (as :meth:`prepare` makes them) of ``P`` pairs sorted by local expert (``offs [E_r]``:
        the end of each expert's pairs, int32), times the pairs' routing ``weights [P]`` -> ``[P, H]``;
        with ``layout`` (:meth:`layout`) the rows are in it, and so is the result (``[M, H]``)."""
        if not self.fp8:
            (x,) = rows
            gate_up = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs)
            if self.rounding == "vllm":
                return moe_vllm.weighted_down(silu_mul(gate_up), self.down_proj, offs, weights)
            return torch._grouped_mm(silu_mul(gate_up, weights), self.down_proj.transpose(-2, -1), offs=offs)
        if self.block:
            return deepgemm.experts_forward(self, rows, weights, offs, layout)
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
    TP ranks itself and calls :meth:`start_routed` and ``shared_experts`` apart, the shared experts
    while the combine all-to-all is in flight. ``pairs`` counts the (token, expert) pairs this rank's
    experts have computed (the worker's expert-load report).

    ``schedule`` (one of :data:`EP_SCHEDULES`; see ``configs.pool.PoolConfig.ep_schedule``) orders the
    expert-parallel work; ``comm_sms`` is the SM carveout (``workers.expert_parallel.sm_carveout``) of
    the kernels that run beside an all-to-all. ``rounding`` (one of :data:`MOE_ROUNDINGS`; see
    ``configs.pool.PoolConfig.moe_rounding``): "reference", or "vllm" (``workers.moe_vllm``). ``gemm``
    (one of :data:`FP8_GEMM_LIBRARIES`; ``PoolConfig.fp8_gemm``): what runs FP8 experts (:class:`Experts`).
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
        schedule: str = "all-to-all",
        comm_sms: int = 0,
        rounding: str = "reference",
        gemm: str = "torch",
        device=None,
    ) -> None:
        super().__init__()
        if schedule not in EP_SCHEDULES:
            raise ValueError(f"EP schedule {schedule!r} is not one of {', '.join(EP_SCHEDULES)}")
        if not isinstance(comm_sms, int) or comm_sms < 0:
            raise ValueError(f"EP comm SMs must be an integer >= 0, got {comm_sms!r}")
        if rounding not in MOE_ROUNDINGS:
            raise ValueError(f"MoE rounding {rounding!r} is not one of {', '.join(MOE_ROUNDINGS)}")
        if rounding == "vllm":
            moe_vllm.check_supported(config, fp8=fp8, ep_size=ep.size)
        self.config, self.ep, self.schedule, self.comm_sms, self.rounding = config, ep, schedule, comm_sms, rounding
        local = ep.experts(config.n_routed_experts)
        self.first_expert = local.start
        self.gate = Router(config, hidden, dtype=dtype, rounding=rounding, device=device)
        self.experts = Experts(len(local), hidden, config.moe_intermediate_size, dtype=dtype, fp8=fp8, rounding=rounding, gemm=gemm, device=device)
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
        if self.shared_experts is not None and self.ep.size == 1 and self.rounding == "reference":
            # one rank has no combine to overlap: the shared experts' rows go into the routed sum's own pass,
            # rounded once with it, instead of an add of two [T, H] tensors of its own (0.67 ms a MoE layer at 64K
            # tokens on H200: the profile's bf16 add, 2026-11-29-h200-prefill-profile-*-fp8-norms-16x4k.json)
            return self._one_rank(x, add=self.shared_experts(x))
        finish = self.start_routed(x)
        if self.shared_experts is None:
            return finish()
        with self.beside_combine(x.device):
            shared = self.shared_experts(x)
        return finish() + shared

    def beside_combine(self, device: torch.device):
        """The SM carveout of work launched between :meth:`start_routed` and its finish (the combine
        all-to-all is in flight then; none with one rank)."""
        return sm_carveout(self.comm_sms if self.ep.size > 1 else 0, device)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for tokens ``x [T, H]`` held by this rank (every rank of the
        EP group calls it, each with its own tokens)."""
        return self.start_routed(x)()

    def start_routed(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start :meth:`routed`; returns the function that waits for the combine all-to-all and gives
        the sum (compute something else in between: it overlaps the combine)."""
        if self.ep.size == 1:
            out = self._one_rank(x)
            return lambda: out
        weights, ids = self.gate(x)
        if self.schedule == "local-first":
            return self._local_first(x, ids, weights)
        # every rank splits, whatever its token count: the ranks' count exchanges must agree in size
        return self._micro_batches(x, self.experts.prepare(x), ids, weights, 2 if self.schedule == "two-micro-batches" else 1)

    def _one_rank(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The routed sum where this rank holds every expert, with ``add`` in its pass (:meth:`_compute`)."""
        weights, ids = self.gate(x)
        return self._compute(x, ids - self.first_expert, weights, ids.numel(), add=add).to(x.dtype)

    def _pair_order(self, local_ids: torch.Tensor, pairs: int) -> _PairOrder:
        """The ``pairs`` valid (row, slot)s of ``local_ids [N, k]`` (-1: not here) sorted by local expert."""
        n, k = local_ids.shape
        flat = local_ids.reshape(-1)
        if pairs == flat.numel():
            index = torch.arange(pairs, device=flat.device)
        else:  # a known size: no host sync
            index = torch.nonzero_static(flat >= 0, size=pairs).squeeze(1)
        experts, by_expert = torch.sort(flat[index], stable=True)
        index = index[by_expert]
        # each expert's end: a search of the sorted ids (torch.bincount would wait for the GPU to size its output)
        ends = torch.arange(1, self.experts.num_local + 1, device=flat.device)
        offs = torch.searchsorted(experts, ends, out_int32=True)
        where = torch.full((n * k,), -1, dtype=torch.int64, device=flat.device)
        where.index_copy_(0, index, torch.arange(pairs, device=flat.device))
        return _PairOrder(index, offs, where.view(n, k))

    def _compute(
        self, rows: list[torch.Tensor] | torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, pairs: int,
        out: torch.Tensor | None = None, order: _PairOrder | None = None, add: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Rows ``[N, ...]`` with their local expert ids ``[N, k]`` (-1: not here) and weights ``[N, k]``,
        ``pairs`` of the ids valid -> the weighted sum of each row's experts ``[N, H]`` (into ``out``).
        ``rows``: as :meth:`Experts.prepare` makes them, or the hidden rows themselves (FP8 experts then
        quantize each row straight into its pairs' places), or with ``order`` (:meth:`_pair_order`)
        the experts' input rows already in that order. ``add [N, H]``: rows added to the sum in its pass
        (rounding "reference" only: vLLM's scales the sum after it)."""
        n, k = local_ids.shape
        self.pairs += pairs
        hidden = rows if isinstance(rows, torch.Tensor) else None
        dtype = torch.bfloat16 if self.experts.fp8 else (rows if hidden is not None else rows[0]).dtype
        if not pairs:
            zeros = local_ids.new_zeros(n, self.experts.down_proj.shape[1], dtype=dtype)
            if add is not None:
                zeros = zeros + add.to(dtype)
            return zeros if out is None else out.copy_(zeros)
        layout = None
        if order is not None:
            pair_rows, where = rows, order.where
        else:
            order = self._pair_order(local_ids, pairs)
            layout = self.experts.layout(order.offs, pairs)  # DeepGEMM's: the pairs' rows go straight there
            where = order.where if layout is None else layout.place(order.where)  # each pair's row of the experts' input
            if hidden is not None and self.experts.fp8:
                pair_rows = self.experts.prepare(hidden, scatter_to=where, rows=pairs if layout is None else layout.rows)
            elif layout is None:
                pair_rows = [r.index_select(0, order.index // k) for r in ([hidden] if hidden is not None else rows)]
            else:
                pair_rows = layout.gather(rows, order.index // k)
        y = self.experts(pair_rows, weights.reshape(-1)[order.index], order.offs, layout)
        total = gather_sum(y, where, dtype, out=out, add=add)
        if self.rounding == "vllm":  # scaled after the sum, rounded again (one rank holds every pair: moe_vllm.check_supported)
            return total * self.config.routed_scaling_factor
        return total

    def _micro_batches(self, x, rows, ids, weights, parts: int) -> Callable[[], torch.Tensor]:
        """Every routed row, this rank's own too, through the all-to-alls; with two parts the dispatch
        of the second and the combine of the first run beside the other's experts."""
        tokens = x.shape[0]
        bounds = [tokens * i // parts for i in range(parts + 1)]
        tables = self.expert_tables(ids.device)
        plans = [Dispatch(self.ep, tables, ids[a:b], weights[a:b]) for a, b in zip(bounds, bounds[1:])]
        exchange_counts(plans, self.ep)
        sent = [plan.send([r[a:b] for r in rows]) for plan, a, b in zip(plans, bounds, bounds[1:])]
        returns = []
        for plan, work in zip(plans, sent):
            received = work()
            with sm_carveout(self.comm_sms if parts > 1 else 0, x.device):  # beside the other part's all-to-all
                y = self._compute(received[:-1], *plan.unpack_meta(received[-1]), plan.recv_pairs)
            returns.append(plan.send_back(y))
        return lambda: torch.cat([gather_sum(work()[0], plan.combine_index(), x.dtype) for plan, work in zip(plans, returns)])

    def _local_first(self, x, ids, weights) -> Callable[[], torch.Tensor]:
        """The pairs of this rank's tokens and experts never travel: they are computed while the other
        rows' dispatch is in flight, into the first rows of the buffer the combine lands in. FP8
        experts quantize each token once, straight into its places in the dispatch buffer and among
        the local pairs (no gathers before the dispatch starts)."""
        tokens = x.shape[0]
        plan = Dispatch(self.ep, self.expert_tables(ids.device), ids, weights, keep_local=True)
        exchange_counts([plan], self.ep)
        local_ids, sent = plan.local_ids(), sum(plan.send_rows)
        order = None
        if self.experts.fp8:
            order = self._pair_order(local_ids, plan.local_pairs)
            dest = torch.cat([plan.places, torch.where(order.where >= 0, order.where + sent, -1)], dim=1)
            q, scale = self.experts.prepare(x, scatter_to=dest, rows=sent + plan.local_pairs)
            dispatched = plan.send([q[:sent], scale[:sent]], gathered=True)
            rows = [q[sent:], scale[sent:]]
        else:
            rows = self.experts.prepare(x)
            dispatched = plan.send(rows)
        dtype = torch.bfloat16 if self.experts.fp8 else x.dtype
        partials = x.new_empty(tokens + sent, x.shape[1], dtype=dtype)
        with sm_carveout(self.comm_sms, x.device):
            self._compute(rows, local_ids, weights, plan.local_pairs, out=partials[:tokens], order=order)
        received = dispatched()
        y = self._compute(received[:-1], *plan.unpack_meta(received[-1]), plan.recv_pairs)
        work = plan.send_back(y, out=partials[tokens:])

        def finish() -> torch.Tensor:
            work()  # the received partial sums land in partials[tokens:]
            return gather_sum(partials, plan.combine_index(local=True), x.dtype)

        return finish


@dataclass(frozen=True)
class _PairOrder:
    """(row, slot) pairs sorted by local expert: ``index [P]`` (flat ``row * k + slot``), ``offs [E_r]``
    (int32: the end of each expert's pairs) and ``where [N, k]`` (each pair's place, -1: none)."""

    index: torch.Tensor
    offs: torch.Tensor
    where: torch.Tensor
