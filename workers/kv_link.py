"""A point-to-point link for the KV handoff: a process group of its own between one receiver (rank
0, a decode actor) and the prefill workers that hold a request's shards (ranks 1..N).

It is independent of the pool's process group (its own ``TCPStore``, hosted by the receiver), so a
decode server can join and leave without touching the grid. NCCL between GPUs (NVLink when the
GPUs share a node), gloo on CPU:

    receiver:  link = KVLink.host(1 + len(holders), device, invite)  # invite(address): holders join
    holder r:  KVLink.join(address, r, size, device).serve(shard)    # a thread answers every pull
    receiver:  shards, timings = link.pull(request_id, rows, layers, dtype, block_size, width)

Every holder also keeps a control connection to the receiver (TCP, no Nagle delay, frames of
``kv.frames``). A pull is one small frame on each: the request and the shard sizes the
receiver expects. The holder's serving thread, blocked reading its connection, wakes up at once
(tens of microseconds, where a Ray call costs milliseconds and a store key half of one) and sends
from a CUDA stream of its own, so a pull does not queue behind the holder's prefill batches; it
waits only for the request's own KV (``shard`` arranges that).

The receiver knows every shard's size in advance (the pool's PCP split), so it posts all its
receives at once instead of waiting for a header. Each holder sends a status, then one tensor per
layer in vLLM's paged MLA layout ``[num_blocks, block_size, width]``, as one NCCL group. A holder
without that shard sends its reason on the control connection, then zeros of the expected sizes
with status 0: the receiver raises :class:`KVLinkError` and the link stays usable. The
receiver's :meth:`close` closes the control connections, which ends every holder's thread; a
holder whose receiver is gone, or whose send fails, ends its own.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from configs.model import DTYPES
from workers.kv_cache import blocks_for
from kv.frames import expect, read_frame, send_frame

logger = logging.getLogger(__name__)

_TAG = 0
# how often a wait looks at the control connections and its works: a transfer is seen done within this
# of its last byte (on GPUs a pull takes milliseconds: 0.1 ms; gloo's waits wake the watcher themselves)
WATCH_S = {"cuda": 1e-4, "cpu": 2e-3}

# what a holder serves: request id -> a context holding (layer views, rows written) while they are
# sent; KeyError(reason) when it has no such request
ShardSource = Callable[[str], ContextManager[tuple[Sequence[torch.Tensor], int]]]


class KVLinkError(RuntimeError):
    """A pull was refused: a holder had no such request. The link stays usable."""


class KVLinkBroken(RuntimeError):
    """The other end went away mid-transfer (its control connection closed). The link is dead."""


@dataclass(frozen=True)
class KVShard:
    """One holder's part of a request: ``blocks [layers, num_blocks, block_size, width]`` whose
    first ``rows`` rows (flattened over blocks) are written."""

    blocks: torch.Tensor
    rows: int

    def row_view(self) -> torch.Tensor:
        layers, num_blocks, block_size, width = self.blocks.shape
        return self.blocks.view(layers, num_blocks * block_size, width)[:, : self.rows]


class KVLink:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        self.rank, self.size, self.device = rank, size, device
        self._store = store  # the receiver's store must outlive the group
        self._control: dict[int, socket.socket] = {}  # the receiver's socket per holder rank; a holder's to the receiver (0)
        self._closed = False  # the receiver's end, after close()
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            options.is_high_priority_stream = True  # a holder's sends get SMs ahead of its prefill kernels
            self.group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, timeout)

    @classmethod
    def host(
        cls,
        size: int,
        device: torch.device,
        invite: Callable[[tuple[str, int, int]], None],
        host: str | None = None,
        timeout_s: float = 300.0,
    ) -> "KVLink":
        """The receiver's end (rank 0). It hosts the store and a control port on free ports of
        ``host`` (default: this node's address) and calls ``invite(address)``, which must get every
        holder to :meth:`join` without waiting for it (the group forms once all have joined)."""
        if size < 2:
            raise ValueError(f"a KV link needs the receiver and at least one holder, got size={size}")
        host = host or socket.gethostbyname(socket.gethostname())
        store = dist.TCPStore(host, 0, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        with socket.create_server((host, 0)) as listener:
            listener.settimeout(timeout_s)
            address = (host, store.port, listener.getsockname()[1])
            invite(address)
            link = cls(store, 0, size, device, timeout_s)
            for _ in range(1, size):
                conn, _ = listener.accept()
                conn.settimeout(timeout_s)
                rank = expect(read_frame(conn, max_payload=0)[0], "hello").get("rank")
                _fast(conn).settimeout(None)
                link._control[rank] = conn
        if sorted(link._control) != list(range(1, size)):
            raise RuntimeError(f"KV link holders connected as ranks {sorted(link._control)}, expected 1..{size - 1}")
        return link

    @classmethod
    def join(cls, address: tuple[str, int, int], rank: int, size: int, device: torch.device, timeout_s: float = 300.0) -> "KVLink":
        """A holder's end (rank >= 1) of the link hosted at ``address``."""
        if not 1 <= rank < size:
            raise ValueError(f"a holder's rank must be in [1, {size}), got {rank}")
        host, store_port, control_port = address
        control = _fast(socket.create_connection((host, control_port), timeout=timeout_s))
        send_frame(control, "hello", {"rank": rank})
        store = dist.TCPStore(host, store_port, size, False, timeout=timedelta(seconds=timeout_s))
        link = cls(store, rank, size, device, timeout_s)
        control.settimeout(None)
        link._control[0] = control
        return link

    def warm_up(self) -> None:
        """Open the receiver-holder connections now (NCCL creates them on first use): every holder
        sends one element. Holders and the receiver all call it."""
        if self.rank == 0:
            buffers = [torch.empty(1, device=self.device) for _ in range(1, self.size)]
            self._wait([self.group.recv([b], src, _TAG) for src, b in enumerate(buffers, start=1)])
        else:
            self._wait([self.group.send([torch.ones(1, device=self.device)], 0, _TAG)])

    # ---- the holder's end ------------------------------------------------------------------------
    def serve(self, shard: ShardSource, on_close: Callable[[], None] = lambda: None) -> threading.Thread:
        """Answer every pull from a thread of this holder until the link closes; ``on_close`` is
        called then (the receiver closed it, or is gone, or a send failed)."""
        if self.rank == 0:
            raise RuntimeError("the receiver's end pulls; only holders serve")
        thread = threading.Thread(target=self._serve, args=(shard, on_close), name=f"kv-link-holder-{self.rank}", daemon=True)
        thread.start()
        return thread

    def _serve(self, shard: ShardSource, on_close: Callable[[], None]) -> None:
        stream = contextlib.nullcontext()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            stream = torch.cuda.stream(torch.cuda.Stream(self.device))
        try:
            with stream:
                statuses = torch.tensor([0, 1], device=self.device)  # made once: no copy to the GPU per pull
                while (ask := read_frame(self._control[0], max_payload=0)[0])["kind"] == "pull":
                    self._answer(shard, ask, statuses)
                expect(ask, "close")
        except Exception as error:  # the receiver is gone, or a send failed: the link is dead
            logger.warning("KV link holder %d: closing after %s: %s", self.rank, type(error).__name__, error)
        finally:
            self._control[0].close()
            on_close()

    def _answer(self, shard: ShardSource, ask: dict, statuses: torch.Tensor) -> None:
        """Send what the receiver asked for: a status (1: the shard, 0: refused) and, per layer,
        ``[blocks, block_size, width]``. The receiver posted those receives before it could know
        whether this holder has the shard, so a refusal still sends their sizes (zeros), after
        telling the receiver why."""
        request_id, rows, layers = ask["request_id"], ask["rows"][self.rank - 1], ask["layers"]
        shape = (blocks_for(rows, ask["block_size"]), ask["block_size"], ask["width"])
        dtype = DTYPES[ask["dtype"]]
        try:
            with shard(request_id) as (views, held):
                if held == rows and len(views) == layers and views[0].shape == shape and views[0].dtype == dtype:
                    return self._wait(self._batch(self.group.send, [statuses[1:], *views], 0))
                reason = (
                    f"request {request_id!r} here has {held} rows, {len(views)} layers of {tuple(views[0].shape)} "
                    f"{views[0].dtype}; the receiver expects {rows} rows, {layers} layers of {shape} {dtype}"
                )
        except KeyError as refusal:
            reason = str(refusal.args[0]) if refusal.args else f"no KV for request {request_id!r}"
        send_frame(self._control[0], "refused", {"reason": reason})
        zeros = torch.zeros(shape, dtype=dtype, device=self.device)
        self._wait(self._batch(self.group.send, [statuses[:1], *[zeros] * layers], 0))

    # ---- the receiver's end ----------------------------------------------------------------------
    def pull(
        self, request_id: str, rows: Sequence[int], layers: int, dtype: torch.dtype, block_size: int, width: int,
        on_asked: Callable[[], None] | None = None,
    ) -> tuple[list[KVShard], dict[str, float]]:
        """Every holder's shard of ``request_id``: holder ``r`` (1-based) is expected to hold
        ``rows[r - 1]`` rows in ``layers`` layers of ``dtype``, so every receive is posted at once,
        without waiting for a header. Returns the shards in holder order, and where the time went:
        ``ask_s`` (sending the ask to every holder) and ``transfer_s`` (from there to the last
        byte in). Raises :class:`KVLinkError` with each refusing holder's reason (the link stays
        usable). ``on_asked`` is called once every holder has been asked."""
        if self.rank != 0:
            raise RuntimeError("only the receiver's end (rank 0) pulls")
        if self._closed:
            raise RuntimeError("this KV link is closed")
        if not request_id:
            raise ValueError("a pull needs a request id")
        if len(rows) != self.size - 1:
            raise ValueError(f"this link has {self.size - 1} holders; got row counts for {len(rows)}")
        dtype_name = str(dtype).removeprefix("torch.")
        if dtype_name not in DTYPES:
            raise ValueError(f"KV dtype {dtype} is not one of {sorted(DTYPES)}")
        ask = {"request_id": request_id, "rows": list(rows), "layers": layers, "dtype": dtype_name, "block_size": block_size, "width": width}
        started = time.perf_counter()
        for rank in range(1, self.size):
            send_frame(self._control[rank], "pull", ask)
        asked = time.perf_counter()
        if on_asked is not None:
            on_asked()
        statuses = torch.empty(self.size - 1, dtype=torch.int64, device=self.device)
        shards, works = [], []
        for src, count in enumerate(rows, start=1):  # the holders send in this order: status, then layers
            blocks = torch.empty(layers, blocks_for(count, block_size), block_size, width, dtype=dtype, device=self.device)
            works += self._batch(self.group.recv, [statuses[src - 1 : src], *blocks], src)
            shards.append(KVShard(blocks, count))
        self._wait(works)
        timings = {"ask_s": asked - started, "transfer_s": time.perf_counter() - asked}
        refused = [src for src, status in enumerate(statuses.tolist(), start=1) if status != 1]
        if refused:
            reasons = []
            for rank in refused:
                refusal = expect(read_frame(self._control[rank], max_payload=0)[0], "refused")
                reasons.append(f"holder {rank}: {refusal.get('reason')}")
            raise KVLinkError("; ".join(reasons))
        return shards, timings

    def close(self) -> None:
        """End the link from the receiver's end: every holder's serving thread stops at once (its
        control connection closes)."""
        if self.rank != 0:
            raise RuntimeError("a link is closed by its receiver; a holder's end closes when the receiver goes")
        if not self._closed:
            self._closed = True
            for conn in self._control.values():
                with contextlib.suppress(OSError):  # a holder already gone
                    send_frame(conn, "close")
                conn.close()

    # ---- both ends -------------------------------------------------------------------------------
    def _batch(self, op: Callable, tensors: Sequence[torch.Tensor], peer: int) -> list:
        """``op`` (the group's send or recv) on every tensor with ``peer``, in order. On NCCL the
        operations are issued as one group (one launch, one work), not one by one."""
        if self.device.type != "cuda":
            return [op([tensor], peer, _TAG) for tensor in tensors]
        self.group._start_coalescing()
        for tensor in tensors:
            op([tensor], peer, _TAG)
        return [self.group._end_coalescing()]

    def _wait(self, works) -> None:
        """Wait for ``works`` while watching the other ends' control connections: one that closes
        (its process died) breaks the link at once, instead of a receive or send that waits for
        a dead peer until the timeout (gloo) or forever (NCCL)."""
        peers, watch_s = list(self._control.values()), WATCH_S[self.device.type]
        if self.device.type == "cuda":
            done = lambda: all(work.is_completed() for work in works)  # noqa: E731
        else:  # gloo's point-to-point works complete only inside wait(): wait on a thread of their own
            finished, errors = threading.Event(), []
            threading.Thread(target=_wait_all, args=(works, finished, errors), name="kv-link-wait", daemon=True).start()
            done = finished.is_set
        while not done():
            readable, _, _ = select.select(peers, [], [], watch_s)
            gone = [conn for conn in readable if _closed(conn)]
            if gone:
                self._abort()
                raise KVLinkBroken(f"KV link rank {self.rank}: {len(gone)} peer(s) went away mid-transfer")
            if readable:  # a frame waiting (the next ask, a refusal): it is read later, do not spin on it
                time.sleep(watch_s)
        if self.device.type != "cuda":
            if errors:
                raise errors[0]  # the transport's own error
            return
        for work in works:
            work.wait()  # raises the transport's own error, if any
        torch.cuda.current_stream(self.device).synchronize()  # NCCL's wait only orders the stream

    def _abort(self) -> None:
        """Abort the link's communicator, so that nothing stays queued on a dead peer (NCCL)."""
        abort = getattr(self.group, "abort", None)
        if abort is not None:
            with contextlib.suppress(Exception):  # already broken
                abort()


# ---- the control connection: kv_transfer frames ("hello", "pull", "refused", "close") ---------------
def _wait_all(works, finished: threading.Event, errors: list) -> None:
    try:
        for work in works:
            work.wait()
    except Exception as exc:  # noqa: BLE001 -- handed to the waiting thread
        errors.append(exc)
    finally:
        finished.set()


def _closed(conn: socket.socket) -> bool:
    """Whether a readable control connection was closed by its peer (not a frame waiting)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _fast(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # an ask is one small frame: send it now
    return sock
