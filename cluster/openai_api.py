"""The OpenAI-compatible front of the Serve tier: ``/v1/completions`` and ``/v1/chat/completions``
(streaming and not), prefilled here, decoded by stock vLLM servers.

    POST /v1/chat/completions {"model": "...", "messages": [...], "max_tokens": 64, "stream": true}

A request is tokenized with the checkpoint's tokenizer (a chat with its chat template, rendered and
then tokenized as vLLM does), prefilled by this replica's pool with its KV kept, and forwarded as a
completion of those token ids to a vLLM decode server (``ServeConfig.decode_servers``) with the
ticket in ``kv_transfer_params["mlapool"]``; vLLM's connector (``kv.vllm_connector``) takes the KV
from the prefill workers, vLLM decodes, and its answer streams back, as a chat completion for a chat.
The first token is the tier's when it reproduces the request's sampling (``cluster.first_token``):
sampled from the prefill's logits and sent at once, with vLLM given the prompt and that token. Else it
is vLLM's, which then gets the request (and its ticket, issued ahead) as the prefill starts, and
computes the prompt's last token itself over our KV.

The decode server with the fewest requests in flight from this replica is tried first; one that
answers 429 is skipped for the next; one that cannot be reached, answers 5xx or breaks an answer off
is ejected: no request goes to it until it answers ``/health`` again, probed every
``probe_interval_s`` in the background. When none is left the client gets 503 with each server's
reason. Other 4xx answers are vLLM judging the request: passed through. An answer a server breaks off
goes on on another one (``cluster.decode_answer``). The KV is released when the answer ends however
it ends (vLLM acknowledges it once loaded; a ticket vLLM refused or never used would otherwise wait
for ``kv_ttl_s``).

Usage counts as OpenAI's: ``prompt_tokens`` the prompt's length, ``completion_tokens`` the tokens
generated (the tier's first token included), ``prompt_tokens_details.cached_tokens`` the prompt tokens
this replica's prefix cache served. What the tier does with each parameter a client can send (reads
it, applies it to the prompt's tokens, forwards it to vLLM, or refuses it with a 400 naming it) is in
``cluster.openai_params``; ``n`` other than 1 is refused (one prompt's KV is loaded once), as are
several prompts in one request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cluster.openai_params import CHAT_TEMPLATE, forwarded, refusal


COMPLETIONS, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"
GENERATE = "/inference/v1/generate"  # vLLM's tokens-in, tokens-out endpoint (cluster.decode_tokens)
logger = logging.getLogger("ray.serve")
RETRY_STATUSES = {429, 500, 502, 503, 504}
EJECT_STATUSES = RETRY_STATUSES - {429}  # a busy server is tried again at once; a failing one once it is healthy


class OpenAIError(Exception):
    """An error answered in OpenAI's form: ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "code": self.status}}


@dataclass
class Parsed:
    """A checked request: the prompt as text or token ids (a completion) or messages (a chat), whether
    to stream, and the parameters passed to vLLM as they came."""

    chat: bool
    prompt: str | list[int] | None
    messages: list[dict] | None
    stream: bool
    include_usage: bool
    passthrough: dict[str, Any]  # forwarded to the decode server (``openai_params.forwarded``)
    template: dict[str, Any] = field(default_factory=dict)  # a chat's template parameters (``openai_params.CHAT_TEMPLATE``)
    add_special_tokens: bool | None = None  # None: vLLM's default (True for a completion's text, False for a chat's)


def parse_request(body: dict[str, Any], chat: bool, model: str) -> Parsed:
    """Check an OpenAI request; ``OpenAIError`` (400, 404) names what is wrong."""
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    if body.get("model") != model:
        raise OpenAIError(404, f"model {body.get('model')!r} is not served here; this endpoint serves {model!r}")
    why = refusal(body, chat)
    if why is not None:
        raise OpenAIError(400, why)
    if body.get("n", 1) != 1:
        raise OpenAIError(400, f"n must be 1 (one prompt's prefilled KV is loaded once), got {body.get('n')!r}")
    if body.get("echo"):
        raise OpenAIError(400, "echo is not supported: the prompt is prefilled here, not by the decode server")
    if "kv_transfer_params" in body:
        raise OpenAIError(400, "kv_transfer_params is set by this endpoint, not by clients")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError(400, f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise OpenAIError(400, f"stream_options must be an object, got {options!r}")
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise OpenAIError(400, "messages must be a non-empty list of objects with a role and content")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and not (prompt and all(type(t) is int for t in prompt)):
            raise OpenAIError(400, "prompt must be a string or a non-empty list of token ids (one prompt per request)")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, str) and not prompt):
            raise OpenAIError(400, f"prompt must be a non-empty string or a list of token ids, got {type(prompt).__name__}")
    template = {k: v for k, v in body.items() if k in CHAT_TEMPLATE and v is not None} if chat else {}
    kinds = {"chat_template_kwargs": dict, "add_generation_prompt": bool, "continue_final_message": bool, "documents": list}
    for name, value in template.items():
        if not isinstance(value, kinds[name]):
            raise OpenAIError(400, f"{name} must be a {kinds[name].__name__}, got {value!r}")
    if template.get("add_generation_prompt", True) and template.get("continue_final_message", False):
        raise OpenAIError(400, "add_generation_prompt and continue_final_message cannot both be true")
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise OpenAIError(400, f"add_special_tokens must be true or false, got {special!r}")
    return Parsed(chat, prompt, messages, stream, bool(options.get("include_usage")), forwarded(body, chat), template, special)


class Tokenizer:
    """The checkpoint's tokenizer (transformers' ``AutoTokenizer``, loaded when first asked for: a
    replica with decode servers asks as it starts), used as vLLM's OpenAI server uses it: a
    completion's text with the tokenizer's special tokens, a chat rendered by its template (with the
    generation prompt) and then tokenized without them. Token ids need no tokenizer."""

    def __init__(self, path: str | None) -> None:
        self.path, self._tokenizer, self._error = path, None, None

    @property
    def tokenizer(self):
        if self._tokenizer is None and self._error is None:
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            except Exception as exc:  # noqa: BLE001 -- no transformers, no tokenizer files, a broken one
                self._error = f"{type(exc).__name__}: {exc}"
        if self._tokenizer is None:
            raise OpenAIError(400, f"this endpoint has no tokenizer ({self.path}: {self._error}); send token ids as the prompt")
        return self._tokenizer

    @property
    def available(self) -> bool:
        try:
            return self.tokenizer is not None
        except OpenAIError:
            return False

    def encode(self, parsed: Parsed) -> list[int]:
        if parsed.chat:
            options = {k: v for k, v in parsed.template.items() if k != "chat_template_kwargs"}
            options.setdefault("add_generation_prompt", True)
            try:
                text = self.tokenizer.apply_chat_template(parsed.messages, tokenize=False, **options, **parsed.template.get("chat_template_kwargs", {}))
            except Exception as exc:  # noqa: BLE001 -- jinja and the template raise what they raise
                raise OpenAIError(400, f"the messages do not fit the model's chat template: {exc}") from None
            return list(self.tokenizer.encode(text, add_special_tokens=bool(parsed.add_special_tokens)))
        if isinstance(parsed.prompt, list):
            return list(parsed.prompt)
        return list(self.tokenizer.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens is not False))


@dataclass
class DecodeServer:
    url: str
    api_key: str | None = field(default=None, repr=False)  # sent as Authorization: Bearer (vLLM's --api-key)
    outstanding: int = 0
    requests: int = 0
    failures: int = 0
    refused_key: bool = False  # its last answer was 401/403: the tier's configuration, not the server, is wrong
    ejected: str | None = None  # why it is out of service (None: in service), until it answers /health
    takes_generate: bool | None = None  # whether it answered vLLM's generate endpoint (None: not asked yet)
    ejections: int = 0
    readmissions: int = 0
    diverged: int = 0  # answers asked to begin with the tier's first token whose first token was another


@dataclass
class DecodeServers:
    """The vLLM decode servers and what this replica has in flight on each."""

    servers: list[DecodeServer] = field(default_factory=list)
    probe_interval_s: float = 1.0
    on_event: Callable[[str, str], None] | None = None  # (event: ejected, readmitted, resumed or diverged; the server's URL)
    on_stall: Callable[[float], None] | None = None  # (seconds from a streamed answer's break to its next token)
    resumptions: int = 0  # answers that went on on another server after theirs broke off
    stalls: deque[dict[str, float]] = field(default_factory=lambda: deque(maxlen=64))  # the last streamed resumptions' (see stalled)
    _probes: set[asyncio.Task] = field(default_factory=set, repr=False)

    @classmethod
    def of(cls, servers: list[tuple[str, str | None]], **kwargs: Any) -> DecodeServers:
        """From (base URL, API key or None) pairs."""
        return cls([DecodeServer(url.rstrip("/"), key) for url, key in servers], **kwargs)

    def by_load(self) -> list[DecodeServer]:
        """The servers in service, least outstanding requests first (ties: the order configured)."""
        return sorted((s for s in self.servers if s.ejected is None), key=lambda s: s.outstanding)

    def eject(self, server: DecodeServer, reason: str) -> None:
        """Take ``server`` out of service until it answers ``/health`` (probed in the background)."""
        if server.ejected is not None:
            return
        server.ejected, server.ejections = reason, server.ejections + 1
        self._event("ejected", server)
        probe = asyncio.get_running_loop().create_task(self._probe(server))
        self._probes.add(probe)  # held: the loop keeps only weak references to its tasks
        probe.add_done_callback(self._probes.discard)

    def resumed(self, server: DecodeServer) -> None:
        self.resumptions += 1
        self._event("resumed", server)

    def diverged(self, server: DecodeServer, reason: str) -> None:
        """``server`` generated a first token other than the tier's, which it was asked to begin with
        (``kv.vllm_first_token``): the answer goes on from the tier's; the server stays in service."""
        server.diverged += 1
        logger.warning("%s; the answer goes on from the tier's first token (start the decode server with --logits-processors "
                       "kv.vllm_first_token:TierFirstToken, or set decode_forward: after_first_token)", reason)  # fmt: skip
        self._event("diverged", server)

    def stalled(self, seconds: float, sent: int) -> None:
        """A streamed answer went on ``seconds`` after its server broke it off (the break seen to the
        next server's first token relayed), after ``sent`` of its tokens: the next one is the resumed
        server's first."""
        self.stalls.append({"stall_s": round(seconds, 4), "tokens_before": sent})
        if self.on_stall is not None:
            self.on_stall(seconds)

    async def _probe(self, server: DecodeServer) -> None:
        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else None
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.probe_interval_s))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await asyncio.sleep(self.probe_interval_s)
                try:
                    async with session.get(server.url + "/health", headers=headers) as response:
                        if response.status == 200:
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    continue
        server.ejected, server.readmissions = None, server.readmissions + 1
        self._event("readmitted", server)

    def _event(self, event: str, server: DecodeServer) -> None:
        if self.on_event is not None:
            self.on_event(event, server.url)

    def report(self) -> list[dict[str, Any]]:
        return [{"url": s.url, "outstanding": s.outstanding, "requests": s.requests, "failures": s.failures,
                 "refuses_the_tiers_key": s.refused_key, "ejected": s.ejected, "ejections": s.ejections,
                 "readmissions": s.readmissions, "takes_generate": s.takes_generate, "first_token_diverged": s.diverged}
                for s in self.servers]  # fmt: skip


class Timeline:
    """Unix times of the steps of the last ``keep`` requests handed to decode servers, by the tier's
    request id (a completion's id is ``cmpl-`` and it): what ``GET /`` shows and the benchmarks put
    beside vLLM's log to take apart the time between the first token and the second."""

    def __init__(self, keep: int = 128) -> None:
        self.keep = keep
        self._steps: OrderedDict[str, dict[str, float]] = OrderedDict()

    def mark(self, request_id: str, step: str, value: float | None = None) -> None:
        """``step`` happened now, or ``value``: a Unix time taken before, or a duration in seconds."""
        self._steps.setdefault(request_id, {})[step] = round(time.time() if value is None else value, 6)
        self._steps.move_to_end(request_id)
        while len(self._steps) > self.keep:
            self._steps.popitem(last=False)

    def recent(self) -> dict[str, dict[str, float]]:
        return {request_id: dict(steps) for request_id, steps in self._steps.items()}


class Upstream:
    """An answer of a decode server being read; ``close`` gives the server back."""

    def __init__(self, server: DecodeServer, session: aiohttp.ClientSession, response: aiohttp.ClientResponse, generate: bool = False) -> None:
        self.server, self.session, self.response = server, session, response
        self.generate = generate  # the answer is the generate endpoint's (token ids), not a completion's
        self.closed = False

    async def close(self) -> None:
        """Close the connection: a decode server whose answer is not read to its end aborts the request.
        The server is given back first (a close cancelled while it awaits the session still counts)."""
        if self.closed:
            return
        self.closed = True
        self.server.outstanding -= 1
        self.response.close()
        await self.session.close()


def prompt_json(token_ids: list[int]) -> str:
    """A prompt's ids as the JSON text of a forward's ``prompt``, made while its prefill runs
    (:func:`encoded_forward`): 3.7 ms for 32K ids on the 2-core CPU, off the first token's path."""
    return json.dumps(token_ids)


def encoded_forward(body: dict[str, Any], prompt: str, first_token: int, key: str = "prompt") -> bytes:
    """``body`` as the JSON sent, its ``key`` (a completion's ``prompt``, the generate endpoint's
    ``token_ids``) being the ids whose JSON text ``prompt`` is (:func:`prompt_json`) followed by
    ``first_token``: only the small rest is serialized now."""
    if body[key][-1] != first_token:
        raise ValueError(f"the forward's {key} ends with {body[key][-1]}, not the first token {first_token}")
    rest = json.dumps({name: value for name, value in body.items() if name != key})
    ids = f"{prompt[:-1]}, {first_token}]" if prompt != "[]" else f"[{first_token}]"
    return f'{rest[:-1]}{", " if len(rest) > 2 else ""}"{key}": {ids}}}'.encode()


async def open_upstream(servers: DecodeServers, body: dict[str, Any], timeout_s: float, encoded: bytes | None = None,
                        generate: dict[str, Any] | None = None, generate_encoded: bytes | None = None) -> Upstream:  # fmt: skip
    """POST ``body`` to ``/v1/completions`` of the least loaded decode server in service that takes it
    (``encoded``: ``body`` already serialized, :func:`encoded_forward`). Given ``generate`` (the same
    request in the form of vLLM's generate endpoint: ``cluster.decode_tokens``), a server that has that
    endpoint (vLLM 0.26; 0.32 started with ``--enable-scale-out``) gets it instead; one that answers it
    404, or 403 naming scale-out, gets ``body`` and is not asked there again. The returned answer says
    which it is (``Upstream.generate``). Each form is serialized once, when a server is first sent it."""
    payloads: dict[str, bytes | None] = {COMPLETIONS: encoded, GENERATE: generate_encoded}

    def payload(path: str) -> bytes:
        if payloads[path] is None:
            payloads[path] = json.dumps(body if path == COMPLETIONS else generate).encode()
        return payloads[path]

    reasons = [f"{s.url}: out of service until it answers /health ({s.ejected})" for s in servers.servers if s.ejected is not None]
    for server in servers.by_load():
        server.outstanding += 1
        server.requests += 1
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s))
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {server.api_key}"} if server.api_key else {})
        asks_generate = generate is not None and server.takes_generate is not False
        try:
            path = GENERATE if asks_generate else COMPLETIONS
            response = await session.post(server.url + path, data=payload(path), headers=headers)
            if asks_generate and (response.status == 404 or (response.status == 403 and "scale-out" in (await response.text()).lower())):
                server.takes_generate, asks_generate = False, False
                logger.warning("decode server %s has no generate endpoint (HTTP %d): its answers are asked of /v1/completions, "
                               "which detokenize the whole prompt before the second token; start vLLM 0.32 with --enable-scale-out",
                               server.url, response.status)  # fmt: skip
                response.release()
                response = await session.post(server.url + COMPLETIONS, data=payload(COMPLETIONS), headers=headers)
            elif asks_generate and response.status == 200:
                server.takes_generate = True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            reasons.append(f"{server.url}: {type(exc).__name__}: {exc}")
            servers.eject(server, reasons[-1])
        except BaseException:  # cancelled (the prefill failed, the client left): the server is given back
            server.outstanding -= 1
            await session.close()
            raise
        else:
            server.refused_key = response.status in (401, 403)
            if response.status not in RETRY_STATUSES and not server.refused_key:
                return Upstream(server, session, response, asks_generate)
            if server.refused_key:  # its answer may quote what it was sent: not relayed
                reasons.append(f"{server.url}: configuration error: it refuses the tier's API key (HTTP {response.status}; "
                               "set decode_api_key or decode_api_keys to the key of its --api-key)")  # fmt: skip
            else:
                reasons.append(f"{server.url}: HTTP {response.status} {(await response.text())[:200]}")
                if response.status in EJECT_STATUSES:
                    servers.eject(server, reasons[-1])
            response.release()
        server.failures += 1
        server.outstanding -= 1
        await session.close()
    raise OpenAIError(503, "no decode server took the request: " + ("; ".join(reasons) or "none configured"))


def model_card(name: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    """The served model as ``GET /v1/models`` lists it, in vLLM's form (``root``: the checkpoint)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "mlapool", "root": root, "parent": None,
            "max_model_len": max_model_len, "permission": []}  # fmt: skip


def chat_answer(completion: dict[str, Any], model: str) -> dict[str, Any]:
    """A vLLM completion as a chat completion."""
    choices = [
        {"index": c.get("index", 0), "message": {"role": "assistant", "content": c.get("text", "")},
         "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason")}
        for c in completion.get("choices", [])
    ]  # fmt: skip
    return {"id": "chatcmpl-" + completion.get("id", uuid.uuid4().hex).removeprefix("cmpl-"), "object": "chat.completion",
            "created": completion.get("created", int(time.time())), "model": model, "choices": choices, "usage": completion.get("usage")}  # fmt: skip


def chat_chunk(chunk: dict[str, Any], model: str, first: bool) -> dict[str, Any]:
    """A vLLM completion chunk as a chat completion chunk (the first one also says the role)."""
    choices = []
    for c in chunk.get("choices", []):
        delta = {"content": c.get("text", "")}
        if first:
            delta = {"role": "assistant", **delta}
        choices.append({"index": c.get("index", 0), "delta": delta, "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason")})
    answer = {"id": "chatcmpl-" + chunk.get("id", "").removeprefix("cmpl-"), "object": "chat.completion.chunk",
              "created": chunk.get("created", int(time.time())), "model": model, "choices": choices}  # fmt: skip
    if chunk.get("usage") is not None:
        answer["usage"] = chunk["usage"]
    return answer


def with_cached_tokens(answer: dict[str, Any], cached_tokens: int) -> dict[str, Any]:
    """An answer whose usage (if any) says ``prompt_tokens_details.cached_tokens``: the prompt tokens
    the tier's prefix cache served (vLLM's own count would be the tokens it loaded from us)."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return answer
    return {**answer, "usage": {**usage, "prompt_tokens_details": {**(usage.get("prompt_tokens_details") or {}), "cached_tokens": cached_tokens}}}


def sse(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


def client_chunk(chunk: dict[str, Any], chat: bool, model: str, first: bool) -> dict[str, Any]:
    return chat_chunk(chunk, model, first) if chat else {**chunk, "model": model}
