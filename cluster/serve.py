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
    servers from this replica's KV (``cluster.openai_api``, ``cluster.first_token``).
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
import contextlib
import json
import logging
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import ray
from ray import serve
from ray.util import get_current_placement_group
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from cluster.decode_answer import DecodeAnswer
from cluster.decode_tokens import TokenText, generate_body
from cluster.kv_server import KVServer
from cluster.metrics import PoolMetrics
from cluster.first_token import FirstToken, first_chunk, generation_defaults, shift, token_text, usage
from cluster.openai_api import (
    CHAT, COMPLETIONS, MODELS, DecodeServers, OpenAIError, Parsed, Tokenizer, Upstream, chat_answer, client_chunk, encoded_forward, open_upstream,
    parse_request, prompt_json, Timeline, model_card, sse, with_cached_tokens,
)  # fmt: skip
from cluster.pool import PrefillPool
from cluster.results import PromptTooLong
from configs.secrets import matches
from configs.serve import ServeConfig

logger = logging.getLogger("ray.serve")
MSGPACK = ("application/msgpack", "application/x-msgpack")
KEYS = {"token_ids", "request_id", "handoff", "return_logits"}
COMPLETION_MAX_TOKENS = 16  # vLLM's completions' max_tokens when a request gives none (its chats': the rest of the context)


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
        self.decoders = DecodeServers.of([(url, key.reveal() if (key := config.decode_key(url)) else None) for url in config.decode_servers],
                                         probe_interval_s=config.decode_probe_interval_s, on_event=self.metrics.decode_event,
                                         on_stall=self.metrics.resume_stalled)  # fmt: skip
        self.timeline = Timeline()  # the steps of recent requests handed to decode servers
        self.started = int(time.time())  # the served model's "created" in /v1/models
        self.tokenizer = Tokenizer(config.tokenizer or config.pool.checkpoint)
        if config.decode_servers:  # the OpenAI endpoint, its user, answers only with decode servers
            self.tokenizer.available  # noqa: B018 -- loaded now: else the first request waits for transformers' import (2-3 s)
        self.generation = generation_defaults(config.pool.checkpoint)  # vLLM's sampling defaults for the first token

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        prefix = request.scope.get("root_path", "")  # the application's route prefix, when Serve says it
        path = "/" + (path[len(prefix) :] if prefix and path.startswith(prefix) else path).strip("/")
        if self.api_keys and not matches(_bearer(request), self.api_keys):  # before anything reaches the pool
            return _unauthorized(path)
        if path in (COMPLETIONS, CHAT) or path == MODELS or path.startswith(MODELS + "/"):
            try:
                if path.startswith(MODELS):
                    return self._models(request.method, path)
                if request.method != "POST":
                    raise OpenAIError(405, f"{request.method} {path}: use POST")
                return await self._openai(request, chat=path == CHAT)
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

    def _models(self, method: str, path: str) -> Response:
        """``GET /v1/models`` (the served model, as vLLM lists it) and ``GET /v1/models/{id}``."""
        if method != "GET":
            raise OpenAIError(405, f"{method} {path}: use GET")
        name = self.config.model_name
        card = model_card(name, self.config.pool.checkpoint or self.config.pool.model, self.pool.max_prompt_tokens, self.started)
        wanted = path[len(MODELS) + 1 :]
        if not wanted:
            return Response(json.dumps({"object": "list", "data": [card]}), media_type="application/json")
        if wanted != name:
            raise OpenAIError(404, f"model {wanted!r} is not served here; this endpoint serves {name!r}")
        return Response(json.dumps(card), media_type="application/json")

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
            "decode_servers": self.decoders.report(),
            "decode_resumptions": self.decoders.resumptions,
            "decode_resume_stalls": list(self.decoders.stalls),
            "handoff_timeline": self.timeline.recent(),
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
        result = await self._run(req["tokens"], client_id, req["handoff"])
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

    async def _run(self, tokens: list[int], client_id: str | None, keep_kv: bool):
        """Prefill ``tokens`` under a tier-unique request id; ``HTTPError`` says why not."""
        request_id, future = self._submit(tokens, client_id, keep_kv)
        return await self._wait(request_id, future)

    def _submit(self, tokens: list[int], client_id: str | None, keep_kv: bool):
        if not self.pool.alive:
            raise HTTPError(503, "the prefill pool of this replica is down")
        request_id = f"{client_id}-{uuid.uuid4().hex[:16]}" if client_id else uuid.uuid4().hex  # unique across the tier
        try:
            return request_id, self.pool.submit(tokens, request_id=request_id, keep_kv=keep_kv)
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

    async def _openai(self, request: Request, chat: bool) -> Response:
        """An OpenAI completion or chat completion: prefill here with the KV kept, decode on a vLLM
        decode server that loads it (``cluster.openai_api``). When the tier reproduces the request's
        sampling (``cluster.first_token``), the first token is sampled here from the prefill's logits
        and sent at once, and the decode server gets the prompt followed by it. Otherwise the request
        goes to the decode server with a ticket issued ahead (``KVServer.ticket_ahead``) as soon as the
        prefill is submitted: vLLM takes it in, allocates its blocks and asks for the KV while the pool
        prefills, and computes the first token itself."""
        received = time.time()
        if not self.decoders.servers:
            raise OpenAIError(503, "this tier has no decode servers (ServeConfig.decode_servers)")
        try:
            body = json.loads(await self._body(request))
        except HTTPError as exc:
            raise OpenAIError(exc.status, str(exc)) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"body is not valid JSON ({exc})") from None
        parsed = parse_request(body, chat, self.config.model_name)
        token_ids = self.tokenizer.encode(parsed)
        default_max = None if chat else COMPLETION_MAX_TOKENS
        first = FirstToken.plan(parsed.passthrough, self.generation, self._eos_id(), default_max) if self.tokenizer.available else "no tokenizer"
        if isinstance(first, FirstToken):
            return await self._openai_first_token(parsed, token_ids, first, received)
        try:
            request_id, future = self._submit(token_ids, None, keep_kv=True)
        except HTTPError as exc:
            raise OpenAIError(exc.status, str(exc)) from None
        forward = self._forward(parsed, parsed.passthrough, token_ids, {"mlapool": self.kv.ticket_ahead(request_id, token_ids, host=self.ticket_host)})
        result, upstream = await self._prefill_and_forward(request_id, future, forward)
        answer = self._decode_answer(parsed, forward, len(token_ids), result.cached_tokens, None)
        logger.info("decoding", extra={"mlapool_request_id": request_id, "decode_server": upstream.server.url, "first_token": first})
        return await self._answer(upstream, result, parsed, answer)

    async def _openai_first_token(self, parsed: Parsed, token_ids: list[int], first: FirstToken, received: float) -> Response:
        """Prefill, sample the first token here, and send the rest to a decode server (or end here).
        The decode request's prompt is serialized while the prefill runs: neither the first token nor
        the forward beside it waits for it (3.7 ms for 32K ids on the 2-core CPU)."""
        encoding = asyncio.ensure_future(asyncio.to_thread(prompt_json, token_ids))
        try:
            result = await self._run(token_ids, None, keep_kv=True)
        except HTTPError as exc:
            raise OpenAIError(exc.status, str(exc)) from None
        finally:
            prompt = await encoding
        self.timeline.mark(result.request_id, "received", received)
        self.timeline.mark(result.request_id, "prefilled")
        self.timeline.mark(result.request_id, "pool_ttft_s", result.ttft_s)  # the pool's part of the TTFT
        try:
            token = first.sample(result.logits) if first.greedy else await asyncio.to_thread(first.sample, result.logits)
            finish = first.finish(token)
            text = "" if finish == "stop" else token_text(self.tokenizer.tokenizer, token_ids, token)
            if text is None:  # not whole on its own: vLLM samples the first token after all
                forward = self._forward(parsed, parsed.passthrough, token_ids, self._ticket(result))
                upstream = await open_upstream(self.decoders, forward, self.config.decode_timeout_s)
                return await self._answer(upstream, result, parsed, self._decode_answer(parsed, forward, len(token_ids), result.cached_tokens, None))
            head = first_chunk("cmpl-" + result.request_id, self.config.model_name, int(time.time()), text, token, finish,
                               token_ids if first.return_token_ids else None)  # fmt: skip
            if finish is not None:
                await self._discard(result)
                return self._local_answer(parsed, head, len(token_ids), result.cached_tokens)
            forward = self._forward(parsed, first.forwarded(parsed.passthrough), token_ids + [token], self._ticket(result, describe=False))
            tokens = generate = generated = None
            if self.config.decode_endpoint == "generate" and TokenText.supports(self.tokenizer.tokenizer):  # token ids back, their text made here
                tokens, generate = TokenText.maker(self.tokenizer.tokenizer, self._eos_id(), forward), generate_body(forward)
                generated = encoded_forward(generate, prompt, token, "token_ids")
            self.timeline.mark(result.request_id, "forwarded")
            opening = asyncio.ensure_future(open_upstream(self.decoders, forward, self.config.decode_timeout_s, encoded_forward(forward, prompt, token),
                                                          generate, generated))  # fmt: skip
            answer = self._decode_answer(parsed, forward, len(token_ids), result.cached_tokens, head, tokens)
            if parsed.stream:  # the first token goes out now, not once a decode server answers (vLLM answers with its first token)
                return StreamingResponse(self._head_then_relay(head, opening, result, parsed, answer), media_type="text/event-stream")
            self.kv.describe_ahead(result)
            upstream = await opening
        except BaseException:  # no decode server took it, or the client left
            await self._discard(result)
            raise
        return await self._answer(upstream, result, parsed, answer)

    async def _head_then_relay(self, head: dict[str, Any], opening: asyncio.Future, result, parsed: Parsed, answer: DecodeAnswer):
        """A streamed answer whose first token is the tier's: that token at once, then the decode
        server's tokens (``answer``: going on on another server if one breaks off). A failure to
        reach one comes as an error event (the answer has begun)."""
        model, upstream, request_id = self.config.model_name, None, result.request_id
        try:
            yield sse(client_chunk(head, parsed.chat, model, True))
            self.timeline.mark(request_id, "first_token_sent")
            self.kv.describe_ahead(result)  # after the first token: the decode server's hello is milliseconds away
            try:
                upstream = await opening
                self.timeline.mark(request_id, "upstream_answered")
            except OpenAIError as exc:
                yield sse(exc.body())
                yield b"data: [DONE]\n\n"
                return
            if upstream.response.status != 200:
                text = (await upstream.response.text())[:500]
                yield sse(OpenAIError(upstream.response.status, f"the decode server refused the rest of the answer: {text}").body())
                yield b"data: [DONE]\n\n"
                return
            second, relay = True, answer.stream(upstream, result)
            upstream = result = None  # the answer's own from here: it closes and releases them however it ends
            async with contextlib.aclosing(relay):
                async for event in relay:
                    yield event
                    if second:  # vLLM's first event is the answer's second token
                        self.timeline.mark(request_id, "second_token_sent")
                        second = False
        finally:
            if upstream is not None:
                await upstream.close()
            elif not opening.done():
                opening.cancel()  # the client left first: open_upstream gives the server back
            elif not opening.cancelled():
                opening.exception()  # retrieved: it was answered as an error event
            if result is not None:
                await self._discard(result)

    def _forward(self, parsed: Parsed, params: dict[str, Any], prompt: list[int], ticket: dict[str, Any]) -> dict[str, Any]:
        """The completion request for a decode server (a stream's with its tokens' ids: where it goes on
        if the server breaks it off, ``cluster.decode_answer``)."""
        forward = {**params, "model": self.config.decode_model_name or self.config.model_name, "prompt": prompt, "stream": parsed.stream,
                   "kv_transfer_params": ticket}  # fmt: skip
        if "max_completion_tokens" in forward:  # a chat's name for it; vLLM's completions take max_tokens
            forward.setdefault("max_tokens", forward.pop("max_completion_tokens"))
        if parsed.stream:
            forward.update(stream_options={"include_usage": parsed.include_usage}, return_token_ids=True)
        return forward

    def _decode_answer(self, parsed: Parsed, forward: dict[str, Any], prompt_tokens: int, cached_tokens: int, head: dict[str, Any] | None,
                       tokens: Callable[[list[int]], TokenText] | None = None) -> DecodeAnswer:  # fmt: skip
        return DecodeAnswer(
            self.decoders, forward, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, chat=parsed.chat, model=self.config.model_name,
            head=head, token_ids_asked=parsed.passthrough.get("return_token_ids") is True, resumptions=self.config.decode_resumptions,
            timeout_s=self.config.decode_timeout_s, prefill=self._prefill_kept, discard=self._discard, tokens=tokens,
        )  # fmt: skip

    async def _prefill_kept(self, token_ids: list[int]) -> tuple[Any, dict[str, Any]]:
        """A prefill whose KV is kept for a decode server, and its ticket (an answer going on elsewhere)."""
        try:
            result = await self._run(token_ids, None, keep_kv=True)
        except HTTPError as exc:
            raise OpenAIError(exc.status, f"the prefill to go on failed: {exc}") from None
        return result, self._ticket(result)

    def _ticket(self, result, describe: bool = True) -> dict[str, Any]:
        """``kv_transfer_params`` of a decode request that takes ``result``'s KV (``describe``: KVServer.ticket's)."""
        return {"mlapool": self.kv.ticket(result, host=self.ticket_host, describe=describe)}

    async def _discard(self, result) -> None:
        """Release a prefill's kept KV (the KV server's lock and the pool's call, off the event loop)."""
        await asyncio.to_thread(self.kv.discard, result)

    def _eos_id(self) -> int | None:
        eos = self.tokenizer.tokenizer.eos_token_id
        return eos if type(eos) is int else None

    def _local_answer(self, parsed: Parsed, head: dict[str, Any], prompt_tokens: int, cached_tokens: int) -> Response:
        """The answer of a request whose first token ended it."""
        model, counts = self.config.model_name, usage(prompt_tokens, 1, cached_tokens)
        if not parsed.stream:
            answer = {**head, "usage": counts}
            return Response(json.dumps(chat_answer(answer, model) if parsed.chat else answer), media_type="application/json")
        events = [sse(client_chunk(head, parsed.chat, model, True))]
        if parsed.include_usage:
            events.append(sse(client_chunk({**head, "choices": [], "usage": counts}, parsed.chat, model, False)))
        return StreamingResponse(iter([*events, b"data: [DONE]\n\n"]), media_type="text/event-stream")

    async def _answer(self, upstream: Upstream, result, parsed: Parsed, answer: DecodeAnswer) -> Response:
        """The decode servers' answer, as the client's (behind ``answer.head``, the first token's chunk,
        when it was the tier's); the KV is released when it ends however it ends."""
        model, cached = self.config.model_name, result.cached_tokens
        if upstream.response.status == 200 and parsed.stream:
            return StreamingResponse(answer.stream(upstream, result), media_type="text/event-stream")
        if upstream.response.status != 200:  # vLLM judging the request (open_upstream passed over failing servers)
            try:
                status, body = upstream.response.status, await upstream.response.read()
            finally:
                await upstream.close()
                await self._discard(result)
            return Response(body, status_code=status, media_type="application/json")
        status, body = await answer.whole(upstream, result)
        if status == 200:
            completion = json.loads(body)
            if answer.head is not None:
                completion = shift(completion, answer.head["id"], answer.head)
            completion = with_cached_tokens(completion, cached)
            body = json.dumps(chat_answer(completion, model) if parsed.chat else {**completion, "model": model}).encode()
        return Response(body, status_code=status, media_type="application/json")

    async def _prefill_and_forward(self, request_id: str, future, forward: dict[str, Any]):
        """The prefill and the decode server's answer (its headers), run at once. The prefill failing
        (or the client leaving) abandons the decode request; no decode server taking it cancels the
        prefill; either way nothing is left held."""
        prefill = asyncio.ensure_future(self._wait(request_id, future))
        decode = asyncio.ensure_future(open_upstream(self.decoders, forward, self.config.decode_timeout_s))
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if decode.done() and decode.exception() is not None:
                raise decode.exception()
            result = await prefill
        except BaseException as exc:
            for task in (prefill, decode):
                task.cancel()
            if decode.done() and not decode.cancelled() and decode.exception() is None:
                await decode.result().close()  # the decode server aborts the request: its load is refused
            with contextlib.suppress(BaseException):
                await prefill  # a cancelled prefill leaves the pool before its next chunk, its KV freed
            kept = self.pool.kept_result(request_id)
            if kept is not None:  # prefilled just before the decode request failed
                await self._discard(kept)
            if isinstance(exc, HTTPError):
                raise OpenAIError(exc.status, str(exc)) from None
            raise
        try:
            return result, await decode
        except BaseException:  # no decode server took it, or the client left
            await self._discard(result)
            raise


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
