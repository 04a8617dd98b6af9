"""DeepSeek-family MoE checkpoints through the pool: for TP x PCP grids 1x1, 2x1, 2x2 and 1x4 (experts
split over every worker), a prompt prefilled in chunks smaller than itself gives transformers' logits,
and its KV, handed to the reference decoder over TCP, continues with transformers' 8 greedy tokens.

Models: V3 routing (sigmoid, groups, a non-zero ``e_score_correction_bias``), V2 routing (no q LoRA,
softmax, ``group_limited_greedy``), and V3 in DeepSeek's FP8 format (the reference is transformers on
the dequantized weights; on the CPU the pool dequantizes at load)."""

import numpy as np
import pytest
import torch
from hf_models import save_fp8, tiny_moe

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from cluster.kv_server import KVServer
from cluster.pool import PrefillPool
from configs.model import load_model_config
from configs.pool import PoolConfig
from workers.decode import ReferenceDecoder
from workers.kv_transfer import KVReceiver
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

STEPS = 8
PROMPT = list(np.arange(1, 62) * 13 % 320)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint, reference decoder, transformers' last logits, transformers' 1 + 8 tokens)."""
    out = {}
    for name in ("v3", "v2", "v3-fp8"):
        path = tmp_path_factory.mktemp(name)
        if name == "v3-fp8":
            hf = save_fp8(tiny_moe("v3", hidden=256, seed=7), path, tmp_path_factory.mktemp("dequantized"))
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


@pytest.mark.parametrize("tp,pcp", [(1, 1), (2, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("name", ["v3", "v2", "v3-fp8"])
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
