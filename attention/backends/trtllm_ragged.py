"""TRTLLM_RAGGED: TensorRT-LLM's ragged DeepSeek prefill kernel, shipped in FlashInfer (SM100 only).

Calls ``flashinfer.prefill.trtllm_ragged_attention_deepseek``; its LSE is
base-2 ``[T, H]`` and is returned as natural-log ``[H, T]``. Not yet run on
SM100 hardware by this project (see docs/backends.md).
"""

from __future__ import annotations

import math

import torch

from attention.backends.base import (
    DEEPSEEK_MLA_DIMS,
    BackendCapabilities,
    MLADimensions,
    MLAPrefillBackend,
)


class TrtllmRaggedPrefillBackend(MLAPrefillBackend):
    name = "TRTLLM_RAGGED"
    capabilities = BackendCapabilities(
        device_kinds=("cuda",),
        min_capability=(10, 0),
        max_capability=(10, 3),
        mla_dims=(DEEPSEEK_MLA_DIMS, MLADimensions(qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256)),
        requires=("flashinfer.prefill",),
    )
    workspace_bytes = 128 << 20

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)

    def _build_state(self, plan):
        return torch.tensor(plan.seqlens_k, dtype=torch.int32, device=self.device)

    def _forward(self, q, k, v, plan, return_lse):
        from flashinfer.prefill import trtllm_ragged_attention_deepseek

        out, lse_TH = trtllm_ragged_attention_deepseek(
            query=q.contiguous(),
            key=k.contiguous(),
            value=v.contiguous(),
            workspace_buffer=self._workspace,
            seq_lens=plan.state,
            max_q_len=plan.max_seqlen_q,
            max_kv_len=plan.max_seqlen_k,
            bmm1_scale=self.scale,
            bmm2_scale=1.0,
            o_sf_scale=1.0,
            batch_size=len(plan.seqlens_q),
            window_left=-1,
            cum_seq_lens_q=plan.cu_seqlens_q,
            cum_seq_lens_kv=plan.cu_seqlens_k,
            enable_pdl=False,
            is_causal=plan.causal,
            return_lse=True,
        )
        lse_HT = lse_TH.t() * math.log(2.0)
        return out, (lse_HT if return_lse else None)
