"""Triton kernels of ``workers.moe``: routing and the sum of each token's expert rows.

``gather_sum``: ``out[t] = sum_j src[index[t, j]]`` over the slots ``j`` whose index is not -1,
accumulated in float32. One program sums one output row's ``BLOCK_H`` columns over its ``SLOTS``
source rows. Offsets are 64-bit.

Why a kernel: a token's weighted expert rows sit at scattered places of the grouped GEMM's output
(sorted by expert). torch's ``index_add_`` sums them with bf16 atomics, and un-permuting the rows to
``[tokens, k, hidden]`` before a sum writes and re-reads them; measured on H200 for 16K tokens x 8
experts x 7168 (``benchmarks/results/2026-11-22-h200-moe-profile-index-add.json``): 7.9 ms and 3.5 ms, a third
of the layer's GEMM time. Here every row is read once and no atomics are needed.

``route``: ``workers.moe.route``'s rules for ``BLOCK_T`` tokens per program, their scores in registers:
scoring, the biased choice, each group's score and the best groups, then ``K`` rounds of argmax.
Why a kernel: done with torch ops routing is a dozen launches and three ``topk`` calls over
``[T, E]``, 0.6 ms of ``topk`` alone for 16K tokens of DeepSeek-V3 on H200
(``benchmarks/results/2026-11-22-h200-moe-profile.json``), while the kernel reads the logits once:
0.11 ms there (``benchmarks/results/2026-11-23-h200-moe-profile-routing-kernel.json``). Ties go to
the lower expert id (torch's ``topk`` leaves them unspecified).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit
def _gather_sum_kernel(
    src_ptr, index_ptr, add_ptr, out_ptr, H, src_stride, add_stride, out_stride, SLOTS: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if ADD:  # the row added to the sum (the shared experts' output), in the same float32 accumulation
        acc += tl.load(add_ptr + t * add_stride + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(SLOTS):
        row = tl.load(index_ptr + t * SLOTS + j).to(tl.int64) + cols * 0  # the slot's row, for every column
        values = tl.load(src_ptr + tl.maximum(row, 0) * src_stride + cols, mask=mask & (row >= 0), other=0.0)
        acc += values.to(tl.float32)
    tl.store(out_ptr + t * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_sum(
    src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None, add: torch.Tensor | None = None
) -> torch.Tensor:
    """See ``workers.moe.gather_sum``; ``index`` is contiguous, ``src``, ``out`` and ``add`` have contiguous rows."""
    rows, slots = index.shape
    if src.stride(1) != 1:
        src = src.contiguous()
    if out is None:
        out = torch.empty(rows, src.shape[1], dtype=dtype, device=src.device)
    elif out.shape != (rows, src.shape[1]) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a [{rows}, {src.shape[1]}] {dtype} tensor with contiguous rows, got {tuple(out.shape)} {out.dtype}")
    if add is not None and (add.shape != (rows, src.shape[1]) or add.stride(1) != 1):
        raise ValueError(f"add must be a [{rows}, {src.shape[1]}] tensor with contiguous rows, got {tuple(add.shape)}")
    if rows and src.shape[1]:
        grid = (rows, triton.cdiv(src.shape[1], BLOCK_H))
        extra = out if add is None else add  # not read without ADD
        _gather_sum_kernel[grid](src, index, extra, out, src.shape[1], src.stride(0), extra.stride(0), out.stride(0),
                                 SLOTS=slots, BLOCK=BLOCK_H, ADD=add is not None)  # fmt: skip
    return out


@triton.jit(do_not_specialize=["T"])  # the token count varies with every batch: compile once (see fp8_triton)
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, E, scaling,
    E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr, BIASED: tl.constexpr,
    N_GROUP: tl.constexpr, NG_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2_GROUPS: tl.constexpr,
    NORMALIZE: tl.constexpr, SCALE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < T
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        shifted = tl.where(ok, x - tl.max(tl.where(ok, x, float("-inf")), axis=1)[:, None], float("-inf"))
        numerators = tl.exp(shifted)
        scores = numerators / tl.sum(numerators, axis=1)[:, None]
    choice = scores
    if BIASED:
        choice = scores + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    choice = tl.where(ok, choice, float("-inf"))
    if N_GROUP > 1:
        # each group's score (the sum of its two best, or its best), then the TOPK_GROUP best groups
        group = cols // (E // N_GROUP)
        gcols = tl.arange(0, NG_PAD)
        group_scores = tl.full([BLOCK_T, NG_PAD], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            members = tl.where(group[None, :] == g, choice, float("-inf"))
            best = tl.max(members, axis=1)
            if TOP2_GROUPS:
                first = tl.argmax(members, axis=1)
                best += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), members), axis=1)
            group_scores = tl.where(gcols[None, :] == g, best[:, None], group_scores)
        kept = tl.zeros([BLOCK_T, NG_PAD], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(group_scores, axis=1)
            kept = tl.where(gcols[None, :] == pick[:, None], 1, kept)
            group_scores = tl.where(gcols[None, :] == pick[:, None], float("-inf"), group_scores)
        keep = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32)
        for g in tl.static_range(N_GROUP):
            in_group = tl.sum(tl.where(gcols[None, :] == g, kept, 0), axis=1)
            keep = tl.where(group[None, :] == g, in_group[:, None], keep)
        choice = tl.where(keep > 0, choice, float("-inf"))
    # the K choices, kept in registers ([BLOCK_T, K_PAD]) and stored once
    slots = tl.arange(0, K_PAD)
    chosen_ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int64)
    chosen_weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in tl.static_range(K):
        pick = tl.argmax(choice, axis=1)
        chosen = cols[None, :] == pick[:, None]
        weight = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
        choice = tl.where(chosen, float("-inf"), choice)
        chosen_ids = tl.where(slots[None, :] == j, pick.to(tl.int64)[:, None], chosen_ids)
        chosen_weights = tl.where(slots[None, :] == j, weight[:, None], chosen_weights)
    if NORMALIZE:
        chosen_weights = chosen_weights / (tl.sum(chosen_weights, axis=1)[:, None] + 1e-20)
    if SCALE:
        chosen_weights = chosen_weights * scaling
    out = rows[:, None] * K + slots[None, :]
    out_ok = row_ok[:, None] & (slots[None, :] < K)
    tl.store(ids_ptr + out, chosen_ids, mask=out_ok)
    tl.store(weights_ptr + out, chosen_weights, mask=out_ok)


def route_constants(config, experts: int, *, biased: bool) -> dict:
    """The routing kernel's compile-time arguments for a ``configs.model.MoEConfig``."""
    v3, k = config.topk_method == "noaux_tc", config.num_experts_per_tok
    normalize = config.norm_topk_prob and (v3 or k > 1)
    e_pad, groups = triton.next_power_of_2(experts), config.n_group if config.grouped else 1
    return {
        "E_PAD": e_pad,
        "BLOCK_T": max(1, min(16, 1024 // e_pad)),  # [BLOCK_T, E_PAD] scores in registers: ~8 per thread, no spills on SM90
        "K": k, "K_PAD": triton.next_power_of_2(k), "SIGMOID": config.scoring_func == "sigmoid", "BIASED": v3 and biased,
        "N_GROUP": groups, "NG_PAD": triton.next_power_of_2(groups), "TOPK_GROUP": config.topk_group, "TOP2_GROUPS": v3,
        "NORMALIZE": normalize, "SCALE": v3 or not normalize,  # V2 normalizes or scales, never both
    }  # fmt: skip


def route(logits: torch.Tensor, config, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``workers.moe.route`` (the same rules; ``logits`` float32 ``[T, E]``, contiguous)."""
    tokens, experts = logits.shape
    k = config.num_experts_per_tok
    weights = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    if not tokens:
        return weights, ids
    constants = route_constants(config, experts, biased=bias is not None)
    _route_kernel[(triton.cdiv(tokens, constants["BLOCK_T"]),)](
        logits, bias if bias is not None else logits, weights, ids, tokens, experts, float(config.routed_scaling_factor), **constants
    )
    return weights, ids
