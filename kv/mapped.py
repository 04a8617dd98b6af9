"""The ``mapped`` KV transport: a holder's paged cache mapped into the receiver's process, when both
run on one host, and a request's rows copied by a gather/scatter per layer, whatever the block
layout on either side.

Why not NIXL READs between processes of one node: a READ is posted per descriptor, one per run of
rows consecutive on both sides, and once vLLM's free list and the pool's prefix cache have run a
while every block is its own run. Measured on one H200: 2,560 READs of one 64-row block for a 32K
prompt of a 5-layer slice, ~29 us each, 2.2 GiB/s (vllm #55434 reports the same for vLLM's own
NixlConnector). Here the receiver maps the holder's whole cache once (CUDA IPC for GPU memory,
torch's ``torch.multiprocessing`` handles; a shared-memory file for host memory) and moves a request
on a stream of its own, on a GPU with one kernel for every layer's rows (``kv.mapped_triton``), in
host memory with one ``index_select`` + ``index_copy_`` pair per layer and chunk of rows: the cost is
the memory traffic of the rows, not a count of descriptors (``benchmarks/bench_kv_load.py`` measures
them all).

    holder:   region = share_cache(cache)                        # once; every offer carries region.as_dict()
    receiver: mapper = Mapper(); mapper.copy(region, layers, src_rows, dst_rows)

Memory: the receiver allocates no landing region; the kernel reads each row into the destination
directly (the row indices are all it allocates), and on the per-layer path each chunk of at most
``chunk_rows`` rows passes through one temporary of ``chunk_rows x width`` elements
(``Mapper.in_flight_bytes`` counts it, back to 0 after every copy). The rows land in the destination only after the holder's rows were read; a
load that fails is reported as a load error by the caller (vLLM recomputes those blocks).

A holder that dies while mapped: its memory stays mapped in the receiver until the receiver drops it
(:meth:`Mapper.forget`, after a failed load), as with UCX's CUDA IPC mappings under NIXL. Whether the
KV was still held when the copy ended is checked by the receiver where it sees the holder's process
(its pid and start time in ``/proc``, before and after the copy: a few microseconds), else by the KV
server, which asks the holders (a Ray call) before it says ``done``.

Nothing here imports Ray or the prefill model.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
CHUNK_ROWS = 16384  # rows per gather/scatter: 18 MiB of 576-wide bf16 rows in flight at most


class MappedError(RuntimeError):
    """A holder's cache could not be mapped or read (the message says which and why)."""


class HolderGone(MappedError):
    """The holder's process was seen gone, before or after the copy: its KV is lost, not unmappable."""


def host_identity() -> str:
    """This host as both ends of a mapped transfer see it: the host name and the kernel's boot id
    (two machines can share a name; two processes of one boot of one kernel are on one host)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def reachable_devices() -> list[str]:
    """UUIDs of the GPUs whose memory this process can map and read (all it sees; a GPU other than
    the reader's is read over peer access, so only those with peer access to device 0's are
    listed). Empty without CUDA."""
    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    return [
        str(torch.cuda.get_device_properties(i).uuid)
        for i in range(count)
        if i == 0 or torch.cuda.can_device_access_peer(0, i)
    ]


def shared_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Path] | None:
    """A host tensor backed by a shared-memory file that other processes of this host can map, or
    None where ``/dev/shm`` lacks the room (a write past a full tmpfs would be a SIGBUS, not an
    error). The caller unlinks the file when it is done (:func:`unlink_shared`)."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if not SHM_DIR.is_dir():
        return None
    stat = os.statvfs(SHM_DIR)
    if stat.f_bavail * stat.f_frsize < 2 * nbytes:  # room for it and as much again for everyone else
        return None
    _remove_stale()
    path = SHM_DIR / f"mlapool-kv-{os.getpid()}-{os.urandom(6).hex()}"
    tensor = torch.from_file(str(path), shared=True, size=int(np.prod(shape)), dtype=dtype).view(shape)
    return tensor, path


def unlink_shared(path: Path) -> None:
    path.unlink(missing_ok=True)


def _remove_stale() -> None:
    """Files of holders that died without unlinking theirs (their pid is gone)."""
    for stale in SHM_DIR.glob("mlapool-kv-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            stale.unlink(missing_ok=True)


@dataclass(frozen=True)
class MappedRegion:
    """A holder's paged cache ``[layers, num_blocks, block_size, width]`` as a receiver on its host
    maps it: host memory by its shared-memory file, GPU memory by a CUDA IPC handle."""

    host: str  # host_identity() of the holder
    memory: str  # "VRAM" or "DRAM"
    device_uuid: str | None  # the holder's GPU (None for host memory)
    shape: tuple[int, ...]
    dtype: str
    path: str | None = None  # DRAM: the shared-memory file
    ipc: dict | None = field(default=None, hash=False)  # VRAM: torch's CUDA IPC handle of the cache's storage
    process: tuple[int, int] | None = None  # the holder's pid and start time (process_identity())

    def as_dict(self) -> dict:
        return {key: getattr(self, key) for key in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, raw: dict) -> MappedRegion:
        try:
            fields = {key: raw[key] for key in cls.__dataclass_fields__ if key not in ("process", "shape")}
            process = raw.get("process")
            return cls(**fields, shape=tuple(raw["shape"]), process=None if process is None else (int(process[0]), int(process[1])))
        except (KeyError, TypeError) as exc:
            raise MappedError(f"a holder's mapped region is malformed ({exc}): {sorted(raw)}") from None

    @property
    def key(self) -> tuple:
        """What identifies the mapping (a restarted holder comes with a new file or handle). A CUDA IPC
        handle names the allocator's whole segment, which several caches may share (tensors under 10 MB
        share 20 MB segments; a TP leader's small per-layer caches did, and each mapped as the first),
        so the cache's offsets in it are part of the key."""
        if self.ipc is None:
            return (self.host, self.path, None)
        return (self.host, self.path, bytes(self.ipc["handle"]), self.ipc["storage_offset"], self.ipc["offset"])


def share_cache(cache: torch.Tensor, path: Path | None = None) -> MappedRegion:
    """Describe a holder's cache for receivers on this host: ``path`` is its shared-memory file
    (host memory, from :func:`shared_host_tensor`); GPU memory is shared by CUDA IPC. Call it once
    per cache (each call on a GPU registers one more share with torch's IPC bookkeeping) and keep the
    cache alive while receivers may map it."""
    if cache.dim() != 4 or not cache.is_contiguous():
        raise ValueError(f"a mapped region must be a contiguous [layers, num_blocks, block_size, width] tensor, got {tuple(cache.shape)}")
    dtype = str(cache.dtype).removeprefix("torch.")
    if not cache.is_cuda:
        if path is None:
            raise ValueError("a host cache is mapped through its shared-memory file: give its path")
        return MappedRegion(host_identity(), "DRAM", None, tuple(cache.shape), dtype, path=str(path), process=process_identity())
    # torch.multiprocessing's own sharing of a CUDA tensor (what it pickles for another process): the
    # public reduce/rebuild pair, its arguments carried as plain fields instead of a pickle
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(cache)
    (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset, event, event_sync) = args
    ipc = {
        "size": list(size), "stride": list(stride), "offset": offset, "handle": handle, "storage_bytes": storage_bytes,
        "storage_offset": storage_offset, "ref_handle": ref_handle, "ref_offset": ref_offset, "event": event,
        "event_sync": event_sync,
    }  # fmt: skip
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return MappedRegion(host_identity(), "VRAM", uuid, tuple(cache.shape), dtype, ipc=ipc, process=process_identity())


def process_identity(pid: int | None = None) -> tuple[int, int] | None:
    """A process as ``(pid, start time)`` (clock ticks after boot: a pid reused later has another), or
    None where ``/proc`` does not show it (gone, or in another pid namespace)."""
    pid = os.getpid() if pid is None else pid
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return pid, int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command's parentheses


def holder_lived(region: MappedRegion) -> bool | None:
    """Whether the holder that shared ``region`` still runs: None where this process cannot tell (no
    identity in the region, or its pid is not visible from here: another pid namespace)."""
    if region.process is None:
        return None
    now = process_identity(region.process[0])
    return now == region.process


class Mapper:
    """The receiver's side: holders' caches mapped once each (kept until :meth:`forget`), and copies
    of rows from them into the receiver's per-layer caches."""

    def __init__(self, chunk_rows: int = CHUNK_ROWS, kernel: bool = True) -> None:
        """``chunk_rows``: rows per gather/scatter on the per-layer path; ``kernel``: a GPU copy by
        ``kv.mapped_triton`` (False: the per-layer torch ops there too, as host memory always takes)."""
        if type(chunk_rows) is not int or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
        self.chunk_rows, self.kernel = chunk_rows, kernel
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}  # the destinations' address tables, by their addresses
        self._mapped: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._in_flight = 0
        self.peak_in_flight_bytes = 0
        self._streams: dict[int, torch.cuda.Stream] = {}

    @property
    def in_flight_bytes(self) -> int:
        """Bytes of the copies' temporaries allocated now (0 between copies)."""
        return self._in_flight

    def open(self, region: MappedRegion, device: torch.device) -> torch.Tensor:
        """The holder's cache as ``[layers, rows, width]``, mapped into this process (once)."""
        with self._lock:
            cached = self._mapped.get(region.key)
        if cached is None:
            cached = self._map(region, device)
            with self._lock:
                self._mapped[region.key] = cached
        layers, blocks, block_size, width = region.shape
        return cached.view(layers, blocks * block_size, width)

    def _map(self, region: MappedRegion, device: torch.device) -> torch.Tensor:
        if region.host != host_identity():
            raise MappedError(f"the holder's cache is on host {region.host}, not this one ({host_identity()})")
        from kv.frames import DTYPES

        dtype = DTYPES.get(region.dtype)
        if dtype is None:
            raise MappedError(f"unknown KV dtype {region.dtype!r}; valid: {', '.join(DTYPES)}")
        numel = int(np.prod(region.shape))
        try:
            if region.memory == "DRAM":
                if not region.path or Path(region.path).parent != SHM_DIR or not Path(region.path).name.startswith("mlapool-kv-"):
                    raise MappedError(f"a host region must be a file mlapool-kv-* in {SHM_DIR}, got {region.path!r}")
                size = numel * torch.empty((), dtype=dtype).element_size()
                if not Path(region.path).is_file() or Path(region.path).stat().st_size < size:  # from_file would make one
                    raise MappedError(f"the holder's cache file {region.path} is gone or smaller than {size} bytes")
                return torch.from_file(region.path, shared=True, size=numel, dtype=dtype).view(region.shape)
            return self._map_cuda(region, dtype, device)
        except MappedError:
            raise
        except Exception as exc:  # noqa: BLE001 -- the OS's or CUDA's reason, said with the region
            raise MappedError(f"cannot map the holder's {region.memory} cache ({type(exc).__name__}: {exc})") from None

    def _map_cuda(self, region: MappedRegion, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Open the holder's CUDA IPC handle on ``device`` (the receiver's cache's: the same GPU, or a
        peer it reads over NVLink / PCIe with CUDA's lazy peer access)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if device.type != "cuda":
            raise MappedError("a holder's GPU cache maps only into a receiver whose cache is on a GPU")
        ipc = region.ipc
        args = (
            torch.Tensor, torch.Size(ipc["size"]), tuple(ipc["stride"]), ipc["offset"], torch.TypedStorage, dtype,
            device.index if device.index is not None else torch.cuda.current_device(), bytes(ipc["handle"]),
            ipc["storage_bytes"], ipc["storage_offset"], False, bytes(ipc["ref_handle"]), ipc["ref_offset"],
            None if ipc["event"] is None else bytes(ipc["event"]), ipc["event_sync"],
        )  # fmt: skip
        tensor = rebuild_cuda_tensor(*args)
        if tuple(tensor.shape) != region.shape:
            raise MappedError(f"the mapped cache is {tuple(tensor.shape)}, the region says {region.shape}")
        return tensor

    def forget(self, region: MappedRegion) -> None:
        """Drop a mapping (after a failed load: the holder may be gone or restarted)."""
        with self._lock:
            self._mapped.pop(region.key, None)

    def copy(self, region: MappedRegion, layers: list[torch.Tensor], src: np.ndarray, dst: np.ndarray) -> tuple[float, bool]:
        """Copy rows ``src`` of every layer of the holder's cache to rows ``dst`` of ``layers`` (each
        ``[num_blocks, block_size, width]``; rows counted as ``block * block_size + offset``): on a GPU
        by one kernel, else in chunks of ``chunk_rows`` per layer. Returns the seconds it took (the copies done, synchronized) and
        whether the holder was seen running before and after it (False: this process cannot see it;
        :class:`HolderGone` when it is seen gone)."""
        seen = holder_lived(region)
        if seen is False:
            raise HolderGone(f"the holder (pid {region.process[0]}) is gone")
        seconds = self._copy(region, layers, src, dst)
        if seen and not holder_lived(region):
            raise HolderGone(f"the holder (pid {region.process[0]}) exited during the copy")
        return seconds, bool(seen)

    def _copy(self, region: MappedRegion, layers: list[torch.Tensor], src: np.ndarray, dst: np.ndarray) -> float:
        device = layers[0].device
        source = self.open(region, device)
        if source.shape[0] != len(layers) or source.shape[2] != layers[0].shape[-1] or source.dtype != layers[0].dtype:
            raise MappedError(f"the holder's cache is {tuple(source.shape)} {source.dtype}; the destination has {len(layers)} layers of width {layers[0].shape[-1]}, {layers[0].dtype}")
        if not len(src):
            return 0.0
        if int(src.max()) >= source.shape[1] or int(src.min()) < 0:
            raise MappedError(f"rows {int(src.min())}..{int(src.max())} are outside the holder's cache of {source.shape[1]} rows")
        width, itemsize = source.shape[2], source.element_size()
        flats = [layer.view(-1, width) for layer in layers]
        if int(dst.max()) >= flats[0].shape[0] or int(dst.min()) < 0:  # the kernel writes where it is told: checked here
            raise MappedError(f"rows {int(dst.min())}..{int(dst.max())} are outside the destination's {flats[0].shape[0]} rows")
        cuda = device.type == "cuda"
        stream = self._stream(device) if cuda else None
        started = time.perf_counter()
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            if cuda:
                stream.wait_stream(torch.cuda.current_stream(device))  # nothing of ours still writes the destination
            src_index = torch.from_numpy(src).to(source.device, non_blocking=True)
            dst_index = torch.from_numpy(dst).to(device, non_blocking=True)
            if cuda and self.kernel:
                from kv.mapped_triton import copy_rows  # Triton only where a GPU copies

                copy_rows(source, flats, self._table(flats), src_index, dst_index)
                stream.synchronize()
                return time.perf_counter() - started
            for first in range(0, len(src), self.chunk_rows):
                rows = slice(first, min(first + self.chunk_rows, len(src)))
                temporary = (rows.stop - rows.start) * width * itemsize  # one piece at a time (stream-ordered reuse)
                self._count(temporary)
                try:
                    src_rows, dst_rows = src_index[rows], dst_index[rows]
                    for layer in range(len(layers)):
                        piece = source[layer].index_select(0, src_rows)
                        flats[layer].index_copy_(0, dst_rows, piece.to(device, non_blocking=True))
                    if cuda:
                        stream.synchronize()
                finally:
                    self._count(-temporary)
        return time.perf_counter() - started

    def warm(self, like: torch.Tensor) -> None:
        """Compile the GPU kernel for caches like ``like`` (its width, dtype and device) on scratch
        tensors, so that the first load does not wait for Triton's compiler; nothing on the host."""
        if not (like.is_cuda and self.kernel):
            return
        from kv.mapped_triton import address_table, copy_rows

        source = torch.zeros(1, 16, like.shape[-1], dtype=like.dtype, device=like.device)
        dest = [torch.empty(16, like.shape[-1], dtype=like.dtype, device=like.device)]
        rows = torch.arange(16, dtype=torch.int64, device=like.device)
        copy_rows(source, dest, address_table(dest), rows, rows)
        torch.cuda.synchronize(like.device)

    def _table(self, layers: list[torch.Tensor]) -> torch.Tensor:
        from kv.mapped_triton import address_table

        key = tuple(layer.data_ptr() for layer in layers)
        with self._lock:
            if key not in self._tables:
                self._tables[key] = address_table(layers)
            return self._tables[key]

    def _count(self, delta: int) -> None:
        with self._lock:
            self._in_flight += delta
            self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self._in_flight)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device.index not in self._streams:
                self._streams[device.index] = torch.cuda.Stream(device)
            return self._streams[device.index]
