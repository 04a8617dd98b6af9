"""FP8 in DeepSeek's block format: quantization round trips, activation quantization, and (on a GPU) the
Triton kernel against the torch code and torch's FP8 GEMMs against the emulation the CPU tests use."""

import fp8_emulation
import pytest
import torch
from hf_models import vllm_checkpoint_config
from torch import nn
from transformers import DeepseekV3ForCausalLM

from attention.rms_norm_triton import add_rms_norm, rms_norm
from configs.model import MoEConfig
from workers import fp8_triton
from workers.fp8 import (
    FP8,
    FP8Linear,
    FP8RMSNorm,
    FP8Rows,
    block_dequantize,
    block_gemm_shape_ok,
    block_quantize,
    quantize_activations,
    requantize_rows,
)
from workers.model import fp8_shard_aligned
from workers.moe import Experts

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")  # the GPU cases below are collected only with CUDA


def _relative(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def test_block_quantize_is_deepseeks_recipe_with_partial_edge_blocks():
    w = torch.randn(300, 200)
    q, scale = block_quantize(w)
    assert q.dtype == FP8 and q.shape == (300, 200) and scale.shape == (3, 2)
    assert torch.equal(scale[2, 1], w[256:, 128:].abs().max() / 448)  # the corner block: 44 x 72 values
    assert _relative(block_dequantize(q, scale, torch.float32), w) < 0.04
    # a slice dequantizes with the scales of the blocks it starts in, wherever it starts
    full = block_dequantize(q, scale, torch.float32)
    part = block_dequantize(q[150:290, 130:200], scale[1:3, 1:2], torch.float32, row_start=150, col_start=130)
    assert torch.equal(part, full[150:290, 130:200])


def test_requantized_rows_are_within_one_fp8_rounding():
    w = block_dequantize(*block_quantize(torch.randn(3, 256, 384)[0]), torch.float32)
    q, scale = requantize_rows(w)
    assert scale.shape == (256,)
    assert ((q.float() * scale[:, None] - w).abs() <= w.abs().amax(1, keepdim=True) / 16).all()


@pytest.mark.parametrize("group", [128, 256])
def test_activation_quantization_per_group_with_padded_rows(group):
    x = torch.randn(37, 256) * torch.logspace(-2, 2, 256)  # columns of very different magnitudes
    q, scale = quantize_activations(x, group, pad_rows_to=4, impl="torch")
    assert q.shape == (40, 256) and scale.shape == (256 // group, 40)
    assert torch.equal(q[37:].float(), torch.zeros(3, 256))
    per_element = scale.t()[:37].repeat_interleave(group, dim=1)
    torch.testing.assert_close(scale.t()[:37, 0], x[:, :group].abs().amax(1) / 448)
    assert ((q[:37].float() * per_element - x).abs() <= x.abs().amax(1, keepdim=True) / 16).all()


def test_activation_quantization_fuses_the_expert_activation_and_routing_weight():
    gate_up, weight = torch.randn(9, 512), torch.rand(9)
    expected = torch.nn.functional.silu(gate_up[:, :256]) * gate_up[:, 256:] * weight[:, None]
    q, scale = quantize_activations(gate_up, 256, silu_mul=True, row_weight=weight, impl="torch")
    assert q.shape == (9, 256)
    assert _relative(q.float() * scale[0][:, None], expected) < 0.04


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_quantization_scattered_to_the_pairs_equals_quantizing_then_gathering(impl):
    """Each token's row quantized once and written to its experts' places (-1: none) equals the
    per-row quantization by the same implementation gathered to those places, bit for bit (Triton's
    interpreter on CPU: its FP8 casts round small values differently from torch's, so each
    implementation is its own reference here; the GPU test compares the two)."""
    x = torch.randn(21, 256) * 3
    order = torch.randperm(21 * 3, generator=torch.Generator().manual_seed(0))
    dest = torch.full((21 * 3,), -1, dtype=torch.int64)
    named = order[:50]  # 50 of the 63 (row, slot)s go somewhere: a permutation of the 50 output rows
    dest[named] = torch.arange(50)
    dest = dest.view(21, 3)
    q, scale = quantize_activations(x, 256, scatter_to=dest, scatter_rows=50, impl=impl)
    ref_q, ref_scale = quantize_activations(x, 256, impl=impl)
    source = named // 3  # output row i is (row, slot) named[i]
    assert q.shape == (50, 256) and scale.shape == (1, 50)
    assert torch.equal(scale[0], ref_scale[0][source])
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)[source])


@pytest.mark.parametrize("group,silu_mul", [(128, False), (256, True), (768, False)], ids=["1x128", "activation", "row"])
def test_triton_quantization_in_one_pass_equals_two_passes(group, silu_mul, monkeypatch):
    """The kernel (Triton's interpreter) holds a group in registers (one pass) or, wider than
    ``ONE_PASS_WIDTH``, reads it twice: the same FP8 bytes and scales either way, the scales torch's
    and padding rows zeros."""
    x = torch.randn(6, 1536) * torch.logspace(-1, 1, 1536)
    weight = torch.rand(6) if silu_mul else None
    kw = {"pad_rows_to": 4, "silu_mul": silu_mul, "row_weight": weight}
    one_pass = quantize_activations(x, group, impl="triton", **kw)
    monkeypatch.setattr(fp8_triton, "ONE_PASS_WIDTH", 64)
    two_passes = quantize_activations(x, group, impl="triton", **kw)
    assert fp8_triton.quantize_constants(group, 448, 1e-10, silu_mul=silu_mul, row_weight=False, scatter=0)["WIDTH"] == 128
    assert torch.equal(one_pass[0].view(torch.uint8), two_passes[0].view(torch.uint8))
    assert torch.equal(one_pass[1], two_passes[1])
    torch.testing.assert_close(one_pass[1], quantize_activations(x, group, impl="torch", **kw)[1], rtol=1e-6, atol=0)
    assert one_pass[0].shape == (8, 768 if silu_mul else 1536) and not one_pass[0][6:].float().any()


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_the_norm_quantized_in_its_pass_equals_the_norm_then_the_quantization(residual):
    """``FP8RMSNorm``'s one-pass kernel (Triton's interpreter) writes the FP8 bytes and scales that the
    norm's kernel then the quantization's write (bf16 rows in between), the residual stream added
    into the same way; padding rows zeros; the torch path's scales (norm, then quantization) within a
    bf16 rounding (the interpreter's bf16 casts truncate). Not its FP8 values: the interpreter's FP8
    cast takes a value that rounds up to a power of two to half that power (126.4 to 64, not 128), in
    either kernel; the GPU test below compares them with torch's."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 1024, generator=gen) * torch.logspace(-1, 1, 1024)).to(torch.bfloat16)
    stream = torch.randn(6, 1024, generator=gen) * 2 if residual else None
    norm = FP8RMSNorm(1024, 1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(1024, generator=gen))
    streams = [None if stream is None else stream.clone() for _ in range(3)]
    fused = norm(x, streams[0], impl="triton")
    rows = add_rms_norm(x, streams[1], norm.weight, 1e-6) if residual else rms_norm(x, norm.weight, 1e-6)  # the norm's own kernel
    two = FP8Rows(*quantize_activations(rows, 128, pad_rows_to=4, impl="triton"), 6)
    assert isinstance(fused, FP8Rows) and fused.shape == (6, 1024) and fused.q.shape == (8, 1024) and fused.scale.shape == (8, 8)
    assert torch.equal(fused.q.view(torch.uint8), two.q.view(torch.uint8)) and torch.equal(fused.scale, two.scale)
    assert not fused.q[6:].float().any()
    if residual:
        assert torch.equal(streams[0], streams[1]) and torch.equal(streams[0], stream + x.float())
    plain = norm(x, streams[2], impl="torch")
    torch.testing.assert_close(plain.scale, fused.scale, rtol=1e-2, atol=0)


def test_fp8_linear_takes_rows_quantized_once_and_refuses_other_widths(monkeypatch):
    """An FP8 linear given :class:`FP8Rows` runs its GEMM on them as they are (torch's, emulated): the
    output of quantizing the input itself; rows of another width are refused, naming both."""
    fp8_emulation.install(monkeypatch)
    linear = FP8Linear(256, 48, device="cpu")
    q, scale = block_quantize(torch.randn(48, 256))
    linear.weight.data, linear.weight_scale_inv.data = q, scale
    x = torch.randn(5, 256).to(torch.bfloat16)
    rows = FP8Rows(*quantize_activations(x, 128, pad_rows_to=4), 5)
    assert torch.equal(linear(rows), linear(x))
    with pytest.raises(ValueError, match="FP8Linear of 256 inputs got quantized rows of 128"):
        linear(FP8Rows(*quantize_activations(x[:, :128], 128, pad_rows_to=4), 5))


def test_bad_quantization_groups_are_refused():
    with pytest.raises(ValueError, match="K \\(200\\) to be a multiple"):
        quantize_activations(torch.randn(4, 200), 128)


def test_fp8_linear_refuses_shapes_torchs_gemm_gets_wrong():
    """K/128 not a multiple of 4 with N over one block: torch refuses the padded scale layout and computes
    wrong results with the exact one (benchmarks/probes/probe_fp8_scale_layout.py); such layers stay bf16."""
    from workers.model import fp8_shard_aligned

    assert block_gemm_shape_ok(7168, 2304) and block_gemm_shape_ok(256, 48) and not block_gemm_shape_ok(2304, 7168)
    with pytest.raises(ValueError, match="FP8Linear of 2304 -> 7168: .* in_features % 512 == 0"):
        FP8Linear(2304, 7168, device="meta")  # DeepSeek-V3's dense down_proj at TP=8
    assert not fp8_shard_aligned(torch.nn.Linear(2304, 7168, device="meta"), 1, 8)
    assert fp8_shard_aligned(torch.nn.Linear(4608, 7168, device="meta"), 1, 4)


# ---- on a GPU: the kernel and torch's GEMMs --------------------------------------------------------------
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "group,silu_mul,weighted,scattered",
    [(128, False, False, False), (128, True, False, False), (7168, False, False, False), (2048, True, True, False),
     (7168, False, False, True)],
)  # fmt: skip
def test_triton_quantization_equals_torch(group, silu_mul, weighted, scattered):
    width = group if group != 128 else 7168
    x = torch.randn(1000, 2 * width if silu_mul else width, device="cuda").to(torch.bfloat16) * 3
    weight = torch.rand(1000, device="cuda") if weighted else None
    kw = {"pad_rows_to": 4, "silu_mul": silu_mul, "row_weight": weight}
    if scattered:  # each row to 8 places of 8000, as a token's row goes to its experts' pairs
        kw = {"scatter_to": torch.randperm(8000, device="cuda").view(1000, 8), "scatter_rows": 8000}
    got = quantize_activations(x, group, impl="triton", **kw)
    ref = quantize_activations(x, group, impl="torch", **kw)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0)
    mismatched = (got[0].float() != ref[0].float()).float().mean().item()
    assert mismatched < 1e-3  # a value at a rounding tie may land either side
    assert _relative(got[0].float(), ref[0].float()) < 1e-2


@gpu
@pytest.mark.gpu
def test_the_norm_quantized_in_its_pass_equals_torch():
    """``FP8RMSNorm``'s kernel on the GPU against the norm and the quantization in torch ops, at V3's
    width with the decoder's float32 residual stream."""
    x = torch.randn(1000, 7168, device="cuda").to(torch.bfloat16)
    stream = torch.randn(1000, 7168, device="cuda") * 4
    norm = FP8RMSNorm(7168, 1e-6, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(7168, device="cuda"))
    streams = [stream.clone(), stream.clone()]
    got, ref = norm(x, streams[0], impl="triton"), norm(x, streams[1], impl="torch")
    assert torch.equal(streams[0], streams[1])
    torch.testing.assert_close(got.scale, ref.scale, rtol=1e-2, atol=0)
    assert (got.q.float() != ref.q.float()).float().mean().item() < 1e-3
    assert _relative(got.q.float(), ref.q.float()) < 1e-2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(7168, 1536), (2112, 7168), (7168, 16384), (32, 256)])  # N x K; K/128 = 12, 56, 128, 2
def test_fp8_linear_on_torchs_block_scaled_gemm(shape):
    n, k = shape
    linear = FP8Linear(k, n, device="cuda")
    q, scale = block_quantize(torch.randn(n, k, device="cuda") * 0.02)
    linear.weight.copy_(q)
    linear.weight_scale_inv.copy_(scale)
    x = torch.randn(333, k, device="cuda").to(torch.bfloat16)
    got = linear(x)
    reference = x.float() @ linear.dequantized().t()
    assert got.shape == (333, n) and _relative(got, reference) < 0.04
    xq, xs = quantize_activations(x, 128, pad_rows_to=4)
    scale_b = linear.weight_scale_inv.t()
    emulated = fp8_emulation.scaled_mm(xq.cpu(), linear.weight.cpu().t(), xs.t().cpu(), scale_b.cpu(), torch.float32)
    assert _relative(got.cpu(), emulated[:333]) < 1e-2  # the emulation computes what torch does


@gpu
@pytest.mark.gpu
def test_fp8_experts_on_torchs_grouped_gemm():
    experts = Experts(8, 512, 256, dtype=torch.bfloat16, fp8=True, device="cuda")
    w13, w2 = torch.randn(8, 512, 512, device="cuda") * 0.05, torch.randn(8, 512, 256, device="cuda") * 0.05
    q13, s13 = requantize_rows(w13)
    q2, s2 = requantize_rows(w2)
    for param, value in zip(experts.parameters(), (q13, q2, s13, s2)):  # gate_up, down, their scales
        param.copy_(value)
    counts = torch.tensor([0, 17, 64, 1, 0, 90, 33, 3], device="cuda")
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 512, device="cuda").to(torch.bfloat16)
    weights = torch.rand(x.shape[0], device="cuda")
    got = experts(experts.prepare(x), weights, offs)
    reference, start = [], 0
    for e, count in enumerate(counts.tolist()):
        rows = x[start : start + count].float()
        gate_up = rows @ (q13[e].float() * s13[e][:, None]).t()
        h = torch.nn.functional.silu(gate_up[:, :256]) * gate_up[:, 256:] * weights[start : start + count, None]
        reference.append(h @ (q2[e].float() * s2[e][:, None]).t())
        start += count
    assert _relative(got, torch.cat(reference)) < 0.06


@gpu
@pytest.mark.gpu
def test_router_logits_in_float32_from_bf16_inputs():
    from workers.moe import Router

    config = MoEConfig(n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=8, scoring_func="softmax", topk_method="greedy")
    router = Router(config, 2048, dtype=torch.bfloat16, device="cuda")
    router.weight.copy_(torch.randn(64, 2048, device="cuda") * 0.02)
    x = torch.randn(4096, 2048, device="cuda").to(torch.bfloat16)
    weights, ids = router(x)
    ref_weights, ref_ids = router.cpu()(x.cpu())
    assert (ids.cpu().sort(1).values == ref_ids.sort(1).values).float().mean() > 0.999


@pytest.mark.parametrize("wide", [False, True])
def test_the_wide_truth_checkpoint_is_the_one_whose_every_linear_the_pool_runs_in_fp8(wide):
    """``bench_vllm_truth.py --wide``: at the narrow widths torch's block-scaled GEMM does not take four of
    the linears (they stay bf16 in the pool while vLLM runs them in FP8); at the wide ones it takes all."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(vllm_checkpoint_config(wide=wide))
    linears = {name.split(".", 3)[-1]: module for name, module in model.named_modules() if isinstance(module, nn.Linear) and name != "lm_head"}
    bf16 = sorted(name for name, module in linears.items() if not fp8_shard_aligned(module, None, 1))
    narrow = ["mlp.down_proj", "mlp.gate_proj", "mlp.shared_experts.down_proj", "mlp.up_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj"]
    assert len(linears) >= 10 and bf16 == ([] if wide else narrow)
