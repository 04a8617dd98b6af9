"""Triton kernel behind ``workers.activation.silu_mul`` (the math is there).

One program computes ``BLOCK_M`` rows x ``BLOCK_K`` columns of ``silu(g) * u`` from ``[g | u]`` rows,
in float32 with the roundings of the torch ops it replaces (``silu`` rounded to the output dtype,
then the product, then the product with the row's weight in that dtype). Rows are read through their
stride. Offsets are 64-bit.

Why a kernel: torch has no fused op for it; ``F.silu(g) * u * w`` is three launches that write and
re-read two ``[M, K]`` intermediates, seven passes over ``[M, K]`` where this kernel makes three
(``g`` and ``u`` read, the result written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 1024
BLOCK_M = 8


# the row count varies with every batch: not specialized on (the kernel compiles once)
@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(
    x_ptr, w_ptr, out_ptr, M, K, x_stride, out_stride,
    ROW_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    offsets = rows[:, None] * x_stride + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + offsets + K, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out = (silu * up).to(dtype)
    if ROW_WEIGHT:
        weight = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(dtype).to(tl.float32)
        out = (out.to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out, mask=mask)


def silu_mul(x: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor:
    """``x [M, 2K]`` (last dim contiguous), ``row_weight [M]`` or None: a new ``[M, K]`` in ``x``'s dtype."""
    rows, k = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    if rows and k:
        grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(k, BLOCK_K))
        _silu_mul_kernel[grid](
            x, row_weight if row_weight is not None else out, out, rows, k, x.stride(0), out.stride(0), **silu_mul_constants(row_weight is not None)
        )  # fmt: skip
    return out


def silu_mul_constants(row_weight: bool) -> dict:
    """The kernel's compile-time arguments and ``num_warps``."""
    return {"ROW_WEIGHT": row_weight, "BLOCK_M": BLOCK_M, "BLOCK_K": BLOCK_K, "num_warps": 8}
