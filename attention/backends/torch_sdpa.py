"""TORCH_SDPA: MLA prefill in plain torch, on CPU and CUDA.

On CUDA, fp16/bf16 sequences go through cuDNN's fused attention, which returns
the LSE with the output (``torch.ops.aten._scaled_dot_product_cudnn_attention``,
adapted in :func:`_cudnn_attention` only; torch >= 2.5). It is not used for
float32 (it returns NaN there on H200 with torch 2.11, without an error), nor
for a causal sequence with ``q_len != kv_len`` (its causal mask is top-left
aligned); those take the exact path below.

Elsewhere (and for those sequences), it computes, in blocks of queries, the
scores ``s [H, tq, S]`` in float32, their logsumexp (the exact natural-log
LSE), the probabilities and ``o = p @ v`` -- the formulas of the contract in
``base.py``. Scores are bounded to ``score_budget`` elements per block, so
memory stays flat in the sequence length, and causal blocks skip the keys
past their diagonal. Q/K keep their 192-wide head dim and
V its 128: no padding is created or returned.
"""

from __future__ import annotations

import torch

from attention.backends.base import BackendCapabilities, MLAPrefillBackend, RaggedPlan


CUDNN_DTYPES = (torch.float16, torch.bfloat16)


class TorchSDPAPrefillBackend(MLAPrefillBackend):
    name = "TORCH_SDPA"
    capabilities = BackendCapabilities(
        device_kinds=("cpu", "cuda", "rocm"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
    )
    score_budget = 1 << 26  # float32 score elements per query block (256 MiB)
    max_query_block = 512  # smaller blocks skip more of the causal upper triangle

    def _forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RaggedPlan, return_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        use_cudnn = q.is_cuda and q.dtype in CUDNN_DTYPES and _has_cudnn_attention()
        if use_cudnn and len(plan.seqlens_q) == 1 and plan.num_k_tokens and (not plan.causal or q.shape[0] == k.shape[0]):
            out_THD, lse_HT = _cudnn_attention(q, k, v, plan.causal, self.scale)  # one sequence: no copies
            return out_THD, (lse_HT if return_lse else None)
        out_THD = q.new_zeros(q.shape[0], self.num_heads, self.dims.v_head_dim)
        lse_HT = torch.full((self.num_heads, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        q_start = k_start = 0
        for q_len, kv_len in zip(plan.seqlens_q, plan.seqlens_k):
            if q_len and kv_len:
                qs, ks = slice(q_start, q_start + q_len), slice(k_start, k_start + kv_len)
                if use_cudnn and (q_len == kv_len or not plan.causal):
                    out_THD[qs], lse_HT[:, qs] = _cudnn_attention(q[qs], k[ks], v[ks], plan.causal, self.scale)
                else:
                    self._attend_sequence(q[qs], k[ks], v[ks], plan.causal, out_THD[qs], lse_HT[:, qs])
            q_start += q_len
            k_start += kv_len
        return out_THD, (lse_HT if return_lse else None)

    def _attend_sequence(
        self,
        q_THD: torch.Tensor,
        k_SHD: torch.Tensor,
        v_SHD: torch.Tensor,
        causal: bool,
        out_THD: torch.Tensor,
        lse_HT: torch.Tensor,
    ) -> None:
        q_len, kv_len = q_THD.shape[0], k_SHD.shape[0]
        k_HDS = k_SHD.float().permute(1, 2, 0)
        v_HSD = v_SHD.float().transpose(0, 1)
        block = max(1, min(self.max_query_block, self.score_budget // (self.num_heads * kv_len)))
        for start in range(0, q_len, block):
            stop = min(start + block, q_len)
            # causal, bottom-right aligned: query i sees keys j <= i + (kv_len - q_len), so
            # keys past the block's last visible one are skipped
            keys = min(kv_len, stop + kv_len - q_len) if causal else kv_len
            if keys <= 0:
                continue  # the whole block sees nothing: o = 0, lse = -inf already
            s_HTS = torch.matmul(q_THD[start:stop].float().transpose(0, 1), k_HDS[..., :keys]) * self.scale
            if causal:
                last_visible = torch.arange(start, stop, device=q_THD.device) + (kv_len - q_len)
                key_pos = torch.arange(keys, device=q_THD.device)
                s_HTS.masked_fill_(key_pos[None, :] > last_visible[:, None], float("-inf"))
            lse = torch.logsumexp(s_HTS, dim=-1)  # [H, t]; -inf where a query sees nothing
            p_HTS = torch.exp(s_HTS - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
            out_THD[start:stop] = torch.matmul(p_HTS, v_HSD[:, :keys]).transpose(0, 1).to(out_THD.dtype)
            lse_HT[:, start:stop] = lse


def _has_cudnn_attention() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention") and torch.backends.cudnn.is_available()


def _cudnn_attention(
    q_THD: torch.Tensor, k_SHD: torch.Tensor, v_SHD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN fused attention of one sequence: ``o [T, H, Dv]`` and natural-log ``lse [H, T]``.

    The one place that touches the private op: it takes ``[B, H, L, D]`` views
    and returns a tuple whose first two entries are the output and the LSE."""
    as_bhld = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731 -- [L, H, D] -> [1, H, L, D], no copy
    outputs = torch.ops.aten._scaled_dot_product_cudnn_attention(
        as_bhld(q_THD), as_bhld(k_SHD), as_bhld(v_SHD.contiguous()), None, True, 0.0, causal, False, scale=scale
    )
    out_BHLD, lse = outputs[0], outputs[1]
    return out_BHLD[0].transpose(0, 1), lse.reshape(lse.shape[1], lse.shape[2]).float()
