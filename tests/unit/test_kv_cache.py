"""The paged latent KV cache: layout, block tables, reuse, capacity."""

import pytest
import torch

from workers.kv_cache import KVCacheFull, PagedKVCache, blocks_for


DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


def _cache(num_blocks=8, block_size=4, layers=2, width=6, device="cpu"):
    return PagedKVCache(layers, num_blocks, block_size, width, torch.float32, torch.device(device))


def test_rows_come_back_in_order_across_chunks_and_blocks():
    cache = _cache()
    latents = [torch.randn(11, 6), torch.randn(11, 6)]  # two layers of one 11-token request
    cache.reserve("a", 11)
    cache.append("a", latents, slice(0, 5))  # chunk 1: tokens 0-4
    cache.append("a", latents, torch.arange(5, 11))  # chunk 2: tokens 5-10
    for layer in range(2):
        assert torch.equal(cache.rows("a", layer), latents[layer])
        assert torch.equal(cache.rows("a", layer, 7), latents[layer][:7])
    assert cache.length("a") == 11 and cache.free_blocks == 8 - blocks_for(11, 4) == 5


def test_vllm_layout_token_i_is_in_block_table_i_over_block_size():
    cache = _cache()
    cache.reserve("x", 3)  # takes block 0 (blocks are handed out lowest first)
    cache.reserve("a", 10)  # blocks 1, 2, 3
    latent = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)
    cache.append("a", [latent, latent + 1000], slice(0, 10))
    table = cache.block_table("a")
    assert table == [1, 2, 3]
    for i in range(10):
        assert torch.equal(cache.blocks[0, table[i // 4], i % 4], latent[i])
        assert torch.equal(cache.blocks[1, table[i // 4], i % 4], latent[i] + 1000)


def test_release_returns_blocks_for_reuse_and_full_is_refused():
    cache = _cache(num_blocks=4, block_size=4)
    cache.reserve("a", 9)  # 3 blocks
    with pytest.raises(KVCacheFull, match="request 'b' needs 2 KV blocks of 4 tokens; 1 of 4 are free"):
        cache.reserve("b", 5)
    assert cache.release("a") == 3 and cache.release("a") == 0
    cache.reserve("b", 16)
    assert cache.free_blocks == 0 and cache.num_requests == 1
    with pytest.raises(ValueError, match="request id 'b' already holds a KV cache"):
        cache.reserve("b", 1)
    with pytest.raises(KeyError, match="no KV cache for request 'zz'"):
        cache.rows("zz", 0)
    with pytest.raises(ValueError, match="needs >= 1 block"):
        _cache(num_blocks=0)


def test_a_block_in_two_tables_stays_in_use_until_both_are_released():
    cache = _cache(num_blocks=6, block_size=4)
    cache.reserve("a", 8, [2, 3])
    cache.reserve("b", 12, [2, 3, 5], filled=8)  # a cached prefix: a's two blocks, shared read-only
    assert cache.free_blocks == 3 and cache._requests["b"].length == 8
    cache.reserve("w", 8)  # without a table: the lowest blocks no table holds
    assert cache.block_table("w") == [0, 1]
    assert cache.release("a") == 2 and cache.free_blocks == 1  # 2 and 3 still in b's table
    cache.reserve("x", 4)
    assert cache.block_table("x") == [4]
    assert cache.release("b") == 3 and cache.free_blocks == 3
    cache.reserve("y", 12)
    assert cache.block_table("y") == [2, 3, 5]
    with pytest.raises(ValueError, match="a table of 2 blocks for 12 rows"):
        cache.reserve("z", 12, [0, 1])


def test_block_views_are_the_paged_blocks_without_a_copy_when_the_table_is_one_run():
    cache = _cache()
    cache.reserve("x", 4)  # block 0
    cache.reserve("a", 10)  # blocks 1-3: one ascending run
    latents = [torch.randn(10, 6), torch.randn(10, 6)]
    cache.append("a", latents, slice(0, 10))
    views = cache.block_views("a")
    assert [tuple(v.shape) for v in views] == [(3, 4, 6)] * 2
    assert views[0].data_ptr() == cache.blocks[0, 1].data_ptr()  # a view into the cache
    assert torch.equal(views[1].reshape(12, 6)[:10], latents[1])
    cache.release("x")
    cache.reserve("b", 9)  # blocks 0, 4, 5: not one run
    cache.append("b", latents, slice(0, 9))
    copies = cache.block_views("b")
    assert copies[0].data_ptr() != cache.blocks[0, 0].data_ptr()
    assert all(torch.equal(c.reshape(12, 6)[:9], cache.rows("b", layer)) for layer, c in enumerate(copies))


@pytest.mark.parametrize("device", DEVICES)
def test_a_batchs_pieces_are_appended_together_as_each_alone_would_be(device):
    """On a GPU the slot tables go from pinned host memory, queued on the stream behind the kernels
    that write the batch's rows: the rows read back are the batch's."""
    latents = [torch.randn(14, 6, device=device), torch.randn(14, 6, device=device)]  # a batch of three pieces: rows 0-4, 5-10, 11-13
    together, alone = _cache(device=device), _cache(device=device)
    for cache in (together, alone):
        cache.reserve("a", 9)
        cache.reserve("b", 6)
        cache.reserve("c", 3)
        cache.append("a", latents, slice(0, 4))  # a's first chunk, from an earlier batch
    parts = [("a", slice(4, 9)), ("b", slice(9, 14)), ("c", slice(0, 3))]  # b's rows before c's: not one run
    together.append_many(latents, parts)
    for request_id, rows in parts:
        alone.append(request_id, latents, rows)
    for request_id in "abc":
        assert together.length(request_id) == alone.length(request_id)
        for layer in range(2):
            assert torch.equal(together.rows(request_id, layer), alone.rows(request_id, layer))
    assert torch.equal(together.rows("a", 1), latents[1][:9]) and torch.equal(together.rows("c", 0), latents[0][:3])
    mixed = _cache(device=device)  # index tensors (a PCP rank's rows) beside a slice
    mixed.reserve("p", 4)
    mixed.reserve("q", 2)
    mixed.append_many(latents, [("p", torch.tensor([13, 1, 7, 2], device=device)), ("q", slice(3, 5))])
    assert torch.equal(mixed.rows("p", 0), latents[0][[13, 1, 7, 2]]) and torch.equal(mixed.rows("q", 1), latents[1][3:5])
    with pytest.raises(KeyError, match="no KV cache for request 'zz'"):
        mixed.append_many(latents, [("zz", slice(0, 1))])


# ---- sized by GPU memory (workers.worker._allocate_kv_cache, workers.placement.check_kv_sizing) --------
def test_workers_packed_on_a_gpu_need_a_fixed_kv_cache():
    from configs.pool import PoolConfig
    from workers.placement import check_kv_sizing

    packed = PoolConfig(model="tiny", worker_gpus=0.5)
    with pytest.raises(ValueError, match=r"worker_gpus=0.5 packs workers on one GPU, and kv_cache_tokens=None .* set kv_cache_tokens"):
        check_kv_sizing(torch.device("cuda", 0), packed)
    check_kv_sizing(torch.device("cuda", 0), packed.replace(kv_cache_tokens=8192))  # each worker's share fixed
    check_kv_sizing(torch.device("cuda", 0), packed.replace(worker_gpus=1.0))  # one worker a GPU: sized by what is left
    check_kv_sizing(torch.device("cpu"), packed)  # a CPU worker's cache has a fixed default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_kv_cache_sized_by_gpu_memory_counts_what_another_process_holds():
    import subprocess
    import sys

    import numpy as np

    from configs.pool import PoolConfig
    from workers.batch_io import ChunkPiece
    from workers.worker import PrefillWorker

    held = torch.cuda.mem_get_info()[1] // 4  # another process on the GPU (a vLLM server beside the pool)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import torch, time; x = torch.empty({held}, dtype=torch.uint8, device='cuda'); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == b"held"
        config = PoolConfig(model="tiny", num_layers=2, device="cuda", dtype="bfloat16", chunk_tokens=2048, max_batch_tokens=4096,
                            gpu_memory_utilization=0.5, cuda_graph_tokens=(), seed=3)  # fmt: skip
        worker = PrefillWorker(config, 0)
        worker.setup("127.0.0.1", 0)
        ids = np.arange(2048, dtype=np.int32) % 512  # the tiny model's vocabulary
        worker.prefill([ChunkPiece(f"r{i}", ids, 0, 2048) for i in range(2)])  # the largest batch: its activations were counted
        free, total = torch.cuda.mem_get_info()
        allowed = 0.5 * total
        assert worker.kv.blocks.nbytes > total // 8  # sized by memory, not a default
        assert allowed - (2 << 30) <= total - free <= allowed + (1 << 30), (allowed / 2**30, (total - free) / 2**30)
    finally:
        holder.kill()
        holder.wait()
