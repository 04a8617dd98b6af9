"""Rotary position embedding for MLA's rope part, with DeepSeek's YaRN scaling.

Per pair i of the R rotary dims (i < R/2), position p rotates by
``theta_i(p) = p * inv_freq_i``, ``inv_freq_i = base^(-2i/R)``:

    (x_a, x_b) -> (x_a cos - x_b sin,  x_b cos + x_a sin)

``interleaved=True`` pairs adjacent dims (x_2i, x_2i+1) -- DeepSeek's layout and
vLLM's ``is_neox_style=False``, so cached ``k_pe`` rows stay interchangeable
with vLLM's; ``False`` pairs the halves (x_i, x_{i+R/2}), the NeoX layout.

YaRN (arXiv 2309.00071, as DeepSeek-V2/V3 use it): with scale factor s and the
pretraining length L0, the dims are blended between extrapolation (inv_freq)
and interpolation (inv_freq / s) by a linear ramp over the correction range
``[low, high]`` of rotation counts ``beta_fast``..``beta_slow``; cos/sin are
multiplied by ``attention_factor = mscale(s, mscale) / mscale(s, mscale_all_dim)``
and the softmax scale by ``mscale(s, mscale_all_dim)^2``, where
``mscale(s, m) = 0.1 * m * ln(s) + 1`` for s > 1, else 1.
Frequencies, angles and cos/sin are float32 and computed on the positions' device in the order of
DeepSeek's reference (``precompute_freqs_cis``) and of vLLM's ``DeepseekScalingRotaryEmbedding``
table: the rows we hand a vLLM decode server must be the rows it would compute itself. Float64 angles
are closer to exact, but differ from that table by up to 3e-4 at position 8K, which changes about 1%
of the bf16 ``k_pe`` values there (one rounding each) and flips near-tied greedy tokens downstream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attention.kernel_choice import use_triton


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """DeepSeek's ``rope_scaling = {"type": "yarn", ...}`` block."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"yarn factor must be positive, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"original_max_position_embeddings must be positive, got {self.original_max_position_embeddings}"
            )

    @property
    def attention_factor(self) -> float:
        """Multiplier of cos/sin."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_multiplier(self) -> float:
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, rotary_dim: int, base: float, device: torch.device) -> torch.Tensor:
        powers = _powers(rotary_dim, base, device)
        extrapolation, interpolation = 1.0 / powers, 1.0 / (self.factor * powers)
        low, high = self._correction_range(rotary_dim, base)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep_extrapolated = 1 - ramp
        return interpolation * (1 - keep_extrapolated) + extrapolation * keep_extrapolated

    def _correction_range(self, rotary_dim: int, base: float) -> tuple[float, float]:
        def dim_for(rotations: float) -> float:
            length = self.original_max_position_embeddings
            return rotary_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_for(self.beta_fast), dim_for(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rotary_dim - 1)


def _powers(rotary_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """``base^(2i/R)`` in float32 on ``device`` (the inverse frequencies are ``1 / powers``)."""
    return base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)


class RotaryEmbedding:
    """Applies RoPE to ``x [T, ..., R]`` given ``positions [T]``.

    Every layer of a batch rotates by the same positions, so the tables of the
    last ``positions`` tensor seen are kept and reused (keyed on the tensor
    object, which the cache holds alive).
    """

    def __init__(
        self, rotary_dim: int, base: float, *, yarn: YarnScaling | None = None, interleaved: bool = True
    ) -> None:
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary dim must be a positive even number, got {rotary_dim}")
        self.rotary_dim, self.base, self.yarn = rotary_dim, base, yarn
        self.interleaved = interleaved
        self.cos_sin_factor = yarn.attention_factor if yarn else 1.0
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[R/2]`` float32, computed on ``device`` (a GPU's ``pow`` may round otherwise than the CPU's)."""
        device = torch.device(device)
        if device not in self._inv_freq:
            yarn, dim, base = self.yarn, self.rotary_dim, self.base
            self._inv_freq[device] = yarn.inv_freq(dim, base, device) if yarn else 1.0 / _powers(dim, base, device)
        return self._inv_freq[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, R/2]`` in float32 for integer ``positions [T]``."""
        if self._last is not None and self._last[0] is positions:
            return self._last[1], self._last[2]
        angles = positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]
        cos, sin = angles.cos() * self.cos_sin_factor, angles.sin() * self.cos_sin_factor
        self._last = (positions, cos, sin)
        return cos, sin

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
        """Rotate ``x [T, R]`` or ``[T, H, R]`` (any strides, last dim contiguous) in place, as :meth:`__call__`
        computes it. A Triton kernel on CUDA (``attention.mla_triton``; R/2 a power of two), torch ops
        elsewhere; ``impl`` forces one ("triton" on CPU tensors needs ``TRITON_INTERPRET=1``)."""
        half = self.rotary_dim // 2
        if use_triton(impl, x, supported=not half & (half - 1)):
            from attention.mla_triton import rotate_

            return rotate_(x, cos, sin, interleaved=self.interleaved)
        return x.copy_(self(x, cos, sin))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, ..., R]`` with ``cos, sin [T, R/2]`` from :meth:`cos_sin`."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.rotary_dim // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        xf = x.float()
        if self.interleaved:
            a, b = xf[..., 0::2], xf[..., 1::2]
            return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
        a, b = xf.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)
