"""Model configurations: HF-format ``config.json`` files, validated on load.

The built-in shapes live beside this file in ``models/*.json`` (the checkpoints'
own ``config.json`` fields), so a checkpoint directory and a built-in name load
through one path::

    load_model_config("tiny")                       # built-in
    load_model_config("/ckpt/DeepSeek-V2-Lite")     # a directory with config.json
    load_model_config("my_config.json", num_hidden_layers=2)

Everything that changes the computation is read from the config's fields,
never from the model's name: the MoE routing (:class:`MoEConfig`: scoring
function, top-k method, groups, scaling) and the FP8 block quantization of the
weights (:class:`FP8Config`, the ``quantization_config`` block). Fields a
transformers-written config leaves out take the defaults of its
``model_type`` (``deepseek_v3``/``kimi_k2``: sigmoid + ``noaux_tc``;
``deepseek_v2``: softmax + ``greedy``), as transformers' own classes do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attention.mla import MLAConfig
from attention.rope import YarnScaling
from kv.frames import config_fingerprint

MODELS_DIR = Path(__file__).with_name("models")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# routing of configs that leave scoring_func / topk_method out: their model type's (transformers' classes)
ROUTING_DEFAULTS = {
    "deepseek_v3": ("sigmoid", "noaux_tc"),
    "kimi_k2": ("sigmoid", "noaux_tc"),
    "deepseek_v2": ("softmax", "greedy"),
}
ARCHITECTURE_TYPES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}


def builtin_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


# how a MoE layer orders its expert-parallel work (configs.pool.PoolConfig.ep_schedule explains each)
EP_SCHEDULES = ("all-to-all", "local-first", "two-micro-batches")
# where a MoE layer rounds (configs.pool.PoolConfig.moe_rounding explains each)
MOE_ROUNDINGS = ("reference", "vllm")
# the libraries that run FP8 GEMMs, and the choice among them (configs.pool.PoolConfig.fp8_gemm explains each;
# the worker resolves "auto")
FP8_GEMM_LIBRARIES = ("torch", "deep_gemm")
FP8_GEMMS = ("auto", *FP8_GEMM_LIBRARIES)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The routed-expert MLP of a DeepSeek-family model (HF config names).

    Routing, per token (``workers.moe.route``; logits ``router(x)`` in float32):

    - ``noaux_tc`` (DeepSeek-V3/R1, Kimi-K2): ``s = scoring(logits)``; experts are *chosen* by
      ``s + e_score_correction_bias``, in the ``topk_group`` groups whose two best biased scores sum
      highest; their weights are the unbiased ``s``, divided by their sum if ``norm_topk_prob``, then
      times ``routed_scaling_factor``.
    - ``greedy`` / ``group_limited_greedy`` (DeepSeek-V2, V2-Lite): ``s = scoring(logits)``; the top
      ``num_experts_per_tok`` of ``s`` (within the ``topk_group`` groups of highest max score for the
      group-limited method); weights divided by their sum if ``norm_topk_prob``, else times
      ``routed_scaling_factor`` (DeepSeek-V2's own rule).

    Layer ``i`` is MoE when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``; every MoE
    layer adds ``n_shared_experts`` shared experts (one MLP of width ``n_shared_experts *
    moe_intermediate_size``) that every token goes through.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def __post_init__(self) -> None:
        for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group", "moe_layer_freq"):
            _positive_int(key, getattr(self, key))
        for key in ("n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; valid: {', '.join(SCORING_FUNCS)}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; valid: {', '.join(TOPK_METHODS)}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        if not isinstance(self.routed_scaling_factor, (int, float)) or not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be a positive number, got {self.routed_scaling_factor!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        if self.grouped:
            if self.n_routed_experts % self.n_group:
                valid = [g for g in range(1, self.n_routed_experts + 1) if self.n_routed_experts % g == 0]
                raise ValueError(
                    f"n_group {self.n_group} does not divide n_routed_experts ({self.n_routed_experts}); valid n_group: {valid}"
                )
            if self.topk_group > self.n_group:
                raise ValueError(f"topk_group {self.topk_group} exceeds n_group ({self.n_group}); valid: 1..{self.n_group}")
            per_group = self.n_routed_experts // self.n_group
            if self.topk_group * per_group < self.num_experts_per_tok:
                raise ValueError(
                    f"topk_group {self.topk_group} x {per_group} experts per group leaves fewer than num_experts_per_tok "
                    f"({self.num_experts_per_tok}) experts to choose from; valid topk_group: "
                    f"{-(-self.num_experts_per_tok // per_group)}..{self.n_group}"
                )
            if self.topk_method == "noaux_tc" and per_group < 2:
                raise ValueError(
                    f"noaux_tc ranks groups by their two best experts: n_group {self.n_group} leaves {per_group} expert "
                    f"per group; valid n_group: divisors of {self.n_routed_experts} up to {self.n_routed_experts // 2}"
                )

    @property
    def grouped(self) -> bool:
        """Whether experts are chosen within the best groups (a group-limited method with > 1 group)."""
        return self.topk_method != "greedy" and self.n_group > 1

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size


@dataclass(frozen=True, kw_only=True)
class FP8Config:
    """DeepSeek's FP8 checkpoint format (``quantization_config``): ``float8_e4m3fn`` weights with a
    float32 ``weight_scale_inv`` per ``weight_block_size`` block (``w = q * scale``; edge blocks are
    partial), activations quantized at run time (``dynamic``). Embeddings, ``lm_head``, norms and the
    router gate stay unquantized."""

    weight_block_size: tuple[int, int] = (128, 128)

    @classmethod
    def from_dict(cls, raw: Any, name: str) -> FP8Config:
        if not isinstance(raw, dict):
            raise ValueError(f"{name}: quantization_config must be an object, got {raw!r}")
        expected = {"quant_method": ("fp8",), "fmt": ("e4m3",), "activation_scheme": ("dynamic",)}
        for key, valid in expected.items():
            value = raw.get(key, valid[0] if key != "quant_method" else None)
            if value not in valid:
                raise ValueError(
                    f"{name}: quantization_config {key} {value!r} is not supported; valid: {', '.join(map(repr, valid))}"
                )
        block = raw.get("weight_block_size")
        if block != [128, 128] and block != (128, 128):
            raise ValueError(f"{name}: quantization_config weight_block_size {block!r} is not supported; valid: [128, 128]")
        return cls(weight_block_size=(128, 128))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A DeepSeek-architecture decoder: embedding, MLA + dense/MoE MLP layers, norm, lm_head."""

    name: str
    vocab_size: int
    intermediate_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    attention: MLAConfig
    tie_word_embeddings: bool = False
    moe: MoEConfig | None = None
    quantization: FP8Config | None = None
    dtype: torch.dtype = torch.bfloat16
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{self.name}: {key} must be a positive integer, got {value!r}")

    @property
    def hidden_size(self) -> int:
        return self.attention.hidden_size

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads

    def is_moe_layer(self, index: int) -> bool:
        moe = self.moe
        return moe is not None and index >= moe.first_k_dense_replace and index % moe.moe_layer_freq == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def check_tp(self, tp_size: int) -> None:
        """Raise ``ValueError`` unless ``tp_size`` divides the heads and every TP-split MLP width
        (the dense layers' and the shared experts'; routed experts are split by expert, not by TP)."""
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"TP degree must be a positive integer, got {tp_size!r}")
        widths = [("attention heads", self.num_heads)]
        if len(self.moe_layers) < self.num_hidden_layers:
            widths.append(("intermediate_size", self.intermediate_size))
        if self.moe_layers and self.moe.n_shared_experts:
            widths.append(("shared experts' width (n_shared_experts x moe_intermediate_size)", self.moe.shared_intermediate_size))
        for what, n in widths:
            if n % tp_size:
                valid = [d for d in range(1, min(n, 64) + 1) if all(w % d == 0 for _, w in widths)]
                raise ValueError(f"TP={tp_size} does not divide {self.name}'s {n} {what}; valid TP degrees: {valid}")

    def fingerprint(self) -> str:
        """Stable hash of the checkpoint's config (for KV handoff compatibility checks)."""
        return config_fingerprint(self.source)


def load_model_config(name_or_path: str | Path, **overrides: Any) -> ModelConfig:
    """Load a built-in model by name, a ``config.json``, or a checkpoint directory holding one.

    ``overrides`` replace keys of the JSON before validation (e.g. ``num_hidden_layers=2``).
    """
    text = str(name_or_path)
    builtin = MODELS_DIR / f"{text}.json"
    path = Path(text)
    if builtin.is_file():
        path, name = builtin, text
    elif path.is_dir():
        path, name = path / "config.json", path.name
    else:
        name = path.stem
    if not path.is_file():
        raise ValueError(
            f"model {text!r} is neither a built-in model ({', '.join(builtin_models())}) "
            "nor a config.json / checkpoint directory that exists"
        )
    raw = json.loads(path.read_text())
    unknown = set(overrides) - set(raw) - {"num_hidden_layers", "max_position_embeddings", "torch_dtype"}
    if unknown:
        raise ValueError(f"unknown config override(s) {sorted(unknown)}; valid keys are those of {path}")
    return model_config_from_dict({**raw, **overrides}, name=name)


def model_config_from_dict(raw: dict[str, Any], *, name: str = "model") -> ModelConfig:
    """Validate an HF-style DeepSeek config dict into a :class:`ModelConfig`."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"{name}: config is missing {missing}")
    dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if dtype_name not in DTYPES:
        raise ValueError(f"{name}: torch_dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act {raw['hidden_act']!r} is not supported; valid: 'silu'")
    attention = MLAConfig(
        hidden_size=raw["hidden_size"],
        num_heads=raw["num_attention_heads"],
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=raw.get("kv_lora_rank", 512),
        qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=raw.get("qk_rope_head_dim", 64),
        v_head_dim=raw.get("v_head_dim", 128),
        rope_theta=float(_rope(raw).get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_interleave=raw.get("rope_interleave", True),
        yarn=_yarn(raw, name),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        attention_bias=raw.get("attention_bias", False),
    )
    return ModelConfig(
        name=name,
        vocab_size=raw["vocab_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        attention=attention,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        moe=_moe(raw, name),
        quantization=FP8Config.from_dict(raw["quantization_config"], name) if raw.get("quantization_config") else None,
        dtype=DTYPES[dtype_name],
        source=dict(raw),
    )


def _moe(raw: dict[str, Any], name: str) -> MoEConfig | None:
    """The routed experts, or None for an all-dense model (no ``n_routed_experts``)."""
    if not raw.get("n_routed_experts"):
        return None
    model_type = raw.get("model_type") or ARCHITECTURE_TYPES.get((raw.get("architectures") or [None])[0])
    defaults = ROUTING_DEFAULTS.get(model_type)
    routing = {}
    for key, default in zip(("scoring_func", "topk_method"), defaults or (None, None)):
        routing[key] = raw.get(key, default)
        if routing[key] is None:
            valid = SCORING_FUNCS if key == "scoring_func" else TOPK_METHODS
            raise ValueError(
                f"{name}: config has no {key} and its model_type {model_type!r} implies none "
                f"(known: {', '.join(ROUTING_DEFAULTS)}); set {key} to one of {', '.join(valid)}"
            )
    if raw.get("num_experts_per_tok") is None:
        raise ValueError(f"{name}: n_routed_experts is set but num_experts_per_tok is missing")
    if raw.get("moe_intermediate_size") is None:
        raise ValueError(f"{name}: n_routed_experts is set but moe_intermediate_size is missing")
    try:
        return MoEConfig(
            n_routed_experts=raw["n_routed_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"],
            moe_intermediate_size=raw["moe_intermediate_size"],
            n_shared_experts=_or_default(raw, "n_shared_experts", 0),
            n_group=_or_default(raw, "n_group", 1),
            topk_group=_or_default(raw, "topk_group", 1),
            norm_topk_prob=raw.get("norm_topk_prob", routing["topk_method"] == "noaux_tc"),
            routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
            first_k_dense_replace=raw.get("first_k_dense_replace", 0),
            moe_layer_freq=raw.get("moe_layer_freq", 1),
            **routing,
        )
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _or_default(raw: dict[str, Any], key: str, default: Any) -> Any:
    """``raw[key]``, or ``default`` when it is missing or null (transformers writes null for unused fields)."""
    value = raw.get(key)
    return default if value is None else value


def _positive_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope block, whichever key holds it (``rope_scaling`` or transformers 5's ``rope_parameters``)."""
    return dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})


def _yarn(raw: dict[str, Any], name: str) -> YarnScaling | None:
    rope = _rope(raw)
    kind = rope.get("type", rope.get("rope_type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        raise ValueError(f"{name}: rope scaling type {kind!r} is not supported; valid: 'yarn' or none")
    return YarnScaling(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 1.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        truncate=bool(rope.get("truncate", True)),
    )
