"""CPU stand-ins for torch's CUDA-only FP8 GEMMs, so the FP8 code paths run in CI.

Each checks the operand layouts torch requires (as its error messages state them on an H200) and
computes the documented result in float32 from the dequantized operands:

- ``_scaled_mm`` with DeepSeek's recipe: ``a [M, K]`` row-major with 1x128 scales ``[M, K/128]``
  outer-dim-major (stride ``(1, M)``, so ``M % 4 == 0``); ``b [K, N]`` column-major with 128x128 scales
  ``[K/128, ceil(N/128)]`` inner-dim-major with an outer stride of exactly ``K/128`` (torch's check),
  which must be 16-byte aligned when ``N > 128`` (cuBLAS computes wrong results otherwise, measured:
  ``workers.fp8.block_gemm_shape_ok``);
- ``_scaled_grouped_mm`` row-wise: ``a [P, K]`` with scales ``[P]``; ``b [E, K, N]`` with ``stride(1) == 1``
  ("transposed") and scales ``[E, N]``; ``offs [E]`` int32, the end of each group's rows;
- DeepGEMM (:data:`deep_gemm`, for ``workers.deepgemm``): ``fp8_gemm_nt``, ``a = (q [M, K], scale [M, K/128]
  float32 M-major, M % 4 == 0: TMA-aligned)``, ``b = (w [N, K], scale [N/128, K/128])`` with whole
  blocks, ``d [M, N]`` bfloat16; and ``m_grouped_fp8_gemm_nt_contiguous``, the same ``a``,
  ``b = (w [G, N, K], scale [G, N/128, K/128])``, ``d [M, N]``, ``m_indices [M]`` int32 (-1: padding,
  left unwritten), every group's rows starting on a multiple of the M alignment, as its contiguous
  layout asks.
"""

import types

import pytest
import torch

FP8 = torch.float8_e4m3fn


def _block_weight(w, scale_w):
    """``w [N, K]`` FP8 times its 128x128 block scales ``[ceil(N/128), K/128]``, float32."""
    n, k = w.shape
    return w.float() * scale_w.repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]


def scaled_mm(a, b, scale_a, scale_b, out_dtype, **_):
    m, k = a.shape
    n = b.shape[1]
    assert a.dtype == b.dtype == FP8 and a.stride(1) == 1 and b.stride(0) == 1, "a row-major, b column-major, both FP8"
    assert m % 4 == 0 and scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    k_blocks, n_blocks = k // 128, -(-n // 128)
    assert scale_b.shape == (k_blocks, n_blocks) and scale_b.stride(0) == 1, (scale_b.shape, scale_b.stride())
    assert n_blocks == 1 or (scale_b.stride(1) == k_blocks and k_blocks % 4 == 0), (scale_b.shape, scale_b.stride())
    a_full = a.float() * scale_a.repeat_interleave(128, dim=1)
    return (a_full @ _block_weight(b.t(), scale_b.t()).t()).to(out_dtype)


def scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, **_):
    p, k = a.shape
    e, _, n = b.shape
    assert a.dtype == b.dtype == FP8 and b.stride(1) == 1, "mat2 must be transposed"
    assert scale_a.shape == (p,) and scale_a.is_contiguous() and scale_b.shape == (e, n) and scale_b.is_contiguous()
    assert offs.dtype == torch.int32 and offs.shape == (e,)
    out = torch.zeros(p, n, dtype=out_dtype)
    start = 0
    for group, end in enumerate(offs.tolist()):
        rows = slice(start, end)
        out[rows] = ((a[rows].float() * scale_a[rows, None]) @ (b[group].float() * scale_b[group][None, :])).to(out_dtype)
        start = end
    return out


M_ALIGNMENT = 128  # DeepGEMM's on SM90 (its largest BLOCK_M)


def fp8_gemm_nt(a, b, d):
    (q, scale_a), (w, scale_w) = a, b
    m, k = q.shape
    n = w.shape[0]
    assert q.dtype == w.dtype == FP8 and q.stride(1) == 1 and w.is_contiguous(), "FP8 operands, K-major"
    assert k % 128 == 0 and n % 128 == 0, f"whole 128x128 blocks: N {n}, K {k}"
    assert m % 4 == 0 and scale_a.dtype == torch.float32 and scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    assert scale_w.shape == (n // 128, k // 128) and scale_w.dtype == torch.float32 and scale_w.is_contiguous()
    assert d.shape == (m, n) and d.dtype == torch.bfloat16
    d.copy_(((q.float() * scale_a.repeat_interleave(128, dim=1)) @ _block_weight(w, scale_w).t()).to(d.dtype))


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices):
    (q, scale_a), (w, scale_w) = a, b
    m, k = q.shape
    groups, n, _ = w.shape
    assert q.dtype == w.dtype == FP8 and q.stride(1) == 1 and w.is_contiguous(), "FP8 operands, K-major"
    assert scale_a.dtype == torch.float32 and scale_a.shape == (m, -(-k // 128)) and scale_a.stride(0) == 1, (scale_a.shape, scale_a.stride())
    assert scale_w.shape == (groups, -(-n // 128), -(-k // 128)) and scale_w.dtype == torch.float32
    assert d.shape == (m, n) and d.dtype == torch.bfloat16 and m_indices.shape == (m,) and m_indices.dtype == torch.int32
    assert m % M_ALIGNMENT == 0, f"M = {m} is not a multiple of the M alignment {M_ALIGNMENT}"
    ids = m_indices.tolist()
    for row, group in enumerate(ids):
        if group >= 0 and (row == 0 or ids[row - 1] != group):
            assert row % M_ALIGNMENT == 0, f"group {group} starts at row {row}, not on the M alignment"
    for group in range(groups):
        rows = torch.nonzero(m_indices == group).squeeze(1)
        a_full = q[rows].float() * scale_a[rows].repeat_interleave(128, dim=1)[:, :k]
        w_full = _block_weight(w[group], scale_w[group])
        d[rows] = (a_full @ w_full.t()).to(d.dtype)


deep_gemm = types.SimpleNamespace(  # the part of DeepGEMM's interface workers.deepgemm uses
    __name__="deep_gemm (fp8_emulation)",
    fp8_gemm_nt=fp8_gemm_nt,
    m_grouped_fp8_gemm_nt_contiguous=m_grouped_fp8_gemm_nt_contiguous,
    get_mk_alignment_for_contiguous_layout=lambda: M_ALIGNMENT,
)


def install(monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Put the stand-ins in place of torch's and of DeepGEMM (``workers.deepgemm.load``), through
    ``monkeypatch``, or for good in a child process."""
    from workers import deepgemm

    for owner, name, fn in ((torch, "_scaled_mm", scaled_mm), (torch, "_scaled_grouped_mm", scaled_grouped_mm),
                            (deepgemm, "load", lambda: deep_gemm)):  # fmt: skip
        if monkeypatch is not None:
            monkeypatch.setattr(owner, name, fn)
        else:
            setattr(owner, name, fn)
