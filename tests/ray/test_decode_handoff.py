"""End to end on CPU: prefill in a TP=2 x PCP=2 pool, hand the KV to the reference decoder over each
transport (TCP; a decode actor pulling Ray objects or using its point-to-point link), decode
greedily; the tokens equal a single process that prefills and decodes by itself, and transformers'
generate."""

import numpy as np
import pytest
import ray
import torch
from hf_models import tiny_deepseek_v3

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from cluster.handoff import DecodeActor
from cluster.kv_server import KVServer
from cluster.pool import PrefillPool
from configs.pool import PoolConfig
from workers.decode import ReferenceDecoder
from workers.kv_transfer import KVReceiver
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

STEPS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory, ray_cluster):
    path = tmp_path_factory.mktemp("hf")
    hf = tiny_deepseek_v3(vocab_size=320, num_layers=2, max_positions=512, mscale_all_dim=1.0, seed=3)
    hf.save_pretrained(path)
    config = PoolConfig(checkpoint=str(path), tp=2, pcp=2, chunk_tokens=16, block_size=8, worker_cpus=0.25, device="cpu")
    prompt = list(np.arange(1, 60) * 13 % 320)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS + 1, do_sample=False)[0, len(prompt) :].tolist()
    model = DeepseekPrefillModel.create(config.model_config(), TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, path)
    with PrefillPool(config).start() as pool:
        yield pool, model, prompt, expected


def test_a_single_process_prefill_and_decode_equals_transformers(setup):
    _, model, prompt, expected = setup
    out = model(torch.tensor(prompt), plan_prefill_batch([len(prompt)]))
    tokens = ReferenceDecoder(model).generate(torch.stack(out.latents), int(out.logits[0].argmax()), STEPS)
    assert tokens == expected


def test_tcp_handoff_from_the_grid_decodes_the_same_tokens(setup):
    pool, model, prompt, expected = setup
    result = pool.prefill(prompt, keep_kv=True)
    with KVServer(pool, token="t") as server:
        kv = KVReceiver(server.host, server.port, token="t", model_fingerprint=pool.model_config.fingerprint()).fetch(result.request_id)
    assert ReferenceDecoder(model).generate(kv.rows(), result.first_token, STEPS) == expected
    assert all(w["kv_requests"] == 0 for w in pool.health()[0])


@pytest.mark.parametrize("transport", ["object", "p2p"])
def test_a_decode_actor_pulls_the_shards_and_decodes_the_same_tokens(setup, transport):
    pool, _, prompt, expected = setup
    result = pool.prefill(prompt, keep_kv=True)
    decoder = ray.remote(DecodeActor).options(num_cpus=0.25).remote(pool.config, transport=transport)
    try:
        source = pool.kv_source(result)
        assert len(source.holders) == 2  # one per PCP rank
        receipt = ray.get(decoder.receive.remote(source))
        assert receipt["tokens"] == len(prompt) and receipt["transport"] == transport
        config = pool.model_config
        assert receipt["bytes"] == config.num_hidden_layers * len(prompt) * config.attention.latent_dim * 4  # fp32
        pool.release(result)  # the actor has it: the prefill side frees it
        assert all(w["kv_requests"] == 0 for w in pool.health()[0])
        assert ray.get(decoder.generate.remote(result.request_id, result.first_token, STEPS)) == expected
    finally:
        ray.kill(decoder)
