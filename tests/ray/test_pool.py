"""The Ray prefill pool on CPU (gloo, logical GPUs): TP equivalence, batching, checkpoints, bad input."""

import threading
import time

import numpy as np
import pytest
import torch

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from cluster import scheduler
from cluster.pool import PrefillPool
from configs.pool import PoolConfig
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

# small chunks so that every prompt below spans several chunks and batches
BASE = PoolConfig(model="tiny", num_layers=3, chunk_tokens=48, max_batch_tokens=96, worker_cpus=0.5, seed=5, device="cpu")


@pytest.fixture(scope="module")
def reference(prompts):
    """Single-process, TP=1 results of each prompt alone: (logits, last_hidden, latents [layers, T, 576])."""
    model_config = BASE.model_config()
    model = DeepseekPrefillModel.create(model_config, TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, None, BASE.seed)
    results = []
    for prompt in prompts:
        out = model(torch.from_numpy(prompt), plan_prefill_batch([len(prompt)]))
        results.append((out.logits[0], out.last_hidden[0], torch.stack(out.latents)))
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def pool(request, ray_cluster):
    with PrefillPool(BASE.replace(tp=request.param)).start() as pool:
        yield pool


def test_workers_are_placed_one_per_logical_gpu(pool):
    infos = pool.worker_infos[0]
    assert [i.rank for i in infos] == list(range(pool.config.tp))
    assert {i.world_size for i in infos} == {pool.config.tp}
    assert {i.backend for i in infos} == {"TORCH_SDPA"} and {i.device for i in infos} == {"cpu"}
    assert len({i.pid for i in infos}) == pool.config.tp


def test_batched_chunked_prefill_equals_single_process_reference(pool, prompts, reference):
    results = pool.prefill_many(prompts, keep_kv=True)  # one submission: the prompts share batches
    for result, prompt, (logits, last_hidden, latents) in zip(results, prompts, reference):
        assert result.num_tokens == len(prompt)
        torch.testing.assert_close(result.logits, logits, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(result.last_hidden, last_hidden, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(pool.fetch_kv(result), latents, atol=2e-5, rtol=1e-5)
        pool.release(result)
    assert all(w["kv_requests"] == 0 for w in pool.health()[0])


def test_requests_without_logits_share_batches_and_get_the_greedy_first_token(pool, prompts, reference):
    asks = [i % 2 == 0 for i in range(len(prompts))]
    futures = [pool.submit(prompt, return_logits=ask) for prompt, ask in zip(prompts, asks)]  # mixed in one batch
    for future, ask, (logits, last_hidden, _) in zip(futures, asks, reference):
        result = future.result()
        assert result.first_token == int(logits.argmax())
        if ask:
            torch.testing.assert_close(result.logits, logits, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(result.last_hidden, last_hidden, atol=2e-5, rtol=1e-5)
        else:
            assert result.logits is None and result.last_hidden is None
    with pytest.raises(TypeError, match="return_logits must be True or False, got 'no'"):
        pool.submit(prompts[0], return_logits="no")
    in_flight = pool.in_flight
    with pytest.raises(TypeError, match="return_logits must be True or False, got 1"):
        pool.submit_many(prompts[:2], return_logits=1)
    assert pool.in_flight == in_flight  # nothing of either call was queued
    assert pool.prefill(prompts[0]).first_token == int(reference[0][0].argmax())  # the pool serves on


def test_each_prompt_alone_equals_the_batch(pool, prompts, reference):
    for prompt, (logits, _, _) in zip(prompts, reference):
        torch.testing.assert_close(pool.prefill(prompt).logits, logits, atol=2e-5, rtol=1e-5)
    assert all(w["kv_requests"] == 0 for w in pool.health()[0]), "KV not kept unless asked"


def test_concurrent_requests_share_batches(pool, prompts, reference):
    before = pool.stats.batches
    results = [None] * 8
    def run(i):
        results[i] = pool.prefill(prompts[i % len(prompts)])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, result in enumerate(results):
        torch.testing.assert_close(result.logits, reference[i % len(prompts)][0], atol=2e-5, rtol=1e-5)
    chunks_alone = 2 * sum(-(-len(p) // BASE.chunk_tokens) for p in prompts)
    assert pool.stats.batches - before < chunks_alone


def test_prompts_submitted_together_start_in_one_batch(pool):
    before, times = pool.stats.batches, (pool.stats.batch_s, pool.stats.worker_s)
    prompts = [np.arange(40) % 500, np.arange(1, 41) % 500]  # 80 tokens: one batch's budget (96) holds both
    began = time.perf_counter()
    results = [f.result() for f in pool.submit_many(prompts)]
    wall = time.perf_counter() - began
    assert [r.num_tokens for r in results] == [40, 40]
    assert pool.stats.batches - before == 1  # one by one, an idle replica would start on the first alone
    # the batch's time, as the driver saw it and as rank 0 spent it: the second inside the first, inside the wall
    batch_s, worker_s = pool.stats.batch_s - times[0], pool.stats.worker_s - times[1]
    assert 0 < worker_s < batch_s < wall


def test_a_bad_prompt_among_prompts_submitted_together_queues_none_of_them(pool, prompts, reference):
    before, in_flight = pool.stats.batches, pool.in_flight
    with pytest.raises(ValueError, match=r"prompt 1 of 3: .*token id 512 is outside the vocabulary"):
        pool.submit_many([prompts[0], [1, 2, 512], prompts[1]])
    assert pool.in_flight == in_flight and pool.stats.batches == before
    torch.testing.assert_close(pool.prefill_many([prompts[1]])[0].logits, reference[1][0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "tokens,error,message",
    [
        ([], ValueError, "empty prompt"),
        ([1, 2, 512], ValueError, r"token id 512 is outside the vocabulary \[0, 512\)"),
        ([-3, 2], ValueError, "token id -3"),
        ([1.5, 2.0], TypeError, "token ids must be integers, got dtype float64"),
        ([[1, 2]], ValueError, "flat sequence"),
        (np.zeros(8193, dtype=np.int64), ValueError, "exceeds tiny's maximum of 8192 positions"),
    ],
    ids=["empty", "vocab", "negative", "float", "nested", "too-long"],
)
def test_bad_prompt_fails_alone_and_the_pool_keeps_serving(pool, prompts, reference, tokens, error, message):
    good = pool.submit(prompts[1])
    with pytest.raises(error, match=message):
        pool.submit(tokens)
    torch.testing.assert_close(good.result().logits, reference[1][0], atol=2e-5, rtol=1e-5)


def test_a_failing_progress_callback_does_not_stop_the_pool(pool, prompts, reference):
    def broken(done, total):
        raise RuntimeError("caller bug")

    result = pool.prefill(prompts[2], on_progress=broken)
    torch.testing.assert_close(result.logits, reference[2][0], atol=2e-5, rtol=1e-5)
    assert pool.prefill(prompts[1]).num_tokens == len(prompts[1])


def test_a_cancelled_request_does_not_stop_the_pool(pool, prompts, reference):
    cancelled = pool.submit(prompts[3])
    cancelled.cancel()
    after = pool.submit(prompts[2]).result(timeout=120)  # a dead scheduler would time out here
    torch.testing.assert_close(after.logits, reference[2][0], atol=2e-5, rtol=1e-5)
    assert cancelled.cancelled()


def test_request_ids_must_be_unique(pool, prompts):
    result = pool.prefill(prompts[0], request_id="same", keep_kv=True)
    with pytest.raises(ValueError, match="request id 'same' is already in flight or holds KV"):
        pool.submit(prompts[0], request_id="same")
    pool.release(result)
    pool.prefill(prompts[0], request_id="same")  # free again once released



def test_a_request_reaching_an_idle_replica_runs_without_waiting_out_the_idle_wait(pool, prompts, monkeypatch):
    # the first request of an idle replica waited for the rest of the idle wait (0.5 s) before
    # running: 0.5 s on every request at low load. With the idle wait stretched to 20 s, the
    # request must still run at once
    monkeypatch.setattr(scheduler, "IDLE_WAIT_S", 20.0)
    time.sleep(0.6)  # every scheduler is now in an idle wait of 20 s
    started = time.monotonic()
    pool.prefill(prompts[0][:40])  # one chunk
    assert time.monotonic() - started < 10.0


def test_a_replica_serving_one_request_at_a_time_never_waits_for_company(pool, prompts, monkeypatch):
    # batch_wait_ms applies after a batch of several requests only: with a wait of 20 s, requests
    # sent one after another (every batch a batch of one) still run at once
    monkeypatch.setattr(pool, "config", pool.config.replace(batch_wait_ms=20_000.0))
    pool.prefill(prompts[0][:40])  # after the previous test's batches: this one may wait
    for prompt in prompts[1:3]:
        assert pool.prefill(prompt[:40]).queue_s < 10.0
