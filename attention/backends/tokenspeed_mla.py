"""TOKENSPEED_MLA: the tokenspeed-mla CuTe DSL prefill kernels (SM100 only).

Calls ``tokenspeed_mla.tokenspeed_mla_prefill``; V must be contiguous (a
strided view gives wrong results in that library), so it is copied when it
is not. Its LSE is natural-log ``[T, H]``, returned as ``[H, T]``. Not yet
run on SM100 hardware by this project (see docs/backends.md).
"""

from __future__ import annotations

import torch

from attention.backends.base import DEEPSEEK_MLA_DIMS, BackendCapabilities, MLAPrefillBackend


class TokenspeedMLAPrefillBackend(MLAPrefillBackend):
    name = "TOKENSPEED_MLA"
    capabilities = BackendCapabilities(
        device_kinds=("cuda",),
        min_capability=(10, 0),
        max_capability=(10, 3),
        mla_dims=(DEEPSEEK_MLA_DIMS,),
        requires=("tokenspeed_mla",),
    )

    def _build_state(self, plan):
        return torch.tensor(plan.seqlens_k, dtype=torch.int32, device=self.device)

    def _forward(self, q, k, v, plan, return_lse):
        from tokenspeed_mla import tokenspeed_mla_prefill

        out, lse_TH = tokenspeed_mla_prefill(
            query=q,
            key=k,
            value=v.contiguous(),
            seq_lens=plan.state,
            cum_seq_lens=plan.cu_seqlens_k,
            max_seq_len=plan.max_seqlen_k,
            batch_size=len(plan.seqlens_q),
            softmax_scale=self.scale,
            is_causal=plan.causal,
            return_lse=True,
            cum_seq_lens_q=plan.cu_seqlens_q,
            max_seq_len_q=plan.max_seqlen_q,
        )
        lse_HT = lse_TH.t().float()
        return out, (lse_HT if return_lse else None)
