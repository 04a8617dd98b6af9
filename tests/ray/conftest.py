"""Ray on the CPU: one local Ray per test module, with logical GPUs so placement is tested as on a GPU
node. Workers are pinned to device="cpu" (gloo), also on hosts that have GPUs."""

import logging
import os

import numpy as np
import pytest
import ray

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Serve's controller kills a proxy that has not answered its readiness check within 5 s, three times
# (ray.serve._private.constants.PROXY_READY_CHECK_TIMEOUT_S), and serve.start() then fails with
# ActorDiedError. On the 2-core CI machine a proxy starting beside vLLM servers that boot takes longer
# (CI, 2026-11-27: the decode chaos test, now in test_decode_resume). Ray's workers inherit this
# environment, the controller with them (benchmarks/autoscaling.py sets it for its own cluster).
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")


@pytest.fixture(scope="module")
def ray_cluster():
    # metrics exported each second, not Ray's 10: the tests that read the pool's counters on Ray's Prometheus
    # endpoint (the soak's, the decode chaos run's) wait for them that much less
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    yield ray
    ray.shutdown()


PROMPT_LENS = (1, 47, 130, 200)  # with chunks of 48: one chunk, a full one, several, several with a remainder


@pytest.fixture(scope="module")
def prompts():
    gen = np.random.default_rng(0)
    return [gen.integers(0, 512, size=n) for n in PROMPT_LENS]
