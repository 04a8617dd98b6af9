"""The prefill tier on Ray Serve, on the CPU with logical GPUs: concurrent answers equal the
single-process reference, autoscaling 1 -> 2 -> 1 replicas loses and duplicates nothing, a
200-request load test of mixed lengths, malformed requests get 4xx while the service keeps
serving, the handoff ticket works, and the metrics reach Ray's Prometheus endpoint."""

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest
import ray
import torch
from ray import serve

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from cluster.serve import build_app
from configs.pool import PoolConfig
from configs.serve import ServeConfig
from kv.receiver import KVReceiver
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights
from workers.worker import rendezvous_address

# Serve's status objects re-check look_back_period_s against its deprecated 10 s metrics_interval_s, not
# against the interval set here (ServeConfig checks that one; cluster.serve.build_app says more)
pytestmark = pytest.mark.filterwarnings("ignore:`look_back_period_s`.*`metrics_interval_s`:FutureWarning")

# replicas report their load every 0.5 s instead of 10 (read by Serve's processes: set before Ray starts)
os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
os.environ["RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"

POOL = PoolConfig(num_layers=2, device="cpu", use_gpus=True, worker_cpus=0.25, chunk_tokens=64, kv_cache_tokens=2048, seed=3)
CONFIG = ServeConfig(
    pool=POOL, name="prefill-test", min_replicas=1, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=1.0,
    downscale_delay_s=3.0, look_back_period_s=2.0, replica_cpus=0.25, max_body_bytes=1 << 16, kv_ttl_s=30.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def url(ray_cluster):
    port = rendezvous_address()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(CONFIG), name="prefill", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def reference():
    model = DeepseekPrefillModel.create(POOL.model_config(), TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, None, POOL.seed)
    cache = {}

    def run(tokens):
        key = tuple(tokens)
        if key not in cache:
            out = model(torch.tensor(tokens), plan_prefill_batch([len(tokens)]))
            cache[key] = (out.logits[0], torch.stack(out.latents))
        return cache[key]

    return run


def post(url, payload, form="json", raw=None, content_type=None):
    body = raw if raw is not None else (msgpack.packb(payload) if form == "msgpack" else json.dumps(payload).encode())
    ctype = content_type or ("application/msgpack" if form == "msgpack" else "application/json")
    request = urllib.request.Request(f"{url}/prefill", data=body, headers={"content-type": ctype}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, data, kind = response.status, response.read(), response.headers.get("content-type")
    except urllib.error.HTTPError as exc:
        status, data, kind = exc.code, exc.read(), exc.headers.get("content-type")
    answer = msgpack.unpackb(data) if kind == "application/msgpack" else json.loads(data)
    if isinstance(answer.get("logits"), bytes):
        answer["logits"] = np.frombuffer(answer["logits"], dtype="<f4").tolist()
    return status, answer


def _check(answer, tokens, reference):
    logits, _ = reference(tokens)
    assert answer["num_tokens"] == len(tokens) and answer["first_token"] == int(logits.argmax())
    assert torch.allclose(torch.tensor(answer["logits"]), logits, atol=1e-4, rtol=1e-4)


def _prompts(count, seed, max_len=400):
    gen = np.random.default_rng(seed)
    return [gen.integers(0, 512, size=int(n)).tolist() for n in gen.integers(1, max_len, size=count)]


def _replicas():
    status = serve.status().applications["prefill"].deployments[CONFIG.name]
    return status.replica_states.get("RUNNING", 0)


def _wait_for_one_replica(timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _replicas() > 1:
        time.sleep(0.5)
    return _replicas() == 1


def test_concurrent_requests_are_answered_like_the_single_process_model(url, reference):
    prompts = _prompts(12, seed=0)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: post(url, {"token_ids": p}, form="msgpack" if len(p) % 2 else "json"), prompts))
    for (status, answer), prompt in zip(answers, prompts):
        assert status == 200, answer
        _check(answer, prompt, reference)


def test_it_scales_up_under_load_and_down_when_idle_losing_and_duplicating_nothing(url, reference):
    assert _replicas() == 1
    sent, answers, stop, lock = [], [], threading.Event(), threading.Lock()

    def client(index):
        gen = np.random.default_rng(index)
        n = 0
        while not stop.is_set():
            tokens, request_id = gen.integers(0, 512, size=int(gen.integers(50, 400))).tolist(), f"c{index}-{n}"
            with lock:
                sent.append((request_id, tokens))
            answers.append((request_id, *post(url, {"token_ids": tokens, "request_id": request_id})))
            n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    peak, deadline = 1, time.monotonic() + 120
    while time.monotonic() < deadline and peak < 2:
        peak = max(peak, _replicas())
        time.sleep(0.5)
    time.sleep(3)  # keep the load on two replicas for a while
    stop.set()
    for thread in threads:
        thread.join()
    assert peak == 2, "did not scale to 2 replicas under load"
    assert _wait_for_one_replica(), "did not scale back to 1 replica when idle"
    assert sorted(a[0] for a in answers) == sorted(s[0] for s in sent)  # each request answered exactly once
    tokens = dict(sent)
    for request_id, status, answer in answers:
        assert status == 200 and answer["client_request_id"] == request_id, answer
        assert answer["request_id"].startswith(f"{request_id}-"), answer  # made unique across the tier
        _check(answer, tokens[request_id], reference)


def test_a_load_of_200_mixed_requests_is_answered_correctly(url, reference):
    prompts = _prompts(200, seed=1, max_len=1000)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda ip: post(url, {"token_ids": ip[1]}, form="msgpack" if ip[0] % 3 == 0 else "json"), enumerate(prompts)))
    assert len(answers) == 200
    for (status, answer), prompt in zip(answers, prompts):
        assert status == 200, answer
        _check(answer, prompt, reference)


@pytest.mark.parametrize(
    ("body", "content_type", "status", "message"),
    [
        (b"{not json", "application/json", 400, "not valid JSON"),
        (b"\xc1\xc1", "application/msgpack", 400, "not valid msgpack"),
        (b"<xml/>", "text/xml", 415, "content type 'text/xml' is not supported"),
        (json.dumps([1, 2]).encode(), "application/json", 422, "must be an object"),
        (json.dumps({"token_ids": "1 2 3"}).encode(), "application/json", 422, "token_ids must be a non-empty list of integers"),
        (json.dumps({"token_ids": [1, 2.5]}).encode(), "application/json", 422, "token_ids must be a non-empty list"),
        (json.dumps({"token_ids": []}).encode(), "application/json", 422, "token_ids must be a non-empty list"),
        (json.dumps({"token_ids": [1, 512]}).encode(), "application/json", 422, "512"),
        (json.dumps({"token_ids": [1], "handoff": "yes"}).encode(), "application/json", 422, "handoff must be true or false"),
        (json.dumps({"tokens": [1]}).encode(), "application/json", 422, "unknown keys ['tokens']"),
        (json.dumps({"token_ids": [1] * 3000}).encode(), "application/json", 413, "longest prompt is 2048 tokens"),
        (json.dumps({"token_ids": [1] * 30000}).encode(), "application/json", 413, "over the limit of 65536"),
    ],
)
def test_malformed_requests_get_4xx_and_the_service_keeps_serving(url, reference, body, content_type, status, message):
    got, answer = post(url, None, raw=body, content_type=content_type)
    assert got == status and message in answer["error"], answer
    ok, answer = post(url, {"token_ids": [5, 6, 7]})
    assert ok == 200
    _check(answer, [5, 6, 7], reference)


def test_wrong_paths_and_methods_get_4xx_and_request_ids_are_unique_across_the_tier(url):
    for path, method, status in (("/nope", "GET", 404), ("/prefill", "GET", 405), ("/", "POST", 405)):
        try:
            urllib.request.urlopen(urllib.request.Request(f"{url}{path}", method=method, data=b"" if method == "POST" else None))
            code = 200
        except urllib.error.HTTPError as exc:
            code = exc.code
        assert code == status, (path, method)
    info = json.loads(urllib.request.urlopen(f"{url}/").read())
    assert info["max_prompt_tokens"] == 2048 and info["backend"] == "TORCH_SDPA"
    # the same client id twice, the first one's KV still held: two requests, two tier-wide ids
    answers = [post(url, {"token_ids": [1, 2], "request_id": "dup", "handoff": h}) for h in (True, False)]
    assert [status for status, _ in answers] == [200, 200]
    ids = [answer["request_id"] for _, answer in answers]
    assert all(i.startswith("dup-") and len(i) == len("dup-") + 16 for i in ids) and ids[0] != ids[1]
    assert [answer["client_request_id"] for _, answer in answers] == ["dup", "dup"]
    assert answers[0][1]["ticket"]["request_id"] == ids[0]


def test_a_client_that_disconnects_cancels_its_request_and_frees_its_place(url):
    assert _wait_for_one_replica()  # the counters below are one replica's
    before = json.loads(urllib.request.urlopen(f"{url}/").read())["requests"]
    body = json.dumps({"token_ids": (np.arange(2040) % 512).tolist()}).encode()  # 32 chunks: long enough to leave
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /prefill HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     + f"content-length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        time.sleep(0.3)  # in the pool now
    deadline, counts = time.monotonic() + 30, before
    while counts["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.2)
        counts = json.loads(urllib.request.urlopen(f"{url}/").read())["requests"]
    assert counts["cancelled"] == before["cancelled"] + 1 and counts["completed"] == before["completed"]
    info = json.loads(urllib.request.urlopen(f"{url}/").read())
    assert info["in_flight"] == 0


def test_a_handoff_ticket_fetches_the_kv_once(url, reference):
    tokens = _prompts(1, seed=5)[0]
    status, answer = post(url, {"token_ids": tokens, "handoff": True, "return_logits": False})
    assert status == 200 and "logits" not in answer
    ticket = answer["ticket"]
    receiver = KVReceiver(ticket["host"], ticket["port"], model_fingerprint=ticket["model_fingerprint"])
    kv = receiver.fetch(ticket["request_id"])
    assert torch.allclose(kv.rows(), reference(tokens)[1], atol=1e-4)


def test_the_metrics_reach_rays_prometheus_endpoint(url):
    node = next(n for n in ray.nodes() if n["Alive"])
    endpoint = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    wanted = ("ray_mlapool_ttft_seconds_count", "ray_mlapool_prefill_tokens_total", "ray_mlapool_requests_total",
              "ray_mlapool_queue_depth", "ray_mlapool_backend_info", "ray_mlapool_kv_bytes_shipped_total",
              "ray_mlapool_queue_seconds_count", "ray_mlapool_batch_seconds_count")  # fmt: skip
    deadline, missing = time.monotonic() + 60, wanted
    while missing and time.monotonic() < deadline:
        text = urllib.request.urlopen(endpoint, timeout=10).read().decode()
        lines = [line for line in text.splitlines() if f'pool="{CONFIG.name}"' in line]
        missing = [name for name in wanted if not any(line.startswith(name) for line in lines)]
        time.sleep(1)
    assert not missing, missing
