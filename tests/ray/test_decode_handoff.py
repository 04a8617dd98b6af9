"""End to end on CPU: prefill in a TP=2 x PCP=2 pool, hand the KV to the reference decoder over each
transport (a receiver outside the cluster, into its own paged cache over NIXL or TCP; a decode actor
pulling Ray objects or using its point-to-point link), decode greedily; the tokens equal a single
process that prefills and decodes by itself, and transformers' generate."""

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
from kv.receiver import KVReceiver
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

STEPS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory, ray_cluster):
    path = tmp_path_factory.mktemp("hf")
    hf = tiny_deepseek_v3(vocab_size=320, num_layers=2, max_positions=512, mscale_all_dim=1.0, seed=3)
    hf.save_pretrained(path)
    config = PoolConfig(checkpoint=str(path), tp=2, pcp=2, chunk_tokens=16, block_size=8, worker_cpus=0.25, device="cpu",
                        prefix_caching=False)  # each test prefills the prompt cold: its rows are compared bit for bit
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


@pytest.mark.parametrize("transport", ["nixl", "tcp"])
def test_a_receiver_outside_the_cluster_decodes_the_same_tokens_from_its_own_cache(setup, transport):
    pool, model, prompt, expected = setup
    result = pool.prefill(prompt, keep_kv=True)
    layers, width = pool.model_config.num_hidden_layers, pool.model_config.attention.latent_dim
    cache = torch.zeros(layers, 32, 8, width)  # a decode server's paged cache; the prompt needs 8 blocks
    ids = [31, 3, 17, 4, 5, 6, 20, 0]
    with KVServer(pool, token="t") as server:
        receiver = KVReceiver(server.host, server.port, token="t", model_fingerprint=pool.model_config.fingerprint(), transport=transport)
        kv = receiver.fetch(result.request_id, into=cache, block_ids=ids)
    rows = cache[:, ids].reshape(layers, -1, width)[:, : len(prompt)]  # as a paged decoder reads them
    assert ReferenceDecoder(model).generate(rows, result.first_token, STEPS) == expected
    assert torch.equal(rows, kv.rows())
    # against one process prefilling the prompt alone: layer 0's rows (embeddings and replicated
    # projections only) bit for bit; later layers within float32 rounding (the grid sums over TP ranks)
    single = torch.stack(model(torch.tensor(prompt), plan_prefill_batch([len(prompt)])).latents)
    assert torch.equal(rows[0], single[0])
    torch.testing.assert_close(rows, single, atol=1e-5, rtol=1e-4)
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
