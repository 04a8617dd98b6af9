"""The routed experts' FP8 GEMMs on DeepGEMM, with DeepSeek's own weight blocks (``PoolConfig.moe_gemm = "deep_gemm"``).

torch's grouped FP8 GEMM takes one scale per row of each operand on SM90, so ``workers.moe.Experts``
otherwise requantizes the checkpoint's 128x128 weight blocks per output row at load (one more FP8
rounding). DeepGEMM's grouped GEMM, ``m_grouped_fp8_gemm_nt_contiguous`` (the kernel of vLLM's DEEPGEMM
MoE backend), takes the blocks as they are and 1x128 activation scales: DeepSeek's recipe, as the
dense FP8 linears run it (``workers.fp8``). It is a library of its own, the package ``deep_gemm``
(github.com/deepseek-ai/DeepGEMM, or the copy vLLM's wheel carries in ``vllm/third_party``);
nothing here is a kernel of ours.

Its contiguous layout: the pairs' rows sorted by expert, each expert's first row on a multiple of
DeepGEMM's M alignment (``get_mk_alignment_for_contiguous_layout()``, its largest BLOCK_M), and
``m_indices [M]`` naming each row's expert, -1 for the padding (blocks of padding are skipped).
:func:`contiguous_layout` places the ``P`` pairs there without a host sync, sized for the worst case
``P + E * (alignment - 1)`` rows, as vLLM sizes it. Per call (``E`` experts here, hidden ``H``,
expert width ``I``; :func:`experts_forward`)::

    up   = A x gate_up^T          A [M, H] FP8, scales [M, H/128]; gate_up [E, 2I, H], scales [E, 2I/128, H/128]
    h    = quantize_1x128(silu(up[:, :I]) * up[:, I:] * w)          (w: each pair's routing weight)
    down = h x down_proj^T        down_proj [E, H, I], scales [E, H/128, I/128]

Activation scales go in as DeepGEMM takes them on SM90, float32 and M-major (``scale [groups, M]``
transposed, as ``workers.fp8.quantize_activations`` writes them). The pairs are copied into the
padded rows and their results out of them: two copies a call that placing the rows there from the
start (the dispatch, ``MoE._compute``'s quantization) would save.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from workers.fp8 import BLOCK, FP8, quantize_activations


@functools.cache
def load() -> ModuleType:
    """DeepGEMM (the package ``deep_gemm``); ``RuntimeError`` saying how to get it where it is missing."""
    try:
        return importlib.import_module("deep_gemm")
    except ImportError as exc:
        raise RuntimeError(
            f"moe_gemm 'deep_gemm' needs DeepGEMM, the package deep_gemm (build it from github.com/deepseek-ai/DeepGEMM, "
            f"or put the copy in vLLM's wheel, vllm/third_party/deep_gemm, on the path as deep_gemm): {exc}. Or use moe_gemm 'torch'"
        ) from exc


def contiguous_layout(offs: torch.Tensor, pairs: int, alignment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pairs`` rows sorted by expert (``offs [E]`` int32: where each expert's rows end) placed in
    DeepGEMM's contiguous layout: ``(at [P] int64, m_indices [M] int32)``, row ``p`` at ``at[p]``,
    ``M = ceil((P + E * (alignment - 1)) / alignment) * alignment`` rows; no host sync."""
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + alignment - 1) // alignment * alignment
    index = torch.arange(pairs, device=offs.device)
    expert = torch.searchsorted(ends, index, right=True)
    at = (torch.cumsum(padded, 0) - padded)[expert] + index - (ends - counts)[expert]
    rows = -(-(pairs + offs.numel() * (alignment - 1)) // alignment) * alignment
    m_indices = torch.full((rows,), -1, dtype=torch.int32, device=offs.device)
    m_indices[at] = expert.to(torch.int32)
    return at, m_indices


def place(rows: list[torch.Tensor], offs: torch.Tensor, alignment: int):
    """The pairs' FP8 rows ``[q [P, H] bytes, scale [P, H/128]]`` copied into the contiguous layout:
    ``(a [M, H] FP8, a_scale [M, H/128] M-major, at, m_indices)``."""
    q, scale = rows
    at, m_indices = contiguous_layout(offs, q.shape[0], alignment)
    total = m_indices.numel()
    a = q.new_empty(total, q.shape[1]).index_copy_(0, at, q).view(FP8)
    a_scale = scale.new_zeros(scale.shape[1], total).index_copy_(1, at, scale.t()).t()
    return a, a_scale, at, m_indices


def grouped_gemm(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, m_indices: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` FP8 (1x128 scales ``[M, K/128]`` M-major) times each row's expert of ``weight [E, N, K]``
    (128x128 block scales), the rows in the contiguous layout ``m_indices``: ``[M, N]`` bfloat16."""
    out = torch.empty(m_indices.numel(), weight.shape[1], dtype=torch.bfloat16, device=x.device)
    load().m_grouped_fp8_gemm_nt_contiguous((x, x_scale), (weight, weight_scale), out, m_indices)
    return out


def experts_forward(experts, rows: list[torch.Tensor], weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``experts`` (``workers.moe.Experts`` holding DeepSeek's blocks) on ``rows`` of ``P`` pairs sorted by
    expert (as its ``prepare`` makes them), times the pairs' ``weights [P]`` -> ``[P, H]`` bfloat16."""
    a, a_scale, at, m_indices = place(rows, offs, load().get_mk_alignment_for_contiguous_layout())
    up = grouped_gemm(a, a_scale, experts.gate_up_proj, experts.gate_up_proj_scale, m_indices)
    row_weight = weights.new_zeros(m_indices.numel(), dtype=torch.float32).index_copy_(0, at, weights.float())
    h, h_scale = quantize_activations(up, BLOCK, silu_mul=True, row_weight=row_weight)
    return grouped_gemm(h, h_scale.t(), experts.down_proj, experts.down_proj_scale, m_indices).index_select(0, at)
