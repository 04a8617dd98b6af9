"""KV handoff inside the Ray cluster: a decode actor pulls a request's KV shards straight from the
prefill workers that hold them, all shards at once.

    source = pool.kv_source(result)                     # who holds which shard
    decoder = ray.remote(DecodeActor).remote(pool.config, device="cuda")
    ray.get(decoder.receive.remote(source))             # returns once the KV is in the actor (the ack)
    pool.release(result)                                # then the prefill side frees it
    tokens = ray.get(decoder.generate.remote(result.request_id, result.first_token, 8))

Two transports, chosen per actor (``transport``) or per ``receive`` call:

- ``p2p``: a point-to-point link of the actor's own (``workers.kv_link``: NCCL on GPUs, so NVLink
  inside a node; gloo on CPU) with the holders, opened on first use and kept for later requests.
  A pull is one message on the link's control connection to each holder, not a Ray call; each
  holder's link thread sends its paged blocks straight from its cache, even while the holder
  runs prefill batches.
- ``object``: each PCP rank's shard (``[layers, rows_r, width]``, on the CPU) is a Ray object
  (a numpy array, which Ray's object store moves without pickling).

``auto`` (the default) is ``p2p`` on a GPU and ``object`` on the CPU. NCCL cannot link two processes
on one GPU, so ``auto`` pulls over ``object`` when a holder uses the actor's own GPU, and an
explicit ``p2p`` is refused then, before anything is asked of the holders. The shards come from TP
rank 0 of every PCP rank; the actor reassembles them in token order. Outside the cluster the same KV
goes over TCP (``cluster.kv_server``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import ray
import torch

from configs.model import DTYPES
from configs.pool import PoolConfig
from kv.mapped import host_identity
from workers.decode import DecodeState, ReferenceDecoder
from workers.kv_link import KVLink, KVLinkBroken, KVLinkError
from workers.pcp_layout import interleave_shards, shard_rows

TRANSPORTS = ("auto", "p2p", "object")


@dataclass(frozen=True)
class KVSource:
    """Where a kept request's KV lives: one worker per PCP rank (its TP rank 0), in PCP order."""

    request_id: str
    holders: tuple
    block_size: int
    num_tokens: int
    dtype: str  # of the KV cache
    devices: tuple = ()  # per holder (kv.mapped.host_identity(), GPU UUID or None on the CPU)
    transports: tuple[str, ...] = ()  # how every holder serves its shard to decode servers outside the cluster


def pull_kv(source: KVSource, on_asked: Callable[[], None] | None = None) -> torch.Tensor:
    """The request's KV ``[layers, tokens, width]`` in token order, every shard fetched at once as a
    Ray object. ``on_asked`` is called once every holder has been asked."""
    refs = [holder.fetch_kv.remote(source.request_id) for holder in source.holders]
    if on_asked is not None:
        on_asked()
    shards = ray.get(refs)
    return interleave_shards([shard.tensor() for shard in shards], source.block_size)


class DecodeActor:
    """The reference decoder (``workers.decode``) as a Ray actor, with the pool's model and weights."""

    def __init__(self, config: PoolConfig, device: str = "cpu", transport: str = "auto", link_timeout_s: float = 300.0) -> None:
        from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
        from workers.model import DeepseekPrefillModel
        from workers.weights import load_weights

        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self._transport(transport)  # checked now, resolved per pull
        self.transport = transport
        self.link_timeout_s = link_timeout_s
        model = DeepseekPrefillModel.create(config.model_config(), TorchSDPAPrefillBackend, dtype=torch.float32, device=device)
        load_weights(model, config.checkpoint, config.seed)
        self.decoder = ReferenceDecoder(model)
        self.states: dict[str, DecodeState] = {}
        self.links: dict[tuple[str, ...], KVLink] = {}
        self._exit_mid_pull = False

    def inject_fault(self) -> None:
        """Chaos testing: the next pull exits this actor's process once the holders were asked,
        before their KV is in (a decode server that dies mid-pull)."""
        self._exit_mid_pull = True

    def _asked(self) -> None:
        if self._exit_mid_pull:
            os._exit(1)

    def receive(self, source: KVSource, transport: str | None = None) -> dict:
        """Pull the request's KV into this actor, over ``transport`` (default: the actor's). Returns the
        acknowledgement: tokens, bytes moved, the transport, ``seconds`` of the whole pull (asking
        the holders, moving the data, reassembly; loading into the decoder excluded) and, for p2p,
        its parts (``KVLink.pull``): ``ask_s`` (asking the holders) and ``transfer_s`` (from there
        to the last byte in this actor's memory)."""
        requested = transport or self.transport
        transport = self._transport(requested)
        note = {}
        if transport == "p2p" and (shared := self._shared_gpu(source)) is not None:
            if requested == "p2p":
                raise ValueError(
                    f"request {source.request_id!r}: holder {shared} uses this decode actor's GPU ({self.device}); NCCL "
                    "cannot link two processes on one GPU. Use transport='auto' or 'object', or put the actor on another GPU"
                )
            transport, note = "object", {"fallback": f"holder {shared} shares this actor's GPU: pulled as Ray objects"}
        started = time.perf_counter()
        kv, timings = self._pull_p2p(source) if transport == "p2p" else (pull_kv(source, self._asked), {})
        seconds = time.perf_counter() - started
        if kv.shape[1] != source.num_tokens:
            raise RuntimeError(f"request {source.request_id!r}: got {kv.shape[1]} KV rows, expected {source.num_tokens}")
        self.states[source.request_id] = self.decoder.load(kv)
        return {
            "request_id": source.request_id,
            "tokens": kv.shape[1],
            "bytes": kv.numel() * kv.element_size(),
            "transport": transport,
            "seconds": seconds,
            **timings,
            **note,
        }

    def _shared_gpu(self, source: KVSource) -> int | None:
        """The first holder (PCP rank) on this actor's GPU, if any."""
        if self.device.type != "cuda":
            return None
        mine = (host_identity(), str(torch.cuda.get_device_properties(self.device).uuid))
        return next((rank for rank, device in enumerate(source.devices) if device == mine), None)

    def _transport(self, name: str) -> str:
        if name not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")
        return name if name != "auto" else ("p2p" if self.device.type == "cuda" else "object")

    def pop_kv(self, request_id: str) -> torch.Tensor:
        """The KV received for a request, ``[layers, tokens, latent]`` on the CPU; the actor drops it."""
        return torch.stack(self.states.pop(request_id).rows).cpu()

    def generate(self, request_id: str, first_token: int, steps: int) -> list[int]:
        """Greedy decode of ``steps`` tokens after ``first_token``; the request's cache is then dropped."""
        return self.decoder.greedy(self.states.pop(request_id), first_token, steps)

    def _pull_p2p(self, source: KVSource) -> tuple[torch.Tensor, dict]:
        link = self._link(source.holders)
        config = self.decoder.model.config
        pcp = len(source.holders)
        rows = [shard_rows(source.num_tokens, rank, pcp, source.block_size) for rank in range(pcp)]
        try:
            shards, timings = link.pull(
                source.request_id, rows, config.num_hidden_layers, DTYPES[source.dtype], source.block_size,
                config.attention.latent_dim, on_asked=self._asked,
            )
        except KVLinkError:
            raise  # refused (an unknown request, say): every holder answered, the link stays usable
        except Exception:
            self._drop_link(source.holders)  # a link is not reused after any other failure
            raise
        return interleave_shards([shard.row_view() for shard in shards], source.block_size), timings

    def _link(self, holders: tuple) -> KVLink:
        key = _key(holders)
        if key not in self.links:
            name, size, joins = uuid.uuid4().hex, 1 + len(holders), []

            def invite(address: tuple[str, int]) -> None:
                joins.extend(
                    holder.join_kv_link.remote(name, address, rank, size, self.link_timeout_s)
                    for rank, holder in enumerate(holders, start=1)
                )

            # the link forms once every holder joined; a holder that dies first would leave it waiting
            # for the whole timeout, so it is set up on a thread while this one watches the joins
            made: dict = {}

            def host() -> None:
                try:
                    made["link"] = KVLink.host(size, self.device, invite, timeout_s=self.link_timeout_s)
                    made["link"].warm_up()
                except BaseException as exc:  # noqa: BLE001 -- handed to the watching thread
                    made["error"] = exc

            setup = threading.Thread(target=host, name="kv-link-setup", daemon=True)
            setup.start()
            while setup.is_alive():
                setup.join(0.05)
                done, _ = ray.wait(joins, num_returns=len(joins), timeout=0) if joins else ([], None)
                for ref in done:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as exc:  # that holder is gone: so is its KV
                        raise KVLinkBroken(f"a KV holder failed while the link was set up: {exc}") from None
            if "error" in made:
                raise made["error"]
            ray.get(joins)
            self.links[key] = made["link"]
        return self.links[key]

    def _drop_link(self, holders: tuple) -> None:
        link = self.links.pop(_key(holders), None)
        if link is not None:
            with contextlib.suppress(OSError):  # a broken connection: the holders see it and end their side
                link.close()


def _key(holders: tuple) -> tuple[str, ...]:
    """A link is kept per set of holder actors (a restarted worker is a new actor: a new link)."""
    return tuple(holder._actor_id.hex() for holder in holders)
