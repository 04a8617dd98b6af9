"""DeepSeek-V2/V3 Multi-head Latent Attention for prefill (the compute-friendly path).

Legend: T new tokens of a ragged batch, C cached context rows, N heads on this
rank, Lq = q_lora_rank, Lkv = kv_lora_rank (512), P = qk_nope (128),
R = qk_rope (64), V = v_head_dim (128). Weight names are DeepSeek's.

    q        = q_b_proj(q_a_layernorm(q_a_proj(h)))       [T, N, P+R]   (q_proj(h) if Lq is None)
    kv_c, kpe = split(kv_a_proj_with_mqa(h), [Lkv, R])
    kv_c     = kv_a_layernorm(kv_c)                        [T, Lkv]
    q[.., P:], kpe = RoPE(q[.., P:]), RoPE(kpe)            positions = context_len + 0..len-1
    latent   = [kv_c | kpe]                                [T, Lkv+R]  -> the cache rows
    k_nope, v = split(kv_b_proj(kv_c), [P, V]) per head    [T, N, P], [T, N, V]
    k        = [k_nope | kpe broadcast over heads]         [T, N, P+R]
    o, lse   = causal attention(q, k, v)                   (backend.run_prefill_new_tokens)

Cached context (latent rows of earlier tokens, already rotated) is attended to
in chunks of at most ``workspace_tokens`` rows, so the up-projected K/V of a
chunk (``rows x N x (P+V)``) has a fixed bound whatever the context length:

    for each chunk:  k_c, v_c = up-project(chunk rows)
                     o_c, lse_c = non-causal attention(q of the chunk's sequences, k_c, v_c)
                     (o, lse) = merge_attn_states((o_c, lse_c), (o, lse))
    out = o_proj(o)                                        [T, hidden]

With tensor parallelism ``o_proj`` here holds this rank's input columns, so
``out`` is a partial sum the caller all-reduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from attention.backends.base import MLADimensions, MLAPrefillBackend
from attention.merge import merge_attn_states
from attention.rope import RotaryEmbedding, YarnScaling

DEFAULT_WORKSPACE_TOKENS = 16 * 1024


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Attention hyper-parameters of a DeepSeek-style model (HF config names)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    yarn: YarnScaling | None = None
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"q_lora_rank must be a positive integer or None, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def dims(self) -> MLADimensions:
        return MLADimensions(
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
        )

    @property
    def latent_dim(self) -> int:
        """Width of one cached row: ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        base = self.dims.qk_head_dim**-0.5
        return base * (self.yarn.softmax_scale_multiplier if self.yarn else 1.0)

    @cached_property
    def rotary_embedding(self) -> RotaryEmbedding:
        """One instance per config, shared by its layers (it caches a batch's cos/sin)."""
        return RotaryEmbedding(
            self.qk_rope_head_dim, self.rope_theta, yarn=self.yarn, interleaved=self.rope_interleave
        )

    def create_backend(
        self, backend_cls: type[MLAPrefillBackend], *, num_heads: int | None = None, device: torch.device | str = "cpu"
    ) -> MLAPrefillBackend:
        """One backend instance for ``num_heads`` local heads (default: all), shared by every layer."""
        return backend_cls(
            num_heads=num_heads or self.num_heads, scale=self.softmax_scale, dims=self.dims, device=device
        )


@dataclass(frozen=True)
class ContextChunk:
    """One pass over cached context: rows ``[row_start, row_end)`` of the packed context.

    It covers sequences ``[seq_start, seq_end)``, whose queries are tokens
    ``[token_start, token_end)``; ``cu_seqlens_q``/``cu_seqlens_k`` are relative
    to those ranges (a sequence with no rows in the chunk has 0 keys).
    """

    seq_start: int
    seq_end: int
    token_start: int
    token_end: int
    row_start: int
    row_end: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class PrefillBatch:
    """Per-batch metadata shared by every layer (built once by :func:`plan_prefill_batch`)."""

    seq_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    context_chunks: tuple[ContextChunk, ...]
    workspace_tokens: int | None

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def num_context_rows(self) -> int:
        return sum(self.context_lens)

    @property
    def last_token_index(self) -> torch.Tensor:
        """Index of every sequence's last new token in the batch."""
        return self.cu_seqlens[1:].long() - 1


def plan_prefill_batch(
    seq_lens: Sequence[int],
    context_lens: Sequence[int] | None = None,
    *,
    workspace_tokens: int | None = DEFAULT_WORKSPACE_TOKENS,
    device: torch.device | str = "cpu",
    backend: MLAPrefillBackend | None = None,
) -> PrefillBatch:
    """Plan a batch of sequences with ``seq_lens`` new tokens after ``context_lens`` cached ones.

    Context rows are packed sequence after sequence and cut into chunks of at
    most ``workspace_tokens`` rows (``None``: one chunk); a chunk may split a
    sequence. When ``backend`` is given its kernels are planned here, once, and
    the plans of earlier batches are dropped.
    """
    seq_lens = tuple(int(n) for n in seq_lens)
    context_lens = tuple(int(n) for n in context_lens) if context_lens is not None else (0,) * len(seq_lens)
    if not seq_lens:
        raise ValueError("a prefill batch needs at least one sequence")
    if len(context_lens) != len(seq_lens):
        raise ValueError(f"got {len(seq_lens)} seq_lens but {len(context_lens)} context_lens")
    if any(n <= 0 for n in seq_lens):
        raise ValueError(f"every sequence needs at least one new token, got seq_lens={list(seq_lens)}")
    if any(n < 0 for n in context_lens):
        raise ValueError(f"context_lens must be >= 0, got {list(context_lens)}")
    if workspace_tokens is not None and workspace_tokens <= 0:
        raise ValueError(f"workspace_tokens must be a positive number of rows or None, got {workspace_tokens}")

    device = torch.device(device)
    cu = offsets(seq_lens)
    positions = torch.cat([torch.arange(c, c + n) for n, c in zip(seq_lens, context_lens)]).to(device)
    chunks = plan_context_chunks(seq_lens, context_lens, workspace_tokens=workspace_tokens, device=device)
    batch = PrefillBatch(
        seq_lens=seq_lens,
        context_lens=context_lens,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen=max(seq_lens),
        positions=positions,
        context_chunks=chunks,
        workspace_tokens=workspace_tokens,
    )
    if backend is not None:
        backend.clear_plans()
        backend.plan(batch.cu_seqlens, causal=True)
        for chunk in chunks:
            backend.plan(chunk.cu_seqlens_q, chunk.cu_seqlens_k, causal=False)
    return batch


def plan_context_chunks(
    q_lens: Sequence[int],
    k_lens: Sequence[int],
    *,
    workspace_tokens: int | None = DEFAULT_WORKSPACE_TOKENS,
    device: torch.device | str = "cpu",
) -> tuple[ContextChunk, ...]:
    """Chunks of non-causal attention of query groups ``q_lens`` over their packed keys ``k_lens``.

    Group ``i`` has ``q_lens[i]`` query rows and ``k_lens[i]`` cached rows; keys are
    packed group after group and cut every ``workspace_tokens`` rows (``None``: one
    chunk). Groups with keys need queries; groups without keys get no chunk.
    """
    if any(k > 0 and q <= 0 for q, k in zip(q_lens, k_lens)):
        raise ValueError(f"every group with cached rows needs queries, got q_lens={list(q_lens)} k_lens={list(k_lens)}")
    q_lens, k_lens = tuple(q_lens), tuple(k_lens)
    cu = offsets(q_lens)
    return tuple(_make_chunk(segments, q_lens, k_lens, cu, torch.device(device)) for segments in _pack_context(k_lens, workspace_tokens))


def offsets(lengths: Sequence[int]) -> list[int]:
    """``[0, l0, l0+l1, ...]``: where each of ``lengths`` starts in their concatenation, and the total."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


def _pack_context(context_lens: Sequence[int], budget: int | None) -> list[list[tuple[int, int, int]]]:
    """Cut the packed context into chunks of ``(seq, first_row, rows)`` segments, ``budget`` rows at most."""
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = 0
    for seq, length in enumerate(context_lens):
        start = 0
        while start < length:
            take = length - start if budget is None else min(length - start, budget - used)
            current.append((seq, start, take))
            used += take
            start += take
            if budget is not None and used == budget:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


def _make_chunk(
    segments: list[tuple[int, int, int]],
    seq_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    cu: list[int],
    device: torch.device,
) -> ContextChunk:
    seq_start, seq_end = segments[0][0], segments[-1][0] + 1
    rows_per_seq = dict.fromkeys(range(seq_start, seq_end), 0)
    for seq, _, rows in segments:
        rows_per_seq[seq] = rows
    # Only the first segment can continue a sequence begun in an earlier chunk.
    row_start = sum(context_lens[:seq_start]) + segments[0][1]
    q_lens = seq_lens[seq_start:seq_end]
    k_lens = [rows_per_seq[s] for s in range(seq_start, seq_end)]
    return ContextChunk(
        seq_start=seq_start,
        seq_end=seq_end,
        token_start=cu[seq_start],
        token_end=cu[seq_end],
        row_start=row_start,
        row_end=row_start + sum(k_lens),
        cu_seqlens_q=torch.tensor(offsets(q_lens), dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(offsets(k_lens), dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
    )


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` in float32, rounded once to the weight's dtype (why once, not twice as
    DeepSeek's reference rounds: ``attention.rms_norm_triton``). With ``residual``: ``residual += x`` (in
    place, in float32 when ``residual`` is: the decoder's residual stream, ``workers.model``) and the new
    ``residual`` normalized. On CUDA one pass of a Triton kernel (rows up to 8192 wide); elsewhere
    torch's fused ``rms_norm`` with the weight inside."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        width = x.shape[-1]
        if x.is_cuda:
            from attention.rms_norm_triton import MAX_WIDTH, add_rms_norm, rms_norm

            if width <= MAX_WIDTH:
                rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, width)
                if residual is None:
                    return rms_norm(rows, self.weight, self.eps).view(x.shape)
                return add_rms_norm(rows, residual.view(-1, width), self.weight, self.eps).view(x.shape)
        if residual is not None:
            x = residual.add_(x)
        if x.dtype != self.weight.dtype:
            return self.unrounded(x).to(self.weight.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, eps=self.eps)

    def unrounded(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x) * weight`` in float32, not rounded to the weight's dtype (for a few rows: the
        last ones, which the head reads in float32, ``workers.model``)."""
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), eps=self.eps)


class MLAAttention(nn.Module):
    """One MLA attention layer over ``num_heads`` heads (this rank's share under TP)."""

    def __init__(
        self,
        config: MLAConfig,
        backend: MLAPrefillBackend,
        *,
        num_heads: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        heads = num_heads or config.num_heads
        if backend.num_heads != heads or backend.dims != config.dims:
            raise ValueError(
                f"backend {backend.name} was built for {backend.num_heads} heads, dims {backend.dims}; "
                f"this layer has {heads} heads, dims {config.dims}"
            )
        self.config, self.backend, self.num_heads = config, backend, heads
        self.rope = config.rotary_embedding
        nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self._pow2_key_dims = (nope & (nope - 1)) == 0 and (rope & (rope - 1)) == 0  # what the key kernel takes
        c, kw = config, {"dtype": dtype, "device": device}
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, heads * c.dims.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, **kw)
            self.q_b_proj = nn.Linear(c.q_lora_rank, heads * c.dims.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.latent_dim, bias=c.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, **kw)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **kw)
        self.o_proj = nn.Linear(heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias, **kw)

    def forward(
        self, hidden: torch.Tensor, batch: PrefillBatch, context_kv: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, hidden]`` -> ``(out [T, hidden], latent [T, Lkv+R])``.

        ``hidden`` is a tensor in the layer's dtype, or the rows already in the form the projections
        that read it take (with a ``shape``; e.g. quantized once for FP8 linears, ``workers.fp8.FP8Rows``).
        ``context_kv [C, Lkv+R]`` holds the cached rows of every sequence with
        context, packed in batch order; it must be given iff the batch has context.
        """
        self._check_inputs(hidden, batch, context_kv)
        q, latent = self.project(hidden, batch.positions)
        k, v = self.up_project(latent)
        has_context = bool(batch.context_chunks)
        result = self.backend.run_prefill_new_tokens(
            q, k, v, batch.cu_seqlens, batch.max_seqlen, return_softmax_lse=has_context
        )
        attn = result[0] if has_context else result
        if has_context:
            self.attend_context(q, attn, result[1], batch.context_chunks, context_kv)
        return self.output(attn), latent

    def project(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, hidden]`` (as :meth:`forward` takes it) at ``positions [T]`` -> ``q [T, N, P+R]`` and
        ``latent [T, Lkv+R]``, both rotated."""
        c, tokens = self.config, hidden.shape[0]
        if c.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(tokens, self.num_heads, c.dims.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(hidden)
        latent[:, : c.kv_lora_rank] = self.kv_a_layernorm(latent[:, : c.kv_lora_rank])
        cos, sin = self.rope.cos_sin(positions)
        self.rope.rotate_(q[..., c.qk_nope_head_dim :], cos, sin)  # in place
        self.rope.rotate_(latent[:, c.kv_lora_rank :], cos, sin)
        return q, latent

    def up_project(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows ``[S, Lkv+R]`` -> ``k [S, N, P+R]``, ``v [S, N, V]``."""
        c = self.config
        rows = latent.shape[0]
        kv = self.kv_b_proj(latent[:, : c.kv_lora_rank]).view(rows, self.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_pe = latent[:, c.kv_lora_rank :]  # one per row, for every head
        if kv.is_cuda and self._pow2_key_dims:
            from attention.mla_triton import build_keys

            return build_keys(kv, k_pe, c.qk_nope_head_dim), v
        k = kv.new_empty(rows, self.num_heads, c.dims.qk_head_dim)
        k[..., : c.qk_nope_head_dim].copy_(k_nope)
        k[..., c.qk_nope_head_dim :].copy_(k_pe[:, None])
        return k, v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of the attention output ``[T, N, V]`` (a partial sum under TP)."""
        return self.o_proj(attn.reshape(attn.shape[0], self.num_heads * self.config.v_head_dim))

    def attend_context(
        self,
        q: torch.Tensor,
        attn: torch.Tensor,
        lse: torch.Tensor,
        chunks: Sequence[ContextChunk],
        context_kv: torch.Tensor,
    ) -> None:
        """Fold non-causal attention over cached latent rows into ``attn [T,N,V]``/``lse [N,T]`` in place,
        one chunk of ``context_kv`` rows (up-projected on the fly) at a time."""
        for chunk in chunks:
            k, v = self.up_project(context_kv[chunk.row_start : chunk.row_end])
            tokens = slice(chunk.token_start, chunk.token_end)
            chunk_out, chunk_lse = self.backend.run_prefill_context_chunk(
                q[tokens], k, v, chunk.cu_seqlens_q, chunk.cu_seqlens_k, chunk.max_seqlen_q, chunk.max_seqlen_k
            )
            merge_attn_states(
                attn[tokens], chunk_out, chunk_lse, attn[tokens], lse[:, tokens], output_lse=lse[:, tokens]
            )

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the norms: a projection's weights may be stored quantized)."""
        return self.kv_a_layernorm.weight.dtype

    def _check_inputs(self, hidden: torch.Tensor, batch: PrefillBatch, context_kv: torch.Tensor | None) -> None:
        if tuple(hidden.shape) != (batch.num_tokens, self.config.hidden_size):
            raise ValueError(
                f"hidden must be [tokens={batch.num_tokens}, hidden={self.config.hidden_size}], "
                f"got {tuple(hidden.shape)}"
            )
        if isinstance(hidden, torch.Tensor) and hidden.dtype != self.dtype:
            raise TypeError(f"hidden has dtype {hidden.dtype}, the layer computes in {self.dtype}")
        if batch.num_context_rows == 0:
            if context_kv is not None and context_kv.shape[0] > 0:
                raise ValueError("context_kv was given but the batch plan has no context (context_lens are 0)")
            return
        expected = (batch.num_context_rows, self.config.latent_dim)
        if context_kv is None or tuple(context_kv.shape) != expected:
            got = None if context_kv is None else tuple(context_kv.shape)
            raise ValueError(f"context_kv must be [context rows, latent] = {expected}, got {got}")
        if context_kv.dtype != self.dtype:
            raise TypeError(f"context_kv has dtype {context_kv.dtype}, the layer computes in {self.dtype}")
