"""A short prompt's forward replayed from CUDA graphs (workers.cuda_graphs).

On the CPU: the padding the graphs rely on (a prompt padded at its end to a captured length, its last
token named, gives its own latent rows and logits, MoE layers included) and the config's checks. On
a GPU: the replay writes what the same forward launched kernel by kernel writes, for prompts of every
captured length in turn (the graphs share one memory pool), bf16 and FP8; the graphs' memory figure
(the worker's start logs it) is the same whatever the allocator's cache held before the capture
(it once went negative by what torch.cuda.graph emptied); the worker replays single
prompts without context, runs the rest eagerly, and runs a batch with a fault armed eagerly (its
hook fires).
"""

import numpy as np
import pytest
import torch
from hf_models import save_fp8, tiny_fp8_moe, tiny_moe

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from configs.model import load_model_config
from configs.pool import PoolConfig
from workers.cuda_graphs import PrefillGraphs, graph_reasons
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights
from workers.batch_io import ChunkPiece
from workers.worker import InjectedFault, PrefillWorker

SIZES = (16, 64, 256)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    tiny_moe("v3", seed=3).save_pretrained(path)
    return path


def _model(path, device="cpu", **kw) -> DeepseekPrefillModel:
    model = DeepseekPrefillModel.create(load_model_config(path), TorchSDPAPrefillBackend, device=device, **{"dtype": torch.float32, **kw})
    load_weights(model, path)
    return model


def _prompt(n: int, seed: int, vocab: int = 320) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


def test_a_prompt_padded_at_its_end_keeps_its_rows_and_logits(moe_checkpoint):
    model = _model(moe_checkpoint)
    assert model.moe_layers()  # routing and experts see the padding too
    size = 64
    for n in (1, 37, 64):
        ids = torch.from_numpy(_prompt(n, n).astype(np.int64))
        alone = model(ids, plan_prefill_batch([n]))
        padded = model.run_layers(
            torch.nn.functional.pad(ids, (0, size - n), value=5), plan_prefill_batch([size]), last_index=torch.tensor([n - 1])
        )
        torch.testing.assert_close(padded.logits, alone.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded.last_hidden, alone.last_hidden, atol=1e-5, rtol=1e-5)
        for got, want in zip(padded.latents, alone.latents):
            torch.testing.assert_close(got[:n], want, atol=1e-5, rtol=1e-5)


def test_cuda_graph_tokens_are_checked_and_sorted():
    assert PoolConfig(cuda_graph_tokens=[512, 64, 64]).cuda_graph_tokens == (64, 512)
    assert PoolConfig(cuda_graph_tokens=()).cuda_graph_tokens == ()
    for bad in ([0], [64, -1], "512", [1.5], [True]):
        with pytest.raises(ValueError, match="cuda_graph_tokens must be a list of positive token counts"):
            PoolConfig(cuda_graph_tokens=bad)


def test_only_a_one_worker_gpu_replica_is_captured(moe_checkpoint):
    model = _model(moe_checkpoint)
    assert graph_reasons(model, torch.device("cpu"), 1) == ["the worker runs on cpu, not a GPU"]
    assert graph_reasons(model, torch.device("cuda"), 1) == []
    assert graph_reasons(model, torch.device("cuda"), 2) == ["the replica has 2 workers (collectives are not captured)"]


def test_a_cpu_worker_runs_eagerly():
    worker = PrefillWorker(PoolConfig(model="tiny", num_layers=1, device="cpu", kv_cache_tokens=256), 0)
    assert worker.setup("127.0.0.1", 0).cuda_graph_tokens == ()


# ---- on a GPU ---------------------------------------------------------------------------------------
def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@on_gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_replay_writes_what_the_eager_forward_writes(tmp_path, moe_checkpoint, fp8):
    if fp8:
        from workers.fp8 import fp8_gemm_supported

        if not fp8_gemm_supported(torch.device("cuda")):
            pytest.skip("FP8 GEMMs need an SM90 GPU")
        path = tmp_path / "fp8"
        save_fp8(tiny_fp8_moe(seed=4), path, tmp_path / "reference")
    else:
        path = moe_checkpoint
    model = _model(path, "cuda", dtype=torch.bfloat16, fp8=fp8)
    graphs = PrefillGraphs.capture(model, SIZES, torch.device("cuda"))
    assert graphs.sizes == list(SIZES) and graphs.pool_bytes > 0
    moe = model.moe_layers()[0][1]
    for n in (200, 1, 16, 17, 64, 256, 3):  # every graph, in an order that reuses the shared pool
        ids = _prompt(n, n)
        before = moe.pairs
        replayed = graphs.run(ids)
        replayed = (replayed.logits.clone(), [latent.clone() for latent in replayed.latents])
        assert moe.pairs - before == n * moe.config.num_experts_per_tok
        size = graphs.size_for(n)
        padded = torch.zeros(size, dtype=torch.int64, device="cuda")
        padded[:n] = torch.from_numpy(ids.astype(np.int64))
        eager = model.run_layers(padded, plan_prefill_batch([size], device="cuda"), last_index=torch.tensor([n - 1], device="cuda"))
        # the same kernels at the same shapes (the capture may pick another GEMM algorithm: bf16 rounding);
        # a replay reading a stale or shared buffer is off by the values themselves
        torch.testing.assert_close(replayed[0], eager.logits, atol=2e-2, rtol=2e-2)
        for got, want in zip(replayed[1], eager.latents):
            torch.testing.assert_close(got, want[:n], atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="the captured graphs take 1 to 256"):
        graphs.run(_prompt(257, 0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        graphs.run(np.array([1, 10_000], dtype=np.int32))


@on_gpu
def test_the_graphs_memory_does_not_depend_on_what_the_cache_held_before_them(moe_checkpoint):
    model = _model(moe_checkpoint, "cuda", dtype=torch.bfloat16)
    alone = PrefillGraphs.capture(model, SIZES, torch.device("cuda")).pool_bytes
    torch.cuda.synchronize()
    junk = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    del junk  # 2 GiB freed into the allocator's cache, as weight loading's temporaries are
    after_junk = PrefillGraphs.capture(model, SIZES, torch.device("cuda")).pool_bytes
    assert 0 < alone < 2**30
    assert abs(after_junk - alone) <= 64 * 2**20, (alone, after_junk)


@on_gpu
def test_the_worker_replays_single_prompts_and_runs_the_rest_eagerly():
    base = PoolConfig(
        model="tiny", num_layers=2, device="cuda", dtype="bfloat16", chunk_tokens=512, max_batch_tokens=1024, kv_cache_tokens=4096, seed=3
    )  # two workers on one GPU: a fixed KV cache each
    graphed, eager = PrefillWorker(base.replace(cuda_graph_tokens=SIZES), 0), PrefillWorker(base.replace(cuda_graph_tokens=()), 0)
    info = graphed.setup("127.0.0.1", 0)
    assert info.cuda_graph_tokens == SIZES and eager.setup("127.0.0.1", 0).cuda_graph_tokens == ()
    assert "cuda_graphs" in info.start_phases_s
    replays = []
    original = graphed.graphs.run
    graphed.graphs.run = lambda ids: replays.append(len(ids)) or original(ids)
    ids = _prompt(400, 1, vocab=512)
    batches = [
        [ChunkPiece("one", ids[:100], 0, 100)],  # replayed
        [ChunkPiece("two", ids[:300], 0, 300)],  # longer than every graph: eager
        [ChunkPiece("a", ids[:30], 0, 30), ChunkPiece("b", ids[30:50], 0, 20)],  # two prompts: eager
        [ChunkPiece("long", ids[:200], 0, 260)],  # replayed: the first chunk of a longer prompt
        [ChunkPiece("long", ids[200:260], 200, 260)],  # over cached context: eager
    ]
    for pieces in batches:
        got, want = graphed.prefill(pieces), eager.prefill(pieces)
        for g, w in zip(got.results, want.results):
            torch.testing.assert_close(torch.from_numpy(got.logits(g)), torch.from_numpy(want.logits(w)), atol=0.05, rtol=0.05)
    assert replays == [100, 200]
    for request_id, rows in (("one", 100), ("two", 300), ("b", 20), ("long", 260)):
        for layer in range(2):
            torch.testing.assert_close(graphed.kv.rows(request_id, layer), eager.kv.rows(request_id, layer), atol=0.05, rtol=0.05)
        assert graphed.kv.length(request_id) == rows
    graphed.inject_fault("raise", layer=1)
    with pytest.raises(InjectedFault):
        graphed.prefill([ChunkPiece("faulty", ids[:50], 0, 50)])
    assert replays == [100, 200]
