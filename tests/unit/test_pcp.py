"""Prefill context parallelism: the zigzag split, KV striping, and PCP workers (gloo, one process
per rank, no Ray) against the single-process reference for several chunk sizes and both strategies."""

import numpy as np
import pytest
import torch

from spmd import run_workers

from attention.backends.base import DEEPSEEK_MLA_DIMS
from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from configs.pool import PoolConfig
from workers.model import DeepseekPrefillModel
from workers.pcp import PCPCostModel, PCPGroup, PCPPlan
from workers.pcp_layout import assign_requests, interleave_shards, rank_segments, shard_positions, shard_rows, zigzag_segments
from workers.weights import load_weights

BASE = PoolConfig(model="tiny", num_layers=2, device="cpu", seed=5, block_size=16, workspace_tokens=40)
PROMPT_LENS = (1, 47, 130, 200)


@pytest.mark.parametrize("tokens", [0, 1, 5, 7, 8, 100, 8193])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_zigzag_covers_every_token_once_balanced_and_rank_0_gets_the_last(tokens, size):
    segments = zigzag_segments(tokens, size)
    assert len(segments) == 2 * size and segments[0][0] == 0 and segments[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(segments, segments[1:]))
    lengths = [b - a for a, b in segments]
    assert max(lengths) - min(lengths) <= 1
    shares = [sum(b - a for a, b in rank_segments(tokens, r, size)) for r in range(size)]
    assert sum(shares) == tokens and max(shares) - min(shares) <= 2
    if tokens:
        head, tail = rank_segments(tokens, 0, size)
        assert tail[1] == tokens and tail[1] > tail[0]
    # causal work (query i sees i + 1 keys) is balanced too: off by O(tokens) of ~tokens^2 / 2
    work = [sum(sum(range(a + 1, b + 1)) for a, b in rank_segments(tokens, r, size)) for r in range(size)]
    assert max(work) - min(work) <= 2 * tokens


@pytest.mark.parametrize("tokens", [0, 15, 16, 17, 100, 129])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_striped_shards_partition_the_tokens_by_block(tokens, size):
    positions = [shard_positions(tokens, r, size, 16) for r in range(size)]
    assert [len(p) for p in positions] == [shard_rows(tokens, r, size, 16) for r in range(size)]
    assert sorted(torch.cat(positions).tolist()) == list(range(tokens))
    for r, p in enumerate(positions):
        assert all((x // 16) % size == r for x in p.tolist())
    latent = torch.randn(3, tokens, 5)
    assert torch.equal(interleave_shards([latent[:, p] for p in positions], 16), latent)


def test_capacity_per_rank_shrinks_linearly_with_pcp():
    for size in (1, 2, 4):
        assert shard_rows(64 * 1024, 0, size, 64) == 64 * 1024 // size


def test_short_requests_go_whole_to_the_least_loaded_rank_long_ones_and_chunks_with_context_are_split():
    lens = [4096] * 16 + [30000]
    owners = assign_requests(lens, [0] * 17, 4)
    assert owners[-1] is None  # longer than half a rank's share: zigzag
    assert sorted(owners[:16]) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4  # balanced
    assert assign_requests([10, 100, 20], [0, 0, 500], 2) == [0, None, None]  # a chunk over cached context is split
    assert assign_requests([8192], [0], 4) == [None]  # one prompt: split


@pytest.mark.parametrize("kind", ["TP", "PCP", "EP"])
def test_a_rank_outside_its_group_is_refused_with_the_kind_and_range(kind):
    from workers.expert_parallel import EPGroup
    from workers.model import TPShard

    group = {"TP": TPShard, "PCP": PCPGroup, "EP": EPGroup}[kind]
    assert group(1, 2).rank == 1
    with pytest.raises(ValueError, match=f"^{kind} rank 2 is outside 0..1$"):
        group(2, 2)


def test_interleave_refuses_inconsistent_shards():
    with pytest.raises(ValueError, match="PCP rank 0 returned 10 KV rows; a 13-token request has 13"):
        interleave_shards([torch.zeros(1, 10, 4), torch.zeros(1, 3, 4)], 16)


def _plan(strategy, seq_lens, context_lens, cost_model=None, size=4):
    return PCPPlan(
        seq_lens, context_lens, pcp=PCPGroup(0, size), block_size=64, num_heads=128, dims=DEEPSEEK_MLA_DIMS,
        latent_width=576, element_size=2, workspace_tokens=None, device=torch.device("cpu"),
        strategy=strategy, cost_model=cost_model,
    )  # fmt: skip


def test_sharded_bytes_are_flat_in_the_context_length_and_gather_bytes_grow():
    sharded = [_plan("sharded", [8192], [c]).comm_bytes_per_layer for c in (8192, 65536, 524288)]
    gather = [_plan("gather", [8192], [c]).comm_bytes_per_layer for c in (8192, 65536, 524288)]
    assert sharded[0] == sharded[1] == sharded[2]
    assert gather[0] < gather[1] < gather[2] and gather[2] / gather[1] > 7
    assert _plan("sharded", [8192], [0]).strategy == "none"


def test_cost_model_switches_to_sharded_when_the_context_is_long():
    # 4xH200-like rates: 215 GB/s per rank, 10M up-projected rows/s
    model = PCPCostModel(link_bytes_per_s=215e9, up_projection_rows_per_s=10e6)
    short, long = _plan("auto", [8192], [8192], model), _plan("auto", [8192], [131072], model)
    assert short.strategy == "gather" and long.strategy == "sharded"
    # the crossover follows the rates: a slower link keeps gather longer
    slow = PCPCostModel(link_bytes_per_s=20e9, up_projection_rows_per_s=10e6)
    assert _plan("auto", [8192], [131072], slow).strategy == "gather"
    with pytest.raises(ValueError, match="PCP strategy 'ring' is not one of auto, sharded, gather"):
        _plan("ring", [8], [0])
    with pytest.raises(ValueError, match="'auto' needs a cost model"):
        _plan("auto", [8], [0])


# ---- PCP workers in processes (gloo) ------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts():
    gen = np.random.default_rng(0)
    return [gen.integers(0, 512, size=n).astype(np.int32) for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference_model():
    model = DeepseekPrefillModel.create(BASE.model_config(), TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, None, BASE.seed)
    return model


@pytest.fixture(scope="module")
def reference(prompts, reference_model):
    model = reference_model
    outs = [model(torch.from_numpy(p.astype(np.int64)), plan_prefill_batch([len(p)])) for p in prompts]
    return [(out.logits[0], torch.stack(out.latents)) for out in outs]


def test_pcp3_workers_with_many_short_prompts_in_one_batch(reference_model):
    """Short prompts go whole to ranks (their logits come from three ranks), a long one is split."""
    gen = np.random.default_rng(1)
    prompts = [gen.integers(0, 512, size=n).astype(np.int32) for n in (3, 17, 30, 31, 44, 58, 60, 5, 12, 300)]
    assert sum(o is not None for o in assign_requests([len(p) for p in prompts], [0] * 10, 3)) == 9
    got = run_workers(BASE.replace(pcp=3, max_batch_tokens=1024, chunk_tokens=512), prompts, 512)
    for i, prompt in enumerate(prompts):
        out = reference_model(torch.from_numpy(prompt.astype(np.int64)), plan_prefill_batch([len(prompt)]))
        torch.testing.assert_close(torch.from_numpy(got[0].logits[f"r{i}"]), out.logits[0], atol=2e-5, rtol=1e-5)
        kv = interleave_shards([torch.from_numpy(got[r].kv[f"r{i}"]) for r in range(3)], BASE.block_size)
        torch.testing.assert_close(kv, torch.stack(out.latents), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["sharded", "gather"])
@pytest.mark.parametrize("chunk", [5, 48, 130])
def test_pcp3_workers_equal_the_reference_whatever_the_chunk_size(prompts, reference, strategy, chunk):
    """PCP=3 (odd, so zigzag segments are uneven; chunk 5 leaves ranks without tokens)."""
    config = BASE.replace(pcp=3, pcp_strategy=strategy)
    got = run_workers(config, prompts, chunk)
    logits, strategies = got[0].logits, got[0].strategies
    assert strategies[0] == "none" and set(strategies[1:]) == {strategy}  # the first batch has no context
    for i, (ref_logits, ref_kv) in enumerate(reference):
        torch.testing.assert_close(torch.from_numpy(logits[f"r{i}"]), ref_logits, atol=2e-5, rtol=1e-5)
        kv = interleave_shards([torch.from_numpy(got[r].kv[f"r{i}"]) for r in range(3)], config.block_size)
        torch.testing.assert_close(kv, ref_kv, atol=2e-5, rtol=1e-5)
