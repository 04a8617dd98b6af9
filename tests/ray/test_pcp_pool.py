"""The pool on a TP x PCP grid (gloo, logical GPUs): equivalence with the single-process reference
for both context strategies, the KV reassembled from its PCP shards, and capacity growing with PCP."""

import numpy as np
import pytest
import torch

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from cluster.pool import PrefillPool
from configs.pool import PoolConfig
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

# small chunks and blocks: every prompt spans several chunks, and its KV several stripes
BASE = PoolConfig(
    model="tiny", num_layers=3, chunk_tokens=48, max_batch_tokens=96, block_size=16, worker_cpus=0.25, seed=5, device="cpu"
)
GRIDS = [(1, 2), (2, 2), (1, 4)]
# the same on real GPUs (NCCL), where the machine has enough of them
CUDA_CASES = [
    pytest.param(grid, strategy, marks=pytest.mark.multi_gpu, id=f"tp{grid[0]}xpcp{grid[1]}-{strategy}")
    for grid in GRIDS
    if torch.cuda.device_count() >= grid[0] * grid[1]
    for strategy in ("sharded", "gather")
] or [pytest.param(None, None, marks=pytest.mark.skip(reason="needs 2+ CUDA GPUs (NCCL); results in benchmarks/results"))]


def _reference(config, prompts, draw_device=None):
    model = DeepseekPrefillModel.create(config.model_config(), TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, None, config.seed, draw_device=draw_device)
    outs = [model(torch.from_numpy(np.asarray(p, dtype=np.int64)), plan_prefill_batch([len(p)])) for p in prompts]
    return [(out.logits[0], torch.stack(out.latents)) for out in outs]


@pytest.fixture(scope="module")
def reference(prompts):
    return _reference(BASE, prompts)


@pytest.mark.parametrize("strategy", ["sharded", "gather"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"tp{g[0]}xpcp{g[1]}")
def test_grid_equals_the_single_process_reference(ray_cluster, prompts, reference, grid, strategy):
    tp, pcp = grid
    with PrefillPool(BASE.replace(tp=tp, pcp=pcp, pcp_strategy=strategy)).start() as pool:
        infos = pool.worker_infos[0]
        assert [i.rank for i in infos] == list(range(tp * pcp)) and len({i.pid for i in infos}) == tp * pcp
        assert all(i.pcp_link_gbps > 0 for i in infos)
        results = pool.prefill_many(prompts, keep_kv=True)  # one submission: the prompts share batches
        for result, (logits, latents) in zip(results, reference):
            torch.testing.assert_close(result.logits, logits, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(pool.fetch_kv(result), latents, atol=2e-5, rtol=1e-5)
            pool.release(result)
        assert set(pool.stats.pcp_strategies) == {"none", strategy}
        assert pool.stats.pcp_bytes > 0
        assert all(w["kv_requests"] == 0 for w in pool.health()[0])
        # the same prompt alone, in other batches, gives the same answer
        torch.testing.assert_close(pool.prefill(prompts[3]).logits, reference[3][0], atol=2e-5, rtol=1e-5)


def test_the_longest_prompt_grows_with_pcp_and_one_at_the_limit_runs(ray_cluster):
    config = BASE.replace(num_layers=1, kv_cache_tokens=256, chunk_tokens=128, max_batch_tokens=128)
    with PrefillPool(config).start() as pool:
        assert pool.max_prompt_tokens == 256
    with PrefillPool(config.replace(pcp=2)).start() as pool:
        assert pool.max_prompt_tokens == 512
        with pytest.raises(ValueError, match="prompt of 513 tokens does not fit in the KV cache: it needs 17 blocks of "
                                             "16 tokens on a worker \\(PCP=2 stripes it\\), a worker holds 16, "
                                             "so the longest prompt is 512 tokens"):  # fmt: skip
            pool.submit(np.arange(513) % 512)
        prompt = np.arange(512) * 7 % 512
        result = pool.prefill(prompt, keep_kv=True)  # fills both workers' caches exactly
        assert [w["kv_free_blocks"] for w in pool.health()[0]] == [0, 0]
        (logits, latents), = _reference(config, [prompt])
        torch.testing.assert_close(result.logits, logits, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(pool.fetch_kv(result), latents, atol=2e-5, rtol=1e-5)
        pool.release(result)
        assert [w["kv_free_blocks"] for w in pool.health()[0]] == [16, 16]


@pytest.mark.parametrize("grid,strategy", CUDA_CASES)
def test_nccl_grid_on_gpus_equals_the_reference(ray_cluster, prompts, grid, strategy):
    tp, pcp = grid
    config = BASE.replace(tp=tp, pcp=pcp, pcp_strategy=strategy, device="cuda", dtype="float32", backend="TORCH_SDPA")
    reference = _reference(config, prompts, draw_device="cuda")  # the workers draw their random weights on CUDA
    with PrefillPool(config).start() as pool:
        assert {i.device.split(":")[0] for i in pool.worker_infos[0]} == {"cuda"}
        results = pool.prefill_many(prompts, keep_kv=True)
        for result, (logits, latents) in zip(results, reference):
            torch.testing.assert_close(result.logits, logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(pool.fetch_kv(result), latents, atol=1e-4, rtol=1e-4)
            pool.release(result)
        assert set(pool.stats.pcp_strategies) == {"none", strategy}
