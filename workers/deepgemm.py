"""FP8 GEMMs on DeepGEMM, with DeepSeek's own weight blocks (``PoolConfig.fp8_gemm = "deep_gemm"``).

DeepGEMM (the package ``deep_gemm``: github.com/deepseek-ai/DeepGEMM, or the copy vLLM's wheel carries
in ``vllm/third_party``) runs DeepSeek's recipe (1x128 activation scales, the checkpoint's 128x128
weight blocks) on SM90, as vLLM runs DeepSeek's linears and its DEEPGEMM MoE backend; nothing here is
a kernel of ours. On one H200 (torch 2.11, DeepSeek-V3's shapes at 16K tokens,
``benchmarks/results/2026-11-28-h200-grouped-gemm-candidates.json``) its dense GEMM ran the linear
layers at 1,059-1,405 TF/s against 810-1,307 for torch's block-scaled ``_scaled_mm`` (a dense layer's
seven GEMMs 10% faster), and its grouped GEMM the routed experts at 985 TF/s against 807 for torch's
row-wise ``_scaled_grouped_mm``, which also needs the weight blocks requantized per row (one more
FP8 rounding).

- :class:`DeepGEMMLinear`: an :class:`workers.fp8.FP8Linear` run by ``fp8_gemm_nt``, for the shapes
  vLLM also gives it (:func:`whole_blocks`; the others keep torch's GEMM, the same recipe).
- The routed experts (``workers.moe.Experts`` with ``gemm="deep_gemm"``): ``m_grouped_fp8_gemm_nt_contiguous``
  on DeepGEMM's contiguous layout (:class:`Layout`): the pairs' rows sorted by expert, each expert's
  first row on a multiple of DeepGEMM's M alignment (``get_mk_alignment_for_contiguous_layout()``, its
  largest BLOCK_M), and ``m_indices [M]`` naming each row's expert, -1 for the padding (blocks of
  padding are skipped; padding rows inside an expert's last block are computed and never read).
  The layout is sized for the worst case ``P + E * (alignment - 1)`` rows, as vLLM sizes it, so it
  is built without a host sync. Where the MoE layer quantizes the tokens itself it writes each one
  straight into its pairs' rows of the layout and sums the results from there
  (``workers.moe.MoE._compute``); rows that arrive in the pairs' order (an expert-parallel dispatch)
  are copied in and their results out (:func:`experts_forward`). Per call (``E`` experts here,
  hidden ``H``, expert width ``I``)::

    up   = A x gate_up^T          A [M, H] FP8, scales [M, H/128]; gate_up [E, 2I, H], scales [E, 2I/128, H/128]
    h    = quantize_1x128(silu(up[:, :I]) * up[:, I:] * w)          (w: each pair's routing weight)
    down = h x down_proj^T        down_proj [E, H, I], scales [E, H/128, I/128]

Activation scales go in as DeepGEMM takes them on SM90, float32 and M-major (``scale [groups, M]``
transposed, as ``workers.fp8.quantize_activations`` writes them).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from workers.fp8 import BLOCK, FP8, FP8Linear, quantize_activations


@functools.cache
def load() -> ModuleType:
    """DeepGEMM (the package ``deep_gemm``); ``RuntimeError`` saying how to get it where it is missing."""
    try:
        return importlib.import_module("deep_gemm")
    except ImportError as exc:
        raise RuntimeError(
            f"fp8_gemm 'deep_gemm' needs DeepGEMM, the package deep_gemm (build it from github.com/deepseek-ai/DeepGEMM, "
            f"or put the copy in vLLM's wheel, vllm/third_party/deep_gemm, on the path as deep_gemm): {exc}. Or use fp8_gemm 'torch'"
        ) from exc


def whole_blocks(*sizes: int) -> bool:
    """Whether DeepGEMM takes these dimensions: each a whole number of 128-wide blocks (a linear layer's
    in and out features, as vLLM gives it its linears; the experts' hidden size and width)."""
    return all(size % BLOCK == 0 for size in sizes)


# ---- dense linear layers ------------------------------------------------------------------------------


class DeepGEMMLinear(FP8Linear):
    """:class:`workers.fp8.FP8Linear` (the same weights, scales and activation quantization) whose GEMM
    is DeepGEMM's ``fp8_gemm_nt``, bfloat16 out."""

    @classmethod
    def check_shape(cls, in_features: int, out_features: int, out_dtype: torch.dtype) -> None:
        if out_dtype != torch.bfloat16 or not whole_blocks(in_features, out_features):
            raise ValueError(f"DeepGEMMLinear of {in_features} -> {out_features}, {out_dtype}: DeepGEMM writes bfloat16 and needs whole 128x128 blocks")

    def gemm(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.out_features, dtype=torch.bfloat16, device=q.device)
        load().fp8_gemm_nt((q, scale), (self.weight, self.weight_scale_inv), out)
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + ", DeepGEMM"


# ---- the routed experts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """``P`` pairs sorted by expert in DeepGEMM's contiguous layout: ``at [P]`` (int64, each pair's row)
    and ``m_indices [M]`` (int32, each row's expert, -1: padding)."""

    at: torch.Tensor
    m_indices: torch.Tensor

    @classmethod
    def of(cls, offs: torch.Tensor, pairs: int, alignment: int | None = None) -> Layout:
        """The layout of ``pairs`` rows sorted by expert (``offs [E]`` int32: where each expert's rows end),
        ``M = ceil((P + E * (alignment - 1)) / alignment) * alignment`` rows (``alignment``: DeepGEMM's); no host sync."""
        alignment = alignment or load().get_mk_alignment_for_contiguous_layout()
        ends = offs.long()
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        padded = (counts + alignment - 1) // alignment * alignment
        index = torch.arange(pairs, device=offs.device)
        expert = torch.searchsorted(ends, index, right=True)
        at = (torch.cumsum(padded, 0) - padded)[expert] + index - (ends - counts)[expert]
        rows = -(-(pairs + offs.numel() * (alignment - 1)) // alignment) * alignment
        m_indices = torch.full((rows,), -1, dtype=torch.int32, device=offs.device)
        m_indices[at] = expert.to(torch.int32)
        return cls(at, m_indices)

    @property
    def rows(self) -> int:
        return self.m_indices.numel()

    def place(self, where: torch.Tensor) -> torch.Tensor:
        """Pair indices (any shape, -1: none) -> their rows in the layout (-1 kept)."""
        return torch.where(where >= 0, self.at[where.clamp(min=0)], -1)

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """``values [P]`` (one per pair) -> ``[M]`` float32, zeros in the padding."""
        return values.new_zeros(self.rows, dtype=torch.float32).index_copy_(0, self.at, values.float())

    def gather(self, rows: list[torch.Tensor], pair_rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """FP8 rows ``[q [R, H] bytes, scale [R, H/128] M-major]`` copied into the layout: pair ``p`` reads
        row ``pair_rows[p]`` (default: row ``p``), the padding row 0 (finite values, never used); the
        scales stay M-major."""
        q, scale = rows
        pair_rows = torch.arange(self.at.numel(), device=self.at.device) if pair_rows is None else pair_rows
        source = pair_rows.new_zeros(self.rows).index_copy_(0, self.at, pair_rows)
        return [q.index_select(0, source), scale.t().index_select(1, source).t()]


def grouped_gemm(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, m_indices: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` FP8 (1x128 scales ``[M, K/128]`` M-major) times each row's expert of ``weight [E, N, K]``
    (128x128 block scales), the rows in the contiguous layout ``m_indices``: ``[M, N]`` bfloat16."""
    out = torch.empty(m_indices.numel(), weight.shape[1], dtype=torch.bfloat16, device=x.device)
    load().m_grouped_fp8_gemm_nt_contiguous((x, x_scale), (weight, weight_scale), out, m_indices)
    return out


def in_layout(rows: list[torch.Tensor], offs: torch.Tensor, layout: Layout | None = None) -> tuple[list[torch.Tensor], Layout]:
    """FP8 ``rows`` of pairs sorted by expert (``offs``) in DeepGEMM's layout: as they are where ``layout``
    holds them already, else gathered from the pairs' order into a new one."""
    if layout is None:
        layout = Layout.of(offs, rows[0].shape[0])
        rows = layout.gather(rows)
    return rows, layout


def experts_forward(experts, rows: list[torch.Tensor], weights: torch.Tensor, offs: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
    """``experts`` (``workers.moe.Experts`` holding DeepSeek's blocks) on FP8 ``rows`` (``[q bytes, scale
    M-major]``) of ``P`` pairs sorted by expert, times the pairs' ``weights [P]``. With ``layout`` the
    rows are already in it and the result is ``[M, H]`` in it; without, they are in the pairs' order,
    gathered into a layout and the result ``[P, H]`` taken back out of it."""
    placed = layout is not None
    (q, scale), layout = in_layout(rows, offs, layout)
    up = grouped_gemm(q.view(FP8), scale, experts.gate_up_proj, experts.gate_up_proj_scale, layout.m_indices)
    h, h_scale = quantize_activations(up, BLOCK, silu_mul=True, row_weight=layout.spread(weights))
    down = grouped_gemm(h, h_scale.t(), experts.down_proj, experts.down_proj_scale, layout.m_indices)
    return down if placed else down.index_select(0, layout.at)
