"""``benchmarks/bench_vllm_truth.py``'s scoring of an engine against the float32 truth (the accuracy
comparisons of the vLLM decode and FP8 results are only as right as this): departures, first tokens,
rows' distance, and the totals over checkpoints; and the tier's pool holding every prompt's kept KV at once."""

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from bench_vllm_truth import compare, pool_config, totals  # noqa: E402


def _truth():
    return [{"tokens": [5, 6, 7], "margins": [0.5, 0.01, 0.002]}, {"tokens": [1, 2, 3], "margins": [0.0001, 0.3, 0.3]}]


def test_an_engine_is_scored_by_its_first_departure_and_its_rows_distance():
    rows = [torch.ones(2, 4, 3), torch.ones(2, 4, 3)]  # per prompt: layers x tokens x width
    runs = [{"tokens": [5, 6, 9], "rows": torch.ones(2, 4, 3), "other_ranks": []},
            {"tokens": [4, 2, 8], "rows": torch.cat([torch.ones(1, 4, 3), 1.1 * torch.ones(1, 4, 3)]), "other_ranks": []}]  # fmt: skip
    got = compare(_truth(), rows, runs)
    assert got["prompts_equal_to_truth"] == 0 and got["first_tokens_equal_to_truth"] == 1
    assert got["departures"] == [{"prompt": 0, "step": 2, "truth_margin": 0.002}, {"prompt": 1, "step": 0, "truth_margin": 0.0001}]
    assert got["rows_relative_l2_per_layer"][0] == {"mean": 0.0, "max": 0.0}
    assert got["rows_relative_l2_per_layer"][1] == {"mean": pytest.approx(0.05), "max": pytest.approx(0.1)}


def _side(equal: int, departures: list[dict]) -> dict:
    return {"prompts_equal_to_truth": equal, "departures": departures, "first_tokens_equal_to_truth": equal + sum(d["step"] > 0 for d in departures)}


def test_totals_add_every_checkpoint_per_engine():
    checkpoints = [{"vllm_alone": _side(1, [{"prompt": 0, "step": 0}]), "tier_and_vllm": _side(2, [])},
                   {"vllm_alone": _side(0, [{"prompt": 0, "step": 3}, {"prompt": 1, "step": 1}]),
                    "tier_and_vllm": _side(1, [{"prompt": 1, "step": 0}])}]  # fmt: skip
    assert totals(checkpoints) == {
        "vllm_alone": {"prompts": 4, "first_tokens_equal_to_truth": 3, "prompts_equal_to_truth": 1, "departs_alone": 2},
        "tier_and_vllm": {"prompts": 4, "first_tokens_equal_to_truth": 3, "prompts_equal_to_truth": 3, "departs_alone": 0},
    }


def test_the_pool_alone_is_set_beside_vllm_alone():
    checkpoints = [{"vllm_alone": _side(1, [{"prompt": 0, "step": 4}]), "tier_and_vllm": _side(1, [{"prompt": 1, "step": 2}]),
                    "pool_alone": _side(0, [{"prompt": 0, "step": 6}, {"prompt": 1, "step": 3}])}]  # fmt: skip
    got = totals(checkpoints)
    assert got["pool_alone"] == {"prompts": 2, "first_tokens_equal_to_truth": 2, "prompts_equal_to_truth": 0, "departs_alone": 1}
    assert got["vllm_alone"]["departs_alone"] == 1 and got["tier_and_vllm"]["departs_alone"] == 1  # each other's counterparts


def test_the_tiers_pool_holds_every_prompts_kept_kv_at_once():
    """The tier keeps each prompt's KV until vLLM loads it, after every prefill: a cache too small for all
    of them left the first prefill past its 131,072 tokens waiting for a release that never came (96 prompts
    of 1-4K on one H200, 2026-11-29)."""
    prompts = [[1] * 4000] * 95 + [[1] * 65]
    config = pool_config(Path("ckpt"), "bfloat16", "cpu", kept=prompts)
    block = config.block_size
    assert config.kv_cache_tokens >= 95 * 4032 + 2 * block > 1 << 17  # each prompt in whole blocks
    assert pool_config(Path("ckpt"), "float32", "cpu").kv_cache_tokens == 1 << 17  # nothing kept: the default
