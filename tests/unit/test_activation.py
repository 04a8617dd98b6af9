"""``workers.activation.silu_mul``: the Triton kernel (Triton's interpreter on CPU, the real kernel in
the ``gpu`` cases) against the torch ops it replaces, and the shapes it refuses."""

import pytest
import torch
import torch.nn.functional as F

from workers.activation import silu_mul

CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16)] + (
    [pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)] if torch.cuda.is_available() else []
)


def _torch_ops(gate_up, weights):
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if weights is None else out * weights[:, None].to(out.dtype)


@pytest.mark.parametrize("weighted", [False, True], ids=["dense", "expert-pairs"])
@pytest.mark.parametrize("device,dtype", CASES)
def test_the_kernel_rounds_as_the_torch_ops(device, dtype, weighted):
    """37 rows of width 1408 + 1408 (neither a multiple of the kernel's block), read as a column slice
    of wider rows: float32 within float32 rounding, bf16 within a bf16 rounding per step (the
    interpreter's bf16 casts truncate) and, on a GPU, nearly every value equal."""
    gen = torch.Generator().manual_seed(3)
    wide = (torch.randn(37, 2 * 1408 + 64, generator=gen) * 4).to(device, dtype)
    gate_up = wide[:, : 2 * 1408]
    weights = torch.rand(37, generator=gen).to(device) if weighted else None
    got = silu_mul(gate_up, weights, impl="triton")
    expected = _torch_ops(gate_up, weights)
    assert got.shape == (37, 1408) and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, expected, rtol=4e-2, atol=1e-5)
    if device == "cuda":
        assert (got != expected).float().mean().item() < 1e-3
        assert torch.equal(silu_mul(gate_up, weights), got)  # CUDA tensors take the kernel by default


def test_leading_dims_and_empty_rows_keep_their_shape():
    gate_up = torch.randn(2, 3, 8)
    torch.testing.assert_close(silu_mul(gate_up, impl="triton"), _torch_ops(gate_up, None), rtol=2e-6, atol=1e-6)
    assert silu_mul(torch.empty(0, 8), impl="triton").shape == (0, 4)


@pytest.mark.parametrize("shape,weights", [((4, 7), None), ((4, 8), (3,)), ((2, 4, 8), (2,))])
def test_bad_shapes_are_refused_naming_them(shape, weights):
    w = None if weights is None else torch.ones(weights)
    with pytest.raises(ValueError, match=str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")):
        silu_mul(torch.zeros(shape), w)
