"""``kv.mapped`` on the CPU: a holder's cache in a shared-memory file, mapped by a receiver and copied
row by row into per-layer caches of another block size, blocks scattered on both sides; what it
refuses; what it allocates. (Across processes, through the KV server, with a pool:
``tests/ray/test_kv_handoff.py``; with vLLM: ``tests/ray/test_vllm_decode.py``; CUDA IPC on a GPU:
``benchmarks/bench_kv_load.py``.) The GPU path's kernel (``kv.mapped_triton``) runs here in Triton's
interpreter, and on a GPU for real."""

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import kv.mapped as mapped
from kv.mapped import MappedError, MappedRegion, Mapper, host_identity, share_cache, shared_host_tensor, unlink_shared
from kv.nixl import runs
from kv.receiver import place_rows

LAYERS, POOL_BLOCK, WIDTH = 3, 16, 8


@pytest.fixture
def holder():
    made = shared_host_tensor((LAYERS, 40, POOL_BLOCK, WIDTH), torch.float32)
    assert made is not None
    cache, path = made
    cache.copy_(torch.randn(cache.shape))
    yield cache, share_cache(cache, path)
    unlink_shared(path)


@pytest.mark.parametrize("chunk_rows", [7, 1 << 14])
def test_scattered_rows_land_where_the_tables_say_and_nothing_stays_allocated(holder, chunk_rows):
    cache, region = holder
    rng = np.random.default_rng(0)
    tokens, block = 300, 4  # the destination's blocks are smaller than the pool's, and both tables scattered
    pool_table = rng.permutation(40)[: -(-tokens // POOL_BLOCK)].tolist()
    dest_table = rng.permutation(100)[: -(-tokens // block)].tolist()
    meta = {"block_size": POOL_BLOCK, "pcp": 1, "tokens": tokens, "shards": [{"blocks": pool_table}]}
    (part,) = place_rows(meta, block, dest_table, 5)  # from token 5: the first rows are the decode server's own
    assert len(runs(part.src, part.dst)[0]) > 0.9 * tokens / block  # nearly every destination block a run of its own
    dest = [torch.zeros(100, block, WIDTH) for _ in range(LAYERS)]
    mapper = Mapper(chunk_rows=chunk_rows)
    _, seen = mapper.copy(MappedRegion.from_dict(region.as_dict()), dest, part.src, part.dst)
    assert seen  # the holder (this process) was seen running before and after the copy
    rows = cache.view(LAYERS, -1, WIDTH)
    for layer in range(LAYERS):
        flat = dest[layer].view(-1, WIDTH)
        assert torch.equal(flat[torch.from_numpy(part.dst)], rows[layer][torch.from_numpy(part.src)])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[torch.from_numpy(part.dst)] = False
        assert not flat[untouched].any()  # no row written but the request's
    assert mapper.in_flight_bytes == 0
    assert mapper.peak_in_flight_bytes == min(chunk_rows, tokens - 5) * WIDTH * 4


def test_a_region_is_mapped_once_and_a_restarted_holder_is_mapped_anew(holder):
    cache, region = holder
    mapper = Mapper()
    first = mapper.open(region, torch.device("cpu"))
    assert mapper.open(region, torch.device("cpu")) is not None and first.data_ptr() == mapper.open(region, torch.device("cpu")).data_ptr()
    assert first.data_ptr() != cache.data_ptr()  # a mapping of its own, of the same memory
    cache[0, 0, 0, 0] = 42.0
    assert first[0, 0, 0] == 42.0


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"host": "elsewhere/0"}, "is on host elsewhere/0, not this one"),
        ({"path": "/etc/passwd"}, "a host region must be a file mlapool-kv-\\* in /dev/shm"),
        ({"dtype": "int8"}, "unknown KV dtype 'int8'"),
        ({"path": "/dev/shm/mlapool-kv-1-gone"}, "the holder's cache file /dev/shm/mlapool-kv-1-gone is gone"),
    ],
)
def test_a_region_it_cannot_map_is_refused_with_the_reason(holder, change, reason):
    _, region = holder
    dest = [torch.zeros(10, 4, WIDTH) for _ in range(LAYERS)]
    with pytest.raises(MappedError, match=reason):
        Mapper().copy(dataclasses.replace(region, **change), dest, np.arange(4), np.arange(4))


def test_a_destination_of_another_shape_and_rows_outside_the_cache_are_refused(holder):
    _, region = holder
    with pytest.raises(MappedError, match="the destination has 2 layers"):
        Mapper().copy(region, [torch.zeros(10, 4, WIDTH)] * 2, np.arange(4), np.arange(4))
    with pytest.raises(MappedError, match="outside the holder's cache of 640 rows"):
        Mapper().copy(region, [torch.zeros(10, 4, WIDTH)] * LAYERS, np.array([0, 640]), np.arange(2))
    with pytest.raises(MappedError, match="outside the destination's 40 rows"):
        Mapper().copy(region, [torch.zeros(10, 4, WIDTH)] * LAYERS, np.arange(2), np.array([3, 40]))
    with pytest.raises(MappedError, match="malformed"):
        MappedRegion.from_dict({"host": host_identity()})


def test_no_shared_file_where_dev_shm_lacks_the_room(monkeypatch):
    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(mapped.os, "statvfs", lambda path: Full)
    assert shared_host_tensor((4, 1024, 1024), torch.float32) is None


def test_files_of_holders_that_died_are_removed_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped, "SHM_DIR", tmp_path)
    dead, alive = tmp_path / "mlapool-kv-999999999-aa", tmp_path / f"mlapool-kv-{os.getpid()}-bb"
    dead.write_bytes(b"x")
    alive.write_bytes(b"x")
    cache, path = shared_host_tensor((2, 2), torch.float32)
    assert not dead.exists() and alive.exists() and Path(path).parent == tmp_path
    unlink_shared(path)


def test_a_holder_seen_gone_is_a_failed_copy_and_one_not_seen_is_left_to_the_kv_server(holder):
    _, region = holder
    dest = [torch.zeros(10, 4, WIDTH) for _ in range(LAYERS)]
    gone = dataclasses.replace(region, process=(region.process[0], region.process[1] + 1))  # a pid reused by another process
    with pytest.raises(MappedError, match=f"the holder \\(pid {region.process[0]}\\) is gone"):
        Mapper().copy(gone, dest, np.arange(4), np.arange(4))
    _, seen = Mapper().copy(dataclasses.replace(region, process=None), dest, np.arange(4), np.arange(4))
    assert seen is False  # another pid namespace: the KV server asks the holders instead


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_the_gpu_kernel_moves_every_layers_rows_bit_for_bit_into_caches_at_unrelated_addresses(dtype):
    """kv.mapped_triton.copy_rows (the GPU path of Mapper; Triton's interpreter here): rows of every
    layer of a [layers, rows, width] cache to scattered rows of per-layer caches allocated apart, as
    vLLM's are, each bit kept (NaN payloads and negative zeros included), nothing else written; a
    width not a multiple of the kernel's column block, and more rows than one program takes. On a GPU
    machine the tensors are CUDA's and the kernel compiled (conftest sets the interpreter only without
    one)."""
    from kv.mapped_triton import address_table, copy_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers, rows, width, moved = 3, 90, 72, 37  # 72 = 64 + 8: a partial column block; 37 rows: three row blocks
    bits = torch.randint(0, 256, (layers, rows, width * dtype.itemsize), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    bits = bits.to(device)
    source = bits.view(dtype)
    dest = [torch.zeros(50 + 10 * i, width, dtype=dtype, device=device) for i in range(layers)]  # unrelated addresses, other sizes
    rng = np.random.default_rng(2)
    src_rows, dst_rows = (torch.from_numpy(r).to(device) for r in (rng.permutation(rows)[:moved], rng.permutation(50)[:moved]))
    copy_rows(source, dest, address_table(dest), src_rows, dst_rows)
    for layer, cache in enumerate(dest):
        as_bits = cache.view(torch.uint8).view(cache.shape[0], -1)
        assert torch.equal(as_bits[dst_rows], bits[layer][src_rows]), layer
        untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=device)
        untouched[dst_rows] = False
        assert not as_bits[untouched].any(), layer
    with pytest.raises(ValueError, match="3 source layers, 2 destinations"):
        copy_rows(source, dest[:2], address_table(dest[:2]), src_rows, dst_rows)
    with pytest.raises(ValueError, match="of one dtype"):
        copy_rows(source, [d.to(torch.float64) for d in dest], address_table(dest), src_rows, dst_rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_kernel_gathers_into_one_tensor_and_copies_between_two_tables_bit_for_bit(dtype):
    """The same kernel's other two forms (``kv.tp_relay``'s): gather_rows, per-layer caches at unrelated
    addresses into one ``[layers, rows, width]`` tensor (the staged relay's buffer), and copy_between,
    per-layer caches into other per-layer caches at the same rows (a TP follower out of its leader's
    mapped caches); each bit kept, nothing else written."""
    from kv.mapped_triton import address_table, copy_between, gather_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers, width, moved = 3, 72, 37
    generator = torch.Generator().manual_seed(3)
    bits = [torch.randint(0, 256, (60 + 5 * i, width * dtype.itemsize), dtype=torch.uint8, generator=generator).to(device) for i in range(layers)]
    caches = [b.view(dtype) for b in bits]
    rows = torch.from_numpy(np.random.default_rng(4).permutation(60)[:moved]).to(device)
    out = torch.zeros(layers, moved + 5, width, dtype=dtype, device=device)
    gather_rows(caches, address_table(caches), rows, out, torch.arange(moved, device=device))
    out_bits = out.view(torch.uint8)
    for layer in range(layers):
        assert torch.equal(out_bits[layer, :moved], bits[layer][rows]), layer
    assert not out_bits[:, moved:].any()
    dest = [torch.zeros(80, width, dtype=dtype, device=device) for _ in range(layers)]
    copy_between(address_table(caches), address_table(dest), dest[0], rows, width)
    for layer, cache in enumerate(dest):
        as_bits = cache.view(torch.uint8)
        assert torch.equal(as_bits[rows], bits[layer][rows]), layer
        untouched = torch.ones(80, dtype=torch.bool, device=device)
        untouched[rows] = False
        assert not as_bits[untouched].any(), layer
    with pytest.raises(ValueError, match="3 source layers into a non-contiguous"):
        gather_rows(caches, address_table(caches), rows, out.transpose(1, 2), torch.arange(moved, device=device))
    with pytest.raises(ValueError, match="3 source layers, 2 destinations"):
        copy_between(address_table(caches), address_table(dest[:2]), dest[0], rows, width)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: Triton compiles the kernel for it")
def test_on_a_gpu_the_kernel_compiles_at_warm_up_and_moves_61_layers_as_the_per_layer_ops_do():
    from kv.mapped_triton import address_table, copy_rows

    source = torch.randn(61, 4096, 576, device="cuda").to(torch.bfloat16)
    dest = [torch.zeros(8192, 576, dtype=torch.bfloat16, device="cuda") for _ in range(61)]
    Mapper().warm(dest[0])
    src_rows, dst_rows = torch.randperm(4096, device="cuda")[:3000], torch.randperm(8192, device="cuda")[:3000]
    copy_rows(source, dest, address_table(dest), src_rows, dst_rows)
    assert all(torch.equal(layer[dst_rows], source[i][src_rows]) for i, layer in enumerate(dest))


def test_caches_in_one_cuda_segment_are_mapped_apart():
    """A CUDA IPC handle names the allocator's segment, which small caches share: the mapper keys each
    cache by its offsets in it too, else the second maps as the first (a TP follower read layer 0's rows
    for every layer on two H100s: tests/unit/test_kv_tp_relay.py's cuda-mapped case)."""
    ipc = {"handle": b"segment", "storage_offset": 0, "offset": 0}
    first = MappedRegion(host_identity(), "VRAM", "GPU-0", (1, 4, 16, 8), "float32", ipc=ipc)
    second = dataclasses.replace(first, ipc={**ipc, "storage_offset": 1 << 20})
    assert first.key != second.key
    assert first.key == dataclasses.replace(first, ipc=dict(ipc)).key
