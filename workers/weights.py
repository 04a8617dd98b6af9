"""Loading HF-format DeepSeek checkpoints, each tensor-parallel rank reading only its shard.

A checkpoint directory holds ``config.json`` and safetensors files, with
``model.safetensors.index.json`` mapping tensor names to files when sharded.
Tensors are read through ``safe_open(...).get_slice``, so a rank reads the rows
or columns it keeps and never the whole tensor. Names are DeepSeek's HF names
(``model.layers.{i}.self_attn.kv_b_proj.weight``, ...); tensors the model does
not use (MoE experts, the MTP layer, layers past ``num_layers``) are ignored.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from workers.model import DeepseekPrefillModel


def checkpoint_index(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of the checkpoint at ``path``."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {path} has no *.safetensors files")
    names = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


def check_checkpoint(model: DeepseekPrefillModel, path: Path) -> dict[Path, list[tuple[str, str]]]:
    """Check the checkpoint against the model from metadata alone (works on a ``meta`` model).

    Raises ``ValueError`` naming missing, mis-shaped or quantized (FP8) tensors.
    Returns the (parameter, tensor) names to read, by file.
    """
    index = checkpoint_index(path)
    params = dict(model.named_parameters())
    source = {name: name for name in params}
    if model.config.tie_word_embeddings and "lm_head.weight" not in index:
        source["lm_head.weight"] = "model.embed_tokens.weight"
    missing = sorted(name for name, src in source.items() if src not in index)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {path} is missing {len(missing)} tensor(s) the model needs: {shown}")
    by_file = defaultdict(list)
    for name, src in source.items():
        by_file[index[src]].append((name, src))
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as handle:
            present = set(handle.keys())
            for name, src in names:
                if src not in present:
                    raise ValueError(f"checkpoint {path}: {file.name} does not contain {src}, which its index maps there")
                tensor_slice = handle.get_slice(src)
                expected = _full_shape(model, name, params[name])
                if list(tensor_slice.get_shape()) != expected:
                    raise ValueError(
                        f"checkpoint tensor {src} has shape {list(tensor_slice.get_shape())}, "
                        f"the model expects {expected} ({file.name})"
                    )
                if tensor_slice.get_dtype() in ("F8_E4M3", "F8_E5M2"):
                    raise ValueError(
                        f"checkpoint tensor {src} is FP8 ({tensor_slice.get_dtype()}); quantized checkpoints are "
                        "not supported yet: convert them to bf16 first"
                    )
    return dict(by_file)


def load_weights(model: DeepseekPrefillModel, checkpoint: str | Path | None, seed: int, *, draw_device: str | None = None) -> None:
    """The pool's weights: this rank's shard of ``checkpoint``, or without one the seeded random weights
    (drawn on ``draw_device``; see :meth:`DeepseekPrefillModel.init_random_weights`)."""
    if checkpoint:
        load_checkpoint(model, checkpoint)
    else:
        model.init_random_weights(seed, draw_device=draw_device)


@torch.no_grad()
def load_checkpoint(model: DeepseekPrefillModel, path: Path) -> None:
    """Copy this rank's shard of every parameter from the checkpoint at ``path``, after checking it all."""
    params = dict(model.named_parameters())
    tp = model.tp
    for file, names in sorted(check_checkpoint(model, path).items()):
        with safe_open(file, framework="pt") as handle:
            for name, src in names:
                shard = _read_shard(handle.get_slice(src), tp.split_dim(name), tp.rank, tp.size)
                params[name].copy_(shard)


def _full_shape(model: DeepseekPrefillModel, name: str, param: torch.Tensor) -> list[int]:
    shape = list(param.shape)
    dim = model.tp.split_dim(name)
    if dim is not None:
        shape[dim] *= model.tp.size
    return shape


def _read_shard(tensor_slice, dim: int | None, rank: int, size: int) -> torch.Tensor:
    if dim is None or size == 1:
        return tensor_slice[:]
    length = tensor_slice.get_shape()[dim] // size
    rows = slice(rank * length, (rank + 1) * length)
    return tensor_slice[rows] if dim == 0 else tensor_slice[:, rows]
