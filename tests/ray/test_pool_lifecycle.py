"""Pool lifecycle: checkpoints, invalid configurations, shutdown, a dying worker.

Its own Ray: the module-scoped TP pools of test_pool hold every logical GPU of theirs."""

import concurrent.futures
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file, save_file
from hf_models import tiny_deepseek_v3

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from cluster.pool import PrefillPool
from cluster.replica import wants_spares
from configs.pool import PoolConfig
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

BASE = PoolConfig(model="tiny", num_layers=3, chunk_tokens=48, max_batch_tokens=96, worker_cpus=0.5, seed=5, device="cpu")


def test_tp_that_does_not_divide_the_heads_is_refused_before_starting(ray_cluster):
    with pytest.raises(ValueError, match=r"TP=3 does not divide tiny's 8 attention heads; valid TP degrees: \[1, 2, 4, 8\]"):
        PrefillPool(BASE.replace(tp=3))
    with pytest.raises(ValueError, match="pcp_strategy 'ring' is not one of auto, sharded, gather"):
        BASE.replace(pcp=2, pcp_strategy="ring")
    with pytest.raises(ValueError, match="placement 'ANYWHERE' is not one of STRICT_PACK, PACK, SPREAD, STRICT_SPREAD"):
        BASE.replace(placement="ANYWHERE")
    with pytest.raises(ValueError, match="pcp must be a positive integer, got 0"):
        BASE.replace(pcp=0)
    with pytest.raises(ValueError, match="unknown MLA prefill backend 'fast'"):
        BASE.replace(backend="fast")


def _hf_checkpoint(path):
    model = tiny_deepseek_v3(vocab_size=320, num_layers=2, max_positions=512, mscale_all_dim=1.0, seed=3)
    model.save_pretrained(path, max_shard_size="60KB")  # several shards + an index
    return model


def test_checkpoint_pool_matches_transformers(tmp_path_factory, ray_cluster):
    path = tmp_path_factory.mktemp("ckpt")
    hf_model = _hf_checkpoint(path)
    assert (path / "model.safetensors.index.json").is_file()
    prompts = [np.arange(5, 90) % 320, np.arange(1, 8)]
    with PrefillPool(BASE.replace(checkpoint=str(path), num_layers=None, tp=2)).start() as pool:
        results = pool.prefill_many(prompts)
    with torch.no_grad():
        for result, prompt in zip(results, prompts):
            expected = hf_model(torch.from_numpy(prompt)[None]).logits[0, -1]
            torch.testing.assert_close(result.logits, expected, atol=1e-4, rtol=1e-4)


def test_broken_checkpoints_are_refused_with_the_tensor_named(tmp_path_factory, ray_cluster):
    path = tmp_path_factory.mktemp("broken")
    _hf_checkpoint(path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    shard = path / index["weight_map"][name]
    tensors = load_file(shard)
    config = BASE.replace(checkpoint=str(path), num_layers=None, tp=2)

    save_file({k: v for k, v in tensors.items() if k != name}, shard)
    with pytest.raises(ValueError, match=f"{shard.name} does not contain {name}, which its index maps there"):
        PrefillPool(config)

    del index["weight_map"][name]
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"is missing 1 tensor\\(s\\) the model needs: {name}"):
        PrefillPool(config)

    index["weight_map"][name] = shard.name
    index_file.write_text(json.dumps(index))
    save_file({**tensors, name: torch.zeros(3, 3)}, shard)
    with pytest.raises(ValueError, match=f"checkpoint tensor {name} has shape \\[3, 3\\], the model expects \\[128, 32\\]"):
        PrefillPool(config)

    save_file(tensors, shard)  # repaired: the same config now starts and serves
    with PrefillPool(config).start() as pool:
        assert pool.prefill([1, 2, 3]).num_tokens == 3


def test_a_grid_larger_than_the_cluster_warns_at_once_and_fails_after_the_timeout(ray_cluster, caplog):
    config = BASE.replace(tp=4, pcp=2, num_layers=1)  # 8 workers x 0.5 CPU; the test cluster has 2 CPUs
    with caplog.at_level("WARNING", logger="cluster.pool"):
        with pytest.raises(RuntimeError, match=r"replica 0 needs 8 x \{'CPU': 0.5\} \(STRICT_PACK\).* Lower tp, pcp or replicas"):
            PrefillPool(config, start_timeout_s=2).start()
    assert "more than the cluster's nodes have now; waiting up to 2 s" in caplog.text


def test_shutdown_refuses_new_requests(ray_cluster):
    pool = PrefillPool(BASE.replace(num_layers=1)).start()
    pool.shutdown()
    with pytest.raises(RuntimeError, match="not running"):
        pool.submit([1, 2, 3])


@pytest.mark.parametrize("grid", [dict(tp=2), dict(pcp=2)], ids=["tp2", "pcp2"])
def test_a_killed_worker_replaces_the_replica_and_its_request_is_retried(ray_cluster, grid):
    prompts = [np.arange(1, 40), np.arange(3, 300) % 512, np.arange(7, 90)]
    model = DeepseekPrefillModel.create(BASE.model_config(), TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, None, BASE.seed)
    expected = [model(torch.from_numpy(p), plan_prefill_batch([len(p)])).logits[0] for p in prompts[1:]]

    with PrefillPool(BASE.replace(**grid, chunk_tokens=4, max_batch_tokens=8)).start() as pool:
        assert pool._replicas[0].spares is None  # spare_workers auto: workers pinned to the CPU start none
        kept = pool.prefill(prompts[0], keep_kv=True)
        started = threading.Event()
        survivor = pool.submit(prompts[1], on_progress=lambda done, total: started.set())
        assert started.wait(60)
        ray_cluster.kill(pool._replicas[0].workers[1])
        # its batch failed with the replica: retried once, alone, on the new workers, from the start
        torch.testing.assert_close(survivor.result(timeout=120).logits, expected[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(pool.prefill(prompts[2]).logits, expected[1], atol=2e-5, rtol=1e-5)
        assert (pool.stats.failed, pool.stats.retried, len(pool.stats.recoveries)) == (0, 1, 1)
        recovery = pool.stats.recoveries[0]
        assert "ActorDiedError" in recovery.cause and recovery.restart_s < 60
        assert recovery.start_s["spares"] is False  # new worker processes, no spares
        with pytest.raises(RuntimeError, match="the KV of request 'req-0' was lost"):
            pool.fetch_kv(kept)
        pool.release(kept)  # nothing left to free; the id is usable again
        assert [w["kv_free_blocks"] for w in pool.health()[0]] == [pool.worker_infos[0][0].kv_blocks] * 2


@pytest.mark.parametrize("kind", ["raise", "exit", "hang"])
def test_a_rank_that_fails_inside_a_collective_is_noticed_in_seconds_and_a_twice_failing_request_fails_alone(
    ray_cluster, kind
):
    """Rank 1 fails at the start of layer 1 while rank 0 is already in layer 1's all-reduce: the
    replica is replaced (a hang: once rank 0's collective times out), the request is retried alone;
    failing again, it fails with the reason, and the next request is served."""
    config = BASE.replace(tp=2, chunk_tokens=16, max_batch_tokens=32, collective_timeout_s=2.0)
    with PrefillPool(config).start() as pool:
        ray.get(pool._replicas[0].workers[1].inject_fault.remote(kind, layer=1))
        doomed = pool.submit(np.arange(1, 50))
        deadline = time.monotonic() + 60
        while not pool.stats.recoveries and time.monotonic() < deadline:
            time.sleep(0.02)
        detected = pool.stats.recoveries[0].detected
        while pool.stats.recoveries[0].restart_s is None and time.monotonic() < deadline:
            time.sleep(0.02)
        ray.get(pool._replicas[0].workers[1].inject_fault.remote(kind, layer=1))  # the retry fails too
        with pytest.raises(RuntimeError, match=r"prefill of 'req-0' failed twice with its replica; last: "):
            doomed.result(timeout=60)
        assert pool.prefill(np.arange(5, 40)).num_tokens == 35
        assert (pool.stats.completed, pool.stats.failed, pool.stats.retried) == (1, 1, 1)
        first = pool.stats.recoveries[0]
        if kind == "raise":  # the rank's own error, with the time it was raised
            raised = float(first.cause.split("(t=")[1].rstrip(")"))
            assert first.cause.startswith("InjectedFault: rank 1: injected fault at layer 1") and detected - raised < 2.0
        elif kind == "hang":  # rank 0's collective gave up on it
            assert "Timed out" in first.cause or "timeout" in first.cause.lower()
        assert all(r.restart_s < 60 for r in pool.stats.recoveries)


def test_kv_capacity_refuses_what_never_fits_and_queues_what_fits_later(ray_cluster):
    config = BASE.replace(num_layers=1, block_size=16, kv_cache_tokens=256, chunk_tokens=64, max_batch_tokens=128)
    with PrefillPool(config).start() as pool:
        assert [info.kv_blocks for info in pool.worker_infos[0]] == [16]
        assert pool.max_prompt_tokens == 256
        with pytest.raises(ValueError, match="prompt of 257 tokens does not fit in the KV cache: it needs 17 blocks of 16 "
                                             "tokens on a worker \\(PCP=1 stripes it\\), a worker holds 16, so the longest "
                                             "prompt is 256 tokens"):
            pool.submit(np.arange(257) % 512)
        first = pool.prefill(np.arange(200), keep_kv=True)  # holds 13 of 16 blocks
        second = pool.submit(np.arange(1, 101))  # needs 7: waits
        assert not second.done()
        with pytest.raises(concurrent.futures.TimeoutError):
            second.result(timeout=2.0)
        pool.release(first)  # frees 13 blocks: the waiting request runs
        assert second.result(timeout=60).num_tokens == 100
        assert pool.health()[0][0]["kv_free_blocks"] == 16
        pool.prefill(np.arange(250), keep_kv=True)  # holds 16 of 16 blocks
        stuck = pool.submit(np.arange(10))  # waits for blocks that are never released
    with pytest.raises(RuntimeError, match="the prefill pool was shut down"):
        stuck.result(timeout=10)


def test_a_cancelled_request_leaves_before_its_next_chunk_and_frees_its_kv(ray_cluster):
    config = BASE.replace(tp=2, num_layers=1, chunk_tokens=8, max_batch_tokens=16, block_size=16, kv_cache_tokens=1024)
    with PrefillPool(config).start() as pool:
        capacity = pool.worker_infos[0][0].kv_blocks
        progress = []
        running = pool.submit(np.arange(500) % 512, on_progress=lambda done, total: progress.append(done))
        queued = pool.submit(np.arange(900) % 512, request_id="queued")  # waits: its KV does not fit yet
        deadline = time.monotonic() + 60
        while not progress and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running.cancel() and pool.cancel("queued") and not pool.cancel("queued") and not pool.cancel("nope")
        assert running.cancelled() and queued.cancelled()
        while pool.stats.cancelled < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (pool.stats.cancelled, pool.stats.completed, pool.stats.failed) == (2, 0, 0)
        assert progress[-1] < 500 and pool.in_flight == 0
        deadline = time.monotonic() + 10
        while any(w["kv_requests"] for w in pool.health()[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [w["kv_free_blocks"] for w in pool.health()[0]] == [capacity] * 2
        assert pool.counts()["cancelled"] == 2
        assert pool.prefill(np.arange(40), request_id="queued").num_tokens == 40  # its id is free again


def test_a_request_that_does_not_fit_one_replica_runs_on_the_other_at_once(ray_cluster):
    """One replica holds 15 of its 16 blocks; each request needing 13 must run on the other one, at
    once (with one queue per replica, each would wait on the full one half of the time)."""
    config = BASE.replace(num_layers=1, replicas=2, block_size=16, kv_cache_tokens=256, chunk_tokens=64, max_batch_tokens=128)
    with PrefillPool(config).start() as pool:
        held = pool.prefill(np.arange(240) % 512, keep_kv=True)  # 15 blocks
        for i in range(6):
            result = pool.submit(np.arange(250 + i, 450 + i) % 512).result(timeout=10)  # 13 blocks, no prefix of the held one
            assert result.replica != held.replica
        pool.release(held)


def _alive_actors() -> int:
    return sum(actor["State"] == "ALIVE" for actor in ray._private.state.actors().values())


@pytest.mark.parametrize(
    "mode,use_gpus,device,wanted",
    [("auto", True, "cuda:0", True), ("auto", True, "cpu", False), ("auto", False, "cuda:0", False), ("on", False, "cpu", True), ("off", True, "cuda:0", False)],
)  # fmt: skip
def test_spares_by_default_only_where_the_workers_compute_on_the_gpus_they_hold(mode, use_gpus, device, wanted):
    infos = [SimpleNamespace(device=device)] * 2  # what a replica's workers said at setup
    assert wants_spares(BASE.replace(spare_workers=mode), use_gpus, infos) is wanted


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_spare_workers_replace_the_failed_ranks_and_new_spares_follow(ray_cluster, kind):
    """With spare_workers on, the replica's spares (started ahead, library imported) take the failed
    ranks' places; new spares are started for the next fault, which they serve too; results equal
    the fault-free ones; nothing is left after shutdown."""
    config = BASE.replace(tp=2, num_layers=2, chunk_tokens=16, max_batch_tokens=32, collective_timeout_s=5.0, spare_workers="on")
    before = _alive_actors()
    prompt = np.arange(1, 50)
    with PrefillPool(config).start() as pool:
        replica = pool._replicas[0]
        expected = pool.prefill(prompt).logits
        for fault in range(2):
            spares = replica.spares
            assert spares is not None and len(spares.workers) == 2
            ray.get(spares.ready, timeout=120)  # preloaded (the backend's name)
            ray.get(replica.workers[1].inject_fault.remote(kind, layer=1))
            torch.testing.assert_close(pool.submit(prompt).result(timeout=120).logits, expected)
            recovery = pool.stats.recoveries[fault]
            assert recovery.start_s["spares"] is True
            assert replica.workers == spares.workers  # the spares are the workers now
            assert replica.spares is not None and replica.spares.workers != spares.workers
        assert pool.stats.retried == 2 and pool.stats.failed == 0
    time.sleep(1.0)  # killed actors leave the GCS's ALIVE list asynchronously
    assert _alive_actors() == before


def test_spares_still_importing_at_a_fault_are_promoted_not_replaced(ray_cluster):
    """A fault before the spares have finished importing (here: right after the start; in the field, a
    second fault soon after the first) still promotes them once they are ready, rather than killing
    them and starting new processes, which are further behind."""
    config = BASE.replace(tp=2, num_layers=2, chunk_tokens=16, max_batch_tokens=32, collective_timeout_s=5.0, spare_workers="on")
    with PrefillPool(config).start() as pool:
        replica = pool._replicas[0]
        spares = replica.spares
        importing = len(ray.wait(spares.ready, num_returns=2, timeout=0)[0]) < 2
        ray.get(replica.workers[0].inject_fault.remote("raise", layer=0))
        assert pool.submit(np.arange(1, 40)).result(timeout=120).logits.shape[-1] == pool.model_config.vocab_size
        assert importing  # the case under test: the spares had not finished importing at the fault
        assert pool.stats.recoveries[0].start_s["spares"] is True and replica.workers == spares.workers
