"""``benchmarks/probes/probe_queue_model.replay``: the model of one replica's queue that the serving
sweep's TTFT is set beside (docs/vllm-decode.md), here its batching and its bound on KV room."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))
from probe_queue_model import replay  # noqa: E402

# a batch costs 1 s plus 1 ms a token, nothing quadratic: the arithmetic below stays readable
MODEL = {"max_batch_tokens": 1000, "batch_s": 1.0, "token_s": 0.001, "token2_s": 0.0}


def test_requests_that_arrive_together_share_a_batch_and_one_that_does_not_fit_is_split_at_the_budget():
    ttft = replay(np.array([0.0, 0.0]), np.array([600, 600]), **MODEL)
    # the first batch: all of the first prompt, 400 of the second (2 s); the second batch its last 200 (1.2 s)
    assert ttft == pytest.approx([2.0, 3.2])


def test_a_request_whose_kv_does_not_fit_waits_until_the_one_holding_it_has_been_handed_off():
    arrivals, lengths = np.array([0.0, 0.1]), np.array([600, 600])
    unbounded = replay(arrivals, lengths, **MODEL)
    bounded = replay(arrivals, lengths, **MODEL, kv_tokens=1000, handoff_s=0.5)
    assert unbounded[1] == pytest.approx(3.2 - 0.1)  # the next batch, from 1.6 s
    # the first prompt holds 600 of 1000 tokens until 1.6 + 0.5 s; the second runs alone then
    assert bounded[0] == pytest.approx(1.6)
    assert bounded[1] == pytest.approx(2.1 + 1.6 - 0.1)


def test_a_release_queued_behind_a_running_batch_frees_the_kv_for_the_batch_after_the_next():
    # 1,300 tokens of KV. At 0 s: two prompts of 500 fill the first batch (to 2.0 s), one of 600 does not
    # fit beside them, one of 100 does and runs next (2.0-3.1 s); another of 100 comes at 2.5 s
    arrivals, lengths = np.array([0.0, 0.0, 0.0, 0.0, 2.5]), np.array([500, 500, 600, 100, 100])
    at_once = replay(arrivals, lengths, **MODEL, kv_tokens=1300, handoff_s=0.1, release="at-once")
    behind = replay(arrivals, lengths, **MODEL, kv_tokens=1300, handoff_s=0.1, release="next-batch")
    assert at_once[:2] == pytest.approx([2.0, 2.0]) and behind[:2] == pytest.approx([2.0, 2.0])
    assert at_once[3] == pytest.approx(3.1) and behind[3] == pytest.approx(3.1)
    # freed at 2.1 s: the 600 and the late 100 run together in the batch built at 3.1 s (1.7 s)
    assert at_once[2] == pytest.approx(4.8) and at_once[4] == pytest.approx(4.8 - 2.5)
    # freed behind the second batch: only the late 100 fits at 3.1 s; the 600 runs after it, from 4.2 s
    assert behind[4] == pytest.approx(4.2 - 2.5) and behind[2] == pytest.approx(4.2 + 1.6)


def test_an_idle_replica_takes_the_room_as_soon_as_it_is_freed_either_way():
    arrivals, lengths = np.array([0.0, 0.0, 0.0]), np.array([500, 500, 600])
    for release in ("at-once", "next-batch"):
        ttft = replay(arrivals, lengths, **MODEL, kv_tokens=1100, handoff_s=0.1, release=release)
        assert ttft == pytest.approx([2.0, 2.0, 2.1 + 1.6])  # nothing runs between: no batch to wait behind
