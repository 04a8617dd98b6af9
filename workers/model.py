"""The DeepSeek-architecture decoder as one tensor-parallel rank runs it for prefill.

    h = embed_tokens(ids)                                        [T, hidden]
    for each layer:
        a, latent = self_attn(input_layernorm(h))                (MLA, this rank's heads)
        h = h + all_reduce(a)
        m = down_proj(silu(gate_proj(x)) * up_proj(x)),  x = post_attention_layernorm(h)
        h = h + all_reduce(m)
    last = norm(h)[last token of each sequence]                  [B, hidden]
    logits = lm_head(last)                                       [B, vocab] float32

Tensor parallelism (Megatron style) over ``tp.size`` ranks: ``q_b_proj``/
``q_proj``, ``kv_b_proj``, ``gate_proj`` and ``up_proj`` are split by output
rows (heads, intermediate units); ``o_proj`` and ``down_proj`` by input
columns, so their outputs are partial sums reduced over the TP group. Norms,
``q_a_proj``, ``kv_a_proj_with_mqa`` (the shared latent), the embedding and
``lm_head`` are replicated. Parameter names are the HF checkpoint names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attention.backends.base import MLAPrefillBackend
from attention.mla import MLAAttention, PrefillBatch, RMSNorm
from configs.model import ModelConfig
from workers.pcp import PCPPlan, context_parallel_attention

COLUMN_PARALLEL = ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight")
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


@dataclass(frozen=True)
class TPShard:
    """This rank's place in its tensor-parallel group (``group`` is a torch.distributed group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside 0..{self.size - 1}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def split_dim(self, name: str) -> int | None:
        """The dim ``name`` is split along (0 rows, 1 columns), or None if replicated."""
        if name.endswith(COLUMN_PARALLEL):
            return 0
        if name.endswith(ROW_PARALLEL):
            return 1
        return None

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor ``name``."""
        dim = self.split_dim(name)
        if dim is None or self.size == 1:
            return full
        return full.chunk(self.size, dim=dim)[self.rank]


@dataclass
class PrefillOutput:
    """What one forward pass returns: per-sequence last hidden state and logits, per-layer latents."""

    last_hidden: torch.Tensor  # [B, hidden]
    logits: torch.Tensor | None  # [B, vocab] float32
    latents: list[torch.Tensor]  # per layer [T, kv_lora_rank + qk_rope_head_dim]


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, **kw) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: MLAPrefillBackend, tp: TPShard, **kw) -> None:
        super().__init__()
        eps = config.attention.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, **kw)
        self.self_attn = MLAAttention(config.attention, backend, num_heads=config.num_heads // tp.size, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, **kw)
        self.mlp = DenseMLP(config.hidden_size, config.intermediate_size // tp.size, **kw)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, backend: MLAPrefillBackend, tp: TPShard, **kw) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, tp, **kw) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.attention.rms_norm_eps, **kw)


class DeepseekPrefillModel(nn.Module):
    """One TP rank of the model. Build with :meth:`create`; weights are loaded separately."""

    def __init__(
        self,
        config: ModelConfig,
        backend: MLAPrefillBackend,
        *,
        tp: TPShard = TPShard(),
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        config.check_dense()
        config.check_tp(tp.size)
        kw = {"dtype": dtype or config.dtype, "device": device}
        self.config, self.backend, self.tp = config, backend, tp
        self.model = Backbone(config, backend, tp, **kw)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        backend_cls: type[MLAPrefillBackend],
        *,
        tp: TPShard = TPShard(),
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> DeepseekPrefillModel:
        """A model whose layers share one backend instance for this rank's heads."""
        config.check_tp(tp.size)
        backend = config.attention.create_backend(backend_cls, num_heads=config.num_heads // tp.size, device=device)
        return cls(config, backend, tp=tp, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        batch: PrefillBatch | PCPPlan,
        context: Sequence[torch.Tensor] | None = None,
        *,
        compute_logits: bool = True,
        on_layer: Callable[[int], None] | None = None,
    ) -> PrefillOutput:
        """Prefill ``token_ids [T]`` (a ragged batch described by ``batch``).

        ``context`` holds one packed ``[C, latent]`` tensor of cached rows per
        layer when the batch has context. ``on_layer(i)`` is called after each layer.
        Under prefill context parallelism ``batch`` is this rank's :class:`PCPPlan`:
        ``token_ids`` are then the rank's zigzag share, ``context`` its KV shard,
        the latents the whole batch's, and only PCP rank 0 gets last states and logits.
        """
        self.check_tokens(token_ids, batch)
        if any(batch.context_lens) and (context is None or len(context) != self.config.num_hidden_layers):
            raise ValueError(f"the batch has cached context: pass one context tensor per layer ({self.config.num_hidden_layers})")
        h = self.model.embed_tokens(token_ids)
        latents = []
        for i, layer in enumerate(self.model.layers):
            x, layer_context = layer.input_layernorm(h), context[i] if context else None
            if isinstance(batch, PCPPlan):
                attn, latent = context_parallel_attention(layer.self_attn, x, batch, layer_context)
            else:
                attn, latent = layer.self_attn(x, batch, layer_context)
            h = h + self.tp.all_reduce(attn)
            h = h + self.tp.all_reduce(layer.mlp(layer.post_attention_layernorm(h)))
            latents.append(latent)
            if on_layer is not None:
                on_layer(i)
        last = self.model.norm(h[batch.last_token_index])
        logits = self.lm_head(last).float() if compute_logits else None
        return PrefillOutput(last_hidden=last, logits=logits, latents=latents)

    def check_tokens(self, token_ids: torch.Tensor, batch: PrefillBatch | PCPPlan) -> None:
        """Raise ``TypeError``/``ValueError`` for token ids this model cannot prefill."""
        if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int64, torch.int32):
            got = token_ids.dtype if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
            raise TypeError(f"token ids must be an int64 or int32 tensor, got {got}")
        if token_ids.dim() != 1 or token_ids.numel() != batch.num_tokens:
            raise ValueError(f"token ids must be 1-D with {batch.num_tokens} entries, got shape {tuple(token_ids.shape)}")
        low, high = (int(token_ids.min()), int(token_ids.max())) if token_ids.numel() else (0, 0)
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        longest = max(c + n for c, n in zip(batch.context_lens, batch.seq_lens))
        if longest > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds {self.config.name}'s maximum of "
                f"{self.config.max_position_embeddings} positions"
            )

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02, *, draw_device: str | None = None) -> None:
        """Seeded random weights, identical for every TP degree: each full tensor is drawn
        from a generator keyed on (seed, name) on ``draw_device`` (default: where the
        weights live) and this rank keeps its shard. CPU and CUDA generators differ, so
        the same seed gives the same weights on every device of one type."""
        for name, param in self.named_parameters():
            device = torch.device(draw_device) if draw_device else param.device
            full_shape = list(param.shape)
            dim = self.tp.split_dim(name)
            if dim is not None:
                full_shape[dim] *= self.tp.size
            gen = torch.Generator(device=device).manual_seed(_name_seed(seed, name))
            full = std * torch.randn(full_shape, generator=gen, device=device)
            if name.endswith("norm.weight"):
                full += 1
            param.copy_(self.tp.shard(name, full))
            del full


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")
