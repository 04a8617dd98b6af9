"""The reference decoder (absorbed MLA over the latent cache) against prefill and transformers' generate."""

import numpy as np
import pytest
import torch
from hf_models import tiny_deepseek_v3

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from configs.model import load_model_config
from workers.decode import ReferenceDecoder
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf = tiny_deepseek_v3(vocab_size=320, num_layers=2, max_positions=512, mscale_all_dim=1.0, seed=3)
    hf.save_pretrained(path)
    model = DeepseekPrefillModel.create(load_model_config(path), TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, path)
    return hf, model


def _prefill(model, tokens):
    out = model(torch.tensor(tokens), plan_prefill_batch([len(tokens)]))
    return out.logits[0], torch.stack(out.latents)


def test_each_decode_step_equals_prefilling_the_longer_prompt(checkpoint):
    _, model = checkpoint
    prompt = list(np.arange(3, 40) * 7 % 320)
    decoder = ReferenceDecoder(model)
    _, kv = _prefill(model, prompt)
    state = decoder.load(kv)
    for token in (5, 17, 300):
        logits = decoder.step(state, token)
        prompt.append(token)
        expected, _ = _prefill(model, prompt)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert state.length == len(prompt)


def test_prefill_then_decode_equals_transformers_generate(checkpoint):
    hf, model = checkpoint
    prompt = list(np.arange(1, 30) * 13 % 320)
    logits, kv = _prefill(model, prompt)
    tokens = ReferenceDecoder(model).generate(kv, int(logits.argmax()), 8)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False)[0, len(prompt) :]
    assert tokens == expected.tolist()


def test_kv_of_the_wrong_shape_is_refused(checkpoint):
    _, model = checkpoint
    with pytest.raises(ValueError, match=r"KV must be \[layers=2, tokens, 40\], got \(3, 5, 40\)"):
        ReferenceDecoder(model).load(torch.zeros(3, 5, 40))
