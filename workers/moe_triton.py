"""Triton kernel behind ``workers.moe.gather_sum``: ``out[t] = sum_j src[index[t, j]]`` over the
slots ``j`` whose index is not -1, accumulated in float32.

One program sums one output row's ``BLOCK_H`` columns over its ``SLOTS`` source rows. Offsets are 64-bit.

Why a kernel: a token's weighted expert rows sit at scattered places of the grouped GEMM's output
(sorted by expert). torch's ``index_add_`` sums them with bf16 atomics, and un-permuting the rows to
``[tokens, k, hidden]`` before a sum writes and re-reads them; measured on H200 for 16K tokens x 8
experts x 7168 (``benchmarks/results/2026-11-22-h200-moe-profile-index-add.json``): 7.9 ms and 3.5 ms, a third
of the layer's GEMM time. Here every row is read once and no atomics are needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit
def _gather_sum_kernel(src_ptr, index_ptr, out_ptr, H, src_stride, out_stride, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        row = tl.load(index_ptr + t * SLOTS + j).to(tl.int64) + cols * 0  # the slot's row, for every column
        values = tl.load(src_ptr + tl.maximum(row, 0) * src_stride + cols, mask=mask & (row >= 0), other=0.0)
        acc += values.to(tl.float32)
    tl.store(out_ptr + t * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_sum(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """See ``workers.moe.gather_sum``; ``src`` has a contiguous last dim, ``index`` is contiguous."""
    rows, slots = index.shape
    out = torch.empty(rows, src.shape[1], dtype=dtype, device=src.device)
    if rows and src.shape[1]:
        grid = (rows, triton.cdiv(src.shape[1], BLOCK_H))
        _gather_sum_kernel[grid](src, index, out, src.shape[1], src.stride(0), out.stride(0), SLOTS=slots, BLOCK=BLOCK_H)
    return out
