"""CPU stand-ins for torch's CUDA-only FP8 GEMMs, so the FP8 code paths run in CI.

Each checks the operand layouts torch requires (as its error messages state them on an H200) and
computes the documented result in float32 from the dequantized operands:

- ``_scaled_mm`` with DeepSeek's recipe: ``a [M, K]`` row-major with 1x128 scales ``[M, K/128]``
  outer-dim-major (stride ``(1, M)``, so ``M % 4 == 0``); ``b [K, N]`` column-major with 128x128 scales
  ``[K/128, ceil(N/128)]`` inner-dim-major with an outer stride of exactly ``K/128`` (torch's check),
  which must be 16-byte aligned when ``N > 128`` (cuBLAS computes wrong results otherwise, measured:
  ``workers.fp8.block_gemm_shape_ok``);
- ``_scaled_grouped_mm`` row-wise: ``a [P, K]`` with scales ``[P]``; ``b [E, K, N]`` with ``stride(1) == 1``
  ("transposed") and scales ``[E, N]``; ``offs [E]`` int32, the end of each group's rows.
"""

import pytest
import torch

FP8 = torch.float8_e4m3fn


def scaled_mm(a, b, scale_a, scale_b, out_dtype, **_):
    m, k = a.shape
    n = b.shape[1]
    assert a.dtype == b.dtype == FP8 and a.stride(1) == 1 and b.stride(0) == 1, "a row-major, b column-major, both FP8"
    assert m % 4 == 0 and scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    k_blocks, n_blocks = k // 128, -(-n // 128)
    assert scale_b.shape == (k_blocks, n_blocks) and scale_b.stride(0) == 1, (scale_b.shape, scale_b.stride())
    assert n_blocks == 1 or (scale_b.stride(1) == k_blocks and k_blocks % 4 == 0), (scale_b.shape, scale_b.stride())
    a_full = a.float() * scale_a.repeat_interleave(128, dim=1)
    w_scale = scale_b.t().repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)  # [N, K]
    return (a_full @ (b.float() * w_scale.t())).to(out_dtype)


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


def install(monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Put the stand-ins in place of torch's (through ``monkeypatch``, or for good in a child process)."""
    for name, fn in (("_scaled_mm", scaled_mm), ("_scaled_grouped_mm", scaled_grouped_mm)):
        if monkeypatch is not None:
            monkeypatch.setattr(torch, name, fn)
        else:
            setattr(torch, name, fn)
