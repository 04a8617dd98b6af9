"""MoE layers: routing and whole models against transformers (V3 and V2 routing, DeepSeek's FP8 format),
expert parallelism in worker processes (gloo) against the single-process model, checkpoint loading
of experts, and the refusals of bad configs and checkpoints."""

import json
import logging
import sys

import fp8_emulation
import numpy as np
import pytest
import torch
from hf_models import save_fp8, tiny_fp8_moe, tiny_moe, write_vllm_checkpoint
from safetensors.torch import load_file, save_file
from spmd import build_moe_layer, emulated_fp8, moe_layer_input, moe_layer_ranks, run_workers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import RMSNorm, plan_prefill_batch
from configs.model import EP_SCHEDULES, MoEConfig, load_model_config, model_config_from_dict
from configs.pool import PoolConfig
from workers import fp8 as fp8_module
from workers import model as model_module
from workers.fp8 import FP8Linear, FP8RMSNorm, block_dequantize
from workers.model import DeepseekPrefillModel, merged_parts
from workers.expert_parallel import EPGroup, sm_carveout
from workers import deepgemm
from workers.moe import Experts, gather_sum, route
from workers.pcp_layout import interleave_shards
from workers.weights import check_checkpoint, load_weights
from workers.fp8_choice import fp8_gemm_for

PROMPT_LENS = (1, 47, 130, 200)
LOAD_DEEP_GEMM = deepgemm.load  # the real one: spmd.emulated_fp8 puts a stand-in there for good


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, transformers reference): V3 routing, V2 routing, V3 in FP8 (hidden 256:
    two 128-column blocks; most rows partial blocks)."""
    out = {}
    for name, family in (("v3", "v3"), ("v2", "v2")):
        path = tmp_path_factory.mktemp(name)
        model = tiny_moe(family, seed=3)
        model.save_pretrained(path)
        out[name] = (path, model)
    path, reference = tmp_path_factory.mktemp("v3-fp8"), tmp_path_factory.mktemp("v3-fp8-dequantized")
    out["v3-fp8"] = (path, save_fp8(tiny_fp8_moe(seed=4), path, reference))
    return out


@pytest.fixture(scope="module")
def prompts():
    gen = np.random.default_rng(0)
    return [gen.integers(0, 320, size=n).astype(np.int32) for n in PROMPT_LENS]


def _ours(path, **kw):
    model = DeepseekPrefillModel.create(load_model_config(path), TorchSDPAPrefillBackend, **{"dtype": torch.float32, **kw})
    load_weights(model, path)
    return model


def _transformers_logits(hf, prompts):
    with torch.no_grad():
        return torch.stack([hf(torch.from_numpy(p.astype(np.int64))[None]).logits[0, -1] for p in prompts])


# ---- routing ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["v3", "v2"])
def test_routing_equals_transformers_router(family):
    hf = tiny_moe(family, seed=5)
    router = hf.model.layers[1].mlp.gate
    assert isinstance(router, DeepseekV3TopkRouter if family == "v3" else DeepseekV2TopkRouter)
    config = load_model_config_from(hf).moe
    x = torch.randn(500, 64)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    bias = router.e_score_correction_bias if family == "v3" else None
    if family == "v3":
        assert bias.abs().max() > 0.1  # the bias is really used to choose
    weights, ids = route(logits, config, bias)
    order, hf_order = ids.argsort(dim=1), hf_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


def load_model_config_from(hf):
    return model_config_from_dict(hf.config.to_dict(), name="hf")


def test_v2_routing_normalizes_or_scales_but_not_both():
    """DeepSeek-V2's rule (transformers has no norm_topk_prob for V2): normalized weights are not scaled."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    base = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, scoring_func="softmax",
                topk_method="greedy", routed_scaling_factor=3.0)  # fmt: skip
    p = logits.softmax(-1)[0, :2]
    weights, _ = route(logits, MoEConfig(**base, norm_topk_prob=False))
    torch.testing.assert_close(weights.sort(descending=True).values[0], p * 3.0)
    weights, _ = route(logits, MoEConfig(**base, norm_topk_prob=True))
    torch.testing.assert_close(weights.sort(descending=True).values[0], p / p.sum())



ROUTING_CASES = {
    **{name: load_model_config(name).moe for name in ("deepseek-v3", "deepseek-v2", "deepseek-v2-lite", "kimi-k2")},
    "v2-normalized": MoEConfig(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=8, scoring_func="softmax",
                               topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=3.0),  # normalized, so never scaled (DeepSeek-V2's rule)
    "three-groups": MoEConfig(n_routed_experts=12, num_experts_per_tok=2, moe_intermediate_size=8, n_group=3, topk_group=2,
                              routed_scaling_factor=2.5),
}  # fmt: skip


@pytest.mark.parametrize("name", ROUTING_CASES)
@pytest.mark.parametrize("device", ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else []))
def test_triton_routing_equals_torch(name, device):
    """The routing kernel (Triton's interpreter on CPU) chooses the same experts with the same weights
    as the torch ops, for every built-in family's rules and a group count that is not a power of two."""
    config = ROUTING_CASES[name]
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(37, config.n_routed_experts, generator=gen) * 2).to(device)  # not a multiple of the kernel's block
    bias = (torch.randn(config.n_routed_experts, generator=gen) * 0.5).to(device) if config.topk_method == "noaux_tc" else None
    weights, ids = route(logits, config, bias, impl="torch")
    got_weights, got_ids = route(logits, config, bias, impl="triton")
    assert got_ids.dtype == torch.int64 and got_weights.dtype == torch.float32
    order, got_order = ids.argsort(dim=1), got_ids.argsort(dim=1)
    assert torch.equal(got_ids.gather(1, got_order), ids.gather(1, order))
    torch.testing.assert_close(got_weights.gather(1, got_order), weights.gather(1, order), rtol=1e-6, atol=1e-7)
    empty = route(logits[:0], config, bias, impl="triton")
    assert empty[0].shape == empty[1].shape == (0, config.num_experts_per_tok)

@pytest.mark.parametrize(
    "impl,device,dtype",
    [("torch", "cpu", torch.float32), ("triton", "cpu", torch.float32)]
    + ([pytest.param("triton", "cuda", torch.bfloat16, marks=pytest.mark.gpu)] if torch.cuda.is_available() else []),
)
def test_gather_sum_adds_the_indexed_rows_in_float32(impl, device, dtype):
    rows = 300 if device == "cuda" else 48  # Triton's interpreter runs a program at a time: 14 s for 300 rows on the CPU
    src = torch.randn(500, 1100, device=device).to(dtype)  # a width that is not a multiple of the kernel's block
    index = torch.randint(-1, 500, (rows, 8), device=device)
    index[7] = -1  # a row with nothing to add
    expected = torch.stack([sum((src[i].double() for i in row if i >= 0), torch.zeros(1100, dtype=torch.float64, device=device))
                            for row in index.tolist()])  # fmt: skip
    got = gather_sum(src, index, torch.float32, impl=impl)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[7], torch.zeros(1100, device=device))
    # with rows added in the same pass (the shared experts'), rounded once to the output's dtype
    add = torch.randn(rows, 1100, device=device).to(dtype)
    got = gather_sum(src, index, dtype, add=add, impl=impl)
    exact = expected + add.double()
    assert got.dtype == dtype and torch.equal(got[7], add[7])
    torch.testing.assert_close(got.double(), exact.to(dtype).double(), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 8e-3)
    with pytest.raises(ValueError, match=rf"add must be a \[{rows}, 1100\] tensor"):
        gather_sum(src, index, dtype, add=add[:10], impl="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_one_rank_runs_the_moe_layer_without_waiting_for_the_gpu(fp8):
    """On one rank no step of the MoE layer (routing, sorting the pairs, the grouped GEMMs, the sums, the
    shared experts added in the routed sum's pass) copies to the host or synchronizes: the host stays
    ahead and the GPU never idles between kernels."""
    from workers.fp8 import requantize_rows
    from workers.model import DenseMLP
    from workers.moe import MoE

    config = load_model_config("deepseek-v3").moe
    shared = DenseMLP(1024, 256, dtype=torch.bfloat16, device="cuda")
    moe = MoE(config, 1024, dtype=torch.bfloat16, fp8=fp8, shared_experts=shared, device="cuda")
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, device="cuda") * 0.05)  # FP8 experts are set below
        if fp8:
            for name in ("gate_up_proj", "down_proj"):
                q, scale = requantize_rows(torch.randn(getattr(moe.experts, name).shape, device="cuda") * 0.05)
                getattr(moe.experts, name).copy_(q)
                getattr(moe.experts, f"{name}_scale").copy_(scale)
        x = torch.randn(3000, 1024, device="cuda").to(torch.bfloat16)
        expected = moe.routed(x), moe(x)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = moe.routed(x), moe(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with torch.no_grad():
        routed, rows = got[0].float(), shared(x).float()
    # the routed sum and the shared rows, rounded once: within a bf16 step of each part of the sum
    assert ((got[1].float() - (routed + rows)).abs() <= torch.finfo(torch.bfloat16).eps * (routed.abs() + rows.abs())).all()


# ---- whole models, one process ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["v3", "v2", "v3-fp8"])
def test_moe_model_logits_equal_transformers(checkpoints, prompts, name):
    path, hf = checkpoints[name]
    ours = _ours(path)
    out = ours(torch.from_numpy(np.concatenate(prompts).astype(np.int64)), plan_prefill_batch([len(p) for p in prompts]))
    torch.testing.assert_close(out.logits, _transformers_logits(hf, prompts), atol=1e-5, rtol=1e-5)


def test_fp8_gemm_path_keeps_the_checkpoint_format(checkpoints, prompts, monkeypatch):
    """With FP8 GEMMs (torch's, emulated on the CPU with their layout checks) the linear layers hold the
    checkpoint's own FP8 bytes and block scales, the experts one FP8 scale per output row, and the
    logits stay within FP8's error of transformers on the dequantized weights."""
    fp8_emulation.install(monkeypatch)
    path, hf = checkpoints["v3-fp8"]
    model = _ours(path, dtype=torch.bfloat16, fp8=True)
    stored = load_file(path / "model.safetensors")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    # the dense MLP's gate_up_proj (gate_proj over up_proj, on a block boundary) and down_proj, and each
    # layer's q_a_proj (48 rows: one partial 128-row block); torch's FP8 GEMM needs N % 16 == 0, so
    # kv_a_proj_with_mqa's 40 rows stay bf16, and so does the shared experts' stack of 32 + 32 rows
    assert sorted(linears) == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj"] + [
        f"model.layers.{i}.self_attn.q_a_proj" for i in range(3)
    ]
    for name, module in linears.items():
        parent = name.rpartition(".")[0]
        parts = [f"{parent}.{part}" for part, _ in merged_parts(model, name)] or [name]
        weight = torch.cat([stored[part + ".weight"].view(torch.uint8) for part in parts])
        assert torch.equal(module.weight.view(torch.uint8), weight), name
        assert torch.equal(module.weight_scale_inv, torch.cat([stored[part + ".weight_scale_inv"] for part in parts])), name
    experts = model.model.layers[2].mlp.experts
    for e in range(16):
        prefix = f"model.layers.2.mlp.experts.{e}.down_proj.weight"
        reference = block_dequantize(stored[prefix], stored[prefix + "_scale_inv"], torch.float32)
        requantized = experts.down_proj[e].float() * experts.down_proj_scale[e][:, None]
        assert ((requantized - reference).abs() <= reference.abs().amax(1, keepdim=True) / 16).all()  # FP8 rounding
    out = model(torch.from_numpy(np.concatenate(prompts).astype(np.int64)), plan_prefill_batch([len(p) for p in prompts]))
    expected = _transformers_logits(hf, prompts)
    assert (out.logits - expected).abs().max() < 0.05 * expected.abs().max()
    assert torch.equal(out.logits.argmax(-1), expected.argmax(-1))


@pytest.fixture(scope="module")
def wide_fp8_checkpoint(tmp_path_factory):
    """A V3 FP8 checkpoint at the wide widths (hidden 1024, q LoRA 512): every attention linear is one
    torch's block-scaled GEMM takes, so each layer's input_layernorm writes FP8 rows."""
    path = tmp_path_factory.mktemp("wide") / "v3"
    write_vllm_checkpoint(path, fp8=True, wide=True, seed=2)
    return path


def test_norms_read_only_by_fp8_linears_quantize_their_rows_once_for_them(wide_fp8_checkpoint, monkeypatch):
    """At the wide widths every attention linear runs in FP8 (torch's GEMMs, emulated): each layer's
    ``input_layernorm`` (read by ``q_a_proj`` and ``kv_a_proj_with_mqa``) and ``q_a_layernorm``
    (``q_b_proj``) write FP8 rows, quantized once per layer where the two readers each quantized the
    norm's bf16 rows, and so does the dense layer's ``post_attention_layernorm`` (``gate_up_proj``);
    ``kv_a_layernorm`` (the cached rows) and a MoE layer's ``post_attention_layernorm`` (the router
    reads it) stay bf16. The same FP8 values reach the GEMMs: the logits are those of the model
    without it, bit for bit."""
    fp8_emulation.install(monkeypatch)
    path = wide_fp8_checkpoint
    gen = np.random.default_rng(3)
    prompts = [gen.integers(0, 508, size=n) for n in (1, 37, 90)]
    tokens, plan = torch.from_numpy(np.concatenate(prompts).astype(np.int64)), plan_prefill_batch([len(p) for p in prompts])
    quantized = fp8_module.quantize_activations
    calls = []
    monkeypatch.setattr(fp8_module, "quantize_activations", lambda *a, **kw: calls.append(a[0].shape[1]) or quantized(*a, **kw))
    logits, counts = {}, {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(model_module, "quantizing", lambda norm: norm)
        model = _ours(path, dtype=torch.bfloat16, fp8=True)
        norms = {name for name, m in model.named_modules() if isinstance(m, FP8RMSNorm)}
        expected = {f"model.layers.{i}.{n}" for i in range(3) for n in ("input_layernorm", "self_attn.q_a_layernorm")} | {"model.layers.0.post_attention_layernorm"}
        assert norms == (expected if fused else set())
        assert sum(isinstance(m, RMSNorm) for m in model.modules()) == 13  # 4 a layer and the final norm
        calls.clear()
        logits[fused] = model(tokens, plan).logits
        counts[fused] = calls.count(1024)  # quantizations of the hidden width: the attention's input
    assert torch.equal(logits[True], logits[False])
    assert counts[False] - counts[True] == 3, counts  # one a layer fewer


def test_deep_gemms_layout_starts_each_experts_rows_on_its_alignment_and_marks_the_padding():
    counts = [3, 0, 130, 1]  # an expert without pairs, one over a block, one of a single pair
    layout = deepgemm.Layout.of(torch.tensor(counts).cumsum(0).to(torch.int32), sum(counts), 128)
    at, m_indices = layout.at, layout.m_indices
    assert at.tolist() == [0, 1, 2, *range(128, 258), 384]
    expected = torch.full((768,), -1, dtype=torch.int32)  # ceil((134 + 4 * 127) / 128) blocks: the worst case, known without a sync
    expected[0:3], expected[128:258], expected[384] = 0, 2, 3
    assert torch.equal(m_indices, expected)
    empty = deepgemm.Layout.of(torch.zeros(4, dtype=torch.int32), 0, 128)
    at, m_indices = empty.at, empty.m_indices
    assert at.numel() == 0 and m_indices.numel() == 512 and bool((m_indices == -1).all())


@pytest.fixture(scope="module")
def blocks_checkpoint(tmp_path_factory):
    """A V3 FP8 checkpoint whose experts are whole 128x128 blocks (hidden 256, expert width 128), and
    transformers on its dequantized weights."""
    path = tmp_path_factory.mktemp("blocks") / "v3"
    return path, write_vllm_checkpoint(path, fp8=True, seed=5)


def test_deep_gemm_experts_keep_the_checkpoints_blocks(blocks_checkpoint, monkeypatch):
    """With fp8_gemm 'deep_gemm' (DeepGEMM emulated on the CPU with its layout checks) the experts hold
    the checkpoint's own FP8 bytes and 128x128 block scales, not rows requantized: a MoE layer is closer
    to the float32 truth (transformers on the dequantized weights) than with torch's row-wise grouped
    GEMM (3.4% against 5.1% relative L2 here), and the model's logits agree with it."""
    fp8_emulation.install(monkeypatch)
    path, hf = blocks_checkpoint
    gen = np.random.default_rng(1)
    prompts = [gen.integers(0, 508, size=n).astype(np.int32) for n in (1, 40, 200)]
    expected = _transformers_logits(hf, prompts)
    tokens, plan = torch.from_numpy(np.concatenate(prompts).astype(np.int64)), plan_prefill_batch([len(p) for p in prompts])
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        truth = hf.model.layers[1].mlp(x[None])[0]
    models, layer_errors = {}, {}
    for gemm in ("deep_gemm", "torch"):
        models[gemm] = _ours(path, dtype=torch.bfloat16, fp8=True, fp8_gemm=gemm)
        logits = models[gemm](tokens, plan).logits
        assert torch.equal(logits.argmax(-1), expected.argmax(-1)), gemm
        assert ((logits - expected).norm() / expected.norm()).item() < 0.05, gemm
        with torch.no_grad():
            layer = models[gemm].model.layers[1].mlp(x.to(torch.bfloat16)).float()
        layer_errors[gemm] = ((layer - truth).norm() / truth.norm()).item()
    assert layer_errors["deep_gemm"] < 0.8 * layer_errors["torch"], layer_errors
    # the linear layers of whole 128x128 blocks run on DeepGEMM's dense GEMM (the stand-in checks its layouts), on the same bytes
    dense = {name: type(m).__name__ for name, m in models["deep_gemm"].named_modules() if isinstance(m, FP8Linear)}
    assert dense == {name: "DeepGEMMLinear" for name, m in models["torch"].named_modules() if isinstance(m, FP8Linear)}, dense
    assert "model.layers.0.self_attn.o_proj" in dense and "model.layers.0.self_attn.q_a_proj" in dense
    stored = load_file(path / "model.safetensors")
    for layer in (1, 2):
        experts = models["deep_gemm"].model.layers[layer].mlp.experts
        assert experts.block and not models["torch"].model.layers[layer].mlp.experts.block
        for e in range(16):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            for part, rows in (("gate_proj", slice(0, 128)), ("up_proj", slice(128, 256))):
                assert torch.equal(experts.gate_up_proj[e, rows].view(torch.uint8), stored[f"{prefix}.{part}.weight"].view(torch.uint8))
                assert torch.equal(experts.gate_up_proj_scale[e, rows.start // 128 : rows.stop // 128], stored[f"{prefix}.{part}.weight_scale_inv"])
            assert torch.equal(experts.down_proj[e].view(torch.uint8), stored[f"{prefix}.down_proj.weight"].view(torch.uint8))
            assert torch.equal(experts.down_proj_scale[e], stored[f"{prefix}.down_proj.weight_scale_inv"])


def test_deep_gemm_is_refused_where_it_cannot_run_naming_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="fp8_gemm 'cutlass' is not one of auto, torch, deep_gemm"):
        PoolConfig(fp8_gemm="cutlass")
    with pytest.raises(ValueError, match="hidden 256 and expert width 96 must be multiples of 128"):
        Experts(4, 256, 96, dtype=torch.bfloat16, fp8=True, gemm="deep_gemm", device="meta")
    with pytest.raises(ValueError, match="DeepGEMM writes bfloat16 and needs whole 128x128 blocks"):
        deepgemm.DeepGEMMLinear(512, 48, device="meta")  # q_a_proj of a 48-wide LoRA: torch's GEMM runs it
    with pytest.raises(ValueError, match="MoE GEMM 'cutlass' is not one of torch, deep_gemm"):
        Experts(4, 256, 128, dtype=torch.bfloat16, fp8=True, gemm="cutlass", device="meta")
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # not installed
    with pytest.raises(RuntimeError, match="needs DeepGEMM, the package deep_gemm .* Or use fp8_gemm 'torch'"):
        LOAD_DEEP_GEMM()


def test_auto_takes_deep_gemm_where_it_imports_and_the_experts_are_whole_blocks(checkpoints, blocks_checkpoint, monkeypatch, caplog):
    """fp8_gemm 'auto' (the default) resolves in the worker, which says what it took and why; a model
    whose weights are dequantized here has no FP8 GEMMs at all."""

    def resolve(path, fp8=True, **config):
        return fp8_gemm_for(PoolConfig(checkpoint=str(path), **config), load_model_config(path), fp8, announce=True)

    fp8_emulation.install(monkeypatch)  # DeepGEMM's stand-in imports
    caplog.set_level(logging.INFO, logger="workers.fp8_choice")
    assert resolve(blocks_checkpoint[0]) == "deep_gemm"
    assert "FP8 GEMMs run by deep_gemm (auto: DeepGEMM is here)" in caplog.text
    assert resolve(checkpoints["v3-fp8"][0]) == "torch"  # its experts are 512 x 32: not whole blocks
    assert resolve(blocks_checkpoint[0], fp8_gemm="torch") == "torch"
    assert resolve(blocks_checkpoint[0], fp8=False) is None
    monkeypatch.setattr(deepgemm, "load", LOAD_DEEP_GEMM)
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # not installed
    assert resolve(blocks_checkpoint[0]) == "torch"
    assert "FP8 GEMMs run by torch (auto: DeepGEMM is not here" in caplog.text
    with pytest.raises(RuntimeError, match="needs DeepGEMM"):
        resolve(blocks_checkpoint[0], fp8_gemm="deep_gemm")  # asked for by name: the worker does not start


# ---- expert parallelism in worker processes --------------------------------------------------------
@pytest.mark.parametrize(
    "name,tp,pcp,schedule",
    [
        pytest.param("v3", 2, 1, "two-micro-batches", id="v3-tp2-two-micro-batches"),
        pytest.param("v3", 2, 1, "local-first", id="v3-tp2-local-first"),
        pytest.param("v2", 1, 2, "all-to-all", id="v2-pcp2"),
        pytest.param("v3", 2, 2, "two-micro-batches", id="v3-tp2xpcp2-two-micro-batches"),
        pytest.param("v3", 2, 2, "local-first", id="v3-tp2xpcp2-local-first"),
        pytest.param("v3-fp8", 1, 3, "all-to-all", id="v3-fp8-dequantized-pcp3-uneven-experts"),
        pytest.param("v3-fp8", 1, 3, "local-first", id="v3-fp8-dequantized-pcp3-local-first"),
    ],
)
def test_expert_parallel_workers_equal_one_process(checkpoints, prompts, name, tp, pcp, schedule):
    path, _ = checkpoints[name]
    config = PoolConfig(checkpoint=str(path), tp=tp, pcp=pcp, device="cpu", chunk_tokens=48, block_size=8, kv_cache_tokens=1024,
                        ep_schedule=schedule)  # fmt: skip
    got = run_workers(config, prompts, 48)
    assert all(r.ep_schedules == {schedule} for r in got)
    reference = _ours(path)
    k = reference.config.moe.num_experts_per_tok
    for i, prompt in enumerate(prompts):
        out = reference(torch.from_numpy(prompt.astype(np.int64)), plan_prefill_batch([len(prompt)]))
        torch.testing.assert_close(torch.from_numpy(got[0].logits[f"r{i}"]), out.logits[0], atol=2e-5, rtol=1e-5)
        kv = interleave_shards([torch.from_numpy(got[p * tp].kv[f"r{i}"]) for p in range(pcp)], config.block_size)
        torch.testing.assert_close(kv, torch.stack(out.latents), atol=2e-5, rtol=1e-5)
    experts = [r.experts for r in got]
    assert experts[0][0] == 0 and experts[-1][1] == 15 and all(a[1] + 1 == b[0] for a, b in zip(experts, experts[1:]))
    for layer in (1, 2):  # every (token, expert) pair computed exactly once, somewhere
        assert sum(r.moe_load[layer] for r in got) == sum(PROMPT_LENS) * k


def test_ranks_left_without_tokens_route_nothing_and_wait_for_the_others(checkpoints):
    """A 1-token prompt alone on a 2x2 grid: one TP rank of each PCP rank and the whole second PCP rank
    have no tokens in a MoE layer (grouped V3 routing of zero tokens failed before), then a prompt
    whose last chunk is one token; both equal the single process."""
    path, _ = checkpoints["v3"]
    config = PoolConfig(checkpoint=str(path), tp=2, pcp=2, device="cpu", chunk_tokens=48, block_size=8, kv_cache_tokens=1024,
                        ep_schedule="local-first")  # fmt: skip
    reference = _ours(path)
    for prompt in (np.array([5], dtype=np.int32), np.arange(49, dtype=np.int32)):
        got = run_workers(config, [prompt], 48)
        out = reference(torch.from_numpy(prompt.astype(np.int64)), plan_prefill_batch([len(prompt)]))
        torch.testing.assert_close(torch.from_numpy(got[0].logits["r0"]), out.logits[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [[37, 0, 5], [300, 1]], ids=["3-ranks-one-empty", "2-ranks-uneven"])
def test_every_ep_schedule_equals_one_rank_holding_all_experts(tokens):
    """One MoE layer (V3 routing with a bias, a shared expert) over 2 and 3 gloo ranks (16 experts: 5/5/6
    on 3), a rank with no tokens and one with a single token: each schedule's routed sum and whole layer
    equal the layer on one rank, and every (token, expert) pair is computed once."""
    config = MoEConfig(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
                       n_group=4, topk_group=2, routed_scaling_factor=2.5)  # fmt: skip
    hidden = 64
    got = moe_layer_ranks(config, hidden, tokens)
    whole = build_moe_layer(config, hidden, EPGroup())
    for rank, n in enumerate(tokens):
        x = moe_layer_input(rank, n, hidden)
        with torch.no_grad():
            routed, layer = whole.routed(x), whole(x)
        assert set(got[rank]) == set(EP_SCHEDULES)
        for schedule, (r, f, _) in got[rank].items():
            torch.testing.assert_close(r, routed, atol=1e-5, rtol=1e-5, msg=f"{schedule}, rank {rank}: routed")
            torch.testing.assert_close(f, layer, atol=1e-5, rtol=1e-5, msg=f"{schedule}, rank {rank}: layer")
    for schedule in EP_SCHEDULES:  # two calls (routed, then the layer) per rank
        assert sum(ranks[schedule][2] for ranks in got) == 2 * sum(tokens) * config.num_experts_per_tok, schedule


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_one_rank_adds_the_shared_experts_in_the_routed_sums_pass(impl, monkeypatch):
    """On one rank the layer's output is the shared experts' rows added into the routed sum's own float32
    pass (``gather_sum``'s ``add``), rounded once: in float32 it equals ``routed + shared``; in bf16 it is
    the exact sum of the pair rows and the shared rows rounded once; each (token, expert) pair is computed once."""
    import workers.moe as moe_module

    config = MoEConfig(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
                       n_group=4, topk_group=2, routed_scaling_factor=2.5)  # fmt: skip
    layer = build_moe_layer(config, 64, EPGroup())
    original, calls = moe_module.gather_sum, []

    def gather_sum(src, index, dtype, **kw):
        calls.append((src, index, kw.get("add")))
        return original(src, index, dtype, **{**kw, "impl": impl})

    monkeypatch.setattr(moe_module, "gather_sum", gather_sum)
    x = torch.randn(37, 64)
    with torch.no_grad():
        whole, pairs = layer(x), layer.pairs
        torch.testing.assert_close(whole, layer.routed(x) + layer.shared_experts(x), atol=1e-6, rtol=1e-6)
        assert pairs == 37 * config.num_experts_per_tok and calls[0][2] is not None and calls[1][2] is None
        layer.to(torch.bfloat16)
        calls.clear()
        whole = layer(x.to(torch.bfloat16))
    (src, index, add), = calls
    exact = torch.stack([sum((src[i].double() for i in row if i >= 0), add[t].double()) for t, row in enumerate(index.tolist())])
    assert whole.dtype == torch.bfloat16 and torch.equal(add, layer.shared_experts(x.to(torch.bfloat16)))
    torch.testing.assert_close(whole.double(), exact.to(torch.bfloat16).double(), atol=0, rtol=torch.finfo(torch.bfloat16).eps)
    if impl == "torch":  # Triton's interpreter truncates float32 to bf16 (a GPU rounds to nearest): within a step above
        # rounded once, all but those a float32 hair from a rounding boundary are the exact sum's bf16 (rounding the
        # routed sum first and then the sum matched on 74% of them)
        assert (whole == exact.to(torch.bfloat16)).float().mean() >= 0.99


def test_sm_carveout_is_set_only_around_cuda_work_and_restored():
    assert torch._C._get_sm_carveout_experimental() is None
    with sm_carveout(16, torch.device("cuda")):
        assert torch._C._get_sm_carveout_experimental() == 16
        with sm_carveout(8, torch.device("cuda")):
            assert torch._C._get_sm_carveout_experimental() == 8
        assert torch._C._get_sm_carveout_experimental() == 16
    assert torch._C._get_sm_carveout_experimental() is None
    with sm_carveout(16, torch.device("cpu")), sm_carveout(0, torch.device("cuda")):
        assert torch._C._get_sm_carveout_experimental() is None
    with pytest.raises(RuntimeError, match="boom"), sm_carveout(16, torch.device("cuda")):
        raise RuntimeError("boom")
    assert torch._C._get_sm_carveout_experimental() is None


def test_bad_ep_schedules_and_carveouts_are_refused_with_the_value():
    with pytest.raises(ValueError, match="ep_schedule 'overlap' is not one of all-to-all, local-first, two-micro-batches"):
        PoolConfig(ep_schedule="overlap")
    with pytest.raises(ValueError, match="ep_comm_sms must be an integer in 0..64, got -1"):
        PoolConfig(ep_comm_sms=-1)
    with pytest.raises(ValueError, match="EP schedule 'x' is not one of all-to-all, local-first, two-micro-batches"):
        build_moe_layer(MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1), 16,
                        EPGroup(), "x")  # fmt: skip


@pytest.mark.parametrize("schedule", EP_SCHEDULES)
def test_expert_parallel_fp8_gemms(checkpoints, prompts, schedule):
    """FP8 rows dispatched as bytes with their scales (emulated FP8 GEMMs, bfloat16) equal one process doing the same."""
    path, _ = checkpoints["v3-fp8"]
    config = PoolConfig(checkpoint=str(path), pcp=2, device="cpu", dtype="bfloat16", chunk_tokens=48, block_size=8, kv_cache_tokens=1024,
                        ep_schedule=schedule)  # fmt: skip
    got = run_workers(config, prompts, 48, prepare=emulated_fp8)
    assert all(r.ep_schedules == {schedule} for r in got)
    emulated_fp8()
    reference = _ours(path, dtype=torch.bfloat16, fp8=True)
    for i, prompt in enumerate(prompts):
        out = reference(torch.from_numpy(prompt.astype(np.int64)), plan_prefill_batch([len(prompt)]))
        torch.testing.assert_close(torch.from_numpy(got[0].logits[f"r{i}"]), out.logits[0], atol=2e-2, rtol=2e-2)


def test_context_parallel_workers_take_the_norms_fp8_rows(wide_fp8_checkpoint, prompts):
    """Two PCP workers (emulated FP8 GEMMs) on the checkpoint whose input norms write FP8 rows: each
    rank's share of the tokens goes through ``context_parallel_attention`` as FP8 rows, and the logits
    are one process's up to rounding (two ranks round attention's merge and the experts' sums
    otherwise, and FP8 quantization amplifies a bf16 step: at these widths the two differ by up to
    0.037 on logits of 1.3-2.2, 2.4% relative L2 on the one-token prompt, the same bit for bit with
    the norms' FP8 rows or without them). Rows mixed up between the ranks would differ by the logits' size."""
    config = PoolConfig(checkpoint=str(wide_fp8_checkpoint), pcp=2, device="cpu", dtype="bfloat16", chunk_tokens=48, block_size=8,
                        kv_cache_tokens=1024)  # fmt: skip
    got = run_workers(config, prompts, 48, prepare=emulated_fp8)
    emulated_fp8()
    reference = _ours(wide_fp8_checkpoint, dtype=torch.bfloat16, fp8=True)
    assert isinstance(reference.model.layers[1].input_layernorm, FP8RMSNorm)
    for i, prompt in enumerate(prompts):
        expected = reference(torch.from_numpy(prompt.astype(np.int64)), plan_prefill_batch([len(prompt)])).logits[0]
        logits = torch.from_numpy(got[0].logits[f"r{i}"])
        assert ((logits - expected).norm() / expected.norm()).item() < 0.05 and (logits - expected).abs().max().item() < 0.1, i


@pytest.mark.parametrize("schedule", ["local-first", "all-to-all"])
def test_expert_parallel_deep_gemm_experts(blocks_checkpoint, prompts, monkeypatch, schedule):
    """FP8 rows with their 1x128 scales dispatched between two workers (local-first: quantized straight
    into the dispatch and local pair rows; all-to-all: every row dispatched, then gathered into DeepGEMM's
    layout), DeepGEMM emulated, equal one process doing the same."""
    path, _ = blocks_checkpoint
    config = PoolConfig(checkpoint=str(path), pcp=2, device="cpu", dtype="bfloat16", chunk_tokens=48, block_size=8, kv_cache_tokens=1024,
                        ep_schedule=schedule, fp8_gemm="deep_gemm")  # fmt: skip
    got = run_workers(config, prompts, 48, prepare=emulated_fp8)
    assert [r.fp8_gemm for r in got] == ["deep_gemm", "deep_gemm"]
    fp8_emulation.install(monkeypatch)
    reference = _ours(path, dtype=torch.bfloat16, fp8=True, fp8_gemm="deep_gemm")
    for i, prompt in enumerate(prompts):
        out = reference(torch.from_numpy(prompt.astype(np.int64)), plan_prefill_batch([len(prompt)]))
        torch.testing.assert_close(torch.from_numpy(got[0].logits[f"r{i}"]), out.logits[0], atol=2e-2, rtol=2e-2)


# ---- loading ----------------------------------------------------------------------------------------------
def test_a_rank_reads_only_its_experts_files(checkpoints, tmp_path):
    """A checkpoint sharded by expert: EP rank 1 of 2 opens the files of its experts and the shared
    tensors, never the other rank's, and reads fewer bytes than the whole model."""
    path, _ = checkpoints["v3"]
    tensors = load_file(path / "model.safetensors")
    files = {"rest.safetensors": {}, "experts-0-7.safetensors": {}, "experts-8-15.safetensors": {}}
    for name, tensor in tensors.items():
        expert = int(name.split(".")[5]) if ".mlp.experts." in name else None
        file = "rest.safetensors" if expert is None else ("experts-0-7.safetensors" if expert < 8 else "experts-8-15.safetensors")
        files[file][name] = tensor
    weight_map = {}
    for file, part in files.items():
        save_file(part, tmp_path / file)
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model = DeepseekPrefillModel.create(load_model_config(tmp_path), TorchSDPAPrefillBackend, ep=EPGroup(1, 2), dtype=torch.float32)
    report = load_weights(model, tmp_path)
    assert report.files_opened == 2
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert report.bytes_read == total - sum(t.numel() * t.element_size() for t in files["experts-0-7.safetensors"].values())
    assert report.bytes_read == sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[0], tensors["model.layers.1.mlp.experts.8.down_proj.weight"])


def _edited(checkpoint, tmp_path, edit):
    tensors = load_file(checkpoint / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    return tmp_path


@pytest.mark.parametrize(
    "name,edit,message",
    [
        ("v3", lambda t: t.pop("model.layers.2.mlp.experts.11.up_proj.weight"),
         "missing 1 tensor(s) the model needs: model.layers.2.mlp.experts.11.up_proj.weight"),
        ("v3", lambda t: t.update({"model.layers.1.mlp.experts.3.down_proj.weight": torch.zeros(64, 31)}),
         r"model.layers.1.mlp.experts.3.down_proj.weight has shape [64, 31], the model expects [64, 32]"),
        ("v3", lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"),
         "model.layers.1.mlp.gate.e_score_correction_bias"),
        ("v3-fp8", lambda t: t.pop("model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"),
         "model.layers.1.mlp.shared_experts.up_proj.weight is FP8 but model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"),
        ("v3-fp8", lambda t: t.update({"model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(1, 1)}),
         "model.layers.0.self_attn.q_a_proj.weight_scale_inv has shape [1, 1], expected [1, 4]"),
    ],  # fmt: skip
)
def test_bad_checkpoints_name_the_tensor(checkpoints, tmp_path, name, edit, message):
    path = _edited(checkpoints[name][0], tmp_path, edit)
    meta = DeepseekPrefillModel.create(load_model_config(path), TorchSDPAPrefillBackend, device="meta")
    with pytest.raises(ValueError) as error:
        check_checkpoint(meta, path)
    assert message in str(error.value)
    model = DeepseekPrefillModel.create(load_model_config(path), TorchSDPAPrefillBackend, dtype=torch.float32)
    with pytest.raises(ValueError, match="model.layers"):  # the worker's loader refuses it too
        load_weights(model, path)


def test_fp8_weights_take_about_half_the_bytes():
    config = load_model_config("deepseek-v3", num_hidden_layers=4)
    meta = {fp8: DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, fp8=fp8, dtype=torch.bfloat16, device="meta")
            for fp8 in (False, True)}  # fmt: skip
    experts = 256 * 3 * 7168 * 2048
    assert meta[False].weight_bytes() - meta[True].weight_bytes() > experts  # the experts at 1 byte, not 2
    split = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, ep=EPGroup(0, 4), fp8=True, dtype=torch.bfloat16, device="meta")
    assert meta[True].weight_bytes() - split.weight_bytes() > 0.74 * experts  # a quarter of the experts per rank


# ---- refusals -----------------------------------------------------------------------------------------
MOE = {"n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2,
       "scoring_func": "sigmoid", "topk_method": "noaux_tc"}  # fmt: skip


@pytest.mark.parametrize(
    "change,message",
    [
        ({"scoring_func": "relu"}, "scoring_func 'relu' is not supported; valid: sigmoid, softmax"),
        ({"topk_method": "top2"}, "topk_method 'top2' is not supported; valid: greedy, group_limited_greedy, noaux_tc"),
        ({"n_group": 5}, "n_group 5 does not divide n_routed_experts (16); valid n_group: [1, 2, 4, 8, 16]"),
        ({"topk_group": 5}, "topk_group 5 exceeds n_group (4); valid: 1..4"),
        ({"topk_group": 0}, "topk_group must be a positive integer, got 0"),
        ({"num_experts_per_tok": 9, "topk_group": 2}, "topk_group 2 x 4 experts per group leaves fewer than num_experts_per_tok (9)"),
        ({"n_group": 16, "topk_group": 4}, "noaux_tc ranks groups by their two best experts"),
        ({"num_experts_per_tok": 17}, "num_experts_per_tok (17) exceeds n_routed_experts (16)"),
        ({"routed_scaling_factor": 0}, "routed_scaling_factor must be a positive number, got 0"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; valid: 'silu'"),
        ({"num_experts_per_tok": None}, "n_routed_experts is set but num_experts_per_tok is missing"),
        ({"scoring_func": None, "model_type": "mystery"}, "config has no scoring_func and its model_type 'mystery' implies none"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config quant_method 'gptq' is not supported; valid: 'fp8'"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
         "quantization_config fmt 'e5m2' is not supported; valid: 'e4m3'"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
         "quantization_config weight_block_size [64, 64] is not supported; valid: [128, 128]"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}},
         "quantization_config activation_scheme 'static' is not supported; valid: 'dynamic'"),
    ],  # fmt: skip
)
def test_bad_moe_and_fp8_configs_name_the_field_and_the_valid_values(change, message):
    raw = {**load_model_config("tiny").source, **MOE}
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ValueError) as error:
        model_config_from_dict(raw, name="bad")
    assert message in str(error.value)


def test_tp_must_divide_the_shared_experts_width():
    config = load_model_config("deepseek-v2-lite")  # 2 shared experts of 1408: 2816 = 2^8 x 11
    config.check_tp(8)
    with pytest.raises(ValueError, match=r"TP=3 does not divide deepseek-v2-lite's 16 attention heads"):
        config.check_tp(3)
    raw = {**config.source, "n_shared_experts": 1, "moe_intermediate_size": 1400}
    with pytest.raises(ValueError, match=r"TP=16 does not divide .* 1400 shared experts' width .* valid TP degrees: \[1, 2, 4, 8\]"):
        model_config_from_dict(raw, name="x").check_tp(16)


def test_a_shard_that_does_not_fit_the_gpu_is_refused_with_the_numbers(monkeypatch):
    from workers.placement import check_weights_fit

    config = PoolConfig(model="deepseek-v3", tp=2, pcp=2, gpu_memory_utilization=0.9)
    model_config = config.model_config()
    meta = DeepseekPrefillModel.create(model_config, TorchSDPAPrefillBackend, ep=EPGroup(0, 4), fp8=True, dtype=torch.bfloat16, device="meta")
    needed = meta.weight_bytes()
    assert 150 * 2**30 < needed < 200 * 2**30  # 671B parameters, mostly FP8 experts, over 4 ranks
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (130 * 2**30, 140 * 2**30))
    with pytest.raises(ValueError) as error:
        check_weights_fit(needed, torch.device("cuda", 0), config, model_config)
    assert (
        f"deepseek-v3 (61 layers) needs {needed / 2**30:.1f} GiB of weights per rank at TP=2 x PCP=2, routed experts split "
        "over 4 ranks; this GPU has 130.0 GiB free of 140.0 GiB and gpu_memory_utilization=0.9 allows 116.0 GiB"
    ) in str(error.value)
    check_weights_fit(100 * 2**30, torch.device("cuda", 0), config, model_config)  # fits: no error
