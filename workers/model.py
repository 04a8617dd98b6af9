"""The DeepSeek-architecture decoder as one rank of a replica runs it for prefill.

    h = embed_tokens(ids)                                        [T, hidden] float32
    for each layer:
        a, latent = self_attn(input_layernorm(h))                (MLA, this rank's heads)
        h = h + all_reduce(a)
        x = post_attention_layernorm(h)
        dense layer:  g, u = split(gate_up_proj(x))                  (gate_proj and up_proj stacked)
                      h = h + all_reduce(down_proj(silu(g) * u))
        MoE layer:    this TP rank's 1/tp of the tokens go through the routed experts (expert
                      parallel over the whole replica, ``workers.moe``); the shared experts run
                      TP-split on all tokens (while the routed experts' combine is in flight),
                      reduce-scattered to the same 1/tp:
                      h_r = h[r] + routed(x[r]) + reduce_scatter(shared(x))[r];  h = all_gather(h_r)
    last = norm(h)[last token of each sequence]                  [B, hidden] float32
    logits = lm_head(last)                                       [B, vocab] float32 (float32_logits)

The residual stream ``h`` is float32 whatever the model's dtype (vLLM and DeepSeek's reference keep
it in the model's: bf16, rounded at every add); the norms' outputs, the layers' inputs, are in the
model's dtype, and each add is done by the next norm in its own pass (``RMSNorm``'s residual: one
read of ``h``). On one H200, three DeepSeek-width checkpoints in bf16, this took the latent rows of
the second and third layers from 0.0037 and 0.0044 of the float32 rows to 0.0029 and 0.0030 (relative
L2; the first layer's, 0.0029, is the rows' own rounding to bf16), where vLLM 0.26's own are 0.0037
and 0.0044 (``benchmarks/results/2026-11-27-h200-vllm-decode-truth-fp32-residual.json``,
``docs/vllm-decode.md``). Under TP the MoE layers' all-gather moves float32 rows (twice the bytes).

Tensor parallelism (Megatron style) over ``tp.size`` ranks: ``q_b_proj``/
``q_proj``, ``kv_b_proj`` and ``gate_up_proj`` (each of its halves) are split by output
rows (heads, intermediate units); ``o_proj`` and ``down_proj`` by input
columns, so their outputs are partial sums reduced over the TP group. Norms,
``q_a_proj``, ``kv_a_proj_with_mqa`` (the shared latent), the embedding,
``lm_head`` and the router are replicated; routed experts are split by expert
over every rank of the replica (``ep``), never by TP, so no expert runs twice
for a token. Parameter names are the HF checkpoint names, but for two stacks: the
routed experts' (transformers' ``mlp.experts.gate_up_proj``/``down_proj``) and the
dense MLPs' ``gate_up_proj``, ``gate_proj`` over ``up_proj`` (:class:`DenseMLP`).

With ``fp8`` the linear layers whose shard keeps DeepSeek's 128x128 blocks whole
are ``workers.fp8.FP8Linear`` (``workers.deepgemm.DeepGEMMLinear`` with ``fp8_gemm="deep_gemm"``,
where DeepGEMM takes the shape) and the experts FP8 (``workers.moe.Experts``); the norms read only
by FP8 linears write FP8 rows (``workers.fp8.FP8RMSNorm``);
the modules are built on the meta device and materialized once, so no bf16
copy of an FP8 weight is ever allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from attention.backends.base import MLAPrefillBackend
from attention.mla import MLAAttention, PrefillBatch, RMSNorm
from configs.model import ModelConfig
from workers.activation import silu_mul
from workers.collectives import GroupRank, all_gather_into, reduce_scatter_into
from workers.deepgemm import DeepGEMMLinear, whole_blocks
from workers.fp8 import BLOCK, FP8Linear, FP8RMSNorm, block_gemm_shape_ok
from workers.expert_parallel import EPGroup
from workers.moe import MoE
from workers.pcp import PCPPlan, context_parallel_attention

COLUMN_PARALLEL = ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight", "gate_up_proj.weight")
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


@dataclass(frozen=True)
class TPShard(GroupRank):
    """This rank's place in its tensor-parallel group."""

    KIND: ClassVar[str] = "TP"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def token_rows(self, tokens: int) -> int:
        """Rows per rank when ``tokens`` are split over the group (the last ranks may hold fewer)."""
        return -(-tokens // self.size)

    def my_tokens(self, tokens: int) -> slice:
        rows = self.token_rows(tokens)
        return slice(min(tokens, self.rank * rows), min(tokens, (self.rank + 1) * rows))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x [T, ...]`` over the group and keep this rank's rows (:meth:`my_tokens`)."""
        rows, mine = self.token_rows(x.shape[0]), self.my_tokens(x.shape[0])
        padded = torch.nn.functional.pad(x, (0, 0, 0, rows * self.size - x.shape[0]))
        out = x.new_empty(rows, *x.shape[1:])
        reduce_scatter_into(out, padded, self.group)
        return out[: mine.stop - mine.start]

    def all_gather(self, x: torch.Tensor, tokens: int) -> torch.Tensor:
        """Every rank's rows (:meth:`my_tokens` of ``tokens``) back into ``[tokens, ...]``."""
        rows = self.token_rows(tokens)
        padded = torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0]))
        out = x.new_empty(rows * self.size, *x.shape[1:])
        all_gather_into(out, padded, self.group)
        return out[:tokens]

    def split_dim(self, name: str) -> int | None:
        """The dim ``name`` is split along (0 rows, 1 columns), or None if replicated."""
        if name.endswith(COLUMN_PARALLEL):
            return 0
        if name.endswith(ROW_PARALLEL):
            return 1
        return None


@dataclass
class PrefillOutput:
    """What one forward pass returns: per-sequence last hidden state and logits, per-layer latents."""

    last_hidden: torch.Tensor  # [B, hidden]
    logits: torch.Tensor  # [B, vocab] float32
    latents: list[torch.Tensor]  # per layer [T, kv_lora_rank + qk_rope_head_dim]


class DenseMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (this rank's ``intermediate`` units), with
    ``gate_proj`` and ``up_proj`` stacked by rows into one ``gate_up_proj [2I, H]``: one GEMM (and,
    in FP8, one quantization of ``x``) instead of two, and an FP8 ``down_proj`` quantizes
    ``silu(g) * u`` in the same pass (``FP8Linear(..., silu_mul=True)``), never writing it in bf16
    (a bf16 one gets it from ``workers.activation.silu_mul``).
    :attr:`merged_rows` names the checkpoint tensors behind the stack (``workers.weights`` reads them
    into its halves); ``load_state_dict`` takes HF's names too."""

    def __init__(self, hidden: int, intermediate: int, **kw) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, **kw)
        self.merged_rows = {"gate_up_proj": (("gate_proj", intermediate), ("up_proj", intermediate))}
        self.register_load_state_dict_pre_hook(_stack_checkpoint_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if isinstance(self.down_proj, FP8Linear):
            return self.down_proj(gate_up, silu_mul=True)
        return self.down_proj(silu_mul(gate_up))


def _stack_checkpoint_rows(module: nn.Module, state: dict, prefix: str, *_) -> None:
    """``load_state_dict`` pre-hook: a state dict with the checkpoint's separate tensors (``gate_proj.weight``,
    ``up_proj.weight``, ...) fills the module's stacked ones (:attr:`DenseMLP.merged_rows`)."""
    for merged, parts in module.merged_rows.items():
        for suffix in ("weight", "weight_scale_inv"):
            names = [f"{prefix}{part}.{suffix}" for part, _ in parts]
            if all(name in state for name in names):
                state[f"{prefix}{merged}.{suffix}"] = torch.cat([state.pop(name) for name in names])


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, index: int, backend: MLAPrefillBackend, tp: TPShard, ep: EPGroup,
        *, dtype: torch.dtype, device, fp8: bool, ep_schedule: str, ep_comm_sms: int, moe_rounding: str, fp8_gemm: str,
    ) -> None:  # fmt: skip
        super().__init__()
        eps, kw = config.attention.rms_norm_eps, {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(config.hidden_size, eps, **kw)
        self.self_attn = MLAAttention(config.attention, backend, num_heads=config.num_heads // tp.size, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, **kw)
        if config.is_moe_layer(index):
            moe = config.moe
            shared = DenseMLP(config.hidden_size, moe.shared_intermediate_size // tp.size, **kw) if moe.n_shared_experts else None
            self.mlp = MoE(
                moe, config.hidden_size, ep=ep, shared_experts=shared, fp8=fp8, schedule=ep_schedule, comm_sms=ep_comm_sms,
                rounding=moe_rounding, gemm=fp8_gemm, **kw,
            )  # fmt: skip
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size // tp.size, **kw)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, backend: MLAPrefillBackend, tp: TPShard, ep: EPGroup, **kw) -> None:
        super().__init__()
        plain = {"dtype": kw["dtype"], "device": kw["device"]}
        # built with its (uninitialized) weight: nn.Embedding's own init of a meta weight imports torch._dynamo,
        # a second of every worker's start
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size, **plain))
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend, tp, ep, **kw) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.attention.rms_norm_eps, **plain)


class DeepseekPrefillModel(nn.Module):
    """One rank of the model (its TP shard and its routed experts). Build with :meth:`create`; the
    parameters are uninitialized until weights are loaded (``workers.weights``)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: MLAPrefillBackend,
        *,
        tp: TPShard = TPShard(),
        ep: EPGroup = EPGroup(),
        fp8: bool = False,
        ep_schedule: str = "all-to-all",
        ep_comm_sms: int = 0,
        moe_rounding: str = "reference",
        fp8_gemm: str = "torch",
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        config.check_tp(tp.size)
        if fp8 and config.quantization is None:
            raise ValueError(f"{config.name} has no quantization_config: its weights are not FP8")
        dtype = dtype or config.dtype
        if fp8 and dtype != torch.bfloat16:
            raise ValueError(f"FP8 GEMMs write bfloat16: the compute dtype must be bfloat16, got {dtype}")
        self.config, self.backend, self.tp, self.ep, self.fp8 = config, backend, tp, ep, fp8
        kw = {"dtype": dtype, "device": "meta", "fp8": fp8, "ep_schedule": ep_schedule, "ep_comm_sms": ep_comm_sms, "moe_rounding": moe_rounding,
              "fp8_gemm": fp8_gemm}  # fmt: skip
        self.model = Backbone(config, backend, tp, ep, **kw)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device="meta")
        if fp8:
            self._use_fp8_linears(fp8_gemm)
        # to_empty(device), without its empty_like of meta tensors (that imports sympy, a third of a
        # second of every worker's start)
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))

    @classmethod
    def create(
        cls, config: ModelConfig, backend_cls: type[MLAPrefillBackend], *, tp: TPShard = TPShard(), device: torch.device | str = "cpu", **kw
    ) -> DeepseekPrefillModel:
        """A model whose layers share one backend instance for this rank's heads; ``kw`` are the
        constructor's other keywords (``ep``, ``fp8``, ``ep_schedule``, ``ep_comm_sms``, ``moe_rounding``, ``fp8_gemm``, ``dtype``)."""
        config.check_tp(tp.size)
        backend = config.attention.create_backend(backend_cls, num_heads=config.num_heads // tp.size, device=device)
        return cls(config, backend, tp=tp, device=device, **kw)

    def _use_fp8_linears(self, gemm: str) -> None:
        """Swap every quantized linear layer (all but ``lm_head``) whose shard keeps the 128x128 blocks
        whole for an :class:`FP8Linear`, run by DeepGEMM where ``gemm`` is "deep_gemm" and it takes the
        shape; the others stay in bf16 (their FP8 weights are dequantized). A norm whose every reader is
        then an FP8 linear (``input_layernorm``, ``q_a_layernorm``, a dense layer's
        ``post_attention_layernorm``) becomes an :class:`FP8RMSNorm`: its rows quantized in its own pass,
        once for both of ``input_layernorm``'s readers."""
        for name, module in list(self.model.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            parts = tuple(rows for _, rows in merged_parts(self.model, name))
            if fp8_shard_aligned(module, self.tp.split_dim(name + ".weight"), self.tp.size, parts):
                parent, _, child = name.rpartition(".")
                linear = DeepGEMMLinear if gemm == "deep_gemm" and whole_blocks(module.in_features, module.out_features) else FP8Linear
                setattr(self.model.get_submodule(parent), child, linear(module.in_features, module.out_features, device="meta"))
        for layer in self.model.layers:  # norms read only by FP8 linears write their rows quantized
            attn = layer.self_attn
            first = [attn.kv_a_proj_with_mqa, attn.q_proj if attn.config.q_lora_rank is None else attn.q_a_proj]
            if all(isinstance(linear, FP8Linear) for linear in first):
                layer.input_layernorm = quantizing(layer.input_layernorm)
            if attn.config.q_lora_rank is not None and isinstance(attn.q_b_proj, FP8Linear):
                attn.q_a_layernorm = quantizing(attn.q_a_layernorm)
            if isinstance(layer.mlp, DenseMLP) and isinstance(layer.mlp.gate_up_proj, FP8Linear):  # a MoE layer's router reads bf16
                layer.post_attention_layernorm = quantizing(layer.post_attention_layernorm)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (works on a ``meta`` model: what loading it will allocate)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def moe_layers(self) -> list[tuple[int, MoE]]:
        return [(i, layer.mlp) for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, MoE)]

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, batch: PrefillBatch | PCPPlan, context: Sequence[torch.Tensor] | None = None) -> PrefillOutput:
        """Prefill ``token_ids [T]`` (a ragged batch described by ``batch``).

        ``context`` holds one packed ``[C, latent]`` tensor of cached rows per
        layer when the batch has context.
        Under prefill context parallelism ``batch`` is this rank's :class:`PCPPlan`:
        ``token_ids`` are then the rank's zigzag share, ``context`` its KV shard,
        the latents the whole batch's, and last states and logits are those of the last tokens this rank
        holds (``PCPPlan.gather_last`` brings them together).
        """
        self.check_tokens(token_ids, batch)
        if any(batch.context_lens) and (context is None or len(context) != self.config.num_hidden_layers):
            raise ValueError(f"the batch has cached context: pass one context tensor per layer ({self.config.num_hidden_layers})")
        return self.run_layers(token_ids, batch, context)

    @torch.no_grad()
    def run_layers(
        self, token_ids: torch.Tensor, batch: PrefillBatch | PCPPlan, context: Sequence[torch.Tensor] | None = None, *,
        last_index: torch.Tensor | None = None,
    ) -> PrefillOutput:  # fmt: skip
        """:meth:`forward` without its checks of the inputs (they read the token ids on the host: a
        device sync, which a CUDA graph capture cannot hold; ``workers.cuda_graphs`` checks them before
        a replay). ``last_index`` names the rows whose final states and logits are returned (default:
        the last token of each sequence): a prompt padded to a captured length names its real last one."""
        h = self.model.embed_tokens(token_ids).float()
        latents, pending = [], None  # pending: a layer's output, added into h by the next norm
        for i, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(h) if pending is None else layer.input_layernorm(pending, h)
            layer_context = context[i] if context else None
            if isinstance(batch, PCPPlan):
                attn, latent = context_parallel_attention(layer.self_attn, x, batch, layer_context)
            else:
                attn, latent = layer.self_attn(x, batch, layer_context)
            x = layer.post_attention_layernorm(self.tp.all_reduce(attn), h)
            if isinstance(layer.mlp, MoE) and self.tp.size > 1:
                h, pending = self._moe(layer.mlp, h, x), None
            else:
                pending = self.tp.all_reduce(layer.mlp(x))
            latents.append(latent)
        index = batch.last_token_index if last_index is None else last_index
        last = self.model.norm.unrounded(h[index] if pending is None else h[index] + pending[index])
        return PrefillOutput(last_hidden=last, logits=float32_logits(last, self.lm_head.weight), latents=latents)

    def _moe(self, moe: MoE, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h + moe(x)`` under TP, each rank routing its 1/tp of the tokens (see the module docstring)."""
        mine = self.tp.my_tokens(x.shape[0])
        finish = moe.start_routed(x[mine])
        local = h[mine]
        if moe.shared_experts is not None:  # while the routed experts' combine is in flight
            with moe.beside_combine(x.device):
                local = local + self.tp.reduce_scatter(moe.shared_experts(x))
        return self.tp.all_gather(local + finish(), x.shape[0])

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


def float32_logits(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows @ weight.T`` [B, vocab] in float32 from float32 ``rows`` and ``weight`` as stored.

    The final norm and the head run in float32 for the last rows only (B of them). bf16 keeps 8
    significant bits, so logits rounded to it are 2^-8 to 2^-7 of their size apart: at the one-scale
    test checkpoints' top logits of about 0.1, 4.9e-4, where float32's top two are often 1e-5 to 5e-4
    apart. A bf16 head makes such near-ties exact ties, which argmax settles by the lower token id, not
    by the model. SGLang (``--enable-fp32-lm-head``) and vLLM 0.32 (``hf_overrides`` ``head_dtype``
    float32) offer a float32 head, both off by default; the truth runs' vLLM 0.26 decodes with a bf16
    one. On the CPU, 450 prompts on three bf16 checkpoints: the first token equal to float32's on 446
    with a bf16 head, on all 450 with this one (``benchmarks/probes/probe_head_precision.py``).

    On CUDA the rows are split into bf16 ``hi + lo`` (16 of float32's 24 significant bits), both halves
    stacked into one GEMM with cuBLAS's float32 output (``out_dtype``), so the weight is read once as
    by a bf16 head: at DeepSeek-V3's width and vocabulary, 16 rows take 475 us against the bf16 head's
    441 us on an H200 (two GEMMs, one per half, took 864 us). On the CPU the weight is upcast."""
    if weight.dtype == torch.float32:
        return F.linear(rows, weight)
    if not rows.is_cuda:
        return F.linear(rows, weight.float())
    hi = rows.to(weight.dtype)
    halves = torch.mm(torch.cat([hi, (rows - hi.float()).to(weight.dtype)]), weight.t(), out_dtype=torch.float32)
    return halves[: len(rows)] + halves[len(rows) :]


def quantizing(norm: RMSNorm) -> FP8RMSNorm:
    """``norm`` (on the meta device) as an :class:`FP8RMSNorm`: its output quantized for FP8 linears."""
    return FP8RMSNorm(norm.weight.shape[0], norm.eps, dtype=norm.weight.dtype, device=norm.weight.device)


def merged_parts(root: nn.Module, module_name: str) -> tuple[tuple[str, int], ...]:
    """The checkpoint tensors stacked into ``root``'s submodule ``module_name`` (their names beside it,
    this rank's rows of each: its parent's ``merged_rows``), or () for a module that stacks none."""
    parent, _, child = module_name.rpartition(".")
    return getattr(root.get_submodule(parent), "merged_rows", {}).get(child, ())


def fp8_shard_aligned(linear: nn.Linear, split_dim: int | None, tp_size: int, parts: tuple[int, ...] = ()) -> bool:
    """Whether a TP shard of this (local-shape) linear layer holds whole 128x128 weight blocks of a shape
    torch's FP8 GEMM runs (``workers.fp8.block_gemm_shape_ok``) and, when split, its split width is a
    multiple of 128 (so every shard starts on a block boundary). A stack of checkpoint tensors
    (``parts``: the local rows of each) also needs every part but the last to end on a block boundary,
    so that their block scales stack."""
    parts = parts or (linear.out_features,)
    if not block_gemm_shape_ok(linear.in_features, linear.out_features) or any(rows % BLOCK for rows in parts[:-1]):
        return False
    return split_dim != 0 or tp_size == 1 or parts[-1] % BLOCK == 0
