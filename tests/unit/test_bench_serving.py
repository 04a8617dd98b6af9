"""``benchmarks/bench_serving.slo_goodput``: disaggregation's goodput from a sweep's points (the
GPU run of two stacks, ``--pd``, reports it; its figures are only as right as this reading); and
``died``: what a sweep whose vLLM server exited says of it; ``memory_growth``: what a soak calls a
leak; ``kept_results``: what ``--add`` keeps of an earlier run; ``engine_itl_buckets`` and
``engine_itl_over``: vLLM's engine side of an ITL tail, beside the client's (``_point``);
``pool_times_between``: the pool's side of a TTFT tail."""

import http.server
import json
import math
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_serving import _engine_itl_now, _point as point_of, died, engine_itl_buckets, engine_itl_over, histograms, kept_results, memory_growth, merge_results, pool_times_between, pool_times_now, slo_goodput, tier_steps  # noqa: E402  # fmt: skip


def _point(rate: float, throughput: float, ttft_p99: float, itl_p50: float, itl_p99: float, failed: int = 0, goodput: float | None = None) -> dict:
    return {"rate": rate, "request_throughput": throughput, "failed": failed, "ttft": {"p50": ttft_p99 / 2, "p99": ttft_p99},
            "itl": {"p50": itl_p50, "p99": itl_p99}, "request_goodput": goodput}  # fmt: skip


def test_the_goodput_is_the_throughput_at_the_highest_rate_within_both_slos_and_each_stack_has_its_own_itl_bound():
    results = {
        "tier-pd": {"8192": [_point(0.5, 0.5, 400, 10.0, 12), _point(1, 1.0, 600, 11, 15), _point(2, 1.9, 900, 12, 19.9),
                             _point(4, 3.1, 2500, 15, 25), _point(math.inf, 3.3, 9000, 20, 40)]},
        "vllm-dp2": {"8192": [_point(0.5, 0.5, 300, 8.0, 30), _point(1, 1.0, 500, 9, 15.9), _point(2, 1.95, 800, 10, 17),
                              _point(4, 3.5, 1500, 12, 16, failed=1), _point(math.inf, 3.6, 8000, 14, 80)]},
    }  # fmt: skip
    got = slo_goodput(results, ttft_p99_ms=2000, itl_factor=2)["8192"]
    assert got["tier-pd"] == {"unloaded_itl_ms": 10.0, "itl_p99_bound_ms": 20.0, "ttft_p99_bound_ms": 2000, "slo_rate": 2, "goodput_req_s": 1.9,
                              "request_goodput": {"req_s": 0.0, "rate": 0.5}}  # fmt: skip
    # vLLM DP2's ITL at 0.5/s is over its bound (30 > 16): not counted; at 4/s a request failed; 2/s (17 > 16) misses too
    assert got["vllm-dp2"]["itl_p99_bound_ms"] == 16.0 and got["vllm-dp2"]["slo_rate"] == 1 and got["vllm-dp2"]["goodput_req_s"] == 1.0
    assert got["ratio"] == 1.9


def test_a_stack_that_meets_no_rate_has_no_goodput_and_no_ratio_is_divided_by_it():
    results = {"tier-pd": {"4096": [_point(1, 1.0, 500, 10, 12)]}, "vllm-dp2": {"4096": [_point(1, 1.0, 2500, 10, 12)]}}
    got = slo_goodput(results, ttft_p99_ms=2000, itl_factor=2)["4096"]
    assert got["vllm-dp2"]["slo_rate"] is None and got["vllm-dp2"]["goodput_req_s"] == 0.0
    assert got["tier-pd"]["goodput_req_s"] == 1.0 and "ratio" not in got


def test_vllms_own_goodput_is_the_best_over_the_rates_and_its_ratio_is_given_even_when_the_p99_slos_meet_no_rate():
    # the run of 2026-11-27 on 2 x H200: neither stack meets the ITL p99 bound at any rate, vLLM's per-request goodput still compares them
    results = {"tier-pd": {"17408": [_point(1, 0.95, 1329, 2.51, 5.48, goodput=0.95), _point(4, 3.17, 4094, 3.05, 10.7, goodput=2.2953),
                                     _point(math.inf, 3.28, 18174, 2.52, 6.07, goodput=0.0)]},
               "vllm-2x1": {"17408": [_point(1, 0.95, 8293, 2.67, 9.04, goodput=0.6626), _point(2, 1.95, 6563, 2.74, 14.3, goodput=1.4101),
                                      _point(8, 5.21, 11230, 8.09, 579, goodput=0.6183)]}}  # fmt: skip
    got = slo_goodput(results, ttft_p99_ms=2000, itl_factor=2)["17408"]
    assert got["tier-pd"]["goodput_req_s"] == 0.0 and got["vllm-2x1"]["goodput_req_s"] == 0.0 and "ratio" not in got
    assert got["tier-pd"]["request_goodput"] == {"req_s": 2.2953, "rate": 4} and got["vllm-2x1"]["request_goodput"] == {"req_s": 1.4101, "rate": 2}
    assert got["request_goodput_ratio"] == round(2.2953 / 1.4101, 3)


class _Exited:
    """What ``died`` reads of a vLLM server: its process (run to its end) and its log."""

    def __init__(self, log_path: Path, code: int) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        self.process.wait()
        self.log_path, self.log = log_path, log_path.read_text()


def test_a_server_that_exited_is_told_by_its_exit_code_and_the_exceptions_its_log_names_not_their_frames(tmp_path):
    log = tmp_path / "vllm-dp2-1.log"
    log.write_text(
        "(APIServer pid=1) WARNING [system_utils.py:255] ... with error current limit: `OSError: [Errno 24] Too many open files`.\n"
        "(Worker_DP1 pid=3) ERROR [multiproc_executor.py:1063] Traceback (most recent call last):\n"
        '(Worker_DP1 pid=3) ERROR [multiproc_executor.py:1063]   File "moe_runner.py", line 924, in _forward_impl\n'
        "(Worker_DP1 pid=3) ERROR [multiproc_executor.py:1063] NotImplementedError\n"
        "(Worker_DP0 pid=4) ERROR [multiproc_executor.py:1063] NotImplementedError\n"
        "(EngineCore_DP1 pid=2) ERROR [core.py:1512] RuntimeError: Worker failed with error '', please check the stack trace above\n"
    )  # fmt: skip
    got = died(_Exited(log, 3))
    assert got == {"exit_code": 3, "log": str(log), "errors": ["NotImplementedError", "RuntimeError: Worker failed with error '', please check the stack trace above"]}


def _soak_samples(first_answer_s: float, gpu_mib, end_s: float = 650.0) -> list[dict]:
    """A sample each 10 s: requests answered from ``first_answer_s`` on, the tier's GPU memory
    ``gpu_mib(t)`` and a flat vLLM."""
    return [{"t_s": float(t), "answered": 8 * max(0, t - first_answer_s + 10), "tier_gpu_mib": gpu_mib(t), "vllm_gpu_mib": 66578.0}
            for t in range(0, int(end_s) + 1, 10)]  # fmt: skip


def test_the_memory_the_first_requests_take_is_not_a_leak_the_fit_starts_after_the_first_answer():
    # the H200 soak of 2026-11-27: prompts built for ~60 s, then the pool's first batches take 17.9 GiB, then flat
    samples = _soak_samples(70.0, lambda t: 30392.0 if t < 70 else 48702.0)
    start, memory = memory_growth(samples, warmup_s=60.0)
    assert start == 130.0 and memory.keys() == {"tier_gpu_mib", "vllm_gpu_mib"}
    assert memory["tier_gpu_mib"]["flat"] and memory["tier_gpu_mib"]["growth_mib"] == 0.0
    # a leak after the load began is caught: 2 MiB a second is 1,040 MiB over the fit, past 1% of the mean (~49 GiB)
    start, memory = memory_growth(_soak_samples(70.0, lambda t: 48702.0 + 2 * max(0.0, t - 70)), warmup_s=60.0)
    assert not memory["tier_gpu_mib"]["flat"] and memory["vllm_gpu_mib"]["flat"], memory


def test_a_soak_that_answered_nothing_or_ends_too_soon_after_its_warm_up_is_refused_by_name():
    with pytest.raises(ValueError, match="no sample saw a request answered"):
        memory_growth(_soak_samples(1e9, lambda t: 1000.0), warmup_s=60.0)
    with pytest.raises(ValueError, match=r"fewer than 3 samples from 650 s \(60 s after the first answer at 590 s\)"):
        memory_growth(_soak_samples(590.0, lambda t: 1000.0), warmup_s=60.0)


def test_add_keeps_every_stack_and_input_length_this_run_does_not_measure_and_replaces_those_it_does():
    earlier = {"tier": {"4096": ["t4"], "32768": ["t32"]}, "vllm-whole-gpu": {"4096": ["w4"], "32768": ["w32-partial"]}}
    # vLLM on the whole GPU measured again at 32K only (2026-11-27: its 4K points came from an earlier lease)
    kept = kept_results(earlier, ["vllm-whole-gpu"], [32768])
    assert kept == {"tier": earlier["tier"], "vllm-whole-gpu": {"4096": ["w4"]}}
    merged = merge_results(kept, {"vllm-whole-gpu": {"32768": ["w32"]}})
    assert merged == {"tier": earlier["tier"], "vllm-whole-gpu": {"4096": ["w4"], "32768": ["w32"]}}
    # a stack measured at every length it had keeps nothing of it
    assert kept_results(earlier, ["tier"], [4096, 32768]) == {"vllm-whole-gpu": earlier["vllm-whole-gpu"]}


def _metrics_server(pages: list[str]) -> tuple[http.server.HTTPServer, str]:
    """A ``/metrics`` answering ``pages`` in turn (the last one from then on)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (pages.pop(0) if len(pages) > 1 else pages[0]).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


def _itl_page(name: str, *engines: dict[str, float]) -> str:
    """A histogram as vLLM exports it (Prometheus' text format): one family, each engine's buckets and count."""
    lines = [f"# HELP {name} Histogram of inter-token latency in seconds.", f"# TYPE {name} histogram"]
    for engine, counts in enumerate(engines):
        lines += [f'{name}_bucket{{engine="{engine}",le="{le}",model_name="m"}} {n}' for le, n in counts.items()]
        lines.append(f'{name}_count{{engine="{engine}",model_name="m"}} {counts["+Inf"]}')
    return "\n".join([*lines, "# TYPE vllm:num_requests_running gauge", "vllm:num_requests_running 0.0"]) + "\n"


def test_the_engines_itl_tail_is_read_from_vllms_histogram_summed_over_engines_and_servers_by_either_of_its_names():
    new, old = "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
    # one server of two engines (DP 2) that also exports the old name (other counts: not to be added), one of the old name only
    dp2 = _itl_page(new, {"0.01": 90, "0.025": 96, "0.05": 99, "0.1": 100, "+Inf": 100}, {"0.01": 40, "0.025": 48, "0.05": 50, "0.1": 50, "+Inf": 50}) \
        + _itl_page(old, {"0.01": 1, "0.025": 1, "0.05": 1, "0.1": 1, "+Inf": 1})  # fmt: skip
    single = _itl_page(old, {"0.01": 0, "0.025": 0, "0.05": 0, "0.1": 0, "+Inf": 0})
    servers = [_metrics_server([dp2]), _metrics_server([single, _itl_page(old, {"0.01": 5, "0.025": 10, "0.05": 10, "0.1": 10, "+Inf": 10})])]
    try:
        before = engine_itl_buckets([url for _, url in servers])
        assert before == {0.01: 130, 0.025: 144, 0.05: 149, 0.1: 150, math.inf: 150}
        after = engine_itl_buckets([url for _, url in servers])
    finally:
        for server, _ in servers:
            server.shutdown()
    # between the reads: the second server recorded 10 intervals, half over 10 ms, none over 25
    assert engine_itl_over(before, after) == {"intervals": 10, "over_ms": {"10": 0.5, "25": 0.0, "50": 0.0, "100": 0.0}}
    assert engine_itl_over(after, after) == {"intervals": 0}
    # no servers, or one that does not answer (exited): no figures, and the sweep goes on
    assert _engine_itl_now([]) is None and _engine_itl_now([SimpleNamespace(url="http://127.0.0.1:9")]) is None


def test_the_clients_itl_tail_is_the_share_of_every_requests_intervals_over_each_bound_and_apart_from_each_first(tmp_path):
    raw = {"completed": 2, "failed": 0, "duration": 1.0, "request_throughput": 2.0, "output_throughput": 8.0, "request_goodput": 2.0,
           "p50_itl_ms": 3.0, "p99_itl_ms": 40.0, "itls": [[0.003, 0.003, 0.030], [0.003, 0.060, 0.003, 0.200, 0.003]],
           "input_lens": [900, 2100], "ttfts": [0.25, 1.5], "start_times": [100.5, 100.75]}  # fmt: skip
    result = tmp_path / "r.json"
    result.write_text(json.dumps(raw))
    got = point_of({"result": str(result), "failures": str(tmp_path / "f.json"), "point": {"rate": 1.0, "prompts": 2}})
    assert got["itl_over_ms"] == {"10": 0.375, "25": 0.375, "50": 0.25, "100": 0.125}
    # each request's first interval (3 and 3 ms) apart; the 6 after them: 30, 3 / 60, 3, 200, 3 ms
    assert got["first_itl"] == {"p50": 3.0, "p99": 3.0}
    assert got["itl_over_ms_later"] == {"10": 0.5, "25": 0.5, "50": 0.33333, "100": 0.16667}
    assert got["requests"] == {"input_len": [900, 2100], "ttft_ms": [250.0, 1500.0], "sent_s": [0.0, 0.25]}  # each request, in order
    raw["itls"] = [[0.050], [0.020]]  # one interval each: all of them first ones, nothing after them
    del raw["start_times"]  # a vLLM whose benchmark does not record them
    result.write_text(json.dumps(raw))
    got = point_of({"result": str(result), "failures": str(tmp_path / "f.json"), "point": {"rate": 1.0, "prompts": 2}})
    assert got["first_itl"] == {"p50": 35.0, "p99": 49.7} and "itl_over_ms_later" not in got and "sent_s" not in got["requests"]


def _pool_page(queue: dict[str, float], queue_sum: float, batch: dict[str, float], batch_sum: float) -> str:
    """The pool's histograms as Ray's endpoint exports them: a series per pool (``pool`` tag), here two pools
    of equal counts, and no ``kv_wait`` series (nothing observed yet)."""
    lines = []
    for name, counts, total in (("ray_mlapool_queue_seconds", queue, queue_sum), ("ray_mlapool_batch_seconds", batch, batch_sum)):
        lines += [f"# HELP {name} h", f"# TYPE {name} histogram"]
        for pool in ("a", "b"):
            lines += [f'{name}_bucket{{Component="core_worker",le="{le}",pool="{pool}"}} {n}' for le, n in counts.items()]
            lines += [f'{name}_count{{Component="core_worker",pool="{pool}"}} {counts["+Inf"]}', f'{name}_sum{{Component="core_worker",pool="{pool}"}} {total}']
    return "\n".join(lines) + "\n"


def test_the_pools_ttft_is_told_apart_from_its_histograms_summed_over_series_between_two_reads():
    names = ("ray_mlapool_ttft_seconds", "ray_mlapool_queue_seconds", "ray_mlapool_kv_wait_seconds", "ray_mlapool_batch_seconds")
    before = _pool_page({"0.25": 4, "0.5": 4, "1.0": 4, "2.5": 4, "+Inf": 4}, 0.2, {"0.25": 2, "0.5": 2, "1.0": 2, "2.5": 2, "+Inf": 2}, 0.1)
    # between the reads each pool queued 4 more requests, one of them 2 s and one 3 s, and ran 2 batches of 0.3 s
    after = _pool_page({"0.25": 6, "0.5": 6, "1.0": 6, "2.5": 7, "+Inf": 8}, 5.2, {"0.25": 2, "0.5": 4, "1.0": 4, "2.5": 4, "+Inf": 4}, 0.7)
    server, url = _metrics_server([before, after])
    try:
        first, second = histograms(url, names), histograms(url, names)
    finally:
        server.shutdown()
    assert first["ray_mlapool_queue_seconds"] == {0.25: 8, 0.5: 8, 1.0: 8, 2.5: 8, math.inf: 8, "sum": 0.4}
    assert "ray_mlapool_kv_wait_seconds" not in first
    got = pool_times_between(first, second)
    assert got["queue"] == {"count": 8, "mean_ms": 1250.0, "over_s": {"0.25": 0.5, "0.5": 0.5, "1.0": 0.5, "2.5": 0.25}}
    assert got["batch"] == {"count": 4, "mean_ms": 300.0, "over_s": {"0.25": 1.0, "0.5": 0.0, "1.0": 0.0, "2.5": 0.0}}
    assert got["kv_wait"] == {"count": 0} and got["ttft"] == {"count": 0}  # none exported by this page


def test_the_tiers_steps_to_a_first_token_are_taken_from_its_timeline_for_the_points_requests_only():
    timeline = {
        "before": {"received": 99.0, "prefilled": 99.5, "pool_ttft_s": 0.4, "first_token_sent": 99.51},  # an earlier point's
        "a": {"received": 100.0, "forwarded": 100.001, "prefilled": 100.3, "pool_ttft_s": 0.25, "first_token_sent": 100.302},
        "b": {"received": 101.0, "forwarded": 101.001, "prefilled": 104.0, "pool_ttft_s": 2.9, "first_token_sent": 104.01},
        "c": {"received": 102.0, "forwarded": 102.001},  # still prefilling when read
    }  # fmt: skip
    got = tier_steps(timeline, since=100.0)
    assert got["requests"] == 3
    assert got["pool_ttft"] == {"p50": 1575.0, "p99": 2873.5}
    assert got["received_to_prefilled"]["p99"] == pytest.approx(2973.0) and got["prefilled_to_first_token_sent"]["p50"] == pytest.approx(6.0)
    assert tier_steps(timeline, since=200.0) == {"requests": 0}


def _ttft_page(count: int) -> str:
    name = "ray_mlapool_ttft_seconds"
    return (f"# TYPE {name} histogram\n{name}_bucket{{le=\"1.0\",pool=\"p\"}} {count}\n{name}_bucket{{le=\"+Inf\",pool=\"p\"}} {count}\n"
            f"{name}_count{{pool=\"p\"}} {count}\n{name}_sum{{pool=\"p\"}} {count * 0.5}\n")  # fmt: skip


def test_the_pools_record_of_a_point_is_read_once_ray_has_exported_its_requests():
    """Ray's endpoint runs behind the pool (on the 2-core CPU, more than 2.5 s under load): a point's
    record waits until the pool's TTFT has counted the point's requests; the first, for two reads that agree."""
    server, url = _metrics_server([_ttft_page(5), _ttft_page(5), _ttft_page(13)])
    try:
        before = histograms(url, ["ray_mlapool_ttft_seconds"])
        assert before["ray_mlapool_ttft_seconds"][math.inf] == 5
        after = pool_times_now(url, since=before, requests=8)  # two reads still at 5, then 13
    finally:
        server.shutdown()
    assert pool_times_between(before, after)["ttft"] == {"count": 8, "mean_ms": 500.0, "over_s": {"1.0": 0.0}}
    server, url = _metrics_server([_ttft_page(3), _ttft_page(6), _ttft_page(6)])
    try:
        assert pool_times_now(url)["ray_mlapool_ttft_seconds"][math.inf] == 6  # 3, then 6 twice: settled
    finally:
        server.shutdown()
