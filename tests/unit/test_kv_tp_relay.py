"""``kv.tp_relay`` between two processes of one gloo group, as two TP ranks of a vLLM instance: the
leader's loaded rows land in the same blocks of the follower's cache, in chunks of a bounded staging
buffer (a chunk boundary inside a block, and a load of one token), in the order the leader's loads
finish; a load that failed on the leader, or blocks past the leader's cache, are reported failed on
the follower (every loaded block), and nothing else of the follower's cache is touched. (The relay
inside real vLLM ranks: tests/ray/test_vllm_decode_tp.py.) On two GPUs the same runs with the caches
on the GPUs, twice: the follower copying out of the leader's caches mapped by CUDA IPC (``mapped``),
and the rows staged over NCCL (``staged``), both through ``kv.mapped_triton``'s kernels."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kv import tp_relay
from kv.tp_relay import Relayed, TPRelay
from workers.worker import SAFE_NCCL_ENV

LAYERS, BLOCKS, BLOCK, WIDTH = 3, 40, 16, 576
CHUNK_TOKENS = 7  # the staging buffer's rows: loads span several chunks, a boundary inside a block
PAST = 33  # the first block past the leader's cache: a load from it cannot be gathered
LOADS = [  # (block ids in token order, start, end, failed on the leader)
    ([31, 4, 17, 9, 22], 0, 70, False),
    ([5, 30, 12], 20, 33, False),  # vLLM's own prefix hit before token 20
    ([6, 30], 15, 16, False),  # one token
    ([1, 2, 3], 0, 40, True),  # the leader's load failed
    ([PAST, PAST + 1], 0, 20, False),  # blocks the leader's cache does not have: refused before any copy
    ([26, 27, 28], 10, 48, False),
]


def _cache(seed: int, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, BLOCK, WIDTH, generator=generator).to(device) for _ in range(LAYERS)]


def _rank(rank: int, port: int, out: str, device: str, mapped: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **SAFE_NCCL_ENV)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device == "cpu" else "cpu:gloo,cuda:nccl", rank=rank, world_size=2)
    tp_relay.RELAY_BYTES = CHUNK_TOKENS * LAYERS * WIDTH * 4
    layers = _cache(rank, device)
    if rank == 0:
        layers_short = [layer[:PAST] for layer in layers]  # its gather of block PAST fails
        relay = TPRelay(layers_short, BLOCK, [0, 1], 0, on_received=lambda *_: None, mapped=mapped)
        for block_ids, start, end, failed in reversed(LOADS):  # the order the leader's loads finished
            relay.send(Relayed(f"r{block_ids[0]}", block_ids, start, end, failed))
        relay.close()
        relay.thread.join(60)
        dist.barrier()  # mapped: the follower reads this rank's caches until its last copy; they must outlive it
        torch.save({"layers": [layer.cpu() for layer in layers], "chunk_tokens": relay.chunk_tokens, "mode": relay.mode}, out)
    else:
        received = []
        relay = TPRelay(layers, BLOCK, [0, 1], 1, on_received=lambda item, failed: received.append((item.request_id, sorted(failed))), mapped=mapped)
        relay.thread.join(60)
        dist.barrier()
        torch.save({"layers": [layer.cpu() for layer in layers], "received": received, "alive": relay.thread.is_alive()}, out)
    dist.destroy_process_group()


TWO_GPUS = [pytest.mark.multi_gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (CUDA IPC, NCCL)")]


@pytest.fixture(scope="module", params=[
    ("cpu", "staged"), pytest.param(("cuda", "mapped"), marks=TWO_GPUS), pytest.param(("cuda", "staged"), marks=TWO_GPUS),
], ids=["cpu-staged", "cuda-mapped", "cuda-staged"])  # fmt: skip
def relayed(request, tmp_path_factory):
    device, mode = request.param
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    out = tmp_path_factory.mktemp("relay")
    context = mp.get_context("spawn")
    ranks = [context.Process(target=_rank, args=(rank, port, str(out / f"{rank}.pt"), device, mode == "mapped")) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
        assert process.exitcode == 0
    leader = torch.load(out / "0.pt")
    assert leader["mode"] == mode
    return leader, torch.load(out / "1.pt"), LOADS


def _rows(layers, block_ids, start, end) -> torch.Tensor:
    flat = [layer.view(-1, WIDTH) for layer in layers]
    slots = [block_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(start, end)]
    return torch.stack([layer[slots] for layer in flat])


def test_the_followers_blocks_get_the_leaders_rows_in_the_leaders_order(relayed):
    leader, follower, loads = relayed
    assert leader["chunk_tokens"] == CHUNK_TOKENS and not follower["alive"]  # the leader's close stopped it
    assert [request for request, _ in follower["received"]] == [f"r{ids[0]}" for ids, *_ in reversed(loads)]
    written = set()
    for block_ids, start, end, failed in loads:
        if failed or block_ids[0] == PAST:
            continue
        assert torch.equal(_rows(follower["layers"], block_ids, start, end), _rows(leader["layers"], block_ids, start, end))
        written |= {block_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(start, end)}
    untouched = [slot for slot in range(BLOCKS * BLOCK) if slot not in written and slot // BLOCK not in (PAST, PAST + 1)]  # a failed load wrote nothing
    original = _cache(1)
    assert all(torch.equal(f.view(-1, WIDTH)[untouched], o.view(-1, WIDTH)[untouched]) for f, o in zip(follower["layers"], original))


def test_a_failed_load_and_rows_not_gathered_are_failed_blocks_on_the_follower(relayed):
    _, follower, loads = relayed
    received = dict(follower["received"])
    assert received["r1"] == [1, 2, 3]  # the leader's load failed: every block of it
    assert received[f"r{PAST}"] == [PAST, PAST + 1]  # past the leader's cache
    assert all(received[f"r{ids[0]}"] == [] for ids, _, _, failed in loads if not failed and ids[0] != PAST)
