"""``benchmarks/bench_serving.slo_goodput``: disaggregation's goodput from a sweep's points (the
GPU run of two stacks, ``--pd``, reports it; its figures are only as right as this reading); and
``died``: what a sweep whose vLLM server exited says of it; ``memory_growth``: what a soak calls a
leak; ``kept_results``: what ``--add`` keeps of an earlier run."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_serving import died, kept_results, memory_growth, merge_results, slo_goodput  # noqa: E402


def _point(rate: float, throughput: float, ttft_p99: float, itl_p50: float, itl_p99: float, failed: int = 0) -> dict:
    return {"rate": rate, "request_throughput": throughput, "failed": failed, "ttft": {"p50": ttft_p99 / 2, "p99": ttft_p99},
            "itl": {"p50": itl_p50, "p99": itl_p99}}  # fmt: skip


def test_the_goodput_is_the_throughput_at_the_highest_rate_within_both_slos_and_each_stack_has_its_own_itl_bound():
    results = {
        "tier-pd": {"8192": [_point(0.5, 0.5, 400, 10.0, 12), _point(1, 1.0, 600, 11, 15), _point(2, 1.9, 900, 12, 19.9),
                             _point(4, 3.1, 2500, 15, 25), _point(math.inf, 3.3, 9000, 20, 40)]},
        "vllm-dp2": {"8192": [_point(0.5, 0.5, 300, 8.0, 30), _point(1, 1.0, 500, 9, 15.9), _point(2, 1.95, 800, 10, 17),
                              _point(4, 3.5, 1500, 12, 16, failed=1), _point(math.inf, 3.6, 8000, 14, 80)]},
    }  # fmt: skip
    got = slo_goodput(results, ttft_p99_ms=2000, itl_factor=2)["8192"]
    assert got["tier-pd"] == {"unloaded_itl_ms": 10.0, "itl_p99_bound_ms": 20.0, "ttft_p99_bound_ms": 2000, "slo_rate": 2, "goodput_req_s": 1.9}
    # vLLM DP2's ITL at 0.5/s is over its bound (30 > 16): not counted; at 4/s a request failed; 2/s (17 > 16) misses too
    assert got["vllm-dp2"]["itl_p99_bound_ms"] == 16.0 and got["vllm-dp2"]["slo_rate"] == 1 and got["vllm-dp2"]["goodput_req_s"] == 1.0
    assert got["ratio"] == 1.9


def test_a_stack_that_meets_no_rate_has_no_goodput_and_no_ratio_is_divided_by_it():
    results = {"tier-pd": {"4096": [_point(1, 1.0, 500, 10, 12)]}, "vllm-dp2": {"4096": [_point(1, 1.0, 2500, 10, 12)]}}
    got = slo_goodput(results, ttft_p99_ms=2000, itl_factor=2)["4096"]
    assert got["vllm-dp2"]["slo_rate"] is None and got["vllm-dp2"]["goodput_req_s"] == 0.0
    assert got["tier-pd"]["goodput_req_s"] == 1.0 and "ratio" not in got


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
