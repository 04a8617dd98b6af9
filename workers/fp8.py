"""FP8 weights in DeepSeek's block format, and the FP8 GEMMs that run them on Hopper.

Checkpoint format (``configs.model.FP8Config``): a weight ``W [N, K]`` is stored as
``q = float8_e4m3fn`` values and ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` float32, one scale
per 128 x 128 block (edge blocks partial), so that ``W[n, k] = q[n, k] * scale[n // 128, k // 128]``.

At run time (SM90, torch's block-scaled ``_scaled_mm``) activations are quantized per token per 128
columns, ``x[m, g] = qx[m, g] * sx[m, g]`` with ``sx = max|x[m, g*128:(g+1)*128]| / 448``, and

    y[m, n] = sum_g sx[m, g] * scale[n // 128, g] * (qx[m, g-block] . q[n, g-block])   (fp32 accumulate)

which is :class:`FP8Linear` (torch's block-scaled ``_scaled_mm``; ``workers.deepgemm.DeepGEMMLinear``
runs the same on DeepGEMM). Routed experts run through torch's grouped FP8 GEMM, which on SM90 only
takes one scale per row of each operand: their weights are requantized at load to one scale per
output row (:func:`requantize_rows`; one more FP8 rounding of the checkpoint's values) and their
activations quantized per token (see ``workers.moe``), or through DeepGEMM's grouped GEMM on the
checkpoint's blocks (``workers.deepgemm``). Everywhere else (CPU, other GPUs, another
compute dtype) FP8 weights are dequantized to the compute dtype at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attention.kernel_choice import use_triton
from attention.mla import RMSNorm

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
EPS = 1e-10  # smallest amax used for a scale: an all-zero group quantizes to zeros, never NaN
ROW_ALIGN = 4  # the linears' activation rows padded to a multiple of this: their M-major scales need M % 4 == 0


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether torch runs DeepSeek's block-scaled FP8 GEMM here (SM90: torch restricts the 1x128 /
    128x128 recipes to it)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(q [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] float32)``, DeepSeek's recipe."""
    n, k = w.shape
    padded = nn.functional.pad(w.float(), (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=EPS) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:n, :k].to(FP8)
    return q, scale


def block_dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, row_start: int = 0, col_start: int = 0
) -> torch.Tensor:
    """``q * scale`` in ``dtype`` for ``q``, the rows and columns of a block-quantized tensor that start at
    ``(row_start, col_start)``; ``scale`` holds the blocks from ``(row_start // 128, col_start // 128)`` on."""
    rows = scale.repeat_interleave(BLOCK, dim=0)[row_start % BLOCK :][: q.shape[0]]
    full = rows.repeat_interleave(BLOCK, dim=1)[:, col_start % BLOCK :][:, : q.shape[1]]
    return (q.float() * full).to(dtype)


def requantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``w [..., N, K]`` (any float dtype) as FP8 with one scale per output row:
    ``(q [..., N, K], scale [..., N] float32)``, ``w ~ q * scale[..., None]``."""
    scale = w.float().abs().amax(dim=-1).clamp(min=EPS) / FP8_MAX
    return (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activations(
    x: torch.Tensor,
    group: int,
    *,
    pad_rows_to: int = 1,
    silu_mul: bool = False,
    row_weight: torch.Tensor | None = None,
    scatter_to: torch.Tensor | None = None,
    scatter_rows: int = 0,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` to FP8 per row per ``group`` columns (``group == K``: one scale per row).

    Returns ``q [M', K]`` and ``scale [K / group, M']`` float32 with ``M' = M`` rounded up to a
    multiple of ``pad_rows_to`` (padding rows are zeros): ``scale.t()`` is the column-major
    ``[M', groups]`` layout torch's block-scaled GEMM takes, ``scale[0]`` the per-row scales of the
    grouped GEMM. ``silu_mul``: ``x`` is ``[M, 2K]`` and ``silu(x[:, :K]) * x[:, K:]`` is quantized;
    ``row_weight [M]`` multiplies each row first. ``scatter_to [M, S]``: each row is written to the
    output rows it names (-1: none) instead, ``M' = scatter_rows`` (every output row must be named
    once: a token's row copied to its experts' places, quantized once). On CUDA a fused Triton
    kernel runs (``workers.fp8_triton``), elsewhere torch ops; ``impl`` forces one ("triton" on CPU
    tensors needs ``TRITON_INTERPRET=1``).
    """
    k = x.shape[1] // 2 if silu_mul else x.shape[1]
    if k % group or (group % BLOCK and group != k):
        raise ValueError(f"quantization groups of {group} columns need K ({k}) to be a multiple, and 128 to divide {group}")
    if scatter_to is not None and (scatter_to.dim() != 2 or scatter_to.shape[0] != x.shape[0] or pad_rows_to != 1):
        raise ValueError(f"scatter_to must be [{x.shape[0]}, slots] and rows not padded, got {tuple(scatter_to.shape)}, pad {pad_rows_to}")
    rows = scatter_rows if scatter_to is not None else -(-x.shape[0] // pad_rows_to) * pad_rows_to
    if use_triton(impl, x, supported=group % BLOCK == 0):
        from workers.fp8_triton import quantize

        return quantize(
            x.contiguous(), group, rows, silu_mul=silu_mul, row_weight=row_weight, fp8_max=FP8_MAX, eps=EPS,
            scatter_to=None if scatter_to is None else scatter_to.contiguous(),
        )  # fmt: skip
    xf = x.float()
    if silu_mul:
        xf = nn.functional.silu(xf[:, :k]) * xf[:, k:]
    if row_weight is not None:
        xf = xf * row_weight.float()[:, None]
    if scatter_to is None:
        xf = nn.functional.pad(xf, (0, 0, 0, rows - x.shape[0]))
    groups = xf.view(xf.shape[0], k // group, group)
    scale = groups.abs().amax(dim=-1).clamp(min=EPS) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(xf.shape[0], k)
    if scatter_to is not None:
        named = scatter_to >= 0
        source = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(scatter_to)[named]
        q = q.view(torch.uint8).new_empty(rows, k).index_copy_(0, scatter_to[named], q.view(torch.uint8)[source]).view(FP8)
        scale = scale.new_empty(rows, scale.shape[1]).index_copy_(0, scatter_to[named], scale[source])
    return q, scale.new_empty(scale.shape[1], rows).copy_(scale.t())  # [groups, rows], strides (rows, 1) even for 1 group


@dataclass(frozen=True)
class FP8Rows:
    """Activation rows quantized once for the FP8 linears that read them (:class:`FP8RMSNorm`'s output):
    ``q [M', K]`` and ``scale [K / 128, M']`` as :func:`quantize_activations` returns them (``M'`` the
    ``rows`` rounded up to a multiple of :data:`ROW_ALIGN`), standing for a ``[rows, K]`` input."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the rows it stands for, as an input tensor's."""
        return self.rows, self.q.shape[1]


class FP8RMSNorm(RMSNorm):
    """``attention.mla.RMSNorm`` whose output is :class:`FP8Rows` for FP8 linears (every reader of it
    must be an :class:`FP8Linear` of its width): on CUDA the norm and the quantization in one pass
    (``attention.rms_norm_triton.rms_norm_fp8``), the rows' bf16 values never written, and quantized
    once for all readers; elsewhere the norm, then :func:`quantize_activations`. The same FP8 values
    and scales either way, up to the kernels' float32 order of operations."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, impl: str = "auto") -> FP8Rows:  # type: ignore[override]
        rows, width = x.shape
        padded = -(-rows // ROW_ALIGN) * ROW_ALIGN
        if use_triton(impl, x, supported=width % BLOCK == 0):
            from attention.rms_norm_triton import MAX_WIDTH, rms_norm_fp8

            if width <= MAX_WIDTH and x.stride(1) == 1:
                q, scale = rms_norm_fp8(x, self.weight, self.eps, residual, group=BLOCK, rows=padded, fp8_max=FP8_MAX, scale_eps=EPS)
                return FP8Rows(q, scale, rows)
        return FP8Rows(*quantize_activations(super().forward(x, residual), BLOCK, pad_rows_to=ROW_ALIGN), rows)


def block_gemm_shape_ok(in_features: int, out_features: int) -> bool:
    """Whether torch's block-scaled FP8 GEMM computes a weight of this shape right: ``K % 128 == 0``,
    ``N % 16 == 0`` and, with more than one 128-row block of ``N``, ``K % 512 == 0``. torch takes the
    weight scales ``[K/128, N/128]`` only with an outer stride of exactly ``K/128``, and cuBLAS reads them
    right only when that stride is 16-byte aligned: any other ``K`` is refused (a padded stride) or gives
    wrong results (the exact one). Measured on H200, torch 2.11:
    ``benchmarks/results/2026-11-23-h200-fp8-weight-scale-layout.json``."""
    return in_features % BLOCK == 0 and out_features % 16 == 0 and (out_features <= BLOCK or in_features % (4 * BLOCK) == 0)


class FP8Linear(nn.Module):
    """``y = x @ W.T`` with ``W`` kept in DeepSeek's FP8 block format (``weight``, ``weight_scale_inv``:
    the checkpoint's names), run as torch's block-scaled ``_scaled_mm`` (1x128 activation scales,
    128x128 weight scales) with a bf16 output. Needs SM90 and a shape :func:`block_gemm_shape_ok` allows."""

    def __init__(self, in_features: int, out_features: int, *, device=None, out_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.check_shape(in_features, out_features, out_dtype)
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        blocks = (-(-out_features // BLOCK), in_features // BLOCK)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(blocks, dtype=torch.float32, device=device), requires_grad=False)

    @classmethod
    def check_shape(cls, in_features: int, out_features: int, out_dtype: torch.dtype) -> None:
        """``ValueError`` where :meth:`gemm` cannot run this shape (the rule of the GEMM a subclass runs)."""
        if not block_gemm_shape_ok(in_features, out_features):
            raise ValueError(
                f"FP8Linear of {in_features} -> {out_features}: torch's block-scaled GEMM needs in_features % 128 == 0, "
                f"out_features % 16 == 0 and, for out_features > 128, in_features % 512 == 0"
            )

    def forward(self, x: torch.Tensor | FP8Rows, *, silu_mul: bool = False) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]``; ``silu_mul``: ``x`` is ``[..., 2K]`` and the input is
        ``silu(x[..., :K]) * x[..., K:]``, computed in the quantization pass. ``x`` may be rows already
        quantized (:class:`FP8Rows`, ``[M, K]``)."""
        if isinstance(x, FP8Rows):
            if x.q.shape[1] != self.in_features or silu_mul:
                raise ValueError(f"FP8Linear of {self.in_features} inputs got quantized rows of {x.q.shape[1]}" + (" with silu_mul" if silu_mul else ""))
            return self.gemm(x.q, x.scale.t())[: x.rows]
        shape = x.shape
        x2 = x.reshape(-1, self.in_features * (2 if silu_mul else 1))
        q, scale = quantize_activations(x2, BLOCK, pad_rows_to=ROW_ALIGN, silu_mul=silu_mul)
        return self.gemm(q, scale.t())[: x2.shape[0]].view(*shape[:-1], self.out_features)

    def gemm(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """FP8 rows ``q [M, K]`` (``M % 4 == 0``) with 1x128 scales ``[M, K/128]`` M-major -> ``[M, N]``."""
        # the weight scales as torch takes them: [K blocks, N blocks], inner-dim-major (a view)
        return torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale_inv.t(), out_dtype=self.out_dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype`` (for code that needs it whole, such as the absorbed decoder)."""
        return block_dequantize(self.weight, self.weight_scale_inv, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block 128x128"


def linear_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight of an ``nn.Linear`` or :class:`FP8Linear` in ``dtype``."""
    if isinstance(module, FP8Linear):
        return module.dequantized(dtype)
    return module.weight.to(dtype)
