"""Serve a prefill pool's kept KV caches over TCP to decode servers (the frames of ``workers.kv_transfer``).

    with PrefillPool(config).start() as pool, KVServer(pool, token="s3cret") as server:
        result = pool.prefill(tokens, keep_kv=True)
        # a decode server: KVReceiver(host, server.port, token="s3cret").fetch(result.request_id)

Binds to 127.0.0.1 unless ``host`` says otherwise; with ``token`` set, a
receiver must present it (compared in constant time) before anything is sent.
A request's KV is freed on the workers once the receiver acknowledges it, and
also when a started transfer fails (an error from the receiver, a lost
connection, no acknowledgement within ``ack_timeout_s``), so a failed
receiver never pins GPU memory; the request then has to be prefilled again.
A receiver that is refused frees nothing: a bad token, an unknown request, or a
receiver that presents a model fingerprint, KV dtype or block size other than
this pool's (checked on its hello, before anything is committed). With
``unclaimed_ttl_s`` set, KV that no receiver has claimed that long after its
prefill finished is freed too (a client that never comes for its ticket).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time

from cluster.pool import PrefillPool
from workers.kv_transfer import KVTransferError, expect, paged, read_frame, send_frame, tensor_buffer

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
    ) -> None:
        self.pool, self.token = pool, token
        self.ack_timeout_s, self.io_timeout_s = ack_timeout_s, io_timeout_s
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self._listener = socket.create_server((host, port))
        self.host, self.port = self._listener.getsockname()[:2]
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.transfers = {"completed": 0, "failed": 0, "refused": 0, "expired": 0}
        self._thread = threading.Thread(target=self._accept, name="mlapool-kv-server", daemon=True)
        self._thread.start()
        self._stop = threading.Event()
        if unclaimed_ttl_s is not None:
            threading.Thread(target=self._expire, name="mlapool-kv-expiry", daemon=True).start()

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
                result = self._admit(conn)
            except KVTransferError as exc:
                self._count("refused")
                logger.warning("KV transfer to %s refused: %s", peer, exc)
                _try_error(conn, str(exc))
                return
            try:
                sent = self._stream(conn, result)
                conn.settimeout(self.ack_timeout_s)
                expect(read_frame(conn, max_payload=0)[0], "ack")
                self._count("completed")
                if self.pool.metrics is not None:
                    self.pool.metrics.shipped(sent, "tcp")
            except Exception as exc:  # noqa: BLE001 -- a bad frame, a lost receiver, or its KV lost with a worker
                self._count("failed")
                logger.warning("KV transfer of %r to %s failed, its KV is freed: %s", result.request_id, peer, exc)
                _try_error(conn, str(exc))
            finally:
                self.pool.release(result)
                with self._lock:
                    self._busy.discard(result.request_id)

    def _expire(self) -> None:
        """Free kept KV that no receiver claimed within ``unclaimed_ttl_s`` of its prefill."""
        while not self._stop.wait(min(1.0, self.unclaimed_ttl_s / 4)):
            deadline = time.monotonic() - self.unclaimed_ttl_s
            for result in self.pool.kept_results():
                with self._lock:
                    if result.finished > deadline or result.request_id in self._busy:
                        continue
                    self._busy.add(result.request_id)  # a receiver arriving now is refused, not raced
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
        result = self.pool.kept_result(request_id) if isinstance(request_id, str) else None
        if result is None:
            raise KVTransferError(f"no kept KV for request {request_id!r} (not prefilled with keep_kv, or already sent)")
        try:
            self.pool.kv_source(result)
        except RuntimeError as exc:  # a worker holding it died: there is nothing to send
            self.pool.release(result)
            raise KVTransferError(str(exc)) from None
        with self._lock:
            if request_id in self._busy:
                raise KVTransferError(f"the KV of request {request_id!r} is already being sent")
            self._busy.add(request_id)
        return result

    def _check_receiver(self, hello: dict) -> None:
        """Refuse a receiver that says it runs another model, KV dtype or block size."""
        pool = self.pool
        ours = {
            "model_fingerprint": pool.model_config.fingerprint(),
            "dtype": pool.worker_infos[0][0].dtype,
            "block_size": pool.config.block_size,
        }
        for key, value in ours.items():
            theirs = hello.get(key)
            if theirs is not None and theirs != value:
                raise KVTransferError(
                    f"the receiver expects {key} {theirs!r}; this prefill pool's KV has {value!r} "
                    f"(request {hello.get('request_id')!r} is kept for a matching receiver)"
                )

    def _stream(self, conn: socket.socket, result) -> int:
        """Send the request's frames; returns the KV payload bytes."""
        pool = self.pool
        cfg = pool.config
        kv = pool.fetch_kv(result)  # [layers, tokens, width] in token order
        send_frame(conn, "begin", {
            "request_id": result.request_id,
            "tokens": result.num_tokens,
            "layers": kv.shape[0],
            "dtype": str(kv.dtype).removeprefix("torch."),
            "block_size": cfg.block_size,
            "width": kv.shape[2],
            "num_blocks": -(-result.num_tokens // cfg.block_size),
            "model_fingerprint": pool.model_config.fingerprint(),
            "shard_map": {"tp": cfg.tp, "pcp": cfg.pcp, "block_size": cfg.block_size,
                          "layout": "block j of the request was on PCP rank j % pcp; TP ranks hold the same rows"},
        })  # fmt: skip
        sent = 0
        for layer in range(kv.shape[0]):
            blocks = paged(kv[layer], cfg.block_size)
            payload = tensor_buffer(blocks)
            send_frame(conn, "layer", {"layer": layer, "shape": list(blocks.shape)}, payload)
            sent += payload.nbytes
        send_frame(conn, "end", {"request_id": result.request_id, "layers": kv.shape[0]})
        return sent

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.transfers[outcome] += 1


def _try_error(conn: socket.socket, message: str) -> None:
    try:
        send_frame(conn, "error", {"message": message})
    except OSError:
        pass  # the receiver is gone
