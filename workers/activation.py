"""The MLPs' activation: ``silu(gate) * up`` of a stacked ``[gate | up]`` GEMM output, in the
compute dtype (the FP8 path never writes it: ``workers.fp8.quantize_activations(..., silu_mul=True)``
quantizes it in the same pass)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.kernel_choice import use_triton


def silu_mul(gate_up: torch.Tensor, row_weight: torch.Tensor | None = None, *, impl: str = "auto") -> torch.Tensor:
    """``silu(g) * u`` for ``gate_up [..., 2K] = [g | u]``, each row times ``row_weight [M]`` when given
    (an expert pair's routing weight; ``gate_up`` is then ``[M, 2K]``): ``[..., K]`` in ``gate_up``'s
    dtype, rounded as the torch ops ``F.silu(g) * u * w.to(dtype)`` round (the models' reference). On CUDA one pass of a Triton kernel
    (``workers.activation_triton``), elsewhere those torch ops; ``impl`` forces one ("triton" on CPU
    tensors needs ``TRITON_INTERPRET=1``)."""
    weights_ok = row_weight is None or (gate_up.dim() == 2 and tuple(row_weight.shape) == (gate_up.shape[0],))
    if gate_up.shape[-1] % 2 or not weights_ok:
        raise ValueError(f"silu_mul needs [..., 2 * width] (and [rows] weights for [rows, 2 * width]), got shape "
                         f"{tuple(gate_up.shape)}, weights {None if row_weight is None else tuple(row_weight.shape)}")  # fmt: skip
    if use_triton(impl, gate_up):
        from workers.activation_triton import silu_mul as kernel

        rows = gate_up.reshape(-1, gate_up.shape[-1])
        rows = rows if rows.stride(1) == 1 else rows.contiguous()
        out = kernel(rows, None if row_weight is None else row_weight.contiguous())
        return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if row_weight is None else out * row_weight[:, None].to(out.dtype)
