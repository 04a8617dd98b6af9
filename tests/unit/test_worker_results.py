"""A batch's results on the host (``workers.worker.results_to_host``): the worker's logits and last
hidden rows, equal to the device's, from a GPU through pinned memory, and never written into by a
later batch (the pinned buffers are reused by torch's caching host allocator)."""

import numpy as np
import pytest
import torch

from configs.pool import PoolConfig
from workers.worker import ChunkPiece, PrefillWorker, results_to_host

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_rows_reach_the_host_equal_and_stay_while_later_rows_come(device):
    rows = torch.randn(16, 4099, device=device)
    host = results_to_host(rows)
    assert host.shape == (16, 4099) and host.dtype == np.float32
    np.testing.assert_array_equal(host, rows.cpu().numpy())
    if device == "cuda":
        assert torch.from_numpy(host).is_pinned()
    kept = host.copy()
    for _ in range(3):  # same size, the first array still alive: its buffer is not handed out again
        results_to_host(torch.randn(16, 4099, device=device))
    np.testing.assert_array_equal(host, kept)


@pytest.mark.parametrize("device", DEVICES)
def test_a_later_batch_leaves_an_earlier_batchs_results_as_they_were(device):
    worker = PrefillWorker(PoolConfig(model="tiny", num_layers=1, device=device, kv_cache_tokens=1024, seed=1), 0)
    worker.setup("127.0.0.1", 0)
    rng = np.random.default_rng(0)

    def batch(*lengths):
        return [ChunkPiece(f"r{rng.integers(1 << 30)}", rng.integers(0, 512, n).astype(np.int32), 0, n) for n in lengths]

    first = worker.prefill(batch(100, 50))
    kept = [(r.logits.copy(), r.last_hidden.copy()) for r in first.results]
    assert [r.logits.shape for r in first.results] == [(512,), (512,)]
    assert not np.array_equal(kept[0][0], kept[1][0])  # two prompts, two rows
    worker.prefill(batch(100, 50))  # the same shapes again: the same size of host buffer
    for result, (logits, hidden) in zip(first.results, kept):
        np.testing.assert_array_equal(result.logits, logits)
        np.testing.assert_array_equal(result.last_hidden, hidden)
