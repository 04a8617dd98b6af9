"""Merging partial attention states (``merge_attn_states``).

Legend: T tokens, H heads, D head dim, N partials. Outputs ``o [T, H, D]``;
LSEs ``lse [H, T]`` float32, natural log (any strides).

Two partial results for the same queries over disjoint key sets A and B,
``(o_A, lse_A)`` and ``(o_B, lse_B)``, combine into attention over A u B:

    m   = max(lse_A, lse_B)
    lse = m + log(exp(lse_A - m) + exp(lse_B - m))
    o   = exp(lse_A - lse) * o_A + exp(lse_B - lse) * o_B

and N partials the same way with the max and the sum taken over all N. The
math runs in float32 whatever the output dtype. ``+inf`` and NaN LSEs mean
"no keys" and are treated as ``-inf``; a partial of weight 0 contributes
nothing, even if its output holds garbage; when every partial is empty the
result is ``o = 0``, ``lse = -inf`` -- never NaN.

On CUDA tensors a Triton kernel (``attention.merge_triton``) runs; elsewhere
the torch code below. ``impl`` forces one ("triton" also runs on CPU tensors
under ``TRITON_INTERPRET=1``, which the CPU tests use).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attention.kernel_choice import use_triton


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
    *,
    impl: str = "auto",
) -> None:
    """Merge two partial states into ``output`` (and ``output_lse``) in place.

    ``output`` may be the same tensor as either input, and ``output_lse`` the
    same as either LSE (the Triton path then writes the merged LSE to a
    temporary first: see ``attention.merge_triton``).
    """
    _check_outputs("output", output, [prefix_output, suffix_output])
    for name, lse in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse), ("output_lse", output_lse)):
        if lse is not None:
            _check_lse(name, lse, output)
    if use_triton(impl, output):
        from attention.merge_triton import merge_two

        merge_two(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)
        return
    out, lse = _merge_torch(torch.stack([prefix_lse, suffix_lse]), [prefix_output, suffix_output])
    output.copy_(out)
    if output_lse is not None:
        output_lse.copy_(lse)


def merge_attn_states_many(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
    *,
    output: torch.Tensor | None = None,
    output_lse: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial states: ``outputs [N, T, H, D]``, ``lses [N, H, T]`` (or sequences of them).

    Returns ``(o [T, H, D], lse [H, T])``, written into ``output``/``output_lse``
    when given. Equals repeated two-way merging, in one pass.
    """
    outputs = torch.stack(list(outputs)) if not isinstance(outputs, torch.Tensor) else outputs
    lses = torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses
    if outputs.dim() != 4 or outputs.shape[0] < 1:
        raise ValueError(f"outputs must be [N, T, H, D] with N >= 1, got {tuple(outputs.shape)}")
    num, tokens, heads, _ = outputs.shape
    if tuple(lses.shape) != (num, heads, tokens):
        raise ValueError(f"lses must be [N, H, T] = {(num, heads, tokens)}, got {tuple(lses.shape)}")
    if lses.dtype != torch.float32:
        raise TypeError(f"lses must be float32 (LSEs are never merged in low precision), got {lses.dtype}")
    if output is None:
        output = torch.empty_like(outputs[0])
    if output_lse is None:
        output_lse = torch.empty((heads, tokens), dtype=torch.float32, device=outputs.device)
    _check_outputs("output", output, [outputs[0]])
    _check_lse("output_lse", output_lse, output)
    if use_triton(impl, output):
        from attention.merge_triton import merge_many

        merge_many(output, output_lse, outputs, lses)
    else:
        out, lse = _merge_torch(lses, outputs)
        output.copy_(out)
        output_lse.copy_(lse)
    return output, output_lse


def _merge_torch(
    lses_NHT: torch.Tensor, outputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    lses_NHT = lses_NHT.float()
    lses_NHT = torch.where(torch.isnan(lses_NHT) | (lses_NHT == float("inf")), float("-inf"), lses_NHT)
    m_HT = lses_NHT.amax(dim=0)
    m_HT = torch.where(torch.isinf(m_HT), 0.0, m_HT)  # all partials empty: exp(-inf - 0) = 0
    e_NHT = torch.exp(lses_NHT - m_HT)
    total_HT = e_NHT.sum(dim=0)
    w_NHT = e_NHT * torch.where(total_HT > 0, 1.0 / total_HT, 0.0)
    out = torch.zeros(outputs[0].shape, dtype=torch.float32, device=outputs[0].device)
    for w_HT, o_THD in zip(w_NHT, outputs):
        w_TH1 = w_HT.t().unsqueeze(-1)
        out += torch.where(w_TH1 > 0, o_THD.float() * w_TH1, 0.0)
    return out, torch.log(total_HT) + m_HT


def _check_outputs(name: str, output: torch.Tensor, inputs: Sequence[torch.Tensor]) -> None:
    if output.dim() != 3:
        raise ValueError(f"{name} must be [T, H, D], got shape {tuple(output.shape)}")
    for tensor in inputs:
        if tensor.shape != output.shape:
            raise ValueError(f"partial outputs must all be {tuple(output.shape)}, got {tuple(tensor.shape)}")
        if tensor.device != output.device:
            raise ValueError(f"partial outputs must be on {output.device}, got {tensor.device}")


def _check_lse(name: str, lse: torch.Tensor, output: torch.Tensor) -> None:
    tokens, heads, _ = output.shape
    if tuple(lse.shape) != (heads, tokens):
        raise ValueError(f"{name} must be [H, T] = {(heads, tokens)}, got {tuple(lse.shape)}")
    if lse.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (LSEs are never merged in low precision), got {lse.dtype}")
    if lse.device != output.device:
        raise ValueError(f"{name} is on {lse.device}, outputs on {output.device}")
