"""The OpenAI completions of one Serve replica (``cluster.serve``): each request's life from its
parsed body to the client's answer. The prompt is prefilled by the replica's pool with its KV kept;
the first token is the tier's when it reproduces the request's sampling (``cluster.first_token``),
and the rest is decoded by vLLM decode servers that load the KV (``cluster.openai_api``), going on on
another server if one breaks an answer off (``cluster.decode_answer``). A streamed answer is asked of
its decode server as the prefill is submitted (``ServeConfig.decode_forward``, ``kv.vllm_first_token``).
The KV is released when the answer ends, however it ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from cluster.decode_answer import DecodeAnswer
from cluster.decode_tokens import TokenText, generate_body
from cluster.first_token import FirstToken, first_chunk, generation_defaults, shift, token_text, usage
from cluster.kv_server import KVServer
from cluster.metrics import PoolMetrics
from cluster.openai_api import (
    MODELS, DecodeServers, OpenAIError, Parsed, Tokenizer, Upstream, chat_answer, client_chunk, encoded_forward, model_card, open_upstream,
    parse_request, prompt_json, Timeline, sse, with_cached_tokens,
)  # fmt: skip
from cluster.pool import PrefillPool
from cluster.results import HTTPError, PrefillResult
from configs.serve import ServeConfig

logger = logging.getLogger("ray.serve")
COMPLETION_MAX_TOKENS = 16  # vLLM's completions' max_tokens when a request gives none (its chats': the rest of the context)


class OpenAIServing:
    """``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models`` of one replica.

    ``submit(token_ids, client_id, keep_kv, return_logits)`` puts a prompt in the replica's pool and gives its
    tier-unique request id and future; ``wait(request_id, future)`` its result; ``read_body(request)``
    the request's body within the size limit. Those three are the replica's (``HTTPError`` says why
    not; answered here in OpenAI's form)."""

    def __init__(self, config: ServeConfig, pool: PrefillPool, kv: KVServer, ticket_host: str, metrics: PoolMetrics,
                 submit: Callable[[list[int], str | None, bool, bool], tuple[str, Future]],
                 wait: Callable[[str, Future], Awaitable[PrefillResult]], read_body: Callable[[Request], Awaitable[bytes]]) -> None:  # fmt: skip
        self.config, self.pool, self.kv, self.ticket_host = config, pool, kv, ticket_host
        self.submit, self.wait, self.read_body = submit, wait, read_body
        self.decoders = DecodeServers.of([(url, key.reveal() if (key := config.decode_key(url)) else None) for url in config.decode_servers],
                                         probe_interval_s=config.decode_probe_interval_s, on_event=metrics.decode_event,
                                         on_stall=metrics.resume_stalled)  # fmt: skip
        self.timeline = Timeline()  # the steps of recent requests handed to decode servers
        self.started = int(time.time())  # the served model's "created" in /v1/models
        self.tokenizer = Tokenizer(config.tokenizer or config.pool.checkpoint)
        if config.decode_servers:  # the OpenAI endpoint, its user, answers only with decode servers
            self.tokenizer.available  # noqa: B018 -- loaded now: else the first request waits for transformers' import (2-3 s)
        self.generation = generation_defaults(config.pool.checkpoint)  # vLLM's sampling defaults for the first token

    def report(self) -> dict[str, Any]:
        """The decode servers, their resumptions and stalls, and the steps of recent handoffs (``GET /``)."""
        return {
            "decode_servers": self.decoders.report(),
            "decode_resumptions": self.decoders.resumptions,
            "decode_resume_stalls": list(self.decoders.stalls),
            "handoff_timeline": self.timeline.recent(),
        }

    def models(self, method: str, path: str) -> Response:
        """``GET /v1/models`` (the served model, as vLLM lists it) and ``GET /v1/models/{id}``; ``OpenAIError``
        for another method or model."""
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

    async def answer(self, request: Request, chat: bool) -> Response:
        """An OpenAI completion or chat completion: prefill here with the KV kept, decode on a vLLM
        decode server that loads it (``cluster.openai_api``). When the tier reproduces the request's
        sampling (``cluster.first_token``), the first token is sampled here from the prefill's logits
        and sent at once, and the decode server gets the prompt followed by it, or, streamed, the
        prompt alone as the prefill is submitted (:meth:`_first_token_early`). Otherwise the request
        goes to the decode server with a ticket issued ahead (``KVServer.ticket_ahead``) as soon as the
        prefill is submitted: vLLM takes it in, allocates its blocks and asks for the KV while the pool
        prefills, and computes the first token itself."""
        received = time.time()
        if not self.decoders.servers:
            raise OpenAIError(503, "this tier has no decode servers (ServeConfig.decode_servers)")
        try:
            body = json.loads(await self.read_body(request))
        except HTTPError as exc:
            raise OpenAIError(exc.status, str(exc)) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"body is not valid JSON ({exc})") from None
        parsed = parse_request(body, chat, self.config.model_name)
        # text is tokenized off the event loop that relays every answer's stream: transformers' fast
        # tokenizers release the GIL as they encode, and a 32K-token prompt took 45 ms on the busy 2-core
        # CPU (17K: 25 ms), a stall of every other client's stream when done here; ids need no thread
        ids = isinstance(parsed.prompt, list) and not parsed.chat
        token_ids = list(parsed.prompt) if ids else await asyncio.to_thread(self.tokenizer.encode, parsed)
        default_max = None if chat else COMPLETION_MAX_TOKENS
        first = FirstToken.plan(parsed.passthrough, self.generation, self._eos_id(), default_max) if self.tokenizer.available else "no tokenizer"
        if isinstance(first, FirstToken):
            if self.config.decode_forward == "early" and parsed.stream and first.max_tokens != 1:
                return await self._first_token_early(parsed, token_ids, first, received)
            return await self._with_first_token(parsed, token_ids, first, received)
        try:
            request_id, future = self.submit(token_ids, None, True, False)  # vLLM samples the first token
        except HTTPError as exc:
            raise OpenAIError(exc.status, str(exc)) from None
        forward = self._forward(parsed, parsed.passthrough, token_ids, {"mlapool": self.kv.ticket_ahead(request_id, token_ids, host=self.ticket_host)})
        result, upstream = await self._prefill_and_forward(request_id, future, forward)
        answer = self._decode_answer(parsed, forward, len(token_ids), result.cached_tokens, None)
        logger.info("decoding", extra={"mlapool_request_id": request_id, "decode_server": upstream.server.url, "first_token": first})
        return await self._answer(upstream, result, parsed, answer)

    async def _first_token_early(self, parsed: Parsed, token_ids: list[int], first: FirstToken, received: float) -> Response:
        """A streamed answer whose first token the tier samples, asked of a decode server as its prefill
        is submitted (``ServeConfig.decode_forward`` ``early``): vLLM takes the bare prompt in, allocates
        its blocks and connects for the KV while the pool prefills, instead of between the first token
        and the second (19-26 ms at 32K on an H200 host). The first token goes to the client once
        sampled, and to vLLM with the KV's ``done`` (``KVServer.first_token``), which makes it vLLM's
        first token too (``kv.vllm_first_token``); the client gets vLLM's answer after it."""
        try:
            request_id, future = self.submit(token_ids, None, True, not first.greedy)
        except HTTPError as exc:
            raise OpenAIError(exc.status, str(exc)) from None
        ticket = {"mlapool": self.kv.ticket_ahead(request_id, token_ids, host=self.ticket_host, first_token=True)}
        forward = self._forward(parsed, first.forwarded(parsed.passthrough, echoed=True), token_ids, ticket)
        tokens, generate = self._as_token_ids(forward)
        self.timeline.mark(request_id, "received", received)
        try:  # 32K ids are 3.7 ms of JSON on the 2-core CPU: off the event loop, while the pool prefills
            encoded = await asyncio.to_thread(lambda: json.dumps(generate or forward).encode())
            self.timeline.mark(request_id, "forwarded")
            result, opening = await self._prefill_and_forward(request_id, future, forward, generate, encoded, answered=False)
        except BaseException:
            self.kv.first_token(request_id, None)
            raise
        self.timeline.mark(request_id, "prefilled")
        self.timeline.mark(request_id, "pool_ttft_s", result.ttft_s)
        if opening.done() and not opening.cancelled() and opening.exception() is None and opening.result().response.status != 200:
            self.kv.first_token(request_id, None)  # vLLM judged the request (as it would alone): its status, not a first token
            return await self._answer(opening.result(), result, parsed, self._decode_answer(parsed, forward, len(token_ids), result.cached_tokens, None))
        try:
            token, head = await self._first_chunk(first, result, token_ids)
            finish = None if head is None else head["choices"][0]["finish_reason"]
            self.kv.first_token(request_id, token if head is not None and finish is None else None)
            if finish is not None:  # the answer ends here: the decode server's request is abandoned
                await _abandon(opening)
                await self._discard(result)
                return self._local_answer(parsed, head, len(token_ids), result.cached_tokens)
            if head is None:  # not whole on its own: vLLM samples the first token, its answer is the client's whole
                upstream = await opening
                return await self._answer(upstream, result, parsed, self._decode_answer(parsed, forward, len(token_ids), result.cached_tokens, None, tokens))
            answer = self._decode_answer(parsed, forward, len(token_ids), result.cached_tokens, head, tokens, echo=token)
        except BaseException:  # no decode server took it, or the client left
            await _abandon(opening)
            await self._discard(result)
            raise
        return StreamingResponse(self._head_then_relay(head, opening, result, parsed, answer, describe=False), media_type="text/event-stream")

    async def _with_first_token(self, parsed: Parsed, token_ids: list[int], first: FirstToken, received: float) -> Response:
        """Prefill, sample the first token here, and send the rest to a decode server (or end here).
        The decode request's prompt is serialized while the prefill runs: neither the first token nor
        the forward beside it waits for it (3.7 ms for 32K ids on the 2-core CPU)."""
        encoding = asyncio.ensure_future(asyncio.to_thread(prompt_json, token_ids))
        try:
            result = await self._prefill(token_ids, return_logits=not first.greedy)
        except HTTPError as exc:
            raise OpenAIError(exc.status, str(exc)) from None
        finally:
            prompt = await encoding
        self.timeline.mark(result.request_id, "received", received)
        self.timeline.mark(result.request_id, "prefilled")
        self.timeline.mark(result.request_id, "pool_ttft_s", result.ttft_s)  # the pool's part of the TTFT
        try:
            token, head = await self._first_chunk(first, result, token_ids)
            if head is None:  # not whole on its own: vLLM samples the first token after all
                forward = self._forward(parsed, parsed.passthrough, token_ids, self._ticket(result))
                upstream = await open_upstream(self.decoders, forward, self.config.decode_timeout_s)
                return await self._answer(upstream, result, parsed, self._decode_answer(parsed, forward, len(token_ids), result.cached_tokens, None))
            if head["choices"][0]["finish_reason"] is not None:
                await self._discard(result)
                return self._local_answer(parsed, head, len(token_ids), result.cached_tokens)
            forward = self._forward(parsed, first.forwarded(parsed.passthrough), token_ids + [token], self._ticket(result, describe=False))
            tokens, generate = self._as_token_ids(forward)
            generated = None if generate is None else encoded_forward(generate, prompt, token, "token_ids")
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

    async def _head_then_relay(self, head: dict[str, Any], opening: asyncio.Future, result, parsed: Parsed, answer: DecodeAnswer,
                               describe: bool = True):  # fmt: skip
        """A streamed answer whose first token is the tier's: that token at once, then the decode
        server's tokens (``answer``: going on on another server if one breaks off). A failure to
        reach one comes as an error event (the answer has begun). ``describe``: ask the holders where
        the KV is once the token is out (False: the decode server asked for it during the prefill)."""
        model, upstream, request_id = self.config.model_name, None, result.request_id
        try:
            yield sse(client_chunk(head, parsed.chat, model, True))
            self.timeline.mark(request_id, "first_token_sent")
            if describe:
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

    async def _first_chunk(self, first: FirstToken, result: PrefillResult, token_ids: list[int]) -> tuple[int, dict[str, Any] | None]:
        """The first token, greedy the worker's (``PrefillResult.first_token``), else sampled from
        ``result``'s logits, and its chunk (its ``finish_reason`` set when it ends the answer), or None
        when its text is not whole on its own (vLLM samples it then)."""
        token = result.first_token if first.greedy else await asyncio.to_thread(first.sample, result.logits)
        finish = first.finish(token)
        text = "" if finish == "stop" else token_text(self.tokenizer.tokenizer, token_ids, token)
        if text is None:
            return token, None
        return token, first_chunk("cmpl-" + result.request_id, self.config.model_name, int(time.time()), text, token, finish,
                                  token_ids if first.return_token_ids else None)  # fmt: skip

    def _as_token_ids(self, forward: dict[str, Any]) -> tuple[Callable[[list[int]], TokenText] | None, dict[str, Any] | None]:
        """For an answer whose first token is the tier's: what makes the text of the token ids vLLM's
        generate endpoint answers, and ``forward`` as that endpoint's body (both None: ``decode_endpoint``
        completions, or a tokenizer without the Rust backend)."""
        if self.config.decode_endpoint == "generate" and TokenText.supports(self.tokenizer.tokenizer):
            return TokenText.maker(self.tokenizer.tokenizer, self._eos_id(), forward), generate_body(forward)
        return None, None

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
                       tokens: Callable[[list[int]], TokenText] | None = None, echo: int | None = None) -> DecodeAnswer:  # fmt: skip
        return DecodeAnswer(
            self.decoders, forward, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, chat=parsed.chat, model=self.config.model_name,
            head=head, token_ids_asked=parsed.passthrough.get("return_token_ids") is True, resumptions=self.config.decode_resumptions,
            timeout_s=self.config.decode_timeout_s, prefill=self._prefill_kept, discard=self._discard, tokens=tokens, echo=echo,
        )  # fmt: skip

    async def _prefill(self, token_ids: list[int], return_logits: bool) -> PrefillResult:
        """A prefill whose KV is kept for a decode server (``return_logits``: the tier samples its first
        token other than greedily)."""
        request_id, future = self.submit(token_ids, None, True, return_logits)
        return await self.wait(request_id, future)

    async def _prefill_kept(self, token_ids: list[int]) -> tuple[Any, dict[str, Any]]:
        """A prefill whose KV is kept for a decode server, and its ticket (an answer going on elsewhere)."""
        try:
            result = await self._prefill(token_ids, return_logits=False)
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

    async def _prefill_and_forward(self, request_id: str, future, forward: dict[str, Any], generate: dict[str, Any] | None = None,
                                   encoded: bytes | None = None, *, answered: bool = True):  # fmt: skip
        """The prefill and the decode server's answer (its headers), run at once (``generate`` and
        ``encoded``: as ``open_upstream`` takes them, ``encoded`` being ``generate``'s when given, else
        ``forward``'s). The prefill failing (or the client leaving) abandons the decode request; no
        decode server taking it cancels the prefill; either way nothing is left held. ``answered``:
        False returns the prefill's result as soon as it is in, with the decode answer still to come
        (a task)."""
        prefill = asyncio.ensure_future(self.wait(request_id, future))
        encodings = (None, encoded) if generate is not None else (encoded, None)
        decode = asyncio.ensure_future(open_upstream(self.decoders, forward, self.config.decode_timeout_s, encodings[0], generate, encodings[1]))
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
        if not answered:
            return result, decode
        try:
            return result, await decode
        except BaseException:  # no decode server took it, or the client left
            await self._discard(result)
            raise


async def _abandon(opening: asyncio.Future) -> None:
    """A decode request no longer wanted: closed if a server answered (vLLM aborts it), else cancelled."""
    if not opening.done():
        opening.cancel()
        with contextlib.suppress(BaseException):
            await opening
    elif not opening.cancelled() and opening.exception() is None:
        await opening.result().close()
