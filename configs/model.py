"""Model configurations: HF-format ``config.json`` files, validated on load.

The built-in shapes live beside this file in ``models/*.json`` (the same keys
as the checkpoints' own ``config.json``), so a checkpoint directory and a
built-in name load through one path::

    load_model_config("tiny")                       # built-in
    load_model_config("/ckpt/DeepSeek-V2-Lite")     # a directory with config.json
    load_model_config("my_config.json", num_hidden_layers=2)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attention.mla import MLAConfig
from attention.rope import YarnScaling

MODELS_DIR = Path(__file__).with_name("models")
ALIASES = {"deepseek-r1": "deepseek-v3"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def builtin_models() -> list[str]:
    return sorted([p.stem for p in MODELS_DIR.glob("*.json")] + list(ALIASES))


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
    n_routed_experts: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    dtype: torch.dtype = torch.bfloat16
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {key} must be a positive integer, got {value!r}")

    @property
    def hidden_size(self) -> int:
        return self.attention.hidden_size

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads

    def is_moe_layer(self, index: int) -> bool:
        return bool(self.n_routed_experts) and index >= self.first_k_dense_replace and index % self.moe_layer_freq == 0

    def check_dense(self) -> None:
        """Raise unless every layer has a dense MLP (MoE layers are not implemented yet)."""
        moe = [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]
        if moe:
            raise ValueError(
                f"{self.name}: layers {moe[0]}..{moe[-1]} are MoE (n_routed_experts={self.n_routed_experts}) and MoE "
                f"layers are not supported yet; run its dense layers only with num_hidden_layers <= "
                f"{self.first_k_dense_replace} (mlapool prefill --num-layers {self.first_k_dense_replace})"
            )

    def check_tp(self, tp_size: int) -> None:
        """Raise ``ValueError`` unless ``tp_size`` divides the heads and the MLP width."""
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"TP degree must be a positive integer, got {tp_size!r}")
        for what, n in (("attention heads", self.num_heads), ("intermediate_size", self.intermediate_size)):
            if n % tp_size:
                valid = [d for d in range(1, min(n, 64) + 1) if self.num_heads % d == 0 and self.intermediate_size % d == 0]
                raise ValueError(f"TP={tp_size} does not divide {self.name}'s {n} {what}; valid TP degrees: {valid}")

    def fingerprint(self) -> str:
        """Stable hash of the shape-defining fields (for KV handoff compatibility checks)."""
        payload = json.dumps({k: v for k, v in self.source.items() if not k.startswith("_")}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def load_model_config(name_or_path: str | Path, **overrides: Any) -> ModelConfig:
    """Load a built-in model by name, a ``config.json``, or a checkpoint directory holding one.

    ``overrides`` replace keys of the JSON before validation (e.g. ``num_hidden_layers=2``).
    """
    text = str(name_or_path)
    builtin = MODELS_DIR / f"{ALIASES.get(text, text)}.json"
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
        n_routed_experts=raw.get("n_routed_experts"),
        first_k_dense_replace=raw.get("first_k_dense_replace", 0),
        moe_layer_freq=raw.get("moe_layer_freq", 1),
        dtype=DTYPES[dtype_name],
        source=dict(raw),
    )


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
