"""A batch's results on the host (``workers.batch_io.results_to_host``): the worker's logits and last
hidden rows, equal to the device's, from a GPU through pinned memory, and never written into by a
later batch (the pinned buffers are reused by torch's caching host allocator); the rows only of the
requests that ask for them, and every finished request's greedy token."""

import numpy as np
import pytest
import torch

from configs.pool import PoolConfig
from workers.batch_io import ChunkPiece, results_to_host
from workers.worker import PrefillWorker

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
    kept = [(first.logits(r).copy(), first.last_hidden(r).copy()) for r in first.results]
    assert [first.logits(r).shape for r in first.results] == [(512,), (512,)]
    assert not np.array_equal(kept[0][0], kept[1][0])  # two prompts, two rows
    worker.prefill(batch(100, 50))  # the same shapes again: the same size of host buffer
    for result, (logits, hidden) in zip(first.results, kept):
        np.testing.assert_array_equal(first.logits(result), logits)
        np.testing.assert_array_equal(first.last_hidden(result), hidden)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_only_for_the_requests_that_ask_and_every_finished_request_gets_its_greedy_token(device):
    worker = PrefillWorker(PoolConfig(model="tiny", num_layers=1, device=device, kv_cache_tokens=1024, seed=1), 0)
    worker.setup("127.0.0.1", 0)
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, 512, n).astype(np.int32) for n in (40, 30, 60, 20)]

    def pieces(asks):  # the third request is a first chunk of 30 of its 60 tokens: not finished
        return [
            ChunkPiece("a", ids[0], 0, 40, return_logits=asks[0]),
            ChunkPiece("b", ids[1], 0, 30, return_logits=asks[1]),
            ChunkPiece("c", ids[2][:30], 0, 60, return_logits=asks[2]),
            ChunkPiece("d", ids[3], 0, 20, return_logits=asks[3]),
        ]

    every = worker.prefill(pieces([True] * 4))
    worker.release(["a", "b", "c", "d"])
    some = worker.prefill(pieces([False, True, True, False]))
    assert [r.request_id for r in some.results] == ["a", "b", "d"]
    assert [r.row for r in some.results] == [None, 0, None]  # one row: the only finished request that asked
    assert some.rows.shape == (1, 512 + worker.model.config.hidden_size)
    assert some.logits(some.results[0]) is None and some.last_hidden(some.results[2]) is None
    np.testing.assert_array_equal(some.logits(some.results[1]), every.logits(every.results[1]))
    assert [r.first_token for r in some.results] == [int(every.logits(r).argmax()) for r in every.results]
    worker.release(["a", "b", "c", "d"])
    none = worker.prefill(pieces([False] * 4))
    assert none.rows.shape[0] == 0 and [r.first_token for r in none.results] == [r.first_token for r in some.results]
