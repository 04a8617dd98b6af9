"""A MoE layer rounded as vLLM 0.26 rounds it on CUDA (``PoolConfig.moe_rounding = "vllm"``).

Why: a vLLM decode server continues from the KV the pool hands it. Where the pool's rows differ
from the ones vLLM's own prefill writes by a bf16 rounding, a greedy token that is a near-tie at
some step can go the other way. The reference rounding (``workers.moe``: float32 router, routing
weight before the down GEMM, float32 sum of a token's experts) is transformers'; vLLM's Triton MoE
rounds at other places. This module reproduces vLLM's places, each a step of its CUDA path for a
DeepSeek-V3 (``noaux_tc``, sigmoid) MoE layer of a bf16 model:

1. router logits in the model's dtype (its gate is a plain linear layer, ``GateLinear`` at the end of
   its kernel list);
2. ``grouped_topk`` (its fused CUDA kernel; ``workers.moe.route(..., rounding="vllm")``) in float32
   from those logits: sigmoid scores plus the bias choose the experts, in the ``topk_group`` groups
   whose two best sums are highest; groups and then experts are taken best first (ties: the lower
   index), so a token's slots are in decreasing biased score; the weights are the unbiased scores over
   their sum, *not* times ``routed_scaling_factor``;
3. the experts' gate/up GEMM rounded to the dtype, ``silu`` rounded, times ``up`` rounded (as here);
4. the down GEMM's float32 accumulator times the pair's weight, rounded to the dtype once;
5. ``moe_sum``: a token's pair rows added in float32, rounded once (``workers.moe.gather_sum``);
6. the sum times ``routed_scaling_factor``, rounded; then plus the shared experts, rounded.

Against vLLM's own kernels on an H200 (``benchmarks/probes/probe_vllm_moe.py``): the same experts in the
same order for every token, and 99.999% of the layer's output values equal bit for bit (the rest a
rounding apart: the GEMMs' float32 sums run in other orders). The cost against the reference: step 4
runs one float32-output GEMM per local expert after one host sync for their row counts, as torch's
grouped GEMM writes only its input dtype ("Grouped gemm output dtype must match `mat_a` dtype", torch
2.11): 15.4 ms for a DeepSeek-V3 layer of 8,192 tokens against 12.0 ms. Covered: unquantized experts
(vLLM's FP8 MoE is another recipe than ours), a replica of one worker (the scaling factor multiplies a
token's whole sum, so all of its pairs are on one rank), and the ``noaux_tc`` + sigmoid routing vLLM
fuses (:func:`check_supported`).
"""

from __future__ import annotations

import torch

from configs.model import MoEConfig


def check_supported(config: MoEConfig, *, fp8: bool, ep_size: int) -> None:
    """Raise ``ValueError`` naming what stops a MoE layer from rounding as vLLM does."""
    if fp8:
        raise ValueError(
            "moe_rounding 'vllm' is for unquantized experts; this model's experts run in FP8: use moe_rounding "
            "'reference', or quantization 'none' (the FP8 weights dequantized at load)"
        )
    if ep_size > 1:
        raise ValueError(f"moe_rounding 'vllm' needs a replica of one worker (tp * pcp == 1); this one has {ep_size}: use 'reference'")
    if (config.topk_method, config.scoring_func) != ("noaux_tc", "sigmoid"):
        raise ValueError(
            f"moe_rounding 'vllm' follows vLLM's fused noaux_tc + sigmoid routing; this model routes by "
            f"{config.topk_method} + {config.scoring_func}: use 'reference'"
        )


def weighted_down(h: torch.Tensor, down_proj: torch.Tensor, offs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[P, H]`` in ``h``'s dtype: each pair row of ``h [P, I]`` (sorted by expert, ``offs [E]`` the end
    of each expert's rows) through its expert's ``down_proj [E, H, I]``, the float32 result times the
    pair's ``weights [P]`` and rounded once (step 4)."""
    out = h.new_empty(h.shape[0], down_proj.shape[1])
    start = 0
    for expert, end in enumerate(offs.tolist()):  # one host sync for the row counts
        if end > start:
            rows, weight = h[start:end], down_proj[expert]
            if h.is_cuda:
                acc = torch.mm(rows, weight.t(), out_dtype=torch.float32)
            else:  # products of bf16 values are exact in float32, as in a GPU GEMM's accumulator
                acc = rows.float() @ weight.float().t()
            out[start:end] = (acc * weights[start:end, None]).to(out.dtype)
        start = end
    return out
