"""One Triton kernel that moves a request's rows of every layer from a holder's mapped cache into a
decode server's per-layer caches (``kv.mapped``, on a GPU).

Why a kernel of ours: vLLM allocates one cache tensor per layer, so torch moves the rows with an
``index_select`` and an ``index_copy_`` per layer, through a temporary: for DeepSeek-V3's 61 layers
122 launches and their host-side dispatch per load, and every row written and read once more. On an
H100 a 4K-token load of 61 layers moved at 70 GiB/s where 32K moved at ~300 GiB/s (2026-11-26 speed
run): a cost per layer, not per byte. No library op gathers rows into a list of tensors at unrelated
addresses; here the destinations are a table of their addresses, and one launch reads each row once
and writes it once, whatever the number of layers. ``benchmarks/bench_kv_load.py`` measures it
against the per-layer ops (``Mapper(kernel=False)``).

The rows are moved as integers of their element's width (a bit-exact copy of any KV dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16
BLOCK_WIDTH = 64
AS_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # element width -> the integer dtype the rows move as


@triton.jit(do_not_specialize=["n"])  # one compiled kernel whatever the row count (1 or a multiple of 16 would be their own)
def _copy_rows_kernel(
    src, layer_stride, dst_table, src_rows, dst_rows, n, WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_WIDTH: tl.constexpr
):
    layer = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = rows < n
    s = tl.load(src_rows + rows, mask=live, other=0)
    d = tl.load(dst_rows + rows, mask=live, other=0)
    source = src + layer.to(tl.int64) * layer_stride
    dest = tl.load(dst_table + layer).to(tl.pointer_type(src.dtype.element_ty))
    for first in tl.static_range(0, WIDTH, BLOCK_WIDTH):
        cols = first + tl.arange(0, BLOCK_WIDTH)
        mask = live[:, None] & (cols[None, :] < WIDTH)
        values = tl.load(source + s[:, None] * WIDTH + cols[None, :], mask=mask)
        tl.store(dest + d[:, None] * WIDTH + cols[None, :], values, mask=mask)


def address_table(layers: list[torch.Tensor]) -> torch.Tensor:
    """The int64 addresses of ``layers`` on their device: the kernel's destinations (build it once for
    caches that stay where they are)."""
    return torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.int64, device=layers[0].device)


def copy_rows(source: torch.Tensor, layers: list[torch.Tensor], table: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Row ``src_rows[i]`` of layer ``l`` of ``source [layers, rows, width]`` to row ``dst_rows[i]`` of
    ``layers[l]`` (each contiguous, ``[*, width]`` rows of ``source``'s dtype), for every layer, in one
    launch on the current stream; ``table`` is :func:`address_table` of ``layers``. The row indices are
    int64 on the device."""
    width, itemsize = source.shape[-1], source.element_size()
    if itemsize not in AS_BITS:
        raise ValueError(f"copy_rows moves elements of {', '.join(map(str, AS_BITS))} bytes, not {itemsize} ({source.dtype})")
    if len(layers) != source.shape[0] or table.numel() != len(layers):
        raise ValueError(f"copy_rows: {source.shape[0]} source layers, {len(layers)} destinations, {table.numel()} addresses")
    if not source.is_contiguous() or any(not layer.is_contiguous() or layer.dtype != source.dtype for layer in layers):
        raise ValueError("copy_rows: the source and every destination must be contiguous and of one dtype")
    n = src_rows.numel()
    if n == 0:
        return
    bits = source.view(AS_BITS[itemsize])
    grid = (triton.cdiv(n, BLOCK_ROWS), len(layers))
    _copy_rows_kernel[grid](bits, bits.stride(0), table, src_rows, dst_rows, n, WIDTH=width, BLOCK_ROWS=BLOCK_ROWS, BLOCK_WIDTH=BLOCK_WIDTH)
