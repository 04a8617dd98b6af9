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

Either side of the kernel is a table of per-layer addresses or one tensor whose layers are a stride
apart, so the same kernel serves three copies: a holder's cache into vLLM's layers (:func:`copy_rows`,
``kv.mapped``), vLLM's layers into one staging tensor (:func:`gather_rows`) and one set of per-layer
caches into another (:func:`copy_between`, a TP rank out of its leader's caches mapped by CUDA IPC),
the last two for ``kv.tp_relay``.

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
    src, dst, like, src_stride, dst_stride, src_rows, dst_rows, n,
    SRC_TABLE: tl.constexpr, DST_TABLE: tl.constexpr, WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_WIDTH: tl.constexpr,
):  # fmt: skip
    # each side is a table of per-layer addresses (SRC_TABLE / DST_TABLE) or one tensor whose layers are *_stride apart;
    # ``like`` gives the rows' element type
    layer = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = rows < n
    s = tl.load(src_rows + rows, mask=live, other=0)
    d = tl.load(dst_rows + rows, mask=live, other=0)
    if SRC_TABLE:
        source = tl.load(src + layer).to(tl.pointer_type(like.dtype.element_ty))
    else:
        source = src + layer.to(tl.int64) * src_stride
    if DST_TABLE:
        dest = tl.load(dst + layer).to(tl.pointer_type(like.dtype.element_ty))
    else:
        dest = dst + layer.to(tl.int64) * dst_stride
    for first in tl.static_range(0, WIDTH, BLOCK_WIDTH):
        cols = first + tl.arange(0, BLOCK_WIDTH)
        mask = live[:, None] & (cols[None, :] < WIDTH)
        values = tl.load(source + s[:, None] * WIDTH + cols[None, :], mask=mask)
        tl.store(dest + d[:, None] * WIDTH + cols[None, :], values, mask=mask)


def address_table(layers: list[torch.Tensor]) -> torch.Tensor:
    """The int64 addresses of ``layers`` on their device: the kernel's destinations (build it once for
    caches that stay where they are)."""
    return torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.int64, device=layers[0].device)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    itemsize = tensor.element_size()
    if itemsize not in AS_BITS:
        raise ValueError(f"rows of elements of {', '.join(map(str, AS_BITS))} bytes move, not {itemsize} ({tensor.dtype})")
    return tensor.view(AS_BITS[itemsize])


def _check_layers(layers: list[torch.Tensor], dtype: torch.dtype, table: torch.Tensor, what: str) -> None:
    if table.numel() != len(layers):
        raise ValueError(f"{what}: {len(layers)} layers, {table.numel()} addresses")
    if any(not layer.is_contiguous() or layer.dtype != dtype for layer in layers):
        raise ValueError(f"{what}: every layer must be contiguous and of one dtype, {dtype}")


def copy_rows(source: torch.Tensor, layers: list[torch.Tensor], table: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Row ``src_rows[i]`` of layer ``l`` of ``source [layers, rows, width]`` to row ``dst_rows[i]`` of
    ``layers[l]`` (each contiguous, ``[*, width]`` rows of ``source``'s dtype), for every layer, in one
    launch on the current stream; ``table`` is :func:`address_table` of ``layers``. The row indices are
    int64 on the device."""
    if len(layers) != source.shape[0]:
        raise ValueError(f"copy_rows: {source.shape[0]} source layers, {len(layers)} destinations")
    if not source.is_contiguous():
        raise ValueError("copy_rows: the source must be contiguous")
    _check_layers(layers, source.dtype, table, "copy_rows")
    bits = _bits(source)
    _launch(bits, table, bits, bits.stride(0), 0, src_rows, dst_rows, len(layers), source.shape[-1], src_table=False, dst_table=True)


def gather_rows(layers: list[torch.Tensor], table: torch.Tensor, src_rows: torch.Tensor, out: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Row ``src_rows[i]`` of every ``layers[l]`` to row ``dst_rows[i]`` of ``out[l]`` (``out``:
    ``[layers, rows, width]``, contiguous): :func:`copy_rows` the other way, one launch."""
    if len(layers) != out.shape[0] or not out.is_contiguous():
        raise ValueError(f"gather_rows: {len(layers)} source layers into a {'' if out.is_contiguous() else 'non-contiguous '}{tuple(out.shape)} tensor")
    _check_layers(layers, out.dtype, table, "gather_rows")
    bits = _bits(out)
    _launch(table, bits, bits, 0, bits.stride(0), src_rows, dst_rows, len(layers), out.shape[-1], src_table=True, dst_table=False)


def copy_between(src_table: torch.Tensor, dst_table: torch.Tensor, like: torch.Tensor, rows: torch.Tensor, width: int) -> None:
    """Row ``rows[i]`` of every source layer to the same row of its destination layer, both sides given
    by their address tables (each layer ``[*, width]`` rows of ``like``'s dtype), one launch: a TP
    follower's copy out of its leader's cache mapped by CUDA IPC (``kv.tp_relay``)."""
    if src_table.numel() != dst_table.numel():
        raise ValueError(f"copy_between: {src_table.numel()} source layers, {dst_table.numel()} destinations")
    bits = _bits(like)
    _launch(src_table, dst_table, bits, 0, 0, rows, rows, src_table.numel(), width, src_table=True, dst_table=True)


def _launch(src, dst, like, src_stride, dst_stride, src_rows, dst_rows, layers: int, width: int, src_table: bool, dst_table: bool) -> None:
    n = src_rows.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK_ROWS), layers)
    _copy_rows_kernel[grid](src, dst, like, src_stride, dst_stride, src_rows, dst_rows, n, SRC_TABLE=src_table, DST_TABLE=dst_table,
                            WIDTH=width, BLOCK_ROWS=BLOCK_ROWS, BLOCK_WIDTH=BLOCK_WIDTH)  # fmt: skip
