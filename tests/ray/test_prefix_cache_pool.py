"""Prefix caching in the pool (gloo, logical GPUs): a prompt prefilled on top of a cached prefix equals
the same prompt prefilled cold (logits and latent KV rows, float32), on TP x PCP grids, with chunks
smaller than the prefix, prefixes ending on and off block boundaries, the tiny MoE model included;
routing keeps a conversation on the replica holding its history; and a randomized run of 500+
requests (shared and unshared prefixes, handoffs, cancellations, a cache small enough to evict)
ends with no block held and every request served its own prompt's rows."""

import time

import numpy as np
import pytest
import torch
from hf_models import tiny_moe

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from cluster.pool import PrefillPool
from configs.model import load_model_config
from configs.pool import PoolConfig
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

BASE = PoolConfig(model="tiny", num_layers=3, chunk_tokens=48, max_batch_tokens=96, block_size=16, worker_cpus=0.25, seed=5, device="cpu")
LIMIT = 1e-5  # relative L2 error, logits and every layer's rows


def _model(config: PoolConfig):
    model = DeepseekPrefillModel.create(config.model_config(), TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, config.checkpoint, config.seed)
    return model


def _cold(model, prompt):
    """The prompt prefilled from its first token in one pass: (logits, rows [layers, tokens, width])."""
    out = model(torch.from_numpy(np.asarray(prompt, dtype=np.int64)), plan_prefill_batch([len(prompt)]))
    return out.logits[0], torch.stack(out.latents)


def _rel(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _check(pool, result, model, prompt):
    logits, rows = _cold(model, prompt)
    assert _rel(result.logits, logits) <= LIMIT
    kv = pool.fetch_kv(result)
    for layer in range(rows.shape[0]):
        assert _rel(kv[layer], rows[layer]) <= LIMIT, (layer, _rel(kv[layer], rows[layer]))
    pool.release(result)


def _idle(pool) -> bool:
    """No block referenced by the driver, no table on any worker, every worker's blocks free."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        report, health = pool.prefix_report(), pool.health()
        capacity = [[i.kv_blocks for i in r] for r in pool.worker_infos]
        if (all(sum(r["blocks_in_use"]) == 0 for r in report)
                and [[w["kv_free_blocks"] for w in r] for r in health] == capacity
                and all(w["kv_requests"] == 0 for r in health for w in r)):  # fmt: skip
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("grid", [(1, 1), (2, 1), (2, 2), (1, 4)], ids=lambda g: f"tp{g[0]}xpcp{g[1]}")
def test_a_prompt_on_a_cached_prefix_equals_its_cold_prefill(ray_cluster, grid):
    tp, pcp = grid
    config = BASE.replace(tp=tp, pcp=pcp)
    model = _model(config)
    rng = np.random.default_rng(tp * 10 + pcp)
    with PrefillPool(config).start() as pool:
        for prefix_len in (96, 100):  # 6 blocks of 16; 6 and a part (the part is recomputed)
            prefix = rng.integers(0, 512, size=prefix_len)
            first = np.concatenate([prefix, rng.integers(0, 512, size=37)])
            assert pool.prefill(first).cached_tokens == 0  # cold: caches its 8 full blocks
            second = np.concatenate([prefix, rng.integers(0, 512, size=70)])  # another suffix, prefilled in 48-token chunks
            result = pool.prefill(second, keep_kv=True)
            assert result.cached_tokens == 96
            _check(pool, result, model, second)
            again = pool.prefill(second, keep_kv=True)  # cached whole but its last block, recomputed for the logits
            assert again.cached_tokens == (len(second) - 1) // 16 * 16
            _check(pool, again, model, second)
        report = pool.prefix_report()[0]
        assert report["hit_tokens"] == (96 + 160) * 2 and report["evictions"] == 0  # 160: (166 - 1) // 16 * 16, as (170 - 1) // 16 * 16
        assert _idle(pool)


def test_the_tiny_moe_model_on_a_cached_prefix_equals_its_cold_prefill(ray_cluster, tmp_path):
    hf = tiny_moe("v3", seed=6)
    hf.save_pretrained(tmp_path)
    config = PoolConfig(checkpoint=str(tmp_path), tp=2, pcp=2, chunk_tokens=16, block_size=8, kv_cache_tokens=512, worker_cpus=0.25, device="cpu")
    model = DeepseekPrefillModel.create(load_model_config(tmp_path), TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, tmp_path)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 320, size=43)  # 5 blocks of 8 and 3 tokens
    with PrefillPool(config).start() as pool:
        pool.prefill(np.concatenate([prefix, rng.integers(0, 320, size=20)]))
        prompt = np.concatenate([prefix, rng.integers(0, 320, size=30)])
        result = pool.prefill(prompt, keep_kv=True)
        assert result.cached_tokens == 40
        _check(pool, result, model, prompt)
        assert _idle(pool)


def test_turning_the_cache_off_prefills_every_prompt_from_its_first_token(ray_cluster):
    with PrefillPool(BASE.replace(prefix_caching=False)).start() as pool:
        prompt = np.arange(200) % 512
        assert [pool.prefill(prompt).cached_tokens for _ in range(2)] == [0, 0]
        assert pool.prefix_report()[0]["blocks_cached"] == [0] and pool.prefix_report()[0]["hit_tokens"] == 0
    with pytest.raises(ValueError, match="prefix_caching must be true or false"):
        BASE.replace(prefix_caching="yes")


def test_a_conversation_stays_on_the_replica_holding_its_history(ray_cluster):
    with PrefillPool(BASE.replace(replicas=2, pcp=2)).start() as pool:
        rng = np.random.default_rng(11)
        chats = [rng.integers(0, 512, size=120) for _ in range(4)]
        homes = [r.replica for r in pool.prefill_many(chats)]
        for turn in range(3):
            chats = [np.concatenate([c, rng.integers(0, 512, size=40)]) for c in chats]
            results = pool.prefill_many(chats)  # all at once: both replicas are free to take any of them
            assert [r.replica for r in results] == homes
            assert all(r.cached_tokens == (len(c) - 40) // 16 * 16 for r, c in zip(results, chats))
        assert _idle(pool)


def test_500_random_requests_share_evict_hand_off_and_cancel_without_a_leak_or_a_wrong_row(ray_cluster):
    """Two replicas of TP 1 x PCP 2 with 48 blocks of 16 per worker (a few prompts' worth, so the cache
    evicts), 520 requests in waves of 26: prompts drawn from 12 shared prefixes (on and off block
    boundaries) or none, each with its own suffix; a quarter kept for a handoff (rows checked against
    the cold prefill, then released), a tenth cancelled. Every finished request's logits equal its
    own prompt's cold logits."""
    config = BASE.replace(num_layers=2, replicas=2, pcp=2, kv_cache_tokens=48 * 16)
    model = _model(config)
    rng = np.random.default_rng(2026)
    prefixes = [rng.integers(0, 512, size=int(n)) for n in rng.integers(20, 180, size=12)]
    cold: dict[bytes, tuple] = {}
    finished = cancelled = kept = 0
    with PrefillPool(config).start() as pool:
        for wave in range(20):
            batch = []
            for _ in range(26):
                own = rng.integers(0, 512, size=int(rng.integers(1, 120)))
                choice = rng.integers(0, len(prefixes) + 2)
                prompt = np.concatenate([prefixes[choice], own]) if choice < len(prefixes) else own
                keep = rng.random() < 0.25
                batch.append((prompt, keep, pool.submit(prompt, keep_kv=keep)))
            for prompt, keep, future in batch:
                if rng.random() < 0.1 and future.cancel():
                    cancelled += 1
            for prompt, keep, future in batch:
                if future.cancelled():
                    continue
                result = future.result(timeout=300)
                key = prompt.astype(np.int64).tobytes()
                if key not in cold:
                    cold[key] = _cold(model, prompt)
                logits, rows = cold[key]
                assert _rel(result.logits, logits) <= LIMIT and result.cached_tokens % 16 == 0 and result.cached_tokens < len(prompt)
                if keep:
                    kv = pool.fetch_kv(result)
                    assert all(_rel(kv[layer], rows[layer]) <= LIMIT for layer in range(rows.shape[0]))
                    pool.release(result)
                    kept += 1
                finished += 1
        reports = pool.prefix_report()
        assert finished + cancelled == 520 and cancelled > 20 and kept > 80
        assert sum(r["hit_tokens"] for r in reports) > 0 and sum(r["evictions"] for r in reports) > 0
        assert pool.counts()["completed"] == finished and pool.counts()["cancelled"] == cancelled
        assert _idle(pool) and not pool.kept_results()
