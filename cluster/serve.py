"""The prefill tier as a Ray Serve application.

    serve run deploy/serve.yaml                  # or: serve deploy deploy/serve.yaml on a running cluster
    curl -X POST localhost:8000/prefill -H 'content-type: application/json' -d '{"token_ids": [1, 2, 3]}'

Each Serve replica is one placement group (``configs.serve.ServeConfig.deployment_options``):
bundle 0 holds the replica actor, the next ``tp * pcp`` bundles the pool's workers, so Serve (and
the cluster autoscaler) place and scale whole TP x PCP groups. Every replica runs a
:class:`~cluster.pool.PrefillPool` in its group and a :class:`~cluster.kv_server.KVServer`.

HTTP API (JSON, or msgpack with ``content-type: application/msgpack``; the answer uses the same):

``POST /prefill`` ``{"token_ids": [int, ...], "request_id": str?, "handoff": bool?, "return_logits": bool?}``
    200 ``{"request_id", "client_request_id"?, "num_tokens", "cached_tokens", "first_token", "ttft_s", "logits"?, "ticket"?}``
    (``cached_tokens``: of the prompt, taken from the replica's prefix cache).
    ``request_id`` is unique across the tier (every replica): the client's ``request_id`` with a
    random suffix (as vLLM's servers do), or a random one; tickets, logs and metrics use it.
    ``logits``
    are the last token's float32 logits (a list in JSON, little-endian bytes in msgpack), unless
    ``return_logits`` is false. With ``handoff`` the KV stays on the replica and ``ticket`` says
    where a decode server fetches it (``kv.receiver.KVReceiver(host, port, token,
    model_fingerprint).fetch(request_id)``) within ``expires_in_s``; without it the KV is freed.
    A client that disconnects cancels its request: it leaves the pool before its next chunk and
    its KV is freed.
``POST /v1/completions``, ``POST /v1/chat/completions`` OpenAI's API, decoded by the configured vLLM
    servers from this replica's KV (``cluster.openai_serving``: the request's life; ``cluster.openai_api``, ``cluster.first_token``).
``GET /v1/models``, ``GET /v1/models/{id}`` the served model, as vLLM lists its own (``max_model_len``:
    the longest prompt the pool takes).
``GET /`` the model, layout, backend and limits of this replica, and its request counters.

With ``api_keys`` set, every endpoint here asks for ``Authorization: Bearer KEY`` (one of the keys,
compared in constant time) and answers 401 without it (OpenAI's error form on ``/v1/*``), before the
request reaches the pool. Serve's own health (``/-/healthz``, ``/-/routes``) and Ray's metrics port
are not this application's and stay open to probes and scrapers; neither shows a prompt or a secret.

Errors are ``{"error": message}`` with 400 (not JSON/msgpack), 404/405 (path, method), 413 (body
over ``max_body_bytes``, prompt longer than the cache holds), 415 (content type), 422 (wrong keys,
types or token ids outside the vocabulary), 503 (the pool is down); a bad request never reaches
the workers, and a failed prefill fails only its own request (500, after the pool's one retry
when a worker failed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
import warnings
from typing import Any

import msgpack
import numpy as np
import ray
from ray import serve
from ray.util import get_current_placement_group
from starlette.requests import Request
from starlette.responses import Response

from cluster.kv_server import KVServer
from cluster.metrics import PoolMetrics
from cluster.openai_api import CHAT, COMPLETIONS, MODELS, OpenAIError
from cluster.openai_serving import OpenAIServing
from cluster.pool import PrefillPool
from cluster.results import HTTPError, PromptTooLong
from configs.secrets import matches
from configs.serve import ServeConfig

logger = logging.getLogger("ray.serve")
MSGPACK = ("application/msgpack", "application/x-msgpack")
KEYS = {"token_ids", "request_id", "handoff", "return_logits"}


def parse_prefill(body: bytes, content_type: str) -> dict[str, Any]:
    """A prefill request from its body, checked; ``HTTPError`` (400, 415 or 422) names what is wrong."""
    if content_type in MSGPACK:
        try:
            payload = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as exc:  # noqa: BLE001 -- msgpack raises several types for bad input
            raise HTTPError(400, f"body is not valid msgpack ({type(exc).__name__})") from None
    elif content_type in ("", "application/json"):
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPError(400, f"body is not valid JSON ({exc})") from None
    else:
        raise HTTPError(415, f"content type {content_type!r} is not supported; valid: application/json, application/msgpack")
    if not isinstance(payload, dict):
        raise HTTPError(422, f"body must be an object with token_ids, got {type(payload).__name__}")
    unknown = set(payload) - KEYS
    if unknown:
        raise HTTPError(422, f"unknown keys {sorted(map(str, unknown))}; valid: {sorted(KEYS)}")
    tokens = payload.get("token_ids")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        raise HTTPError(422, "token_ids must be a non-empty list of integers")
    request_id = payload.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= 128):
        raise HTTPError(422, "request_id must be a string of 1-128 characters")
    for flag in ("handoff", "return_logits"):
        if not isinstance(payload.get(flag, False), bool):
            raise HTTPError(422, f"{flag} must be true or false, got {payload[flag]!r}")
    return {
        "tokens": tokens,
        "request_id": request_id,
        "handoff": payload.get("handoff", False),
        "return_logits": payload.get("return_logits", True),
    }


class PrefillServer:
    """One Serve replica: a prefill pool in the replica's placement group, and its KV server."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics = PoolMetrics(config.name)
        self.pool = PrefillPool(config.pool, placement_group=get_current_placement_group(), bundle_offset=1, metrics=self.metrics)
        self.pool.start()
        token = config.kv_token.reveal() if config.kv_token is not None else None
        self.kv = KVServer(self.pool, host=config.kv_host, port=config.kv_port, token=token, unclaimed_ttl_s=config.kv_ttl_s)
        self.api_keys = [key.reveal() for key in config.api_keys]  # ValueError names a variable or file that lacks one
        self.ticket_host = ray.util.get_node_ip_address() if config.kv_host in ("0.0.0.0", "::") else self.kv.host
        self.fingerprint = self.pool.model_config.fingerprint()
        self.openai = OpenAIServing(config, self.pool, self.kv, self.ticket_host, self.metrics, self._submit, self._wait, self._body)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        prefix = request.scope.get("root_path", "")  # the application's route prefix, when Serve says it
        path = "/" + (path[len(prefix) :] if prefix and path.startswith(prefix) else path).strip("/")
        if self.api_keys and not matches(_bearer(request), self.api_keys):  # before anything reaches the pool
            return _unauthorized(path)
        if path in (COMPLETIONS, CHAT) or path == MODELS or path.startswith(MODELS + "/"):
            try:
                if path.startswith(MODELS):
                    return self.openai.models(request.method, path)
                if request.method != "POST":
                    raise OpenAIError(405, f"{request.method} {path}: use POST")
                return await self.openai.answer(request, chat=path == CHAT)
            except OpenAIError as exc:
                return Response(json.dumps(exc.body()), status_code=exc.status, media_type="application/json")
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        reply = "msgpack" if content_type in MSGPACK else "json"
        try:
            if path == "/prefill":
                if request.method != "POST":
                    raise HTTPError(405, f"{request.method} /prefill: use POST")
                answer = await self._prefill(parse_prefill(await self._body(request), content_type))
            elif path == "/":
                if request.method != "GET":
                    raise HTTPError(405, f"{request.method} /: use GET")
                answer = self.info()
            else:
                raise HTTPError(404, f"no endpoint {request.url.path!r}; valid: POST /prefill, POST {COMPLETIONS}, POST {CHAT}, GET {MODELS}, GET /")
            return _response(200, answer, reply)
        except HTTPError as exc:
            return _response(exc.status, {"error": str(exc)}, reply)

    def info(self) -> dict[str, Any]:
        cfg, info = self.config.pool, self.pool.worker_infos[0][0]
        return {
            "model": self.pool.model_config.name,
            "model_fingerprint": self.fingerprint,
            "tp": cfg.tp,
            "pcp": cfg.pcp,
            "backend": info.backend,
            "device": info.device,
            "dtype": info.dtype,
            "weights": info.weights,
            "experts_per_worker": [i.experts for i in self.pool.worker_infos[0]] if info.experts else None,
            "max_prompt_tokens": self.pool.max_prompt_tokens,
            "vocab_size": self.pool.model_config.vocab_size,
            "in_flight": self.pool.in_flight,
            "requests": self.pool.counts(),
            "prefix_cache": self.pool.prefix_report()[0],
            "kv_kept_requests": len(self.pool.kept_results()),
            "kv_transfers": dict(self.kv.transfers),
            **self.openai.report(),
        }

    def check_health(self) -> None:
        """Serve's health check: a replica whose pool is gone is replaced."""
        if not self.pool.alive:
            raise RuntimeError("the prefill pool of this replica is down")

    def __del__(self) -> None:  # Serve calls it when it stops the replica
        if hasattr(self, "kv"):
            self.kv.close()
        self.pool.shutdown()

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, f"body of {declared} bytes is over the limit of {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise HTTPError(413, f"body is over the limit of {limit} bytes")
        return bytes(body)

    async def _prefill(self, req: dict[str, Any]) -> dict[str, Any]:
        client_id = req["request_id"]
        result = await self._run(req["tokens"], client_id, req["handoff"], req["return_logits"])
        logger.info("prefilled", extra={"mlapool_request_id": result.request_id, "tokens": result.num_tokens, "ttft_s": round(result.ttft_s, 4)})
        answer: dict[str, Any] = {
            "request_id": result.request_id,
            **({"client_request_id": client_id} if client_id else {}),
            "num_tokens": result.num_tokens,
            "cached_tokens": result.cached_tokens,
            "first_token": result.first_token,
            "ttft_s": round(result.ttft_s, 6),
        }
        if req["return_logits"]:
            answer["logits"] = result.logits.numpy()
        if req["handoff"]:
            answer["ticket"] = self.kv.ticket(result, host=self.ticket_host)
        return answer

    async def _run(self, tokens: list[int], client_id: str | None, keep_kv: bool, return_logits: bool):
        """Prefill ``tokens`` under a tier-unique request id; ``HTTPError`` says why not."""
        request_id, future = self._submit(tokens, client_id, keep_kv, return_logits)
        return await self._wait(request_id, future)

    def _submit(self, tokens: list[int], client_id: str | None, keep_kv: bool, return_logits: bool):
        if not self.pool.alive:
            raise HTTPError(503, "the prefill pool of this replica is down")
        request_id = f"{client_id}-{uuid.uuid4().hex[:16]}" if client_id else uuid.uuid4().hex  # unique across the tier
        try:
            return request_id, self.pool.submit(tokens, request_id=request_id, keep_kv=keep_kv, return_logits=return_logits)
        except PromptTooLong as exc:
            raise HTTPError(413, str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise HTTPError(422, str(exc)) from None

    async def _wait(self, request_id: str, future):
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # Serve cancels the call when the HTTP client disconnects
            future.cancel()  # out of the pool before its next chunk, its KV freed
            logger.info("cancelled: the client disconnected", extra={"mlapool_request_id": request_id})
            raise
        except Exception as exc:  # noqa: BLE001 -- a failed prefill fails this request alone
            logger.warning("prefill failed", extra={"mlapool_request_id": request_id, "error": str(exc)})
            raise HTTPError(500, f"prefill failed: {exc}") from None


def _bearer(request: Request) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def _unauthorized(path: str) -> Response:
    """401 without a key or with a wrong one: OpenAI's error form on its endpoints, ours elsewhere."""
    message = "a valid API key is needed: send it as 'Authorization: Bearer KEY'"
    if path.startswith("/v1/"):
        body: dict[str, Any] = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    else:
        body = {"error": message}
    return Response(json.dumps(body), status_code=401, media_type="application/json", headers={"WWW-Authenticate": "Bearer"})


def _response(status: int, answer: dict[str, Any], form: str) -> Response:
    logits = answer.get("logits")
    if form == "msgpack":
        if isinstance(logits, np.ndarray):
            answer = {**answer, "logits": logits.astype("<f4").tobytes(), "logits_dtype": "float32"}
        return Response(msgpack.packb(answer, use_bin_type=True), status_code=status, media_type="application/msgpack")
    if isinstance(logits, np.ndarray):
        answer = {**answer, "logits": logits.tolist()}
    return Response(json.dumps(answer), status_code=status, media_type="application/json")


def build_app(config: ServeConfig) -> serve.Application:
    """The Serve application of ``config``: one autoscaled deployment of :class:`PrefillServer`."""
    with warnings.catch_warnings():
        # Serve checks look_back_period_s against its deprecated metrics_interval_s (10 s), not against the
        # interval replicas really report at (its environment variable, which ServeConfig checks against)
        warnings.filterwarnings("ignore", message="`look_back_period_s`.*`metrics_interval_s`", category=FutureWarning)
        return serve.deployment(PrefillServer).options(**config.deployment_options()).bind(config)


def app(args: dict[str, Any]) -> serve.Application:
    """Application builder for Serve config files: ``import_path: cluster.serve:app``, ``args`` the
    fields of :class:`~configs.serve.ServeConfig` (``pool``: a mapping of PoolConfig fields)."""
    return build_app(ServeConfig.from_dict(args or {}))
