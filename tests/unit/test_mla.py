"""The MLA layer: parity with transformers' DeepseekV3Attention, chunked context, planning."""

import math

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import MLAAttention, MLAConfig, RMSNorm, plan_prefill_batch
from attention.rope import RotaryEmbedding, YarnScaling

YARN = dict(factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)
TINY = dict(hidden_size=64, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def _configs(q_lora_rank, yarn, interleave):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, **YARN}
    hf_config = DeepseekV3Config(
        vocab_size=100, intermediate_size=96, num_hidden_layers=1, num_attention_heads=TINY["num_heads"],
        num_key_value_heads=TINY["num_heads"], q_lora_rank=q_lora_rank, max_position_embeddings=512,
        rope_parameters=rope, rope_interleave=interleave, attention_bias=False, rms_norm_eps=1e-6,
        **{k: v for k, v in TINY.items() if k != "num_heads"},
    )  # fmt: skip
    hf_config._attn_implementation = "eager"
    ours = MLAConfig(
        **TINY, q_lora_rank=q_lora_rank, rope_theta=10000.0, rope_interleave=interleave,
        yarn=YarnScaling(**YARN) if yarn else None, rms_norm_eps=1e-6,
    )  # fmt: skip
    return hf_config, ours


def _layers(q_lora_rank=24, yarn=True, interleave=True):
    hf_config, config = _configs(q_lora_rank, yarn, interleave)
    reference = hf.DeepseekV3Attention(hf_config, layer_idx=0).eval()
    for param in reference.parameters():  # RMSNorm weights start at 1: randomize everything
        torch.nn.init.normal_(param, std=0.2)
    backend = config.create_backend(TorchSDPAPrefillBackend)
    ours = MLAAttention(config, backend)
    ours.load_state_dict(reference.state_dict())
    return reference, ours, hf_config


@torch.no_grad()
def _hf_forward(reference, hf_config, hidden):
    tokens = hidden.shape[0]
    positions = torch.arange(tokens)[None]
    cos, sin = hf.DeepseekV3RotaryEmbedding(hf_config)(hidden[None], positions)
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]
    return reference(hidden[None], position_embeddings=(cos, sin), attention_mask=mask)[0][0]


@pytest.mark.parametrize(
    "q_lora_rank,yarn,interleave",
    [(24, True, True), (None, False, True), (24, False, False), (None, True, False)],
    ids=["q_lora+yarn+interleaved", "q_proj+default-rope", "q_lora+neox", "q_proj+yarn+neox"],
)
@torch.no_grad()
def test_matches_transformers_deepseek_v3_attention(q_lora_rank, yarn, interleave):
    reference, ours, hf_config = _layers(q_lora_rank, yarn, interleave)
    lengths = [41, 1, 23]
    hidden = [torch.randn(n, TINY["hidden_size"]) for n in lengths]
    batch = plan_prefill_batch(lengths)
    out, latent = ours(torch.cat(hidden), batch)  # one ragged batch
    expected = torch.cat([_hf_forward(reference, hf_config, h) for h in hidden])  # one at a time
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert latent.shape == (sum(lengths), TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"])


@torch.no_grad()
def test_yarn_scaling_matches_transformers():
    hf_config, config = _configs(24, True, True)
    inv_freq, attention_factor = hf.ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    rope = config.rotary_embedding
    torch.testing.assert_close(rope.inv_freq(), inv_freq, atol=0, rtol=0)  # the same float32 ops
    assert math.isclose(rope.cos_sin_factor, attention_factor, rel_tol=1e-12)
    hf_scale = hf.DeepseekV3Attention(hf_config, 0).scaling
    assert math.isclose(config.softmax_scale, hf_scale, rel_tol=1e-12)
    assert config.softmax_scale != (16 + 8) ** -0.5  # mscale_all_dim really changes it


@torch.no_grad()
@pytest.mark.parametrize("yarn", [True, False], ids=["yarn", "default-rope"])
def test_cos_sin_are_the_references_float32_table(yarn):
    """cos/sin equal transformers' table bit for bit (float32 frequencies and angles, as DeepSeek's
    reference and vLLM's DeepSeek table compute them), to the longest position."""
    hf_config, config = _configs(24, yarn, True)
    positions = torch.arange(hf_config.max_position_embeddings)
    cos, sin = config.rotary_embedding.cos_sin(positions)
    hf_cos, hf_sin = hf.DeepseekV3RotaryEmbedding(hf_config)(torch.zeros(1, 1), positions[None])
    half = config.rotary_embedding.rotary_dim // 2
    torch.testing.assert_close(cos, hf_cos[0, :, :half], atol=0, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0, :, :half], atol=0, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize(
    "device,dtype",
    [("cpu", torch.float32), ("cpu", torch.bfloat16)]
    + ([pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)] if torch.cuda.is_available() else []),
)
def test_rotation_in_place_equals_the_torch_rotation(interleaved, device, dtype):
    """The rotation kernel (Triton's interpreter on CPU) rotates the rope part of the query rows and
    of the latent rows in place, through their strides, as the torch code computes it (float32 exactly,
    bf16 within one rounding); the rows' other columns are untouched."""
    rope = RotaryEmbedding(64, 10000.0, yarn=YarnScaling(**YARN), interleaved=interleaved)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(37, 5, 192, generator=gen).to(device, dtype)  # 37 tokens: not a multiple of the kernel's block
    latent = torch.randn(37, 576, generator=gen).to(device, dtype)
    positions = torch.randint(0, 4000, (37,), generator=gen).to(device)
    cos, sin = rope.cos_sin(positions)
    for rows, part in ((q, (Ellipsis, slice(128, None))), (latent, (slice(None), slice(512, None)))):
        expected = rows.clone()
        expected[part] = rope(rows[part], cos, sin)
        got = rows.clone()
        assert rope.rotate_(got[part], cos, sin, impl="triton").data_ptr() == got[part].data_ptr()
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        else:  # one bf16 rounding (the interpreter's bf16 casts truncate)
            torch.testing.assert_close(got, expected, rtol=8e-3, atol=1e-5)
        assert torch.equal(got[..., :128] if rows is q else got[:, :512], rows[..., :128] if rows is q else rows[:, :512])


@pytest.mark.parametrize("width,strided", [(7168, False), (512, True)], ids=["hidden-7168", "latent-slice-512"])
@pytest.mark.parametrize(
    "device,dtype",
    [("cpu", torch.float32), ("cpu", torch.bfloat16)]
    + ([pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)] if torch.cuda.is_available() else []),
)
def test_rms_norm_kernel_rounds_once(width, strided, device, dtype):
    """The one-pass RMSNorm kernel (Triton's interpreter on CPU) against float32 ops rounded once at the
    end: float32 within float32 rounding, bf16 within one bf16 rounding and (on a GPU) nearly every
    value equal, as torch's fused op with the weight inside; rows read through their stride."""
    from attention.rms_norm_triton import rms_norm

    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(37, width + 64 if strided else width, generator=gen).to(device, dtype) * 3
    x = rows[:, :width]  # a column slice when strided: the latent rows' kv_c
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(device, dtype)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(dtype)
    got = rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    else:  # one bf16 rounding (the interpreter's bf16 casts truncate)
        torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-5)
    if device == "cuda":
        assert (got != expected).float().mean().item() < 1e-3
        module = RMSNorm(width, 1e-6, dtype=dtype, device=device)
        with torch.no_grad():
            module.weight.copy_(weight)
            assert torch.equal(module(x), got)  # the layer's norm runs the kernel on CUDA


@pytest.mark.parametrize(
    "device", ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
)
def test_rms_norm_adds_into_a_float32_residual_in_its_own_pass(device):
    """The decoder's residual stream: ``residual += x`` in float32 (x bf16), written back, and the new
    residual normalized and rounded once to the weight's dtype; the kernel (Triton's interpreter on
    CPU) and RMSNorm's torch path both, and a float32 stream normalized into bf16 without an add."""
    from attention.rms_norm_triton import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(3)
    residual = (torch.randn(37, 2048, generator=gen) * 2).to(device)
    x = torch.randn(37, 2048, generator=gen).to(device, torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(2048, generator=gen)).to(device, torch.bfloat16)
    total = residual + x.float()
    expected = (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(torch.bfloat16)
    kernel_residual, module_residual = residual.clone(), residual.clone()
    got = add_rms_norm(x, kernel_residual, weight, 1e-6)
    assert got.dtype == torch.bfloat16 and torch.equal(kernel_residual, total)
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-5)  # one bf16 rounding (the interpreter's casts truncate)
    torch.testing.assert_close(rms_norm(total, weight, 1e-6), expected, rtol=1.6e-2, atol=1e-5)  # float32 rows in, bf16 out
    module = RMSNorm(2048, 1e-6, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        module.weight.copy_(weight)
        through_module = module(x, module_residual)
    assert torch.equal(module_residual, total) and through_module.dtype == torch.bfloat16
    torch.testing.assert_close(through_module, expected, rtol=1.6e-2, atol=1e-5)
    if device == "cuda":
        assert (got != expected).float().mean().item() < 1e-3
    with pytest.raises(ValueError, match=r"add_rms_norm needs a residual of x's shape \(37, 2048\)"):
        add_rms_norm(x, residual[:, :1024], weight, 1e-6)


@pytest.mark.parametrize(
    "device", ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
)
def test_key_kernel_builds_the_key_rows_of_every_head(device):
    """The key kernel (Triton's interpreter on CPU) writes each head's up-projected ``k_nope`` and the
    row's shared ``k_pe`` (a column slice of the latent rows), exactly as the two torch copies do."""
    from attention.mla_triton import build_keys

    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(37, 5, 256, generator=gen).to(device, torch.bfloat16)  # [rows, heads, nope + v]
    latent = torch.randn(37, 576, generator=gen).to(device, torch.bfloat16)
    k = build_keys(kv, latent[:, 512:], 128)
    assert k.shape == (37, 5, 192) and k.is_contiguous()
    assert torch.equal(k[..., :128], kv[..., :128])
    assert torch.equal(k[..., 128:], latent[:, None, 512:].expand(37, 5, 64))


def test_context_continuation_matches_transformers_on_the_whole_prompt():
    """Prefill a prefix, then the rest against its cached latent rows: equals one full pass."""
    reference, ours, hf_config = _layers()
    hidden = torch.randn(50, TINY["hidden_size"])
    expected = _hf_forward(reference, hf_config, hidden)
    _, prefix_latent = ours(hidden[:32], plan_prefill_batch([32]))
    for workspace in (1, 5, 32, None):
        batch = plan_prefill_batch([18], [32], workspace_tokens=workspace)
        out, _ = ours(hidden[32:], batch, context_kv=prefix_latent)
        torch.testing.assert_close(out, expected[32:], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@torch.no_grad()
def test_chunked_context_equals_unchunked(dtype):
    config = MLAConfig(**TINY, q_lora_rank=24, yarn=YarnScaling(**YARN))
    layer = MLAAttention(config, config.create_backend(TorchSDPAPrefillBackend), dtype=dtype)
    seq_lens, context_lens = [3, 4, 2, 5], [13, 0, 7, 1]
    hidden = torch.randn(sum(seq_lens), config.hidden_size, dtype=dtype)
    context = torch.randn(sum(context_lens), config.latent_dim, dtype=dtype)
    whole, latent = layer(hidden, plan_prefill_batch(seq_lens, context_lens, workspace_tokens=None), context)
    # chunks of 1 row, chunks that split sequences, one chunk exactly the size of the context
    for workspace in (1, 2, 6, 13, 20, 21, 1000):
        batch = plan_prefill_batch(seq_lens, context_lens, workspace_tokens=workspace)
        assert all(c.row_end - c.row_start <= workspace for c in batch.context_chunks)
        out, latent_chunked = layer(hidden, batch, context)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out, whole, **tol)
        assert torch.equal(latent_chunked, latent)


def test_plan_chunks_split_sequences_and_skip_empty_contexts():
    batch = plan_prefill_batch([3, 2, 4], [5, 0, 7], workspace_tokens=4)
    chunks = [
        (c.seq_start, c.seq_end, c.token_start, c.token_end, c.row_start, c.row_end, c.cu_seqlens_k.tolist())
        for c in batch.context_chunks
    ]
    assert chunks == [
        (0, 1, 0, 3, 0, 4, [0, 4]),  # first 4 rows of sequence 0
        (0, 3, 0, 9, 4, 8, [0, 1, 1, 4]),  # its last row; sequence 1 has no context; 3 rows of sequence 2
        (2, 3, 5, 9, 8, 12, [0, 4]),  # the rest of sequence 2
    ]
    assert batch.positions.tolist() == [5, 6, 7, 0, 1, 7, 8, 9, 10]
    assert plan_prefill_batch([3], [0]).context_chunks == ()


def test_plan_once_for_all_layers():
    config = MLAConfig(**TINY, q_lora_rank=None)
    backend = config.create_backend(TorchSDPAPrefillBackend)
    layers = [MLAAttention(config, backend) for _ in range(3)]
    batch = plan_prefill_batch([4, 6], [3, 9], workspace_tokens=5, backend=backend)
    planned = backend.num_plans_built
    assert planned == 1 + len(batch.context_chunks)
    hidden = torch.randn(10, config.hidden_size)
    context = torch.randn(12, config.latent_dim)
    with torch.no_grad():
        for layer in layers:
            hidden = hidden + layer(hidden, batch, context)[0]
    assert backend.num_plans_built == planned
    plan_prefill_batch([5], backend=backend)  # the next batch replaces this batch's plans
    assert len(backend._plans) == 1


def test_bad_inputs_are_named():
    config = MLAConfig(**TINY, q_lora_rank=None)
    layer = MLAAttention(config, config.create_backend(TorchSDPAPrefillBackend))
    batch = plan_prefill_batch([4], [3])
    with pytest.raises(ValueError, match=r"hidden must be \[tokens=4, hidden=64\], got \(5, 64\)"):
        layer(torch.randn(5, 64), batch, torch.randn(3, 40))
    with pytest.raises(TypeError, match="hidden has dtype torch.float64"):
        layer(torch.randn(4, 64, dtype=torch.float64), batch, torch.randn(3, 40))
    with pytest.raises(ValueError, match=r"context_kv must be \[context rows, latent\] = \(3, 40\), got None"):
        layer(torch.randn(4, 64), batch)
    with pytest.raises(ValueError, match="every sequence needs at least one new token"):
        plan_prefill_batch([4, 0])
    with pytest.raises(ValueError, match="got 2 seq_lens but 1 context_lens"):
        plan_prefill_batch([4, 1], [2])
    with pytest.raises(ValueError, match="workspace_tokens must be a positive number"):
        plan_prefill_batch([4], workspace_tokens=0)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLAConfig(**{**TINY, "qk_rope_head_dim": 7}, q_lora_rank=None)
    with pytest.raises(ValueError, match="backend TORCH_SDPA was built for 4 heads"):
        MLAAttention(config, config.create_backend(TorchSDPAPrefillBackend), num_heads=2)
