"""A reference decode server: continues a prefilled request from its handed-off latent KV cache.

Decode reads the cache with the absorbed, MQA-style form of MLA (DeepSeek-V2
§2.1.3; the "data-movement friendly" path of the seeds): instead of
up-projecting every cached row to per-head keys and values, the up-projection
is folded into the query and the output. With ``W_UK [N, P, Lkv]`` and
``W_UV [N, V, Lkv]`` the per-head slices of ``kv_b_proj``:

    q_lat[n]  = q_nope[n] @ W_UK[n]                       [N, Lkv]
    score[n,t] = (q_lat[n] . kv_c[t] + q_pe[n] . k_pe[t]) * scale   over the latent rows [T, Lkv+R]
    o_lat[n]  = softmax(score[n]) @ kv_c                  [N, Lkv]
    o[n]      = W_UV[n] @ o_lat[n]                         [N, V]  -> o_proj

so one step reads ``T x 576`` values per layer, shared by all heads. This is
plain torch, one sequence at a time, for checking a handoff end to end (it is
not a production decode engine). It reuses the prefill model's weights and
layers (TP = 1, all experts on one rank; MoE layers route each new token like
prefill does) and appends each new token's latent row to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.fp8 import linear_weight
from workers.model import DeepseekPrefillModel


@dataclass
class DecodeState:
    """One request's cache: per layer its latent rows ``[T, Lkv+R]`` in token order."""

    rows: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.rows[0].shape[0]


class ReferenceDecoder:
    def __init__(self, model: DeepseekPrefillModel) -> None:
        if model.tp.size != 1 or model.ep.size != 1:
            raise ValueError(
                f"the reference decoder runs one whole model (TP=1, EP=1), got a TP={model.tp.size}, EP={model.ep.size} shard"
            )
        self.model = model
        c = model.config.attention
        self.absorbed = []
        for layer in model.model.layers:
            w = linear_weight(layer.self_attn.kv_b_proj, model.dtype)
            w = w.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            self.absorbed.append((w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]))  # W_UK, W_UV

    def load(self, kv: torch.Tensor) -> DecodeState:
        """Start from handed-off rows ``[layers, tokens, Lkv+R]`` (``ReceivedKV.rows()`` or ``PrefillPool.fetch_kv``)."""
        config, weight = self.model.config, self.model.lm_head.weight
        expected = (config.num_hidden_layers, config.attention.latent_dim)
        if kv.dim() != 3 or (kv.shape[0], kv.shape[2]) != expected:
            raise ValueError(f"KV must be [layers={expected[0]}, tokens, {expected[1]}], got {tuple(kv.shape)}")
        return DecodeState([layer.to(device=weight.device, dtype=weight.dtype) for layer in kv])

    @torch.no_grad()
    def step(self, state: DecodeState, token: int) -> torch.Tensor:
        """Feed ``token`` at the next position; returns the next token's logits ``[vocab]`` (float32)."""
        model, c = self.model, self.model.config.attention
        device = model.lm_head.weight.device
        position = torch.tensor([state.length], device=device)
        h = model.model.embed_tokens(torch.tensor([token], device=device))
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            q, latent = attn.project(layer.input_layernorm(h), position)  # [1, N, P+R], [1, Lkv+R]
            rows = state.rows[i] = torch.cat([state.rows[i], latent])
            w_uk, w_uv = self.absorbed[i]
            q_nope, q_pe = q[0].split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
            q_lat = torch.einsum("np,npl->nl", q_nope, w_uk)
            kv_c, k_pe = rows[:, : c.kv_lora_rank], rows[:, c.kv_lora_rank :]
            scores = (q_lat @ kv_c.T + q_pe @ k_pe.T).float() * c.softmax_scale  # [N, T+1]
            o_lat = torch.softmax(scores, dim=-1).to(kv_c.dtype) @ kv_c
            o = torch.einsum("nl,nvl->nv", o_lat, w_uv)
            h = h + attn.output(o[None])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.lm_head(model.model.norm(h))[0].float()

    def generate(self, kv: torch.Tensor, first_token: int, steps: int) -> list[int]:
        """Greedy: ``first_token`` (the prefill's) followed by ``steps`` decoded tokens."""
        return self.greedy(self.load(kv), first_token, steps)

    def greedy(self, state: DecodeState, first_token: int, steps: int) -> list[int]:
        tokens = [int(first_token)]
        for _ in range(steps):
            tokens.append(int(self.step(state, tokens[-1]).argmax()))
        return tokens
