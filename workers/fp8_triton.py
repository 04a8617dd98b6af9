"""Triton kernel behind ``workers.fp8.quantize_activations`` (the math is there).

One program quantizes ``BLOCK_M`` rows of one group of ``GROUP`` columns: a first pass over the
group's 128-column chunks finds each row's largest magnitude, a second writes the FP8 values (the
chunks are re-read from L2). With ``SILU_MUL`` the input is ``[M, 2K]`` and the value quantized is
``silu(x[:, :K]) * x[:, K:]`` (the experts' activation, never written in high precision); with
``ROW_WEIGHT`` each row is also multiplied by its weight (a token's routing weight). Rows from ``M``
to the padded row count are written as zeros with scale ``EPS / FP8_MAX``. With ``SCATTER`` slots
each row is written to the ``SCATTER`` output rows ``dest[row]`` names (-1: none) instead: the
experts' input rows in pair order, each token read and quantized once (not quantized, then copied
to its pairs by a gather that reads and writes every pair row again). Offsets are 64-bit.

Why a kernel: torch has no fused op for per-group FP8 quantization; done with torch ops it takes
five passes over the activations and, measured on H200, as long as the FP8 GEMM it feeds
(``benchmarks/results/2026-11-22-h200-grouped-gemm-candidates.json``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 128


@triton.jit
def _load_chunk(x_ptr, rows, x_stride, cols, row_ok, K, SILU_MUL: tl.constexpr):
    mask = row_ok[:, None]
    offsets = rows[:, None] * x_stride + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = tl.load(x_ptr + offsets + K, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    return x


# the row counts (and the scales' row stride) vary with every batch: not specialized on, so the kernel
# compiles once (in the warm-up) rather than again for each new pattern of them (seconds each on H200,
# in the first requests of a new node: benchmarks/results/2026-11-23-h200-first-batches-*.json)
@triton.jit(do_not_specialize=["M", "M_PAD", "s_stride_g"])
def _quantize_kernel(
    x_ptr, w_ptr, q_ptr, s_ptr, dest_ptr,
    M, M_PAD, K, x_stride, q_stride, s_stride_g,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
    SILU_MUL: tl.constexpr, ROW_WEIGHT: tl.constexpr, SCATTER: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    row_ok = rows < M
    cols0 = group * GROUP + tl.arange(0, 128)
    if ROW_WEIGHT:
        weight = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k in range(0, GROUP, 128):
        x = _load_chunk(x_ptr, rows, x_stride, cols0 + k, row_ok, K, SILU_MUL)
        if ROW_WEIGHT:
            x = x * weight[:, None]
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = tl.maximum(amax, EPS) / FP8_MAX
    pad_ok = rows < M_PAD
    for k in range(0, GROUP, 128):
        cols = cols0 + k
        x = _load_chunk(x_ptr, rows, x_stride, cols, row_ok, K, SILU_MUL)
        if ROW_WEIGHT:
            x = x * weight[:, None]
        q = tl.minimum(tl.maximum(x / scale[:, None], -FP8_MAX), FP8_MAX).to(q_ptr.dtype.element_ty)
        if SCATTER:
            for slot in tl.static_range(SCATTER):
                dest = tl.load(dest_ptr + rows * SCATTER + slot, mask=row_ok, other=-1)
                tl.store(q_ptr + dest[:, None] * q_stride + cols[None, :], q, mask=(dest >= 0)[:, None])
        else:
            tl.store(q_ptr + rows[:, None] * q_stride + cols[None, :], q, mask=pad_ok[:, None])
    if SCATTER:
        for slot in tl.static_range(SCATTER):
            dest = tl.load(dest_ptr + rows * SCATTER + slot, mask=row_ok, other=-1)
            tl.store(s_ptr + group * s_stride_g + dest, scale, mask=dest >= 0)
    else:
        tl.store(s_ptr + group * s_stride_g + rows, scale, mask=pad_ok)


def quantize(
    x: torch.Tensor, group: int, rows: int, *, silu_mul: bool, row_weight: torch.Tensor | None, fp8_max: float, eps: float,
    scatter_to: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``workers.fp8.quantize_activations``; ``x`` has a contiguous last dim, ``group % 128 == 0``,
    ``scatter_to`` (int64, contiguous) names each row's output rows."""
    m = x.shape[0]
    k = x.shape[1] // 2 if silu_mul else x.shape[1]
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(k // group, rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    constants = quantize_constants(group, fp8_max, eps, silu_mul=silu_mul, row_weight=row_weight is not None,
                                   scatter=0 if scatter_to is None else scatter_to.shape[1])  # fmt: skip
    grid = (triton.cdiv(m if scatter_to is not None else rows, constants["BLOCK_M"]), k // group)
    _quantize_kernel[grid](
        x, row_weight if row_weight is not None else scale, q, scale, scatter_to if scatter_to is not None else scale,
        m, rows, k, x.stride(0), q.stride(0), scale.stride(0), **constants,
    )  # fmt: skip
    return q, scale


def quantize_constants(group: int, fp8_max: float, eps: float, *, silu_mul: bool, row_weight: bool, scatter: int) -> dict:
    """The quantization kernel's compile-time arguments."""
    return {
        "GROUP": group, "BLOCK_M": 16 if group > CHUNK else 32, "FP8_MAX": fp8_max, "EPS": eps,
        "SILU_MUL": silu_mul, "ROW_WEIGHT": row_weight, "SCATTER": scatter,
    }  # fmt: skip
