"""NIXL READs of paged KV blocks between two agents (UCX, host memory, in one process), and the
descriptor arithmetic that keeps a transfer to a few large descriptors."""

import threading
import time

import numpy as np
import pytest
import torch

from kv.nixl import NixlEndpoint, NixlError, Region, descriptors, nixl_unavailable, runs

pytestmark = pytest.mark.skipif(nixl_unavailable() is not None, reason=f"needs NIXL: {nixl_unavailable()}")


def test_runs_are_consecutive_on_both_sides():
    src, dst, lengths = runs(np.array([3, 4, 5, 9, 10, 11, 12]), np.array([7, 8, 9, 0, 1, 5, 6]))
    assert src.tolist() == [3, 9, 11] and dst.tolist() == [7, 0, 5] and lengths.tolist() == [3, 2, 2]
    empty = runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert all(len(part) == 0 for part in empty)


def test_descriptors_address_every_layer_of_every_run():
    cache = torch.zeros(3, 10, 4, 2)  # float32 blocks of 32 bytes (rows of 8), layers of 320
    region = Region.of("a", b"", cache)
    base = cache.data_ptr()
    assert region.layer_bases().tolist() == [base, base + 320, base + 640]
    descs = descriptors(region.layer_bases(), 32, np.array([2, 7]), np.array([3, 1]), 0)
    assert descs.tolist() == [[base + l * 320 + b * 32, n * 32, 0] for l in range(3) for b, n in ((2, 3), (7, 1))]
    rows = descriptors(np.array([100, 5000]), 8, np.array([3]), np.array([5]), 1)  # rows of 8 bytes, device 1
    assert rows.tolist() == [[124, 40, 1], [5024, 40, 1]]


def _blocks(region, layers, starts, lengths, unit=None):
    return descriptors(region.layer_bases()[:layers], unit or region.block_bytes, starts, lengths, region.device)


def test_a_read_moves_exactly_the_chosen_blocks_between_two_agents():
    holder, receiver = NixlEndpoint("test-holder", serves=True), NixlEndpoint("test-receiver", serves=False)
    source = torch.randn(2, 10, 4, 3)
    dest = torch.full((2, 12, 4, 3), -1.0)
    remote, local = holder.register(source), receiver.register(dest)
    src, dst, lengths = runs(np.array([3, 4, 5, 9]), np.array([7, 8, 0, 1]))
    seconds = receiver.read([(remote, _blocks(remote, 2, src, lengths), "DRAM", _blocks(local, 2, dst, lengths))], timeout_s=30)
    assert seconds >= 0
    for src, dst in zip([3, 4, 5, 9], [7, 8, 0, 1]):
        assert torch.equal(dest[:, dst], source[:, src])
    untouched = [b for b in range(12) if b not in (7, 8, 0, 1)]
    assert (dest[:, untouched] == -1).all()
    # the region as a holder publishes it survives the trip through msgpack-able dicts
    assert Region.from_dict(remote.as_dict()) == remote


def test_a_malformed_region_and_an_unknown_agent_are_named():
    with pytest.raises(NixlError, match="malformed"):
        Region.from_dict({"agent": "a"})
    receiver = NixlEndpoint("test-receiver-2", serves=False)
    dest = torch.zeros(1, 2, 4, 3)
    bogus = Region.of("nobody", b"not nixl metadata", torch.zeros(1, 2, 4, 3))
    with pytest.raises(NixlError, match="holder 0: cannot connect to its NIXL agent 'nobody'"):
        local = receiver.register(dest)
        receiver.read([(bogus, _blocks(bogus, 1, np.array([0]), np.array([1])), "DRAM", _blocks(local, 1, np.array([1]), np.array([1])))], timeout_s=5)


def test_a_holders_agent_does_not_keep_a_core_busy():
    """NIXL's own progress thread polls without a pause (about 60% of a core here, measured); a
    holder's endpoint pauses between polls, so an idle holder costs next to nothing."""
    endpoint = NixlEndpoint("test-idle-holder", serves=True)
    endpoint.register(torch.zeros(1 << 20, dtype=torch.uint8).view(1, 1, 1, -1))
    started = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - started < 0.2


def test_reads_from_several_threads_on_one_agent_each_land_where_they_should():
    """A decode server's loads run on several threads sharing its agent (vLLM's connector): every
    call into the agent is serialized, and each read's blocks arrive whole."""
    holder, receiver = NixlEndpoint("test-holder-threads", serves=True), NixlEndpoint("test-receiver-threads", serves=False)
    source = torch.randn(2, 64, 4, 3)
    dest = torch.zeros(2, 64, 4, 3)
    remote, local = holder.register(source), receiver.register(dest)
    errors = []

    def read(first: int) -> None:
        try:
            for _ in range(20):
                blocks = np.arange(first, first + 8)
                src, dst, lengths = runs(blocks, blocks[::-1].copy())
                receiver.read([(remote, _blocks(remote, 2, src, lengths), "DRAM", _blocks(local, 2, dst, lengths))], timeout_s=30)
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(8 * i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for block in range(64):
        group = block // 8
        assert torch.equal(dest[:, 8 * group + 7 - block % 8], source[:, block])
