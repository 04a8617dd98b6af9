"""workers.checkpoint_files reads slices of safetensors files as safetensors' own reader does, without
mapping the file, and refuses a damaged file naming it; a checkpoint written from the seeded weights
loads as they are drawn."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from configs.model import MODELS_DIR, load_model_config
from workers.checkpoint_files import SafetensorsFile
from workers.expert_parallel import EPGroup
from workers.model import DeepseekPrefillModel, TPShard
from workers.weights import load_weights

TENSORS = {
    "w.bf16": torch.randn(300, 260, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
    "w.fp8": (torch.randn(130, 257, generator=torch.Generator().manual_seed(1)) * 50).to(torch.float8_e4m3fn),
    "s.f32": torch.rand(3, 3, generator=torch.Generator().manual_seed(2)),
    "b.f32": torch.randn(7, generator=torch.Generator().manual_seed(3)),
    "ids.i64": torch.arange(40).view(8, 5),
    "mask.bool": torch.arange(12).view(3, 4) % 3 == 0,
    "empty": torch.zeros(0, 4),
}
SLICES = [
    (slice(None), None),
    (slice(None), slice(None)),
    (slice(5, 9), None),
    (slice(1, 3), slice(0, 2)),
    (slice(0, 2), slice(2, 5)),
    (slice(4, 4), slice(1, 3)),
    (slice(2, 100), slice(1, None)),
]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(TENSORS, path, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("name", list(TENSORS))
def test_slices_equal_safetensors_own_reader(path, name):
    file = SafetensorsFile(path)
    with safe_open(path, framework="pt") as theirs:
        assert file.shape(name) == tuple(theirs.get_slice(name).get_shape())
        assert file.dtype(name) == theirs.get_slice(name).get_dtype()
        for rows, cols in SLICES:
            if cols is not None and TENSORS[name].dim() != 2:
                continue
            expected = theirs.get_slice(name)[rows] if cols is None else theirs.get_slice(name)[rows, cols]
            got = file.read(name, rows, cols)
            assert got.dtype == expected.dtype and got.shape == expected.shape, (rows, cols)
            assert torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8)), (rows, cols)
    file.close()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_reading_maps_nothing(tmp_path):
    path = tmp_path / "unmapped.safetensors"  # a file no other test opened with safetensors (which maps it)
    save_file(TENSORS, path)
    file = SafetensorsFile(path)
    file.read("w.bf16", slice(None), slice(3, 9))
    file.read("w.fp8", slice(None))
    assert str(path) not in Path("/proc/self/maps").read_text()
    file.close()


def test_a_damaged_file_is_refused_naming_it(path, tmp_path):
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"truncated\.safetensors is truncated: tensor \S+ ends at byte \d+, the file has \d+"):
        SafetensorsFile(truncated)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"garbage\.safetensors is not a safetensors file \(64 bytes, header length \d+\)"):
        SafetensorsFile(garbage)
    not_json = tmp_path / "notjson.safetensors"
    not_json.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(ValueError, match=r"notjson\.safetensors is not a safetensors file: its header is not JSON"):
        SafetensorsFile(not_json)
    odd = tmp_path / "odd.safetensors"
    header = json.dumps({"x": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}}).encode()
    odd.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0")
    with pytest.raises(ValueError, match=r"odd\.safetensors: tensor x has dtype 'F8_E8M0'; readable: F64, .*F8_E4M3"):
        SafetensorsFile(odd)


def test_strided_and_column_slices_of_1d_tensors_are_refused(path):
    file = SafetensorsFile(path)
    with pytest.raises(ValueError, match=r"slices of w\.bf16 are read with step 1"):
        file.read("w.bf16", slice(0, 10, 2))
    with pytest.raises(ValueError, match=r"a column slice of b\.f32 needs a 2-D tensor, it has shape \[7\]"):
        file.read("b.f32", slice(None), slice(0, 3))
    file.close()


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2)], ids=["whole", "tp2-ep2-rank1"])
def test_a_written_checkpoint_of_the_seeded_weights_loads_as_they_are_drawn(tmp_path, tp, ep):
    """benchmarks/write_checkpoint.py writes the seeded weights in DeepSeek's FP8 format over several
    files; a rank (whole, or TP rank 1 of 2 holding EP rank 1's experts) loading it holds exactly the
    weights a rank drawing them holds: the GPU benchmarks compare the two."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from write_checkpoint import write_checkpoint

    raw = json.loads((MODELS_DIR / "deepseek-v3.json").read_text())
    raw.update(hidden_size=256, intermediate_size=320, moe_intermediate_size=96, num_attention_heads=4, q_lora_rank=160,
               kv_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
               num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, vocab_size=300)  # fmt: skip
    (tmp_path / "v3-small.json").write_text(json.dumps(raw))
    written = write_checkpoint(str(tmp_path / "v3-small.json"), 3, tmp_path / "ckpt", seed=5, device="cpu",
                               dtype=torch.float32, file_bytes=2**20)  # fmt: skip
    assert written["files"] > 1 and (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    config = load_model_config(tmp_path / "ckpt")
    assert config.num_hidden_layers == 3 and config.quantization is not None

    def rank():
        shard = {"tp": TPShard(tp - 1, tp), "ep": EPGroup(ep - 1, ep)} if tp > 1 else {}
        return DeepseekPrefillModel.create(config, TorchSDPAPrefillBackend, dtype=torch.float32, **shard)

    loaded, drawn = rank(), rank()
    report = load_weights(loaded, tmp_path / "ckpt")
    load_weights(drawn, None, seed=5)
    assert report.files_opened >= 1 and report.bytes_read > 0
    for (name, a), (_, b) in zip(loaded.named_parameters(), drawn.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_benchmark_checkpoints_tokenizer_round_trips_and_keeps_vllms_characters_bound(tmp_path):
    """write_checkpoint.write_tokenizer: random ids (bos and eos among them) decode to a text that
    encodes back to the same ids, and that text is no longer than the ids times the longest token,
    the bound vLLM checks a text prompt against before tokenizing it (prompts of 32K ids past it were
    refused with a 400 when bos and eos were <s> and </s>: words of 8 characters with their space, 7
    the longest token; DeepSeek-V3's own names are 21)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from transformers import AutoTokenizer
    from write_checkpoint import write_tokenizer

    write_tokenizer(tmp_path, {"vocab_size": 129280})
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.randint(100000, 129280, (2000,), generator=torch.Generator().manual_seed(0)).tolist() + [0, 5, 1, 17]
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text) == ids
    assert len(text) <= len(ids) * max(len(token) for token in tokenizer.get_vocab())
