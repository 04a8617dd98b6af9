"""One rank's weights: read from an HF checkpoint directory, or drawn at random in the same format.

A checkpoint directory holds ``config.json`` and safetensors files, with
``model.safetensors.index.json`` mapping tensor names to files when sharded.
Names are DeepSeek's HF names (``model.layers.{i}.self_attn.kv_b_proj.weight``,
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, ...). Every parameter
of a rank's model is filled from the tensors it needs (:func:`load_plan`):

- most parameters from the tensor of the same name; TP-split weights read only
  this rank's rows or columns;
- the stacked routed experts ``mlp.experts.gate_up_proj [E_r, 2I, H]`` and
  ``down_proj [E_r, H, I]`` from ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``
  of this rank's experts ``e`` only;
- a stack of checkpoint tensors (a module's ``merged_rows``, e.g. the dense MLPs'
  ``gate_up_proj`` from ``gate_proj`` and ``up_proj``), each part's rows (its TP
  shard's) into its place;
- ``lm_head.weight`` from the embedding when the config ties them and the
  checkpoint has no ``lm_head``.

Tensors are read with plain reads (``workers.checkpoint_files``; not a memory
map, whose touched pages would stay resident): a rank opens only the files
holding its tensors and reads only its slices, in pieces of at most
``READ_BYTES``, so host memory never holds the model. Tensors the model does not
use (other ranks' experts, the MTP layers after the last decoder layer, layers
past ``num_layers``) are never read.

FP8 tensors (DeepSeek's format: ``float8_e4m3fn`` with ``<name>_scale_inv`` per
128x128 block, ``workers.fp8``) are kept as they are by ``FP8Linear`` layers and
by FP8 experts that DeepGEMM runs (``Experts.block``), requantized per output row
for the other FP8 experts, and dequantized to the compute dtype for everything
else, on the rank's device.

Random weights (no checkpoint) come from :class:`RandomWeights`, a checkpoint
drawn on the fly: each tensor ``N(0, std)`` (norms ``1 + N(0, std)``) from a
generator seeded by ``(seed, name)``, block-quantized when the config says FP8.
Every rank layout therefore sees the same weights, and the same seed gives the
same weights on every device of one type (CPU and CUDA generators differ).
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from configs.model import ModelConfig
from workers.checkpoint_files import SafetensorsFile
from workers.fp8 import BLOCK, FP8Linear, block_dequantize, block_quantize, requantize_rows
from workers.model import DeepseekPrefillModel, merged_parts
from workers.moe import Experts

logger = logging.getLogger(__name__)

READ_BYTES = 256 * 2**20  # largest piece of a tensor read into host memory at once
SCALE = "_scale_inv"  # suffix of a block-quantized weight's scales


@dataclass(frozen=True)
class Piece:
    """Fill ``param[dest]`` with ``tensor[rows, cols]`` (``cols`` None for 1-D tensors)."""

    param: str
    tensor: str
    full_shape: tuple[int, ...]
    rows: slice
    cols: slice | None
    dest: tuple = ()


@dataclass
class LoadReport:
    """How loading went on one rank: seconds, bytes read from the source, files opened, and the worker
    process's peak resident host memory before and after (``ru_maxrss``)."""

    seconds: float
    bytes_read: int
    files_opened: int
    peak_host_mib_before: float
    peak_host_mib: float


# ---- sources -------------------------------------------------------------------------------------
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
        with SafetensorsFile(file) as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


class CheckpointReader:
    """Slices of the tensors of a safetensors checkpoint; a file is opened when first needed."""

    chunk_bytes = READ_BYTES  # host memory is the limit: read big tensors in pieces

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.index = checkpoint_index(self.path)
        self._handles: dict[Path, SafetensorsFile] = {}
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self.index:
            raise ValueError(f"checkpoint {self.path} has no tensor {name}")
        file = self.index[name]
        if file not in self._handles:
            self._handles[file] = SafetensorsFile(file)
        handle = self._handles[file]
        if name not in handle.tensors:
            raise ValueError(f"checkpoint {self.path}: {file.name} does not contain {name}, which its index maps there")
        return handle

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def is_fp8(self, name: str) -> bool:
        return self._file(name).dtype(name) in ("F8_E4M3", "F8_E5M2")

    def read(self, name: str, rows: slice, cols: slice | None) -> torch.Tensor:
        tensor = self._file(name).read(name, rows, cols)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()

    @property
    def files_opened(self) -> int:
        return len(self._handles)


class RandomWeights:
    """A seeded random checkpoint with the model's tensor names and shapes (FP8 weights and scales where
    the config is quantized; no ``lm_head`` when the config ties it to the embedding), drawn on
    ``device`` one tensor at a time."""

    chunk_bytes = None  # drawn on the device: no host memory to spare
    bytes_read = files_opened = 0

    def __init__(self, model: DeepseekPrefillModel, seed: int, device: torch.device, std: float = 0.02) -> None:
        self.seed, self.device, self.std = seed, device, std
        self.shapes = {piece.tensor: piece.full_shape for piece in load_plan(model, full=True)}
        if model.config.tie_word_embeddings:
            self.shapes.pop("lm_head.weight")
        fp8 = model.config.quantization is not None
        self.quantized = {name for name in self.shapes if fp8 and _quantizable(name)}
        self._last: tuple[str, torch.Tensor, torch.Tensor | None] | None = None  # the last tensor drawn (and its scales)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes or (name.endswith(SCALE) and name.removesuffix(SCALE) in self.quantized)

    def shape(self, name: str) -> tuple[int, ...]:
        if name.endswith(SCALE):
            rows, cols = self.shapes[name.removesuffix(SCALE)]
            return -(-rows // BLOCK), -(-cols // BLOCK)
        return self.shapes[name]

    def is_fp8(self, name: str) -> bool:
        return name in self.quantized

    def read(self, name: str, rows: slice, cols: slice | None) -> torch.Tensor:
        weight = name.removesuffix(SCALE)
        if self._last is None or self._last[0] != weight:
            full = self._draw(weight)
            self._last = (weight, *block_quantize(full)) if weight in self.quantized else (weight, full, None)
        full = self._last[2] if name.endswith(SCALE) else self._last[1]
        return full[rows] if cols is None else full[rows, cols]

    def _draw(self, name: str) -> torch.Tensor:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()[:7]
        gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest, "little"))
        full = self.std * torch.randn(self.shapes[name], generator=gen, device=self.device)
        return full + 1 if name.endswith("norm.weight") else full


def _quantizable(name: str) -> bool:
    """Whether DeepSeek's FP8 checkpoints store this tensor quantized: every linear layer's weight but
    ``lm_head``'s and the router's (embeddings, norms and biases are never quantized)."""
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


# ---- what each parameter reads ---------------------------------------------------------------------
def load_plan(model: DeepseekPrefillModel, *, full: bool = False) -> Iterator[Piece]:
    """The checkpoint pieces that fill this rank's parameters (``full``: the whole tensors, as a TP=1,
    EP=1 model reads them; used to list and check a checkpoint's tensors)."""
    tp = model.tp
    for name, param in model.named_parameters():
        if name.endswith(SCALE) or name.endswith("_proj_scale"):
            continue  # filled with their weights
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, Experts):
            yield from _expert_pieces(model, name, module, full)
            continue
        parent, _, child = module_name.rpartition(".")
        parts = merged_parts(model, module_name) or ((child, param.shape[0]),)
        dim, start = tp.split_dim(name), 0
        for part, local_rows in parts:  # one part, the tensor of the parameter's own name, unless merged
            shape = [local_rows, *param.shape[1:]]
            if dim is not None:
                shape[dim] *= tp.size
            rows, cols = slice(None), (slice(None) if param.dim() == 2 else None)
            if dim is not None and tp.size > 1 and not full:
                mine = slice(tp.rank * shape[dim] // tp.size, (tp.rank + 1) * shape[dim] // tp.size)
                rows, cols = (mine, cols) if dim == 0 else (rows, mine)
            dest = (slice(start, start + local_rows),) if len(parts) > 1 else ()
            yield Piece(name, f"{parent}.{part}.{kind}" if dest else name, tuple(shape), rows, cols, dest)
            start += local_rows


def _expert_pieces(model: DeepseekPrefillModel, name: str, experts: Experts, full: bool) -> Iterator[Piece]:
    prefix, kind = name.rsplit(".", 1)
    hidden, width = model.config.hidden_size, experts.intermediate
    local = model.ep.experts(model.config.moe.n_routed_experts)
    everyone = range(model.config.moe.n_routed_experts) if full else local
    for e in everyone:
        j = e - local.start
        if kind == "gate_up_proj":
            for part, at in (("gate_proj", slice(0, width)), ("up_proj", slice(width, 2 * width))):
                yield Piece(name, f"{prefix}.{e}.{part}.weight", (width, hidden), slice(None), slice(None), (j, at))
        else:
            yield Piece(name, f"{prefix}.{e}.down_proj.weight", (hidden, width), slice(None), slice(None), (j,))


def check_checkpoint(model: DeepseekPrefillModel, path: str | Path) -> None:
    """Check, from metadata alone (works on a ``meta`` model), that the checkpoint has every tensor the
    model reads with the right shape, and a scale tensor of the right shape beside each FP8 one.
    Raises ``ValueError`` naming the first tensors that are missing or mis-shaped."""
    reader = CheckpointReader(path)
    try:
        pieces = [_tied(piece, model, reader) for piece in load_plan(model, full=True)]
        missing = sorted({p.tensor for p in pieces if p.tensor not in reader})
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint {path} is missing {len(missing)} tensor(s) the model needs: {shown}")
        for piece in pieces:
            _check_tensor(reader, piece.tensor, piece.full_shape, path)
    finally:
        reader.close()


def check_checkpoint_of(config: ModelConfig, path: str | Path) -> None:
    """:func:`check_checkpoint` for the whole model of ``config`` (every rank's shards and experts),
    from the files' headers alone: the driver's check before any worker starts."""
    check_checkpoint(DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, device="meta"), path)


def _tied(piece: Piece, model: DeepseekPrefillModel, source) -> Piece:
    """``lm_head`` read from the embedding when the config ties them and the source has no ``lm_head``."""
    if piece.tensor == "lm_head.weight" and model.config.tie_word_embeddings and piece.tensor not in source:
        return Piece(piece.param, "model.embed_tokens.weight", piece.full_shape, piece.rows, piece.cols)
    return piece


def _check_tensor(source, name: str, shape: tuple[int, ...], where) -> None:
    found = source.shape(name)
    if found != tuple(shape):
        raise ValueError(f"checkpoint tensor {name} has shape {list(found)}, the model expects {list(shape)} ({where})")
    if source.is_fp8(name):
        scale = name + SCALE
        expected = tuple(-(-n // BLOCK) for n in shape)
        if scale not in source:
            raise ValueError(f"checkpoint tensor {name} is FP8 but {scale} (its 128x128 block scales) is missing ({where})")
        if source.shape(scale) != expected:
            raise ValueError(f"checkpoint tensor {scale} has shape {list(source.shape(scale))}, expected {list(expected)} ({where})")


# ---- loading -------------------------------------------------------------------------------------
def load_weights(
    model: DeepseekPrefillModel, checkpoint: str | Path | None = None, seed: int = 0, *, draw_device: str | None = None
) -> LoadReport:
    """Fill this rank's parameters from ``checkpoint``, or without one with the seeded random weights
    (drawn on ``draw_device``, default: where the parameters live)."""
    device = model.lm_head.weight.device
    if not checkpoint:
        return load_from(model, RandomWeights(model, seed, torch.device(draw_device) if draw_device else device))
    source = CheckpointReader(checkpoint)
    try:
        return load_from(model, source)
    finally:
        source.close()


@torch.no_grad()
def load_from(model: DeepseekPrefillModel, source) -> LoadReport:
    """Fill every parameter of ``model`` from ``source`` (:class:`CheckpointReader` or :class:`RandomWeights`)."""
    started, before = time.perf_counter(), _peak_rss_mib()
    params = dict(model.named_parameters())
    dequantized = 0
    for piece in load_plan(model):
        piece = _tied(piece, model, source)
        _check_tensor(source, piece.tensor, piece.full_shape, getattr(source, "path", "random weights"))
        owner = model.get_submodule(piece.param.rpartition(".")[0])
        param = params[piece.param]
        if isinstance(owner, FP8Linear) and piece.param.endswith(".weight"):
            _load_block_fp8(source, piece, param, params[piece.param + SCALE])
        elif isinstance(owner, Experts) and owner.block:  # expert j's blocks as they are (piece.dest: j, then its rows)
            expert, rows = piece.dest[0], piece.dest[1:]
            _load_block_fp8(source, replace(piece, dest=rows), param[expert], params[piece.param + "_scale"][expert])
        elif isinstance(owner, Experts) and owner.fp8:
            scale = params[piece.param + "_scale"]
            for rows, part in _read_float(source, piece, torch.float32, param.device):
                q, s = requantize_rows(part)
                param[piece.dest][rows].copy_(q)
                scale[piece.dest][rows].copy_(s)
        else:
            dequantized += source.is_fp8(piece.tensor)
            for rows, part in _read_float(source, piece, param.dtype, param.device):
                param[piece.dest][rows].copy_(part)
    if dequantized and model.config.quantization is not None:
        logger.info("%d FP8 weight(s) dequantized to %s at load", dequantized, model.dtype)
    return LoadReport(
        seconds=round(time.perf_counter() - started, 2),
        bytes_read=source.bytes_read,
        files_opened=source.files_opened,
        peak_host_mib_before=before,
        peak_host_mib=_peak_rss_mib(),
    )


def _row_chunks(piece: Piece, source, element_bytes: int) -> Iterator[tuple[slice, slice]]:
    """``(rows of the destination, rows of the tensor)`` in pieces of at most ``source.chunk_bytes``
    (multiples of 128 rows, so FP8 pieces keep whole blocks; one piece when it has no limit)."""
    start, stop, _ = piece.rows.indices(piece.full_shape[0])
    step = stop - start
    if source.chunk_bytes is not None:
        width = len(range(*piece.cols.indices(piece.full_shape[1]))) if piece.cols else 1
        step = max(BLOCK, source.chunk_bytes // max(1, width * element_bytes) // BLOCK * BLOCK)
    for a in range(start, stop, max(step, 1)):
        b = min(stop, a + step)
        yield slice(a - start, b - start), slice(a, b)


def _read_float(source, piece: Piece, dtype: torch.dtype, device: torch.device) -> Iterator[tuple[slice, torch.Tensor]]:
    """Pieces of ``source[piece]`` in ``dtype`` on ``device`` (FP8 tensors dequantized with their scales)."""
    fp8 = source.is_fp8(piece.tensor)
    for dest_rows, rows in _row_chunks(piece, source, 1 if fp8 else 2):
        data = source.read(piece.tensor, rows, piece.cols).to(device)
        if fp8:
            cols = piece.cols.indices(piece.full_shape[1]) if piece.cols else (0, 1, 1)
            scale_rows = slice(rows.start // BLOCK, -(-rows.stop // BLOCK))
            scale_cols = slice(cols[0] // BLOCK, -(-cols[1] // BLOCK))
            scale = source.read(piece.tensor + SCALE, scale_rows, scale_cols).to(device)
            data = block_dequantize(data, scale, dtype, row_start=rows.start, col_start=cols[0])
        yield dest_rows, data.to(dtype)


def _load_block_fp8(source, piece: Piece, weight: nn.Parameter, scale: nn.Parameter) -> None:
    """An ``FP8Linear``'s weight and block scales, or a DeepGEMM-run expert's (or one stacked part of them, from ``piece.dest``'s
    first row on): the checkpoint's own (a shard or part starts on a block boundary:
    ``workers.model.fp8_shard_aligned``), or a float tensor quantized here."""
    cols = piece.cols.indices(piece.full_shape[1])
    scale_cols = slice(cols[0] // BLOCK, -(-cols[1] // BLOCK))
    first = piece.dest[0].start if piece.dest else 0
    for dest_rows, rows in _row_chunks(piece, source, 1):
        dest_rows = slice(first + dest_rows.start, first + dest_rows.stop)
        dest_blocks = slice(dest_rows.start // BLOCK, -(-dest_rows.stop // BLOCK))
        if source.is_fp8(piece.tensor):
            q = source.read(piece.tensor, rows, piece.cols)
            s = source.read(piece.tensor + SCALE, slice(rows.start // BLOCK, -(-rows.stop // BLOCK)), scale_cols)
        else:
            q, s = block_quantize(source.read(piece.tensor, rows, piece.cols).to(weight.device))
        weight[dest_rows].copy_(q.to(weight.device))
        scale[dest_blocks].copy_(s.to(scale.device))


def _peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux

