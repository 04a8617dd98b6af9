"""The chaos test: two replicas of TP=2 (gloo) under a stream of 200 requests of mixed lengths,
with kept KV handed off to receivers outside the cluster (TCP, mapped and NIXL) and to decode actors, while a seeded schedule kills and breaks
workers mid-batch, kills decode actors mid-pull, drops KV receivers mid-frame and cancels
requests. ``benchmarks/chaos.py`` holds the run and its checks; see its docstring."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from chaos import chaos_config, run_chaos  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_request_is_accounted_for_once_and_nothing_leaks_under_chaos(ray_cluster, capsys):
    summary = run_chaos(chaos_config(), requests=200, seed=0)
    with capsys.disabled():
        print("\nchaos:", {k: summary[k] for k in ("requests", "completed", "failed", "cancelled", "retried",
                                                    "faults_injected", "handoffs", "leaked_blocks", "max_fault_to_serving_s")})  # fmt: skip
    assert summary["violations"] == []
    assert summary["completed"] + summary["failed"] + summary["cancelled"] == 200
    # the schedule really happened: worker faults replaced replicas, requests were cancelled and retried
    assert summary["faults_injected"]["worker"] == 4 and len(summary["replica_recoveries"]) == 4
    assert summary["cancelled"] >= 1 and summary["retried"] >= 1
    # receivers dropped mid-frame and decode actors killed mid-pull (a few may find the KV lost with a replica first)
    assert summary["handoffs"].get("dropped, freed", 0) >= 1 and summary["handoffs"].get("actor after a kill", 0) >= 1
    # receivers outside the cluster took KV from the holders over every transport (the suite installs NIXL)
    assert summary["handoffs"].get("tcp", 0) >= 1 and summary["handoffs"].get("nixl", 0) >= 1 and summary["handoffs"].get("mapped", 0) >= 1
    assert summary["leaked_blocks"] == 0 and summary["leaked_actors"] == 0 and summary["leaked_threads"] == []
    # the slowest replacement served again within a bound only a hang would exceed, not a speed target (the
    # benchmark reports speed, docs/faults.md): its processes take 3-10 s to start on 2 loaded cores
    assert summary["max_fault_to_serving_s"] < 30.0
