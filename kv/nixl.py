"""NIXL for the KV handoff: one agent per process, the paged latent cache registered with it, and
one-sided READs of a request's blocks from the holders that prefilled it.

NIXL (what vLLM's NixlConnector and SGLang's disaggregation use) moves registered memory over UCX:
NVLink / CUDA IPC between GPUs of a node, RDMA between nodes, shared memory or TCP between host
buffers. A holder registers its whole cache once (``[layers, num_blocks, block_size, width]``,
VRAM on a GPU, DRAM on the CPU) and publishes a :class:`Region`: its agent's metadata (a few
hundred bytes), the cache's address, device and strides. A receiver adds the holder's agent,
registers its own cache tensors (one per layer, as vLLM allocates them, or one for all) and READs
the rows it was told about straight into them, wherever it wants them; the holder's CPU takes no
part in it.

    holder:    endpoint = NixlEndpoint("prefill-3", serves=True); region = endpoint.register(cache.blocks)
    receiver:  endpoint = NixlEndpoint("decode-0", serves=False); endpoint.register_tensor(dest)
               src, dst, n = runs(holder_rows, dest_rows)
               endpoint.read([(region, descriptors(region.layer_bases(), row_bytes, src, n, region.device),
                               "VRAM", descriptors(dest_layer_bases, row_bytes, dst, n, 0))], timeout_s=60)

Descriptors are built per run of rows consecutive on both sides (one per layer and run), so a
request whose blocks are runs on both ends moves as a handful of large descriptors, not one per
block (per-block descriptors are what makes MLA transfers slow over CUDA IPC: vllm #55434).

READs between GPUs of one node need UCX's CUDA IPC GET, which UCX turns off where it finds no
NVLink (one GPU, PCIe-only GPUs): the READs then go over TCP through host memory, at well under
1 GiB/s (measured: 0.36 GiB/s into vLLM's cache on one H200). Every agent here is made with
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` where CUDA is present, unless the environment sets it (as
Dynamo's and llm-d's same-node deployments do).

The module is importable without NIXL; :func:`nixl_unavailable` says why it cannot be used.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")  # the meta package, then the CUDA-specific wheels
BACKEND = "UCX"


class NixlError(RuntimeError):
    """A NIXL operation failed (the message names the peer and NIXL's reason)."""


@cache
def _api():
    if torch.cuda.is_available():  # before UCX reads its configuration (see above); off CUDA UCX warns of it as unused
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    errors = []
    for name in MODULES:
        try:
            api = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- a wheel can fail with OSError (missing libraries) too
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:  # its per-agent INFO lines, unless asked for
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise ImportError("NIXL is not installed (pip install 'mlapool[nixl]'); tried " + "; ".join(errors))


def nixl_unavailable() -> str | None:
    """Why NIXL cannot be used in this process, or None when it can."""
    try:
        _api()
    except ImportError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class Region:
    """A registered paged cache ``[layers, num_blocks, block_size, width]`` as a peer needs to address it."""

    agent: str
    metadata: bytes  # the owning agent's NIXL metadata (empty for the local side)
    memory: str  # "VRAM" or "DRAM"
    device: int  # CUDA device index in the owner's process (0 for host memory)
    base: int  # address of block 0 of layer 0
    layers: int
    num_blocks: int
    layer_stride: int  # bytes from one layer to the next
    block_bytes: int  # bytes of one block (block_size x width x itemsize)

    @classmethod
    def of(cls, agent: str, metadata: bytes, cache: torch.Tensor) -> "Region":
        if cache.dim() != 4 or not cache.is_contiguous():
            raise ValueError(f"a KV region must be a contiguous [layers, num_blocks, block_size, width] tensor, got {tuple(cache.shape)}")
        layers, num_blocks = cache.shape[:2]
        block_bytes = cache[0, 0].numel() * cache.element_size()
        return cls(
            agent=agent, metadata=metadata, memory="VRAM" if cache.is_cuda else "DRAM",
            device=(cache.device.index or 0) if cache.is_cuda else 0, base=cache.data_ptr(), layers=layers,
            num_blocks=num_blocks, layer_stride=num_blocks * block_bytes, block_bytes=block_bytes,
        )  # fmt: skip

    def layer_bases(self) -> np.ndarray:
        """The address of block 0 of every layer."""
        return self.base + np.arange(self.layers, dtype=np.uint64) * np.uint64(self.layer_stride)

    def as_dict(self) -> dict:
        return {key: getattr(self, key) for key in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, raw: dict) -> "Region":
        try:
            return cls(**{key: raw[key] for key in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise NixlError(f"a holder's NIXL region is malformed ({exc}): {sorted(raw)}") from None


def runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired indices (rows or blocks) into runs consecutive on both sides:
    ``(src_start, dst_start, length)``."""
    if len(src) == 0:
        return src, dst, src
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [len(src)]]))
    return src[starts], dst[starts], lengths


def descriptors(layer_bases: np.ndarray, unit_bytes: int, starts: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """``[layers x runs, 3]`` (address, bytes, device) of the runs ``starts``/``lengths`` (in units of
    ``unit_bytes``: a row or a block) in every layer whose first unit is at ``layer_bases``."""
    bases = np.asarray(layer_bases, dtype=np.uint64)[:, None]
    addresses = bases + starts.astype(np.uint64)[None, :] * np.uint64(unit_bytes)
    sizes = np.broadcast_to(lengths.astype(np.uint64)[None, :] * np.uint64(unit_bytes), addresses.shape)
    devices = np.full(addresses.shape, device, dtype=np.uint64)
    return np.stack([addresses, sizes, devices], axis=-1).reshape(-1, 3)


PROGRESS_DELAY_US = 100
_AGENT_LOCK = threading.Lock()


def _agent(api, name: str, progress_thread: bool):
    """A NIXL agent; with a progress thread that sleeps ``PROGRESS_DELAY_US`` between polls. The one
    place that reaches past NIXL's Python API: its ``nixl_agent`` sets the thread's pause to 0 on the
    binding's config object, so the config class is swapped, while the agent is made, for one that
    keeps the pause (falling back to NIXL's own when the binding has no such field)."""
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[BACKEND])
    base = getattr(getattr(api, "nixlBind", None), "nixlAgentConfig", None)
    if not progress_thread or base is None or not hasattr(base, "pthrDelay"):
        return api.nixl_agent(name, config)

    class PausedProgress(base):
        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):
            base.pthrDelay.__set__(self, max(value, PROGRESS_DELAY_US))

    with _AGENT_LOCK:
        api.nixlBind.nixlAgentConfig = PausedProgress
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base


@dataclass
class Read:
    """One posted READ from one holder."""

    holder: int  # its index among the reads (the PCP rank)
    agent: str
    handle: object
    bytes: int


class NixlEndpoint:
    """This process's NIXL agent (UCX backend), its registered regions and the peers it added.

    ``serves=True`` (a holder): the agent runs UCX's progress thread, which a peer's first READ
    needs to connect (the holder itself never calls into NIXL again). NIXL's Python agent starts
    that thread without a pause between polls, which keeps a core busy in every holder; here it
    sleeps ``PROGRESS_DELAY_US`` between them (READs over shared memory, CUDA IPC and RDMA are
    one-sided: the rate is the same). ``serves=False`` (a receiver): no thread; :meth:`read`'s
    polling drives its transfers.
    """

    def __init__(self, name: str, *, serves: bool) -> None:
        api = _api()
        self.name = name
        self.agent = _agent(api, name, serves)
        if BACKEND not in self.agent.backends:
            raise NixlError(f"NIXL's {BACKEND} backend could not be created in agent {name!r} (plugins: {self.agent.get_plugin_list()})")
        self._registered: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}  # (address, bytes) -> (tensor, registration)
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata it was added with
        # one call into the agent at a time: UCX's worker is not thread-safe, and a decode server's
        # loads run on several threads (concurrent READs on one agent crashed vLLM's worker in UCX)
        self._lock = threading.RLock()

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def register(self, cache: torch.Tensor) -> Region:
        """Register a paged cache ``[layers, num_blocks, block_size, width]`` and describe it."""
        self.register_tensor(cache)
        return Region.of(self.name, self.metadata(), cache)

    def register_tensor(self, tensor: torch.Tensor) -> None:
        """Register a contiguous tensor's memory (once per tensor; the endpoint keeps it alive)."""
        if not tensor.is_contiguous():
            raise ValueError(f"NIXL registers contiguous memory; got a tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()}")
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if key not in self._registered:
            with self._lock:
                self._registered[key] = (tensor, self.agent.register_memory(tensor))

    def deregister(self, cache: torch.Tensor) -> None:
        with self._lock:
            entry = self._registered.pop((cache.data_ptr(), cache.numel() * cache.element_size()), None)
            if entry is not None:
                self.agent.deregister_memory(entry[1])

    def _peer(self, region: Region) -> str:
        """Add the region's agent (again, if it came back with new metadata: a restarted holder)."""
        if self._peers.get(region.agent) != region.metadata:
            if region.agent in self._peers:
                self.agent.remove_remote_agent(region.agent)
            self.agent.add_remote_agent(region.metadata)
            self._peers[region.agent] = region.metadata
            self.agent.make_connection(region.agent)
        return region.agent

    def forget(self, agent: str) -> None:
        """Drop a peer (after a failed READ: it may have restarted with the same name)."""
        with self._lock:
            known = self._peers.pop(agent, None) is not None
        if known:
            try:
                with self._lock:
                    self.agent.remove_remote_agent(agent)
            except Exception:  # noqa: BLE001 -- forgetting a peer that is already gone cannot fail the caller
                pass

    def read(self, pieces: list[tuple[Region, np.ndarray, str, np.ndarray]], timeout_s: float) -> float:
        """READ, for each ``(remote, remote_descs, local_memory, local_descs)`` (:func:`descriptors`
        of the same sizes on both sides; the local ones inside registered tensors), the remote
        memory into the local one, all pieces in flight at once; returns the seconds from posting
        the first READ to the last one done. Raises :class:`NixlError` naming the piece (holder)
        that failed; the other READs are released."""
        posted: list[Read] = []
        try:
            for holder, (remote, remote_array, local_memory, local_array) in enumerate(pieces):
                if not len(remote_array):
                    continue
                agent = self._peer_or_fail(holder, remote)
                remote_descs = self._call(holder, agent, self.agent.get_xfer_descs, remote_array, remote.memory)
                local_descs = self._call(holder, agent, self.agent.get_xfer_descs, local_array, local_memory)
                handle = self._call(holder, agent, self.agent.initialize_xfer, "READ", local_descs, remote_descs, agent)
                posted.append(Read(holder, agent, handle, int(remote_array[:, 1].sum())))
            started = time.perf_counter()
            for read in posted:
                if self._call(read.holder, read.agent, self.agent.transfer, read.handle) == "ERR":
                    raise self._failed(read.holder, read.agent, "the READ could not be posted")
            pending = list(posted)
            deadline = started + timeout_s
            while pending:
                for read in list(pending):
                    state = self._call(read.holder, read.agent, self.agent.check_xfer_state, read.handle)
                    if state == "DONE":
                        pending.remove(read)
                    elif state == "ERR":
                        raise self._failed(read.holder, read.agent, "the READ failed")
                if pending and time.perf_counter() > deadline:
                    raise NixlError(f"holder {pending[0].holder}: READ not done within {timeout_s:.0f} s")
            return time.perf_counter() - started
        finally:
            for read in posted:
                try:
                    with self._lock:
                        self.agent.release_xfer_handle(read.handle)
                except Exception:  # noqa: BLE001 -- a handle of a dead peer: nothing left to release
                    pass

    def _peer_or_fail(self, holder: int, region: Region) -> str:
        try:
            with self._lock:
                return self._peer(region)
        except Exception as exc:  # noqa: BLE001 -- NIXL raises its own exception types
            self._peers.pop(region.agent, None)
            raise NixlError(f"holder {holder}: cannot connect to its NIXL agent {region.agent!r} ({type(exc).__name__}: {exc})") from None

    def _call(self, holder: int, agent: str, fn, *args):
        try:
            with self._lock:
                return fn(*args)
        except Exception as exc:  # noqa: BLE001 -- e.g. nixlRemoteDisconnectError when the holder died
            raise self._failed(holder, agent, f"{type(exc).__name__}: {exc}") from None

    def _failed(self, holder: int, agent: str, why: str) -> NixlError:
        self.forget(agent)
        return NixlError(f"holder {holder} ({agent}) failed mid-transfer: {why}")
