"""DeepSeek-family MoE checkpoints through the pool: for TP x PCP grids 1x1, 2x1, 2x2 and 1x4 (experts
split over every worker; V2 and FP8 on some of them), a prompt prefilled in chunks smaller than itself gives transformers' logits,
and its KV, handed to the reference decoder over TCP, continues with transformers' 8 greedy tokens.
The CLI and the batch job take the same checkpoints and report the experts' load.

Models: V3 routing (sigmoid, groups, a non-zero ``e_score_correction_bias``), V2 routing (no q LoRA,
softmax, ``group_limited_greedy``), and V3 in DeepSeek's FP8 format (the reference is transformers on
the dequantized weights; on the CPU the pool dequantizes at load)."""

import json

import numpy as np
import pytest
import torch
from hf_models import save_fp8, tiny_fp8_moe, tiny_moe

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from cluster import job
from cluster.cli import main
from cluster.kv_server import KVServer
from cluster.pool import PrefillPool
from configs.model import EP_SCHEDULES, load_model_config
from configs.pool import PoolConfig
from workers.decode import ReferenceDecoder
from kv.receiver import KVReceiver
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

STEPS = 8
PROMPT = [int(t) for t in np.arange(1, 62) * 13 % 320]
# expert parallelism over NCCL on real GPUs, every EP schedule, where the machine has the GPUs
CUDA_CASES = [
    pytest.param(grid, schedule, marks=pytest.mark.multi_gpu, id=f"tp{grid[0]}xpcp{grid[1]}-{schedule}")
    for grid in [(1, 2), (2, 2)]
    if torch.cuda.device_count() >= grid[0] * grid[1]
    for schedule in EP_SCHEDULES
] or [pytest.param(None, None, marks=pytest.mark.skip(reason="needs 2+ CUDA GPUs (NCCL)"))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint, reference decoder, transformers' last logits, transformers' 1 + 8 tokens)."""
    out = {}
    for name in ("v3", "v2", "v3-fp8"):
        path = tmp_path_factory.mktemp(name)
        if name == "v3-fp8":
            hf = save_fp8(tiny_fp8_moe(seed=7), path, tmp_path_factory.mktemp("dequantized"))
        else:
            hf = tiny_moe(name, seed=6)
            hf.save_pretrained(path)
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT])).logits[0, -1]
            tokens = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS + 1, do_sample=False)[0, len(PROMPT) :].tolist()
        model = DeepseekPrefillModel.create(load_model_config(path), TorchSDPAPrefillBackend, dtype=torch.float32)
        load_weights(model, path)
        out[name] = (path, ReferenceDecoder(model), logits, tokens)
    return out


# V3 on every grid; what V2 and FP8 change (softmax routing, no q LoRA; block scales sliced with the
# heads and experts) on 2x2, which splits heads and experts both ways, and FP8 on 1x4's expert split too
GRID_CASES = [("v3", 1, 1), ("v3", 2, 1), ("v3", 2, 2), ("v3", 1, 4), ("v2", 2, 2), ("v3-fp8", 2, 2), ("v3-fp8", 1, 4)]


@pytest.mark.parametrize("name,tp,pcp", GRID_CASES)
def test_grid_prefill_and_handoff_decode_like_transformers(ray_cluster, models, name, tp, pcp):
    path, decoder, expected_logits, expected_tokens = models[name]
    config = PoolConfig(
        checkpoint=str(path), tp=tp, pcp=pcp, chunk_tokens=16, block_size=8, kv_cache_tokens=512, worker_cpus=0.25, device="cpu"
    )
    with PrefillPool(config).start() as pool:
        result = pool.prefill(PROMPT, keep_kv=True)
        torch.testing.assert_close(result.logits, expected_logits, atol=1e-4, rtol=1e-4)
        with KVServer(pool, token="t") as server:
            receiver = KVReceiver(server.host, server.port, token="t", model_fingerprint=pool.model_config.fingerprint())
            kv = receiver.fetch(result.request_id)
        assert decoder.generate(kv.rows(), result.first_token, STEPS) == expected_tokens
        k = pool.model_config.moe.num_experts_per_tok
        load = pool.expert_load()
        assert sorted(load) == ["1", "2"]
        for layer in load.values():  # every (token, expert) pair computed once, on tp x pcp ranks
            (pairs,) = layer["pairs_per_rank"]
            assert len(pairs) == tp * pcp and sum(pairs) == len(PROMPT) * k
        weights = pool.weights_report()
        assert weights["format"] == "float32" and len(weights["load_s"][0]) == tp * pcp
        read, held = weights["read_bytes_per_rank"][0], weights["bytes_per_rank"][0]
        if name != "v3-fp8":  # float32 as stored: each rank read exactly its slices (heads, experts), no more
            assert read == held and (max(read) < sum(read) or tp * pcp == 1)
        else:  # FP8 weights and their scales, dequantized at load: fewer bytes read than held
            assert all(0 < r < h for r, h in zip(read, held))


@pytest.mark.parametrize("grid,schedule", CUDA_CASES)
def test_nccl_expert_parallel_schedules_equal_transformers(ray_cluster, models, grid, schedule):
    """On GPUs (NCCL; the routing kernel, the SM carveout beside the all-to-alls): V3 routing in float32
    equals transformers and decodes its tokens; the FP8 checkpoint on FP8 GEMMs (bfloat16) keeps
    transformers' first token, its logits within 5% of the largest."""
    tp, pcp = grid
    base = PoolConfig(tp=tp, pcp=pcp, chunk_tokens=16, block_size=8, kv_cache_tokens=512, device="cuda", backend="TORCH_SDPA",
                      ep_schedule=schedule, ep_comm_sms=8)  # fmt: skip
    path, decoder, expected_logits, expected_tokens = models["v3"]
    with PrefillPool(base.replace(checkpoint=str(path), dtype="float32")).start() as pool:
        result = pool.prefill(PROMPT, keep_kv=True)
        torch.testing.assert_close(result.logits, expected_logits, atol=1e-4, rtol=1e-4)
        assert decoder.generate(pool.fetch_kv(result), result.first_token, STEPS) == expected_tokens
    path, _, expected_logits, expected_tokens = models["v3-fp8"]
    with PrefillPool(base.replace(checkpoint=str(path), dtype="bfloat16")).start() as pool:
        assert pool.weights_report()["format"] == "fp8"
        result = pool.prefill(PROMPT)
        assert (result.logits - expected_logits).abs().max() < 0.05 * expected_logits.abs().max()
        assert result.first_token == expected_tokens[0]


def test_cli_verifies_an_fp8_moe_checkpoint_and_reports_the_expert_load(ray_cluster, models, tmp_path, capsys):
    path = models["v3-fp8"][0]
    argv = ["prefill", "--checkpoint", str(path), "--tp", "2", "--device", "cpu", "--chunk-tokens", "16", "--random-tokens", "50"]
    assert main([*argv, "--verify", "--output-dir", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verify"]["ok"] and summary["verify"]["max_abs_err_logits"] < 1e-4
    assert summary["weights"]["experts_per_rank"] == [[[0, 7], [8, 15]]]  # 16 experts over 2 workers
    assert [sum(summary["expert_load"][layer]["pairs_per_rank"][0]) for layer in ("1", "2")] == [50 * 4, 50 * 4]


def test_the_batch_job_prefills_a_moe_checkpoint(ray_cluster, models, tmp_path):
    path, decoder, _, expected = models["v2"]
    prompts = [{"id": "a", "token_ids": PROMPT}, {"id": "b", "token_ids": PROMPT[:17]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--checkpoint", str(path)]
    assert job.main([*argv, "--pcp", "2", "--device", "cpu", "--chunk-tokens", "16", "--kv-cache-tokens", "512"]) == 0
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["prefilled"] == 2 and sorted(summary["expert_load"]) == ["1", "2"]
    record = json.loads((tmp_path / "out" / "prompts" / "a.json").read_text())
    assert record["first_token"] == expected[0]
