"""Which implementation an op with a Triton kernel and torch ops runs, by its ``impl`` argument:
``"auto"`` the kernel for CUDA tensors (of a shape it supports), torch ops elsewhere; ``"torch"``;
``"triton"`` the kernel, on CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1``, as
the CPU tests run it)."""

from __future__ import annotations

import functools
import os

import torch

IMPLS = ("auto", "torch", "triton")


def use_triton(impl: str, tensor: torch.Tensor, supported: bool = True) -> bool:
    """Whether to run the kernel on ``tensor``; ``supported``: whether ``"auto"`` may (the kernel
    handles this shape). Raises ``ValueError`` for an unknown ``impl`` and for ``"triton"`` on CPU
    tensors outside the interpreter."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto":
        return tensor.is_cuda and supported and _triton_importable()
    if not (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the interpreter on CPU)")
    return True


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
