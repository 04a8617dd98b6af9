"""Faults and handoff safety on real GPUs (NCCL), where the machine has two or more: a rank that
raises, exits or hangs inside a TP=2 batch is noticed and its replica replaced, its request retried; a
decode actor on a holder's own GPU pulls over Ray objects (``auto``) or is refused before any send
(``p2p``), and one on the other GPU pulls over NCCL. Results: benchmarks/results/history/*-gpu-faults.log."""

import json
import logging
import os
import time

import numpy as np
import pytest
import ray
import torch

from cluster.handoff import DecodeActor
from cluster.pool import PrefillPool
from configs.pool import PoolConfig
from workers.worker import SAFE_NCCL_ENV

pytestmark = [
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs (NCCL); results in benchmarks/results"),
]
CONFIG = PoolConfig(model="tiny", num_layers=3, chunk_tokens=64, max_batch_tokens=256, kv_cache_tokens=8192, seed=7,
                    device="cuda", collective_timeout_s=5.0)  # fmt: skip
NOSET = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", **SAFE_NCCL_ENV}  # the actor picks its GPU itself


@pytest.fixture(scope="module")
def gpu_ray():
    os.environ.update(SAFE_NCCL_ENV)
    ray.init(num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": dict(SAFE_NCCL_ENV)})  # fmt: skip
    yield
    ray.shutdown()


@pytest.mark.parametrize("kind", ["raise", "exit", "hang"])
def test_a_rank_failing_inside_an_nccl_batch_is_replaced_within_seconds(gpu_ray, kind):
    # a hung rank: its peer's NCCL collective times out after 5 s, but torch's watchdog takes the
    # process down only a minute later (measured), so the driver's bound on a batch catches it first
    config = CONFIG.replace(tp=2, batch_timeout_s=20.0 if kind == "hang" else CONFIG.batch_timeout_s)
    with PrefillPool(config).start() as pool:
        prompt = np.arange(1, 600) % 512
        expected = pool.prefill(prompt).logits
        pool.inject_fault(0, 1, kind, layer=1)
        survivor = pool.submit(prompt)
        result = survivor.result(timeout=120)  # retried on the new replica
        recovery = pool.stats.recoveries[0].as_dict()
        print(f"\n{kind}: {json.dumps(recovery)}")
        assert pool.stats.retried == 1 and pool.stats.failed == 0
        assert torch.allclose(result.logits, expected, atol=5e-2 * float(expected.abs().max()))
        # measured 14-16 s on 2 x H200 (the target is 10 s: see docs/faults.md)
        assert recovery["serving_s"] < 30.0


def test_a_decode_actor_on_a_holders_gpu_pulls_objects_or_is_refused_and_on_the_other_gpu_uses_nccl(gpu_ray):
    with PrefillPool(CONFIG).start() as pool:
        result = pool.prefill(np.arange(1, 300) % 512, keep_kv=True)
        expected = pool.fetch_kv(result)
        holder = pool.worker_infos[0][0].device_uuid
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        same, other = uuids.index(holder), next(i for i, u in enumerate(uuids) if u != holder)
        actor = ray.remote(DecodeActor).options(num_gpus=0, runtime_env={"env_vars": NOSET})
        shared = actor.remote(CONFIG, device=f"cuda:{same}")
        with pytest.raises(ray.exceptions.RayTaskError, match="uses this decode actor's GPU .*NCCL cannot link two processes on one GPU"):
            ray.get(shared.receive.remote(pool.kv_source(result), transport="p2p"))
        ack = ray.get(shared.receive.remote(pool.kv_source(result)))  # auto
        assert ack["transport"] == "object" and "shares this actor's GPU" in ack["fallback"]
        assert torch.equal(ray.get(shared.pop_kv.remote(result.request_id)), expected.float())
        apart = actor.remote(CONFIG, device=f"cuda:{other}")
        started = time.perf_counter()
        ack = ray.get(apart.receive.remote(pool.kv_source(result)))
        print(f"\nother GPU: {ack['transport']} in {time.perf_counter() - started:.2f} s (link set-up included)")
        assert ack["transport"] == "p2p" and "fallback" not in ack
        assert torch.equal(ray.get(apart.pop_kv.remote(result.request_id)), expected.float())
        pool.release(result)
