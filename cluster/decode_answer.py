"""A client's answer from the decode servers, which goes on on another server when one breaks it off.

A decode server can die in the middle of an answer (killed, its engine dead, the machine gone). A
relay that stopped there would end the client's stream with no error, no ``finish_reason`` and no
``[DONE]``: an OpenAI client cannot tell half an answer from a whole one. :class:`DecodeAnswer` holds
what it takes to go on instead: the prompt the server got, the tokens it has streamed so far (it asks
vLLM for their ids, ``return_token_ids``, and leaves them out of the client's chunks unless the client
asked for them), and the pool. When the stream breaks (the connection reset or closed before
``[DONE]``, a read timing out, an error event of status 5xx such as vLLM's engine dying) the server is
ejected (``DecodeServers.eject``: no request goes to it until it answers ``/health``), the prompt
followed by the tokens already sent is prefilled again with its KV kept (the prompt's blocks are
this replica's prefix cache hit), and the next server in service gets it with the pool's ticket and
what is left of ``max_tokens`` (and ``min_tokens``). vLLM computes the last token's row over the
loaded KV and samples the next token: the client's stream goes on with the same id, no token
repeated or missing, its usage counting each token once. Greedy answers go on exactly as an unbroken
one; sampled ones go on from the same tokens, with vLLM's sampler started afresh there (a ``seed``
gives the same continuation for the same break, not the unbroken answer's). A stop string split across
the break is not seen by the next server. After ``resumptions`` breaks, or when no server is left,
the client gets an OpenAI error event and then ``[DONE]``: a stream never ends silently. An answer
not streamed has sent the client nothing when it breaks, so it is asked again whole of the next
server; with none left the client gets 503 with each server's reason. A streamed answer's stall, from
the break seen to the next server's first token relayed, is recorded (``DecodeServers.stalled``).

Closing an answer (the client left, or it ended) closes the connection to the decode server, which
aborts the request in vLLM, and releases the KV this replica still holds for it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from cluster.decode_tokens import TokenText, generate_body
from cluster.openai_api import EJECT_STATUSES, DecodeServers, OpenAIError, Upstream, client_chunk, open_upstream, sse, with_cached_tokens

DONE = b"data: [DONE]\n\n"
READ_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class Broken(Exception):
    """The decode server broke the answer off."""


class Diverged(Exception):
    """The decode server's first token is not the tier's, which it was asked to begin with and the
    client already has."""


class DecodeAnswer:
    """One client answer over one or more decode servers.

    ``forward``: the completion request the first server got (its ``prompt``: the ids vLLM continues
    from, the client's prompt and the tier's first token when it sent the request after sampling
    it). ``prompt_tokens``: the client's prompt's length. ``head``: the tier's first token's chunk,
    already sent (None: vLLM's first chunk is the answer's first). ``prefill(ids)``: the pool's
    prefill of ``ids`` with the KV kept, and its ticket (``kv_transfer_params``); ``discard(result)``:
    the KV of a prefill released.
    ``tokens(prompt)``: for an answer asked of vLLM's generate endpoint (``cluster.decode_tokens``),
    what turns a server's token ids after ``prompt`` into completion chunks; None: its completions.
    ``echo``: the tier's first token (``head``'s), when the first server got the bare prompt and was
    asked to generate that token first (``kv.vllm_first_token``): it is checked and left out of the
    client's stream; another token there goes on from the tier's on a server as after a break, the
    server kept in service (``DecodeServers.diverged``) and no resumption counted."""

    def __init__(
        self,
        decoders: DecodeServers,
        forward: dict[str, Any],
        *,
        prompt_tokens: int,
        cached_tokens: int,
        chat: bool,
        model: str,
        head: dict[str, Any] | None,
        token_ids_asked: bool,
        resumptions: int,
        timeout_s: float,
        prefill: Callable[[list[int]], Awaitable[tuple[Any, dict[str, Any]]]],
        discard: Callable[[Any], Awaitable[None]],
        tokens: Callable[[list[int]], TokenText] | None = None,
        echo: int | None = None,
    ) -> None:
        self.decoders, self.forward = decoders, forward
        self.prompt_tokens, self.cached_tokens, self.chat, self.model = prompt_tokens, cached_tokens, chat, model
        self.answer_id = head["id"] if head is not None else None
        self.head, self.token_ids_asked = head, token_ids_asked
        self.resumptions, self.timeout_s = resumptions, timeout_s
        self.prefill, self.discard, self.tokens, self.echo = prefill, discard, tokens, echo

    async def stream(self, upstream: Upstream, result: Any) -> AsyncIterator[bytes]:
        """The client's server-sent events from ``upstream`` on (the server answered 200), going on on
        other servers when it breaks off; ``result``: the prefill whose KV it loads."""
        generated: list[int] = [] if self.echo is None else [self.echo]  # the answer's tokens past the prompt so far (the tier's too when echoed)
        prompt, first, finished, resumed, echo = self.forward["prompt"], self.head is None, False, 0, self.echo
        broke_at: float | None = None  # when the last break was seen, until the next server's first token
        sent_at_break = 0  # the answer's tokens the client had been sent then (the tier's first token too)
        try:
            while True:
                reader = self.tokens(prompt if echo is None else prompt + [echo]) if upstream.generate else None  # token ids: their text made here
                try:
                    async for chunk in _chunks(upstream):
                        if chunk is None:  # [DONE]
                            yield DONE
                            return
                        if "error" in chunk:  # vLLM judging the request (a failed server's raised Broken)
                            yield sse(chunk)
                            continue
                        if echo is not None and any(choice.get("token_ids") for choice in chunk.get("choices", [])):
                            chunk, echo = self._unecho(chunk, echo, upstream.generate), None
                            if chunk is None:
                                continue
                        if reader is not None:
                            chunk = reader.chunk(chunk)
                        for choice in chunk.get("choices", []):
                            generated += choice.get("token_ids") or []
                            finished = finished or choice.get("finish_reason") is not None
                        if broke_at is not None and any(choice.get("token_ids") for choice in chunk.get("choices", [])):
                            self.decoders.stalled(time.monotonic() - broke_at, sent_at_break)
                            broke_at = None
                        out = client_chunk(self._rewrite(chunk, prompt), self.chat, self.model, first)
                        first = first and not out.get("choices")
                        yield sse(out)
                    raise Broken("the answer ended before [DONE]")
                except Diverged as exc:
                    why, broken = f"{upstream.server.url}: {exc}", False
                except (Broken, *READ_ERRORS) as exc:
                    why, broken = f"{upstream.server.url}: the answer broke off: {type(exc).__name__}: {exc}", True
                if broke_at is None:
                    broke_at, sent_at_break = time.monotonic(), len(generated) + (self.head is not None and self.echo is None)
                if broken:
                    self.decoders.eject(upstream.server, why)
                else:
                    self.decoders.diverged(upstream.server, why)
                await upstream.close()
                await self.discard(result)
                upstream, result, echo = None, None, None
                if finished:  # every token was sent; only the end was lost
                    yield DONE
                    return
                if broken and resumed == self.resumptions:
                    yield sse(OpenAIError(503, f"{why}; it was resumed {resumed} time(s), as many as allowed").body())
                    yield DONE
                    return
                resumed += broken
                prompt = self.forward["prompt"] + generated
                try:
                    upstream, result = await self._resume(prompt, len(generated))
                except OpenAIError as exc:
                    yield sse(OpenAIError(exc.status, f"{why}; it could not go on: {exc}").body())
                    yield DONE
                    return
        finally:
            if upstream is not None:
                await upstream.close()
            if result is not None:
                await self.discard(result)

    async def whole(self, upstream: Upstream, result: Any) -> tuple[int, bytes]:
        """An answer not streamed: the status and body of the first server that gives it whole (it is
        asked again of the next one when a server breaks it off); ``OpenAIError`` 503 when none does."""
        reasons: list[str] = []
        try:
            while True:
                try:
                    status, body = upstream.response.status, await upstream.response.read()
                    if status == 200 and upstream.generate:
                        body = json.dumps(self.tokens(self.forward["prompt"]).whole(json.loads(body))).encode()
                    if status not in EJECT_STATUSES:
                        return status, body
                    raise Broken(f"HTTP {status} {body[:200].decode(errors='replace')}")
                except (Broken, *READ_ERRORS) as exc:
                    reasons.append(f"{upstream.server.url}: the answer broke off: {type(exc).__name__}: {exc}")
                self.decoders.eject(upstream.server, reasons[-1])
                await upstream.close()
                await self.discard(result)
                upstream = result = None
                if len(reasons) > self.resumptions:
                    raise OpenAIError(503, "; ".join(reasons))
                try:
                    upstream, result = await self._resume(self.forward["prompt"], 0)
                except OpenAIError as exc:
                    raise OpenAIError(503, "; ".join([*reasons, str(exc)])) from None
        finally:
            if upstream is not None:
                await upstream.close()
            if result is not None:
                await self.discard(result)

    async def _resume(self, prompt: list[int], done: int) -> tuple[Upstream, Any]:
        """The next server in service, with ``prompt``'s KV prefilled again and ``done`` tokens less to go."""
        result, ticket = await self.prefill(prompt)
        body = {**self.forward, "prompt": prompt, "kv_transfer_params": ticket}
        for key in ("max_tokens", "min_tokens"):
            if isinstance(self.forward.get(key), int):
                body[key] = max(0, self.forward[key] - done)
        try:
            upstream = await open_upstream(self.decoders, body, self.timeout_s, generate=generate_body(body) if self.tokens is not None else None)
        except BaseException:
            await self.discard(result)
            raise
        self.decoders.resumed(upstream.server)
        return upstream, result

    def _unecho(self, chunk: dict[str, Any], echo: int, generate: bool) -> dict[str, Any] | None:
        """A decode server's first chunk with tokens, less its first token, which must be ``echo``
        (else ``Diverged``), and that token's text (a completions chunk's; the tier's head has it);
        None when nothing else is in it."""
        choice = chunk["choices"][0]
        ids = list(choice.get("token_ids") or [])
        if ids[0] != echo:
            raise Diverged(f"its first token is {ids[0]}, not the tier's {echo}")
        rest = {**choice, "token_ids": ids[1:]}
        if not generate:  # vLLM's text: the head's first
            head, text = self.head["choices"][0]["text"], choice.get("text") or ""
            if not text.startswith(head):
                raise Diverged(f"its first text {text!r} does not begin with the tier's {head!r}")
            rest["text"] = text[len(head) :]
        if not rest["token_ids"] and rest.get("finish_reason") is None and chunk.get("usage") is None:
            return None
        return {**chunk, "choices": [rest]}

    def _rewrite(self, chunk: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
        """A decode server's chunk as the client's: the answer's id, usage of the client's prompt (the
        tokens the server got past it were generated), the token ids only if the client asked."""
        self.answer_id = self.answer_id or chunk.get("id")
        out = {**chunk, "id": self.answer_id}
        if isinstance(chunk.get("usage"), dict):
            u, extra = chunk["usage"], len(prompt) - self.prompt_tokens
            out["usage"] = {**u, "prompt_tokens": u["prompt_tokens"] - extra, "completion_tokens": u["completion_tokens"] + extra}
        if not self.token_ids_asked:  # asked of vLLM for the tokens' ids: not the client's
            drop = {"token_ids", "prompt_token_ids"}
        else:  # the prompt's ids once, in the answer's first chunk (the tier's, when it sent the first token)
            drop = set() if self.head is None and prompt is self.forward["prompt"] else {"prompt_token_ids"}
        out["choices"] = [{k: v for k, v in choice.items() if k not in drop} for choice in chunk.get("choices", [])]
        return with_cached_tokens(out, self.cached_tokens)


async def _chunks(upstream: Upstream) -> AsyncIterator[dict[str, Any] | None]:
    """A decode server's events as JSON (None for ``[DONE]``); ``Broken`` for an error event of a
    server that failed (status 5xx), which is not the request's fault."""
    async for raw in upstream.response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            yield None
            continue
        chunk = json.loads(data)
        error = chunk.get("error") if isinstance(chunk, dict) else None
        if error is not None:
            code = error.get("code") if isinstance(error, dict) else None
            if isinstance(code, int) and code >= 500:
                raise Broken(f"error event: {error.get('message')}")
        yield chunk
