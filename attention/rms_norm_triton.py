"""Triton kernel behind ``attention.mla.RMSNorm`` on GPUs (the math is there).

One program normalizes ``BLOCK_M`` rows, each read once and held in registers (``WIDTH``: the row
width rounded up to a power of two, at most :data:`MAX_WIDTH`): the mean square, the normalization
and the weight in float32, rounded once to the weight's dtype. Rows are read through their stride (a
column slice of wider rows works). Offsets are 64-bit. With a residual (:func:`add_rms_norm`, the
decoder's float32 residual stream: ``workers.model``) the same pass first adds the rows into it, in
float32, and writes the sum back: one read of each, not an add and then a norm.

Rounded once, not as DeepSeek's reference (the normalized row rounded, then times the weight and
rounded again): the truth is float32, and the second rounding added about a fifth to the cached
latent rows' distance from it. On the tests' DeepSeek-width checkpoint in bf16, layer 0's rows are
0.0029 from float64 rounded once against 0.0037 rounded twice (relative L2,
``benchmarks/probes/probe_row_rounding.py``): where vLLM 0.26's own prefill's rows were on an H100,
and the rows it loaded from the pool were not (``docs/vllm-decode.md``, against the float32 truth).

Why a kernel: torch's fused ``rms_norm`` with the weight inside rounds the same way, and was slower.
Measured on H200 for 64K tokens x 7168 (``benchmarks/probes/probe_mla_ops.py``, when this kernel still
rounded twice): this kernel 0.45 ms, torch's op 0.65 ms, the separate float32 ops 5.7 ms.

:func:`rms_norm_fp8` is the same pass with its output quantized for FP8 GEMMs, per row per
``GROUP`` columns (``workers.fp8.quantize_activations``' recipe, on the row rounded to the weight's
dtype as above): FP8 values and a scale per group, never the rounded row itself. The tile is read as
``[BLOCK_M, WIDTH / GROUP, GROUP]``, so each group's largest magnitude is a reduction over its last
axis. Where the norm feeds only FP8 linears (a layer's ``input_layernorm``: ``q_a_proj`` and
``kv_a_proj_with_mqa``; ``q_a_layernorm``: ``q_b_proj``; a dense layer's ``post_attention_layernorm``:
``gate_up_proj``) this replaces the norm's write and read of the bf16 rows, and the second reader's
quantization of them again. Why a kernel: no library has it; FlashInfer's ``rmsnorm_quant`` takes one
static scale per tensor, not DeepSeek's dynamic per-token 1x128 scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WIDTH = 8192  # the widest row held in registers (DeepSeek's hidden sizes are 7168 and below)
VALUES_PER_PROGRAM = 8192
FP8_PER_THREAD = 16  # values a thread of the quantizing kernel holds (rms_norm_constants says why)


# the row count varies with every batch: not specialized on (the kernel compiles once)
@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, M, D, x_stride, out_stride, res_stride, eps,
    WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.arange(0, WIDTH)
    col_ok = cols < D
    mask = (rows < M)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual stream's new value: normalized below, and kept
        res = res_ptr + rows[:, None] * res_stride + cols[None, :]
        x += tl.load(res, mask=mask, other=0.0).to(tl.float32)
        tl.store(res, x.to(res_ptr.dtype.element_ty), mask=mask)
    scale = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    weight = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = (x * scale[:, None] * weight[None, :]).to(out_ptr.dtype.element_ty)  # the one rounding
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out, mask=mask)


# the row counts vary with every batch: not specialized on
@triton.jit(do_not_specialize=["M", "M_PAD", "s_stride"])
def _rms_norm_fp8_kernel(
    x_ptr, w_ptr, q_ptr, s_ptr, res_ptr, M, M_PAD, D, x_stride, q_stride, s_stride, res_stride, eps,
    WIDTH: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ADD: tl.constexpr, FP8_MAX: tl.constexpr, Q_EPS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    groups = tl.arange(0, WIDTH // GROUP)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [groups, GROUP]
    col_ok = cols < D
    row_ok = rows < M
    mask = row_ok[:, None, None] & col_ok[None, :, :]
    x = tl.load(x_ptr + rows[:, None, None] * x_stride + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:
        res = res_ptr + rows[:, None, None] * res_stride + cols[None, :, :]
        x += tl.load(res, mask=mask, other=0.0).to(tl.float32)
        tl.store(res, x.to(res_ptr.dtype.element_ty), mask=mask)
    scale = tl.math.rsqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / D + eps)
    weight = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = (x * scale[:, None, None] * weight[None, :, :]).to(w_ptr.dtype.element_ty).to(tl.float32)  # the one rounding
    # the quantization (padding rows, from M to M_PAD, are zeros: their scale is Q_EPS / FP8_MAX)
    group_scale = tl.maximum(tl.max(tl.abs(y), axis=2), Q_EPS) / FP8_MAX  # [BLOCK_M, groups]
    q = tl.minimum(tl.maximum(y / group_scale[:, :, None], -FP8_MAX), FP8_MAX).to(q_ptr.dtype.element_ty)
    pad_ok = rows < M_PAD
    tl.store(q_ptr + rows[:, None, None] * q_stride + cols[None, :, :], q, mask=pad_ok[:, None, None] & col_ok[None, :, :])
    tl.store(s_ptr + groups[None, :] * s_stride + rows[:, None], group_scale, mask=pad_ok[:, None] & (groups * GROUP < D)[None, :])


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, *, group: int, rows: int, fp8_max: float, scale_eps: float,
    constants: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`rms_norm` (:func:`add_rms_norm` with ``residual``) of ``x [M, D]`` quantized to FP8 per row
    per ``group`` columns (``D % group == 0``): ``q [rows, D]`` float8_e4m3fn and ``scale [D / group,
    rows]`` float32, rows from ``M`` to ``rows`` zeros (``workers.fp8.quantize_activations``' layout,
    ``scale_eps`` the smallest largest magnitude it scales by). One pass. ``constants``: a launch's
    ``BLOCK_M`` and ``num_warps`` instead of :func:`rms_norm_constants`' (``benchmarks/probes/probe_rms_norm_fp8.py``)."""
    m, width = x.shape
    if x.stride(1) != 1 or width > MAX_WIDTH or width % group or rows < m:
        raise ValueError(f"rms_norm_fp8 needs a contiguous last dim of at most {MAX_WIDTH} in whole groups of {group} and rows >= {m}, "
                         f"got shape {tuple(x.shape)}, strides {x.stride()}, rows {rows}")  # fmt: skip
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"rms_norm_fp8 needs a residual of x's shape {tuple(x.shape)} with a contiguous last dim, got {tuple(residual.shape)}")
    q = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(width // group, rows, dtype=torch.float32, device=x.device)
    if rows:
        constants = {**rms_norm_constants(width, per_thread=FP8_PER_THREAD), **(constants or {})}
        grid = (triton.cdiv(rows, constants["BLOCK_M"]),)
        res = residual if residual is not None else x  # not read without ADD
        _rms_norm_fp8_kernel[grid](
            x, weight, q, scale, res, m, rows, width, x.stride(0), q.stride(0), scale.stride(0), res.stride(0), eps,
            GROUP=group, ADD=residual is not None, FP8_MAX=fp8_max, Q_EPS=scale_eps, **constants,
        )  # fmt: skip
    return q, scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [M, D]`` (last dim contiguous, ``D <= MAX_WIDTH``) normalized, times ``weight [D]``: a new
    ``[M, D]`` in the weight's dtype."""
    return _launch(x, weight, eps, None)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in float32 (``residual [M, D]``, any float dtype, updated in place), and
    ``residual`` normalized, times ``weight``: a new ``[M, D]`` in the weight's dtype. One pass."""
    if residual.shape != x.shape or residual.stride(1) != 1:
        raise ValueError(f"add_rms_norm needs a residual of x's shape {tuple(x.shape)} with a contiguous last dim, got {tuple(residual.shape)}, strides {residual.stride()}")
    return _launch(x, weight, eps, residual)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> torch.Tensor:
    rows, width = x.shape
    if x.stride(1) != 1 or width > MAX_WIDTH:
        raise ValueError(f"rms_norm needs a contiguous last dim of at most {MAX_WIDTH}, got shape {tuple(x.shape)}, strides {x.stride()}")
    out = torch.empty(rows, width, dtype=weight.dtype, device=x.device)
    if rows:
        constants = rms_norm_constants(width)
        grid = (triton.cdiv(rows, constants["BLOCK_M"]),)
        add = residual is not None
        res = residual if add else out  # not read without ADD
        _rms_norm_kernel[grid](x, weight, out, res, rows, width, x.stride(0), out.stride(0), res.stride(0), eps, ADD=add, **constants)
    return out


def rms_norm_constants(width: int, per_thread: int = 32) -> dict:
    """The kernels' compile-time arguments and ``num_warps`` for rows of ``width`` values, ``per_thread``
    of them a thread. The quantizing kernel takes 16: at 32 its row of 8192 took 149 registers a thread
    (8 warps resident per SM, against the plain kernel's 124 and 16 warps), at 16 it takes 77 (16 warps)
    and spills none (Triton 3.9's cubin for sm_90a, ``cuobjdump --dump-resource-usage``)."""
    padded = triton.next_power_of_2(width)
    block_m = max(1, VALUES_PER_PROGRAM // padded)
    return {"WIDTH": padded, "BLOCK_M": block_m, "num_warps": max(4, min(16, block_m * padded // (32 * per_thread)))}
