"""``moe_rounding="vllm"`` (``workers.moe_vllm``): a bf16 MoE layer rounded as vLLM's CUDA path rounds
it, checked on the CPU against a token-by-token loop written from the steps in the module's
docstring (vLLM's own kernels are compared on a GPU: ``benchmarks/probes/probe_vllm_moe.py``), and the
refusals of what it does not cover."""

import pytest
import torch

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from configs.model import MoEConfig, load_model_config
from configs.pool import PoolConfig
from workers.expert_parallel import EPGroup
from workers.model import DeepseekPrefillModel, DenseMLP
from workers.moe import MoE, route

BF16 = torch.bfloat16
CONFIG = MoEConfig(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5)  # fmt: skip


def _layer(config: MoEConfig, rounding: str, hidden: int = 64, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    shared = DenseMLP(hidden, config.moe_intermediate_size * max(config.n_shared_experts, 1), dtype=BF16)
    moe = MoE(config, hidden, shared_experts=shared, dtype=BF16, rounding=rounding)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.1)
        moe.gate.e_score_correction_bias.normal_(0, 0.5)
    return moe


def _route_one(logits: torch.Tensor, config: MoEConfig, bias: torch.Tensor) -> tuple[list[int], list[float]]:
    """One token's experts and weights, step 2, in plain Python over float32 scalars."""
    per_group = config.n_routed_experts // config.n_group
    scores = [torch.sigmoid(v.float()) for v in logits]
    choice = [s + bias[e] for e, s in enumerate(scores)]
    group_score = []
    for g in range(config.n_group):
        members = sorted((choice[e] for e in range(g * per_group, (g + 1) * per_group)), key=float, reverse=True)
        group_score.append(members[0] + members[1])
    groups = sorted(range(config.n_group), key=lambda g: (-float(group_score[g]), g))[: config.topk_group]
    candidates = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
    ids = sorted(candidates, key=lambda e: (-float(choice[e]), e))[: config.num_experts_per_tok]
    total = sum(float(scores[e]) for e in ids)
    return ids, [float(scores[e]) / total for e in ids]


def test_routing_takes_groups_and_experts_best_first_from_bf16_logits():
    moe = _layer(CONFIG, "vllm")
    x = torch.randn(64, 64).to(BF16)
    weights, ids = moe.gate(x)
    logits = torch.nn.functional.linear(x, moe.gate.weight)
    assert logits.dtype == BF16
    for t in range(x.shape[0]):
        want_ids, want_weights = _route_one(logits[t], CONFIG, moe.gate.e_score_correction_bias)
        assert ids[t].tolist() == want_ids
        assert weights[t].tolist() == pytest.approx(want_weights, rel=1e-6)


def test_tied_scores_go_to_the_lower_expert():
    config = MoEConfig(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=8)
    logits = torch.tensor([[0.5, 2.0, 0.5, 2.0, 0.5, 0.5, 2.0, 0.25]], dtype=BF16)
    weights, ids = route(logits, config, torch.zeros(8), rounding="vllm")
    assert ids.tolist() == [[1, 3, 6]]
    assert weights.sum().item() == pytest.approx(1.0)


def test_the_layer_rounds_each_step_as_vllm_does():
    """Each token: its experts' down GEMM in float32 times the weight, rounded; those added in
    float32, rounded; times the scaling factor, rounded; plus the shared expert."""
    moe = _layer(CONFIG, "vllm")
    x = torch.randn(48, 64).to(BF16)
    with torch.no_grad():
        got = moe(x)
        weights, ids = moe.gate(x)
        shared = moe.shared_experts(x)
        for t in range(x.shape[0]):
            total = torch.zeros(1, 64)
            for j in range(CONFIG.num_experts_per_tok):
                e = int(ids[t, j])
                gate_up = (x[t : t + 1].float() @ moe.experts.gate_up_proj[e].float().t()).to(BF16)
                gate, up = gate_up.chunk(2, dim=-1)
                h = torch.nn.functional.silu(gate.float()).to(BF16) * up
                y = ((h.float() @ moe.experts.down_proj[e].float().t()) * weights[t, j]).to(BF16)
                total += y.float()
            want = shared[t : t + 1] + total.to(BF16) * CONFIG.routed_scaling_factor
            # the GEMMs' float32 sums may be ordered otherwise than this loop's: a rounding apart at most
            assert (got[t : t + 1] == want).float().mean() >= 0.98
            torch.testing.assert_close(got[t : t + 1], want, atol=0.0, rtol=2**-7)


def test_the_two_roundings_differ_and_both_stay_close_to_float32():
    reference, vllm = _layer(CONFIG, "reference"), _layer(CONFIG, "vllm")
    exact = _layer(CONFIG, "reference")
    exact.float()
    x = torch.randn(256, 64).to(BF16)
    with torch.no_grad():
        a, b, want = reference(x), vllm(x), exact(x.float())
    assert (a != b).float().mean() > 0.05  # the switch changes where the layer rounds
    for got in (a, b):
        assert float((got.float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fp8": True}, "unquantized experts"),
        ({"ep": EPGroup(0, 2)}, "a replica of one worker"),
        ({"config": MoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, scoring_func="softmax", topk_method="greedy")},
         r"routes by greedy \+ softmax"),
        ({"rounding": "exact"}, "'exact' is not one of reference, vllm"),
    ],
)  # fmt: skip
def test_what_vllm_rounding_does_not_cover_is_refused_by_name(kwargs, message):
    args = {"config": CONFIG, "rounding": "vllm", **kwargs}
    with pytest.raises(ValueError, match=message):
        MoE(args.pop("config"), 64, dtype=BF16, device="meta", **args)


def test_the_pool_config_takes_vllm_rounding_for_one_worker_replicas_only():
    assert PoolConfig(moe_rounding="vllm").moe_rounding == "vllm"
    with pytest.raises(ValueError, match="moe_rounding 'nearest' is not one of reference, vllm"):
        PoolConfig(moe_rounding="nearest")
    with pytest.raises(ValueError, match="tp=2, pcp=1"):
        PoolConfig(moe_rounding="vllm", tp=2)


def test_the_model_passes_the_rounding_to_every_moe_layer():
    config = load_model_config("deepseek-v3", num_hidden_layers=5)
    model = DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, device="meta", dtype=BF16, moe_rounding="vllm")
    layers = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    assert layers and all(moe.rounding == "vllm" and moe.gate.rounding == "vllm" and moe.experts.rounding == "vllm" for moe in layers)
