"""Triton kernel behind ``workers.fp8.quantize_activations`` (the math is there).

One program quantizes ``BLOCK_M`` rows of one group of ``GROUP`` columns. A group of up to
``ONE_PASS_WIDTH`` columns is read once and held in registers (``WIDTH``: ``GROUP`` rounded up to a
power of two); a wider one in two passes over its 128-column chunks, the first finding each row's
largest magnitude, the second re-reading the chunks (from L2) to write the FP8 values. Measured on
H200 (16K tokens of DeepSeek-V3), one pass took the experts' input from 0.45 to 0.32 ms and their
activation from 0.64 to 0.31 ms (3.6-4.3 TB/s).

With ``SILU_MUL`` the input is ``[M, 2K]`` and the value quantized is ``silu(x[:, :K]) * x[:, K:]``
(the experts' activation, never written in high precision); with ``ROW_WEIGHT`` each row is also
multiplied by its weight (a token's routing weight). Rows from ``M`` to the padded row count are
written as zeros with scale ``EPS / FP8_MAX``. With ``SCATTER`` slots each row is written to the
``SCATTER`` output rows ``dest[row]`` names (-1: none) instead: the experts' input rows in pair
order, each token read and quantized once (not quantized, then copied to its pairs by a gather that
reads and writes every pair row again). Offsets are 64-bit.

Why a kernel: torch has no fused op for per-group FP8 quantization; done with torch ops it takes
five passes over the activations and, measured on H200, as long as the FP8 GEMM it feeds
(``benchmarks/results/2026-11-22-h200-grouped-gemm-candidates.json``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 128  # the columns of one chunk of a group quantized in two passes
ONE_PASS_WIDTH = 8192  # the widest group (rounded up to a power of two) held in registers: one pass
TILE = 8192  # values loaded per program in one pass, 64 per thread (the best of 2K-16K values, 2-16 warps on H200)


@triton.jit
def _load(x_ptr, rows, x_stride, cols, mask, K, SILU_MUL: tl.constexpr):
    offsets = rows[:, None] * x_stride + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = tl.load(x_ptr + offsets + K, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    return x


@triton.jit
def _store(q_ptr, dest_ptr, x, scale, rows, cols, col_ok, row_ok, pad_ok, q_stride,
           FP8_MAX: tl.constexpr, SCATTER: tl.constexpr):  # fmt: skip
    q = tl.minimum(tl.maximum(x / scale[:, None], -FP8_MAX), FP8_MAX).to(q_ptr.dtype.element_ty)
    if SCATTER:
        for slot in tl.static_range(SCATTER):
            dest = tl.load(dest_ptr + rows * SCATTER + slot, mask=row_ok, other=-1)
            tl.store(q_ptr + dest[:, None] * q_stride + cols[None, :], q, mask=(dest >= 0)[:, None] & col_ok[None, :])
    else:
        tl.store(q_ptr + rows[:, None] * q_stride + cols[None, :], q, mask=pad_ok[:, None] & col_ok[None, :])


@triton.jit
def _store_scale(s_ptr, dest_ptr, scale, rows, row_ok, pad_ok, SCATTER: tl.constexpr):
    if SCATTER:
        for slot in tl.static_range(SCATTER):
            dest = tl.load(dest_ptr + rows * SCATTER + slot, mask=row_ok, other=-1)
            tl.store(s_ptr + dest, scale, mask=dest >= 0)
    else:
        tl.store(s_ptr + rows, scale, mask=pad_ok)


# the row counts (and the scales' row stride) vary with every batch: not specialized on, so the kernel
# compiles once (in the warm-up) rather than again for each new pattern of them (seconds each on H200,
# in the first requests of a new node: benchmarks/results/2026-11-23-h200-first-batches-*.json)
@triton.jit(do_not_specialize=["M", "M_PAD", "s_stride_g"])
def _quantize_kernel(
    x_ptr, w_ptr, q_ptr, s_ptr, dest_ptr,
    M, M_PAD, K, x_stride, q_stride, s_stride_g,
    GROUP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
    SILU_MUL: tl.constexpr, ROW_WEIGHT: tl.constexpr, SCATTER: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    row_ok = rows < M
    pad_ok = rows < M_PAD
    cols0 = group * GROUP + tl.arange(0, WIDTH)
    col_ok = tl.arange(0, WIDTH) < GROUP
    if ROW_WEIGHT:
        weight = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if WIDTH >= GROUP:  # one pass: the whole group is held in registers
        x = _load(x_ptr, rows, x_stride, cols0, row_ok[:, None] & col_ok[None, :], K, SILU_MUL)
        if ROW_WEIGHT:
            x = x * weight[:, None]
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), EPS) / FP8_MAX
        _store(q_ptr, dest_ptr, x, scale, rows, cols0, col_ok, row_ok, pad_ok, q_stride, FP8_MAX, SCATTER)
    else:  # two passes over WIDTH-column chunks: the largest magnitudes, then the values (re-read from L2)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k in range(0, GROUP, WIDTH):
            x = _load(x_ptr, rows, x_stride, cols0 + k, row_ok[:, None], K, SILU_MUL)
            if ROW_WEIGHT:
                x = x * weight[:, None]
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = tl.maximum(amax, EPS) / FP8_MAX
        for k in range(0, GROUP, WIDTH):
            x = _load(x_ptr, rows, x_stride, cols0 + k, row_ok[:, None], K, SILU_MUL)
            if ROW_WEIGHT:
                x = x * weight[:, None]
            _store(q_ptr, dest_ptr, x, scale, rows, cols0 + k, col_ok, row_ok, pad_ok, q_stride, FP8_MAX, SCATTER)
    _store_scale(s_ptr + group * s_stride_g, dest_ptr, scale, rows, row_ok, pad_ok, SCATTER)


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
    """The quantization kernel's compile-time arguments, ``num_warps`` (a launch option) included: groups
    up to :data:`ONE_PASS_WIDTH` columns in one pass, ``TILE`` values of them per program."""
    loads = 2 if silu_mul else 1
    width = triton.next_power_of_2(group)
    if width <= ONE_PASS_WIDTH:
        block_m = min(32, max(1, TILE // (width * loads)))  # more rows of a narrow group spill registers
        warps = max(4, block_m * width * loads // (64 * 32))
    else:
        width, block_m, warps = CHUNK, 16, 4
    return {
        "GROUP": group, "WIDTH": width, "BLOCK_M": block_m, "FP8_MAX": fp8_max, "EPS": eps,
        "SILU_MUL": silu_mul, "ROW_WEIGHT": row_weight, "SCATTER": scatter, "num_warps": warps,
    }  # fmt: skip
