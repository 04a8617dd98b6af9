"""The front door of a prefill pool's kept KV for decode servers outside the Ray cluster.

    with PrefillPool(config).start() as pool, KVServer(pool, token="s3cret") as server:
        result = pool.prefill(tokens, keep_kv=True)
        # a decode server: KVReceiver(host, server.port, token="s3cret").fetch(result.request_id)

The server carries no KV: it admits a receiver (``kv.receiver`` has the protocol), asks the
workers holding the request's shards where its blocks are (a call in their ``kv`` concurrency group,
answered beside a running prefill batch), and tells the receiver, who takes the blocks from the
holders themselves: by copying them out of the holders' caches mapped into its process (a receiver on
their host), by NIXL READs, or by TCP pulls from each holder (``workers.kv_export``).

Binds to 127.0.0.1 unless ``host`` says otherwise, and refuses to start on another address without
a ``token``; with ``token`` set, a receiver must present it (compared in constant time) before
anything is said. The token is what admits a receiver: one that holds it is trusted with the
holders' memory (NIXL READs and mapped copies are one-sided), so decode servers are inside the trust
boundary and clients are not. A request's KV is freed on the workers once
the receiver acknowledges it, and also when a started transfer fails (an error from the receiver,
a holder that died, a lost connection, no acknowledgement within ``ack_timeout_s``), so a failed
receiver never pins GPU memory; the request then has to be prefilled again. A receiver that is
refused frees nothing: a bad token, an unknown request, a model fingerprint, KV dtype or cache
shape (layers, width) other than this pool's, room for fewer rows than the request has, a prompt
other than the prefilled one (its digest), or no transport in common (all checked on its hello,
before anything is committed). The receiver's block size is its own: it places the rows. With ``unclaimed_ttl_s`` set,
KV that no receiver has claimed that long after its prefill finished is freed too.

A ticket can be issued ahead (:meth:`KVServer.ticket_ahead`), as soon as a request is submitted with
``keep_kv``: a receiver that says hello while the request still prefills is held until its KV is
complete, so the decode server's own work on the request (parsing it, allocating its blocks,
connecting) overlaps the prefill instead of following it. A ticket issued ahead with ``first_token``
also carries the token the tier samples from the prefill's logits: the endpoint hands it over
(:meth:`KVServer.first_token`) and the server sends it with ``done``, for the decode server to
generate it first (``kv.vllm_first_token``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hmac
import logging
import socket
import threading
import time

import ray

from cluster.pool import PrefillPool
from cluster.replica import KV_GROUP, cause
from configs.model import DTYPES
from configs.secrets import loopback
from workers.kv_cache import blocks_for
from kv.frames import KVTransferError, expect, prompt_digest, read_frame, send_frame, try_send

logger = logging.getLogger(__name__)


class KVServer:
    def __init__(
        self,
        pool: PrefillPool,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        ack_timeout_s: float = 60.0,
        io_timeout_s: float = 60.0,
        unclaimed_ttl_s: float | None = None,
        prefill_wait_s: float = 600.0,
    ) -> None:
        if token is None and not loopback(host):
            raise ValueError(
                f"a KV server on {host!r} without a token would hand the KV of users' prompts to anyone who reaches it: "
                "give it a token (the decode servers' connectors present the same one) or bind 127.0.0.1"
            )
        self.pool, self.token = pool, token
        self.ack_timeout_s, self.io_timeout_s, self.prefill_wait_s = ack_timeout_s, io_timeout_s, prefill_wait_s
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self._listener = socket.create_server((host, port))
        self.host, self.port = self._listener.getsockname()[:2]
        self._busy: set[str] = set()
        self._described: dict[str, tuple[str, list]] = {}  # request id -> (transport, the holders' describe_kv refs) asked ahead
        self._first: dict[str, concurrent.futures.Future] = {}  # request id -> the tier's first token (or None), for tickets that carry it
        self._lock = threading.Lock()
        self._closed = False
        self.transfers = {"completed": 0, "failed": 0, "refused": 0, "expired": 0}
        self._thread = threading.Thread(target=self._accept, name="mlapool-kv-server", daemon=True)
        self._thread.start()
        self._stop = threading.Event()
        if unclaimed_ttl_s is not None:
            threading.Thread(target=self._expire, name="mlapool-kv-expiry", daemon=True).start()

    def ticket(self, result, *, host: str | None = None, describe: bool = True) -> dict:
        """What a decode server needs to take ``result``'s KV (``kv.vllm_connector.Ticket``, as vLLM's
        ``kv_transfer_params["mlapool"]``): this server's address (``host``: the one to advertise,
        when it listens on all interfaces), the request, its prompt's length and digest, the model's
        fingerprint, and until when it is kept unclaimed (Unix time; None: until claimed).
        ``describe``: ask the holders ahead now (:meth:`describe_ahead`); False when the caller does
        once more urgent work is out (the OpenAI endpoint: after the first token is sent)."""
        remaining = None if self.unclaimed_ttl_s is None else self.unclaimed_ttl_s - (time.monotonic() - result.finished)
        if describe:
            self.describe_ahead(result)
        return self._ticket(result.request_id, result.num_tokens, result.prompt_digest, remaining, host)

    def describe_ahead(self, result) -> None:
        """Ask the holders now where a prefilled request's blocks are, over the transport a receiver on
        their host (mapped) or another (NIXL) takes: the answer is in when the receiver says hello,
        off the time between the first token and the second (a receiver that takes another transport,
        or says hello first, is described then). A Ray call per holder, on the caller's thread."""
        try:
            source = self.pool.kv_source(result)
        except (ValueError, RuntimeError):
            return  # not kept, or lost: the receiver is told so at its hello
        transport = next((t for t in ("mapped", "nixl") if t in source.transports), None)
        if transport is not None:
            refs = _describe(result, source, transport)
            with self._lock:
                if result.request_id not in self._busy:  # a receiver came first: its transfer described them itself
                    self._described[result.request_id] = (transport, refs)

    def ticket_ahead(self, request_id: str, token_ids, *, host: str | None = None, first_token: bool = False) -> dict:
        """The ticket of a request submitted with ``keep_kv`` and not prefilled yet, so that a decode
        server can take it while it prefills: a receiver's hello waits for the prefill (up to
        ``prefill_wait_s``) and is refused if it fails. ``first_token``: the transfer's ``done`` carries
        the token given to :meth:`first_token` (its wait bounded by ``ack_timeout_s``; none then)."""
        ticket = self._ticket(request_id, len(token_ids), prompt_digest(token_ids), self.unclaimed_ttl_s, host)
        if first_token:
            with self._lock:
                self._first[request_id] = concurrent.futures.Future()
            ticket["first_token"] = True
        return ticket

    def first_token(self, request_id: str, token: int | None) -> None:
        """The first token of a request whose ticket carries it (None: the decode server samples its own;
        also said when the request ends before its prefill does, which forgets it)."""
        with self._lock:
            future = self._first.get(request_id) if token is not None else self._first.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(token)

    def _ticket(self, request_id: str, tokens: int, digest: str, remaining: float | None, host: str | None) -> dict:
        return {
            "host": host or self.host,
            "port": self.port,
            "request_id": request_id,
            "tokens": tokens,
            "prompt_digest": digest,
            "model_fingerprint": self.pool.model_config.fingerprint(),
            "expires_at": None if remaining is None else time.time() + remaining,
            "token_required": self.token is not None,
        }

    def discard(self, result) -> None:
        """Free ``result``'s kept KV now unless a receiver is taking it (then it is freed when that
        transfer ends); either way no receiver gets it after this."""
        self.first_token(result.request_id, None)  # a transfer waiting for it sends its done now, without
        with self._lock:
            self._described.pop(result.request_id, None)
            if result.request_id in self._busy:
                return
            self._busy.add(result.request_id)
        try:
            self.pool.release(result)
        finally:
            with self._lock:
                self._busy.discard(result.request_id)

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not, on Linux)
        self._listener.close()
        self._thread.join(timeout=10)

    def __enter__(self) -> KVServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, peer), name="mlapool-kv-transfer", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        with conn:
            conn.settimeout(self.io_timeout_s)
            try:
                result, source, transport = self._admit(conn)
            except KVTransferError as exc:
                self._count("refused")
                logger.warning("KV transfer to %s refused: %s", peer, exc)
                try_send(conn, "error", {"message": str(exc)})
                return
            try:
                begin = self._begin(result, source, transport)
                send_frame(conn, "begin", begin)
                conn.settimeout(self.ack_timeout_s)  # the receiver takes the blocks from the holders meanwhile
                ack = expect(read_frame(conn, max_payload=0)[0], "ack")
                if transport == "mapped" and ack.get("holders_seen") is not True:  # the receiver could not see them:
                    self._confirm_held(result, source)  # ask whether they lived through the copy (a Ray call)
                send_frame(conn, "done", {"request_id": result.request_id, **self._first_token_of(result.request_id)})  # the KV was held until now
                self._count("completed")
                if self.pool.metrics is not None:
                    self.pool.metrics.shipped(_payload_bytes(begin), transport)
            except Exception as exc:  # noqa: BLE001 -- the receiver's error, a lost receiver, a holder gone
                self._count("failed")
                logger.warning("KV transfer of %r to %s failed, its KV is freed: %s", result.request_id, peer, exc)
                try_send(conn, "error", {"message": str(exc)})
            finally:
                self.pool.release(result)
                with self._lock:
                    self._busy.discard(result.request_id)
                    self._described.pop(result.request_id, None)
                    self._first.pop(result.request_id, None)

    def _first_token_of(self, request_id: str) -> dict:
        """``{"first_token": ...}`` for a ticket that carries it (None when the endpoint gave none in
        ``ack_timeout_s``: the decode server samples its own), else nothing."""
        with self._lock:
            future = self._first.get(request_id)
        if future is None:
            return {}
        try:
            return {"first_token": future.result(timeout=self.ack_timeout_s)}
        except concurrent.futures.TimeoutError:
            logger.warning("no first token for request %r within %.0f s: the decode server samples its own", request_id, self.ack_timeout_s)
            return {"first_token": None}

    def _expire(self) -> None:
        """Free kept KV that no receiver claimed within ``unclaimed_ttl_s`` of its prefill."""
        while not self._stop.wait(min(1.0, self.unclaimed_ttl_s / 4)):
            deadline = time.monotonic() - self.unclaimed_ttl_s
            for result in self.pool.kept_results():
                with self._lock:
                    if result.finished > deadline or result.request_id in self._busy:
                        continue
                    self._busy.add(result.request_id)  # a receiver arriving now is refused, not raced
                    self._described.pop(result.request_id, None)
                    self._first.pop(result.request_id, None)
                try:
                    self.pool.release(result)
                    self._count("expired")
                    logger.warning("KV of %r was not claimed within %.0f s and is freed", result.request_id, self.unclaimed_ttl_s)
                finally:
                    with self._lock:
                        self._busy.discard(result.request_id)

    def _admit(self, conn: socket.socket):
        hello = expect(read_frame(conn, max_payload=0)[0], "hello")
        if self.token is not None and not hmac.compare_digest(str(hello.get("token") or ""), self.token):
            raise KVTransferError("the receiver's token does not match this KV server's")
        request_id = hello.get("request_id")
        self._check_receiver(hello)
        result = self._prefilled(request_id) if isinstance(request_id, str) else None
        if result is None:
            raise KVTransferError(f"no kept KV for request {request_id!r} (not prefilled with keep_kv, or already sent)")
        try:
            source = self.pool.kv_source(result)
        except RuntimeError as exc:  # a worker holding it died: there is nothing to send
            self.pool.release(result)
            raise KVTransferError(str(exc)) from None
        transport = self._transport(hello, source)
        offered = hello.get("max_tokens")
        if offered is not None and (type(offered) is not int or offered < result.num_tokens):
            raise KVTransferError(
                f"request {request_id!r} has {result.num_tokens} tokens; the receiver's blocks hold {offered!r} "
                "(the KV is kept for a receiver with room)"
            )
        digest = hello.get("prompt_digest")
        if digest is not None and digest != result.prompt_digest:
            raise KVTransferError(
                f"request {request_id!r} was prefilled for another prompt than the receiver's "
                f"({result.num_tokens} tokens, digest {result.prompt_digest[:12]}...; the receiver's {str(digest)[:12]}...)"
            )
        with self._lock:
            if request_id in self._busy:
                raise KVTransferError(f"the KV of request {request_id!r} is already being sent")
            self._busy.add(request_id)
        return result, source, transport

    def _prefilled(self, request_id: str):
        """The kept result of ``request_id``, waiting for its prefill when it is still in flight."""
        future = self.pool.prefilling(request_id)
        if future is not None:
            try:
                future.result(timeout=self.prefill_wait_s)
            except concurrent.futures.TimeoutError:
                raise KVTransferError(f"request {request_id!r} is still prefilling after {self.prefill_wait_s:.0f} s") from None
            except concurrent.futures.CancelledError:
                raise KVTransferError(f"request {request_id!r} was cancelled before its prefill finished") from None
            except Exception as exc:  # noqa: BLE001 -- the prefill's own error, said to the receiver
                raise KVTransferError(f"the prefill of request {request_id!r} failed: {exc}") from None
        return self.pool.kept_result(request_id)

    def _check_receiver(self, hello: dict) -> None:
        """Refuse a receiver that says it runs another model, KV dtype or cache shape."""
        pool = self.pool
        model = pool.model_config
        ours = {
            "model_fingerprint": model.fingerprint(),
            "dtype": pool.worker_infos[0][0].dtype,
            "layers": model.num_hidden_layers,
            "width": model.attention.latent_dim,
        }
        for key, value in ours.items():
            theirs = hello.get(key)
            if theirs is not None and theirs != value:
                raise KVTransferError(
                    f"the receiver expects {key} {theirs!r}; this prefill pool's KV has {value!r} "
                    f"(request {hello.get('request_id')!r} is kept for a matching receiver)"
                )

    def _transport(self, hello: dict, source) -> str:
        """The first of the receiver's transports (in its order) that every holder serves; ``mapped``
        only to a receiver on the holders' host that reaches their GPUs (``kv.mapped``)."""
        wanted = hello.get("transports") or ["tcp"]
        if not isinstance(wanted, list) or not all(isinstance(t, str) for t in wanted):
            raise KVTransferError(f"the receiver's transports must be a list of names, got {wanted!r}")
        for transport in wanted:
            if transport in source.transports and (transport != "mapped" or _can_map(hello, source)):
                return transport
        raise KVTransferError(
            f"the receiver takes KV over {wanted}; this pool's workers serve it over {list(source.transports)} "
            "(mapped only to a receiver on their host that reaches their GPUs; NIXL is not installed on them, "
            "or the pool runs with nixl='off')"
        )

    def _begin(self, result, source, transport: str) -> dict:
        """Ask every holder where its shard's blocks are (once their KV is complete), and say it all."""
        cfg, model = self.pool.config, self.pool.model_config
        with self._lock:
            ahead = self._described.pop(result.request_id, None)
        refs = ahead[1] if ahead is not None and ahead[0] == transport else _describe(result, source, transport)
        try:
            shards = ray.get(refs, timeout=self.io_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            raise RuntimeError(f"a worker holding request {result.request_id!r} did not say where its KV is: {cause(exc)}") from None
        return {
            "request_id": result.request_id,
            "tokens": result.num_tokens,
            "layers": model.num_hidden_layers,
            "dtype": source.dtype,
            "block_size": cfg.block_size,
            "width": model.attention.latent_dim,
            "num_blocks": blocks_for(result.num_tokens, cfg.block_size),
            "model_fingerprint": model.fingerprint(),
            "transport": transport,
            "pcp": cfg.pcp,
            "shards": shards,
        }

    def _confirm_held(self, result, source) -> None:
        """After a mapped copy: every holder still holds the request's KV (one that died meanwhile may
        have left its memory to the receiver's mapping, but the KV is counted lost: a load error)."""
        refs = [holder.holds_kv.options(concurrency_group=KV_GROUP).remote(result.request_id) for holder in source.holders]
        for rank, ref in enumerate(refs):
            try:
                held = ray.get(ref, timeout=self.io_timeout_s)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
                raise RuntimeError(f"holder {rank} of request {result.request_id!r} died during the transfer: {cause(exc)}") from None
            if not held:
                raise RuntimeError(f"holder {rank} no longer holds the KV of request {result.request_id!r}")

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.transfers[outcome] += 1


def _describe(result, source, transport: str) -> list:
    """Ask every holder where its shard of ``result`` is, for ``transport`` (refs of their offers)."""
    return [holder.describe_kv.options(concurrency_group=KV_GROUP).remote(result.request_id, transport) for holder in source.holders]


def _can_map(hello: dict, source) -> bool:
    """Whether the receiver runs on every holder's host and reaches every holder's GPU."""
    devices = hello.get("devices") or []
    return all(host == hello.get("host") and (uuid is None or uuid in devices) for host, uuid in source.devices)


def _payload_bytes(begin: dict) -> int:
    """The KV bytes a ``begin`` frame hands over: every block of every layer."""
    itemsize = DTYPES[begin["dtype"]].itemsize
    return begin["num_blocks"] * begin["block_size"] * begin["width"] * begin["layers"] * itemsize
