"""``benchmarks/bench_serving.slo_goodput``: disaggregation's goodput from a sweep's points (the
GPU run of two stacks, ``--pd``, reports it; its figures are only as right as this reading); and
``died``: what a sweep whose vLLM server exited says of it."""

import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_serving import died, slo_goodput  # noqa: E402


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
