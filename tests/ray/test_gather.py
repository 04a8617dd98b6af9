"""``cluster.replica.gather``, the pool's one SPMD call: results in the workers' order, the first
failure raised at once (the others may be blocked in a collective with the failed rank), and a call
that outlives its timeout reported as ``BatchTimeout``, for one worker and for several."""

import time

import pytest
import ray

from cluster.replica import BatchTimeout, gather


@ray.remote(num_cpus=0.1)
class Rank:
    def run(self, value, delay_s: float = 0.0, fail: bool = False):
        time.sleep(delay_s)
        if fail:
            raise ValueError(f"rank failed with {value}")
        return value


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    actors = [Rank.remote() for _ in range(3)]
    ray.get([a.run.remote(None) for a in actors])
    return actors


@pytest.mark.parametrize("count", [1, 3])
def test_results_come_back_in_the_ranks_order(ranks, count):
    refs = [a.run.remote(i, delay_s=0.2 * (count - i) / count) for i, a in enumerate(ranks[:count])]
    assert gather(refs, timeout_s=30) == list(range(count))


@pytest.mark.parametrize("count", [1, 3])
def test_a_rank_that_raises_is_raised_at_once_while_another_still_runs(ranks, count):
    started = time.monotonic()
    refs = [ranks[0].run.remote(0, fail=True)] + [a.run.remote(i, delay_s=8) for i, a in enumerate(ranks[1:count], 1)]
    with pytest.raises(ValueError, match="rank failed with 0"):
        gather(refs, timeout_s=60)
    assert time.monotonic() - started < 5
    ray.get([a.run.remote(None) for a in ranks])  # let the slow calls drain before the next test


@pytest.mark.parametrize("count", [1, 3])
def test_a_call_that_outlives_its_timeout_is_a_batch_timeout(ranks, count):
    refs = [a.run.remote(i, delay_s=0.0 if i else 5.0) for i, a in enumerate(ranks[:count])]
    started = time.monotonic()
    with pytest.raises(BatchTimeout, match=f"1 of {count} workers did not finish within 0.5 s"):
        gather(refs, timeout_s=0.5)
    assert time.monotonic() - started < 3
    ray.get([a.run.remote(None) for a in ranks])
