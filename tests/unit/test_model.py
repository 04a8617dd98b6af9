"""The single-rank model stack: parity with transformers' DeepseekV3ForCausalLM, batching, inputs."""

import pytest
import torch
from hf_models import tiny_deepseek_v3

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from configs.model import load_model_config, model_config_from_dict
from workers.model import DeepseekPrefillModel, TPShard, float32_logits, merged_parts
from workers.weights import load_weights


def _ours_from(hf_model):
    config = model_config_from_dict(hf_model.config.to_dict(), name="hf-tiny")
    ours = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, dtype=torch.float32)
    ours.load_state_dict(hf_model.state_dict())
    return ours


def test_last_token_logits_match_transformers():
    hf_model = tiny_deepseek_v3()
    ours = _ours_from(hf_model)
    prompts = [torch.randint(0, 300, (n,)) for n in (37, 1, 64)]
    out = ours(torch.cat(prompts), plan_prefill_batch([len(p) for p in prompts]))
    with torch.no_grad():
        expected = torch.stack([hf_model(p[None]).logits[0, -1] for p in prompts])
    torch.testing.assert_close(out.logits, expected, atol=1e-4, rtol=1e-4)
    assert out.logits.shape == (3, 300) and len(out.latents) == 3


def test_a_bf16_model_gives_float32_logits_of_its_float32_last_rows():
    """The final norm and the head in float32: bf16 logits would turn near-ties into ties."""
    config = load_model_config("tiny", num_hidden_layers=1)
    model = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, dtype=torch.bfloat16)
    load_weights(model, None, 5)
    out = model(torch.randint(0, config.vocab_size, (40,)), plan_prefill_batch([25, 15]))
    assert out.last_hidden.dtype == out.logits.dtype == torch.float32
    assert (out.last_hidden != out.last_hidden.bfloat16().float()).any()  # not rounded to the model's dtype
    expected = (out.last_hidden.double() @ model.lm_head.weight.double().t()).float()
    torch.testing.assert_close(out.logits, expected, atol=1e-6, rtol=1e-5)
    assert (out.logits != out.logits.bfloat16().float()).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float32_logits_of_a_bf16_head_on_cuda_keep_16_bits_of_the_rows():
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(16, 7168, device="cuda", generator=gen)
    weight = (torch.randn(129280, 7168, device="cuda", generator=gen) * 0.02).bfloat16()
    exact = rows.double() @ weight.double().t()
    got = float32_logits(rows, weight)
    assert got.dtype == torch.float32 and got.shape == (16, 129280)
    bf16_head = (rows.bfloat16() @ weight.t()).double()
    err, bf16_err = (got.double() - exact).abs().max().item(), (bf16_head - exact).abs().max().item()
    assert err < 1e-4 * exact.abs().max().item() and err < bf16_err / 50, (err, bf16_err)


def test_batch_of_mixed_lengths_equals_each_alone():
    config = load_model_config("tiny", num_hidden_layers=2)
    model = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, None, 3)
    prompts = [torch.randint(0, config.vocab_size, (n,)) for n in (5, 130, 17)]
    together = model(torch.cat(prompts), plan_prefill_batch([5, 130, 17]))
    offset = 0
    for i, prompt in enumerate(prompts):
        alone = model(prompt, plan_prefill_batch([len(prompt)]))
        torch.testing.assert_close(together.logits[i], alone.logits[0], atol=1e-5, rtol=1e-5)
        for layer in range(2):
            torch.testing.assert_close(together.latents[layer][offset : offset + len(prompt)], alone.latents[layer])
        offset += len(prompt)


def test_random_init_is_the_same_weights_for_every_tp_degree():
    config = load_model_config("tiny", num_hidden_layers=1)
    full = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(full, None, 7)
    shards = []
    for rank in range(2):
        shard = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, tp=TPShard(rank, 2), dtype=torch.float32)
        load_weights(shard, None, 7)
        shards.append(shard)
    stacked = 0
    for name, param in full.named_parameters():
        dim = TPShard(0, 2).split_dim(name)
        parts = [_checkpoint_tensors(model, name) for model in (full, *shards)]
        stacked += len(parts[0]) > 1
        for whole, *pieces in zip(*parts):  # each shard holds its slice of each stacked checkpoint tensor
            if dim is None:
                assert all(torch.equal(piece, whole) for piece in pieces), name
            else:
                assert torch.equal(torch.cat(pieces, dim=dim), whole), name
    assert stacked == 1  # the dense MLP's gate_up_proj: gate_proj over up_proj


def _checkpoint_tensors(model, name):
    """A parameter as the checkpoint tensors stacked in it (itself alone if it stacks none)."""
    rows = [n for _, n in merged_parts(model, name.rpartition(".")[0])]
    return model.get_parameter(name).split(rows) if rows else (model.get_parameter(name),)


def test_bad_prompts_are_named():
    config = load_model_config("tiny", num_hidden_layers=1)
    model = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, dtype=torch.float32)
    batch = plan_prefill_batch([3])
    with pytest.raises(TypeError, match="int64 or int32 tensor, got torch.float32"):
        model(torch.tensor([1.0, 2.0, 3.0]), batch)
    with pytest.raises(ValueError, match=r"token id 512 is outside the vocabulary \[0, 512\)"):
        model(torch.tensor([1, 512, 3]), batch)
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([1, -1, 3]), batch)
    with pytest.raises(ValueError, match="1-D with 3 entries"):
        model(torch.tensor([1, 2]), batch)
    with pytest.raises(ValueError, match="a sequence of 9000 tokens exceeds tiny's maximum of 8192 positions"):
        model(torch.zeros(9000, dtype=torch.int64), plan_prefill_batch([9000]))
    with pytest.raises(ValueError, match=r"TP=3 does not divide tiny's 8 attention heads; valid TP degrees: \[1, 2, 4, 8\]"):
        config.check_tp(3)
