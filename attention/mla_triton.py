"""Triton kernels behind the MLA layer's per-head row steps on GPUs: the rotation of the rope parts
(``attention.rope.RotaryEmbedding.rotate_``, the math is there) and the key rows
(``attention.mla.MLAAttention.up_project``). Each program takes ``BLOCK_T`` rows x ``BLOCK_H`` heads,
read through their strides. Offsets are 64-bit.

Rotation: ``x [T, H, R]`` in place (the rope part of the queries is a view of ``[T, N, P+R]`` rows,
the key's rope part a column slice of the latent rows). Each row of ``R`` values is read whole
(contiguous loads), split into its pairs in registers, rotated in float32 and written back over
itself. With torch ops the rotation is ten passes over the values (float32 copies, the products, the
stack that re-interleaves the pairs, the copy back into the query rows): measured on H200 for the
queries of 64K tokens x DeepSeek-V3's 128 heads, 13.9 ms per layer, as long as the layer's
attention; this kernel 0.63 ms (3.4 TB/s).

Key rows: ``k [S, N, P+R]`` from the up-projection ``kv [S, N, P+V]`` (its first ``P`` columns per
head) and the rope part ``k_pe [S, R]`` shared by every head (a column slice of the latent rows),
each ``k_pe`` row read once for all its heads. torch builds it in two strided copies, one reading
every ``k_pe`` row once per head: for 64K rows x 128 heads on H200, this kernel 1.48 ms, the two
copies 3.44 ms, ``torch.cat`` of the strided parts 5.30 ms.

(Measured by ``benchmarks/probes/probe_mla_ops.py``.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

VALUES_PER_PROGRAM = 4096  # rows x heads x values per head: 32 per thread of 4 warps


@triton.jit
def _rows_heads(T, H, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's rows and heads (64-bit), its rows' mask and the [rows, heads, 1] mask."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    t_ok = t < T
    return t, h, t_ok, t_ok[:, None, None] & (h < H)[None, :, None]


# the row counts vary with every batch: not specialized on (each kernel compiles once)
@triton.jit(do_not_specialize=["T"])
def _rotate_kernel(
    x_ptr, cos_ptr, sin_ptr, T, H, stride_t, stride_h,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    t, h, t_ok, mask = _rows_heads(T, H, BLOCK_T, BLOCK_H)
    offsets = (t[:, None, None] * stride_t + h[None, :, None] * stride_h) + tl.arange(0, 2 * HALF)[None, None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if INTERLEAVED:  # pairs (x_2i, x_2i+1)
        a, b = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, HALF, 2]))
    else:  # pairs (x_i, x_i+R/2)
        a, b = tl.split(tl.permute(tl.reshape(x, [BLOCK_T, BLOCK_H, 2, HALF]), (0, 1, 3, 2)))
    table = t[:, None] * HALF + tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + table, mask=t_ok[:, None], other=0.0)[:, None, :]
    sin = tl.load(sin_ptr + table, mask=t_ok[:, None], other=0.0)[:, None, :]
    pairs = tl.join(a * cos - b * sin, b * cos + a * sin)  # [BLOCK_T, BLOCK_H, HALF, 2]
    if not INTERLEAVED:
        pairs = tl.permute(pairs, (0, 1, 3, 2))
    tl.store(x_ptr + offsets, tl.reshape(pairs, [BLOCK_T, BLOCK_H, 2 * HALF]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _keys_kernel(
    kv_ptr, pe_ptr, k_ptr, T, H, kv_stride_t, kv_stride_h, pe_stride_t,
    NOPE: tl.constexpr, ROPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t, h, t_ok, mask = _rows_heads(T, H, BLOCK_T, BLOCK_H)
    nope = tl.arange(0, NOPE)[None, None, :]
    k_nope = tl.load(kv_ptr + (t[:, None, None] * kv_stride_t + h[None, :, None] * kv_stride_h) + nope, mask=mask)
    k_pe = tl.load(pe_ptr + t[:, None] * pe_stride_t + tl.arange(0, ROPE)[None, :], mask=t_ok[:, None])
    row = (t[:, None, None] * H + h[None, :, None]) * (NOPE + ROPE)
    tl.store(k_ptr + row + nope, k_nope, mask=mask)
    k_pe = tl.broadcast_to(k_pe[:, None, :], (BLOCK_T, BLOCK_H, ROPE))
    tl.store(k_ptr + row + NOPE + tl.arange(0, ROPE)[None, None, :], k_pe, mask=mask)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Rotate ``x [T, R]`` or ``[T, H, R]`` (last dim contiguous) in place by ``cos, sin [T, R/2]``."""
    view = x if x.dim() == 3 else x.unsqueeze(1)
    tokens, heads, dims = view.shape
    if view.stride(2) != 1:
        raise ValueError(f"rotate_ needs a contiguous last dim, got strides {tuple(x.stride())}")
    if dims & (dims - 1) or dims < 2:
        raise ValueError(f"the rotation kernel needs a power-of-two rotary dim, got {dims}")
    if tokens:
        constants = rotate_constants(dims, heads, interleaved=interleaved)
        grid = (triton.cdiv(tokens, constants["BLOCK_T"]), triton.cdiv(heads, constants["BLOCK_H"]))
        _rotate_kernel[grid](view, cos.contiguous(), sin.contiguous(), tokens, heads, view.stride(0), view.stride(1), **constants)
    return x


def build_keys(kv: torch.Tensor, k_pe: torch.Tensor, nope: int) -> torch.Tensor:
    """``k [S, N, nope + R]`` from ``kv [S, N, >= nope]`` and ``k_pe [S, R]`` (last dims contiguous;
    ``nope`` and ``R`` powers of two)."""
    rows, heads, rope = kv.shape[0], kv.shape[1], k_pe.shape[1]
    if kv.stride(2) != 1 or k_pe.stride(1) != 1:
        raise ValueError(f"build_keys needs contiguous last dims, got strides {kv.stride()} and {k_pe.stride()}")
    if nope & (nope - 1) or rope & (rope - 1):
        raise ValueError(f"the key kernel needs power-of-two nope and rope dims, got {nope} and {rope}")
    k = kv.new_empty(rows, heads, nope + rope)
    if rows:
        constants = keys_constants(nope, rope, heads)
        grid = (triton.cdiv(rows, constants["BLOCK_T"]), triton.cdiv(heads, constants["BLOCK_H"]))
        _keys_kernel[grid](kv, k_pe, k, rows, heads, kv.stride(0), kv.stride(1), k_pe.stride(0), **constants)
    return k


def rotate_constants(rotary_dim: int, heads: int, *, interleaved: bool) -> dict:
    """The rotation kernel's compile-time arguments for ``heads`` heads of ``rotary_dim`` values."""
    return {"HALF": rotary_dim // 2, **_blocks(rotary_dim, heads), "INTERLEAVED": interleaved}


def keys_constants(nope: int, rope: int, heads: int) -> dict:
    """The key kernel's compile-time arguments for ``heads`` heads of ``nope + rope`` values."""
    return {"NOPE": nope, "ROPE": rope, **_blocks(nope + rope, heads)}


def _blocks(values_per_head: int, heads: int) -> dict:
    """``BLOCK_T`` rows x ``BLOCK_H`` heads, powers of two, about :data:`VALUES_PER_PROGRAM` values."""
    fits = 1 << (max(1, VALUES_PER_PROGRAM // values_per_head).bit_length() - 1)
    block_h = min(triton.next_power_of_2(heads), fits)
    return {"BLOCK_T": fits // block_h, "BLOCK_H": block_h}
