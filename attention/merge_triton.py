"""Triton kernels behind ``attention.merge`` (formulas and conventions there).

One program handles a tile of BLOCK_T tokens x one head x the whole head dim;
LSEs are read through their strides (``[H, T]`` views of ``[T, H]`` storage
work), outputs need a contiguous last dim. Offsets are 64-bit.

The merged LSE is never written over an input LSE. Triton loads each LSE twice,
in two register layouts (one for the output tile's weights, one for the LSE
store), so the warps of one program read a token's LSE at different times; with
the output LSE on the same memory, one warp could store the merged LSE before
another read the input, and weight that token's output with the wrong LSE
(seen on H200 with FlashInfer's ``[T, H]`` LSE merged in place: one head of two
adjacent tokens off by up to 30% in 9 of 10 runs at 8K tokens x 128 heads). An
output LSE that shares memory with an input is written to a temporary and
copied back. The output tile is read and written in one layout, by the same
threads, so it may be an input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sanitize(lse):
    # +inf and NaN mean "no keys": treat them as -inf.
    return tl.where((lse != lse) | (lse == float("inf")), float("-inf"), lse)


@triton.jit
def _tile(T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's head, token offsets, dim offsets and masks (64-bit offsets)."""
    h = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < T
    return h, t, d, t_ok, t_ok[:, None] & (d < D)[None, :]


# Triton compiles a kernel again for each new pattern of its integer arguments (== 1, divisible by 16):
# the token count and the strides that follow it vary with every batch, so they are not specialized on
# (one compile, in the warm-up, instead of one per pattern in the first requests: seconds each on H200,
# benchmarks/results/2026-11-23-h200-first-batches-*.json)
VARYING_TWO = ["T", "out_lse_sh", "p_lse_sh", "s_lse_sh"]
VARYING_MANY = ["T", "o_sn", "out_lse_sh", "lse_sn", "lse_sh"]


@triton.jit(do_not_specialize=VARYING_TWO)
def _merge_two_kernel(
    out_ptr, out_lse_ptr, p_ptr, p_lse_ptr, s_ptr, s_lse_ptr,
    T, D,
    out_st, out_sh, p_st, p_sh, s_st, s_sh,
    out_lse_sh, out_lse_st, p_lse_sh, p_lse_st, s_lse_sh, s_lse_st,
    HAS_OUT_LSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    h, t, d, t_ok, tile_ok = _tile(T, D, BLOCK_T, BLOCK_D)

    p_lse = _sanitize(tl.load(p_lse_ptr + h * p_lse_sh + t * p_lse_st, mask=t_ok, other=float("-inf")))
    s_lse = _sanitize(tl.load(s_lse_ptr + h * s_lse_sh + t * s_lse_st, mask=t_ok, other=float("-inf")))
    m = tl.maximum(p_lse, s_lse)
    m = tl.where(m == float("-inf"), 0.0, m)
    p_e = tl.exp(p_lse - m)
    s_e = tl.exp(s_lse - m)
    total = p_e + s_e
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    p_w = (p_e * inv)[:, None]
    s_w = (s_e * inv)[:, None]

    p_o = tl.load(p_ptr + t[:, None] * p_st + h * p_sh + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    s_o = tl.load(s_ptr + t[:, None] * s_st + h * s_sh + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    o = tl.where(p_w > 0, p_o * p_w, 0.0) + tl.where(s_w > 0, s_o * s_w, 0.0)
    tl.store(out_ptr + t[:, None] * out_st + h * out_sh + d[None, :], o.to(out_ptr.dtype.element_ty), mask=tile_ok)
    if HAS_OUT_LSE:
        tl.store(out_lse_ptr + h * out_lse_sh + t * out_lse_st, tl.log(total) + m, mask=t_ok)


@triton.jit(do_not_specialize=VARYING_MANY)
def _merge_many_kernel(
    out_ptr, out_lse_ptr, o_ptr, lse_ptr,
    N, T, D,
    out_st, out_sh, o_sn, o_st, o_sh,
    out_lse_sh, out_lse_st, lse_sn, lse_sh, lse_st,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    h, t, d, t_ok, tile_ok = _tile(T, D, BLOCK_T, BLOCK_D)
    lse_base = lse_ptr + h * lse_sh + t * lse_st

    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    for n in range(N):
        m = tl.maximum(m, _sanitize(tl.load(lse_base + n * lse_sn, mask=t_ok, other=float("-inf"))))
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((BLOCK_T,), tl.float32)
    for n in range(N):
        total += tl.exp(_sanitize(tl.load(lse_base + n * lse_sn, mask=t_ok, other=float("-inf"))) - m)
    inv = tl.where(total > 0, 1.0 / total, 0.0)

    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for n in range(N):
        lse = _sanitize(tl.load(lse_base + n * lse_sn, mask=t_ok, other=float("-inf")))
        w = (tl.exp(lse - m) * inv)[:, None]
        o = tl.load(o_ptr + n * o_sn + t[:, None] * o_st + h * o_sh + d[None, :], mask=tile_ok, other=0.0)
        acc += tl.where(w > 0, o.to(tl.float32) * w, 0.0)
    tl.store(out_ptr + t[:, None] * out_st + h * out_sh + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(out_lse_ptr + h * out_lse_sh + t * out_lse_st, tl.log(total) + m, mask=t_ok)


def _tiles(output: torch.Tensor) -> tuple[tuple[int, int], int, int]:
    tokens, heads, dim = output.shape
    block_d = triton.next_power_of_2(dim)
    block_t = max(1, min(64, 4096 // block_d))
    return (triton.cdiv(tokens, block_t), heads), block_t, block_d


def _last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError(f"the Triton merge needs a contiguous head dim, got strides {tensor.stride()}")


def _lse_destination(output_lse: torch.Tensor | None, input_lses: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """Where a kernel writes the merged LSE: ``output_lse``, or a temporary (copied back by the caller)
    when it lies in the same storage as an input LSE (views of one buffer count)."""
    if output_lse is None:
        return None
    base = output_lse.untyped_storage().data_ptr()
    if all(lse.untyped_storage().data_ptr() != base for lse in input_lses):
        return output_lse
    return torch.empty(output_lse.shape, dtype=torch.float32, device=output_lse.device)


def merge_two(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None,
) -> None:
    _last_dim_contiguous(output, prefix_output, suffix_output)
    merged_lse = _lse_destination(output_lse, (prefix_lse, suffix_lse))
    grid, block_t, block_d = _tiles(output)
    lse_out = merged_lse if merged_lse is not None else prefix_lse  # not written when absent
    _merge_two_kernel[grid](
        output, lse_out, prefix_output, prefix_lse, suffix_output, suffix_lse,
        output.shape[0], output.shape[2],
        output.stride(0), output.stride(1), prefix_output.stride(0), prefix_output.stride(1),
        suffix_output.stride(0), suffix_output.stride(1),
        lse_out.stride(0), lse_out.stride(1), prefix_lse.stride(0), prefix_lse.stride(1),
        suffix_lse.stride(0), suffix_lse.stride(1),
        HAS_OUT_LSE=output_lse is not None, BLOCK_T=block_t, BLOCK_D=block_d,
    )  # fmt: skip
    if merged_lse is not output_lse:
        output_lse.copy_(merged_lse)


def merge_many(
    output: torch.Tensor, output_lse: torch.Tensor, outputs: torch.Tensor, lses: torch.Tensor
) -> None:
    _last_dim_contiguous(output, outputs)
    merged_lse = _lse_destination(output_lse, (lses,))
    grid, block_t, block_d = _tiles(output)
    _merge_many_kernel[grid](
        output, merged_lse, outputs, lses,
        outputs.shape[0], output.shape[0], output.shape[2],
        output.stride(0), output.stride(1), outputs.stride(0), outputs.stride(1), outputs.stride(2),
        merged_lse.stride(0), merged_lse.stride(1), lses.stride(0), lses.stride(1), lses.stride(2),
        BLOCK_T=block_t, BLOCK_D=block_d,
    )  # fmt: skip
    if merged_lse is not output_lse:
        output_lse.copy_(merged_lse)
