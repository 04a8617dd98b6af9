"""Slices of tensors in safetensors files, read with plain reads instead of a memory map.

``safetensors.safe_open`` maps a file and copies each slice out of the mapping; every page touched
stays resident in the process until the file is closed, so a rank that loads its shard piece by
piece still ends with the whole shard in its resident memory (DeepSeek-V3's 5-layer slice in FP8
on one H200: peak RSS 0.9 -> 27.5 GiB while loading 26.5 GiB,
``benchmarks/results/...-deepseek-v3-5layers-fp8-checkpoint-load-mmap.json``). The format is
simple: an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets}}`` (and ``__metadata__``), then each tensor's bytes, row-major. So a slice of rows
is one read straight into the returned tensor, and a slice of columns one read per row; host
memory holds the slice and nothing else (the kernel's page cache aside).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


class SafetensorsFile:
    """One safetensors file: its header, read at open, and slices of its tensors on request."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 -- kept open for the reads, closed by close()
        try:
            size = os.fstat(self._file.fileno()).st_size
            length = int.from_bytes(self._read_exactly(8, 0), "little") if size >= 8 else -1
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{self.path} is not a safetensors file ({size} bytes, header length {length})")
            try:
                header = json.loads(self._read_exactly(length, 8))
            except ValueError as exc:
                raise ValueError(f"{self.path} is not a safetensors file: its header is not JSON ({exc})") from None
            header.pop("__metadata__", None)
            self.data_start = 8 + length
            for name, info in header.items():
                if info.get("dtype") not in DTYPES:
                    raise ValueError(f"{self.path}: tensor {name} has dtype {info.get('dtype')!r}; readable: {', '.join(DTYPES)}")
                if self.data_start + info["data_offsets"][1] > size:
                    raise ValueError(
                        f"{self.path} is truncated: tensor {name} ends at byte {self.data_start + info['data_offsets'][1]}, "
                        f"the file has {size}"
                    )
            self.tensors: dict[str, dict] = header
        except BaseException:
            self._file.close()
            raise

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> str:
        """The safetensors dtype name (``BF16``, ``F8_E4M3``, ...)."""
        return self.tensors[name]["dtype"]

    def read(self, name: str, rows: slice, cols: slice | None = None) -> torch.Tensor:
        """``tensor[rows]`` or, for a 2-D tensor, ``tensor[rows, cols]`` (contiguous slices: step 1)."""
        info = self.tensors[name]
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        first, stop = _range(rows, shape[0], name)
        itemsize = dtype.itemsize
        row_bytes = math.prod(shape[1:]) * itemsize
        start = self.data_start + info["data_offsets"][0] + first * row_bytes
        if cols is not None and len(shape) != 2:
            raise ValueError(f"{self.path}: a column slice of {name} needs a 2-D tensor, it has shape {shape}")
        if cols is None or cols.indices(shape[1]) == (0, shape[1], 1):
            out = torch.empty((stop - first, *shape[1:]), dtype=dtype)
            self._read_into(out, start)
            return out
        col, col_stop = _range(cols, shape[1], name)
        out = torch.empty((stop - first, col_stop - col), dtype=dtype)
        for i in range(stop - first):
            self._read_into(out[i], start + i * row_bytes + col * itemsize)
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _read_into(self, tensor: torch.Tensor, offset: int) -> None:
        view = memoryview(tensor.view(torch.uint8).reshape(-1).numpy())  # the tensor's own bytes
        done = 0
        while done < len(view):
            self._file.seek(offset + done)
            got = self._file.readinto(view[done:])
            if not got:
                raise ValueError(f"{self.path} ended at byte {offset + done}, inside a tensor")
            done += got

    def _read_exactly(self, n: int, offset: int) -> bytes:
        buffer = bytearray(n)
        self._read_into(torch.frombuffer(buffer, dtype=torch.uint8), offset)
        return bytes(buffer)


def _range(part: slice, size: int, name: str) -> tuple[int, int]:
    start, stop, step = part.indices(size)
    if step != 1:
        raise ValueError(f"slices of {name} are read with step 1, got {part}")
    return start, max(start, stop)
