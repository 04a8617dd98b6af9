"""The mlapool command line (in-process)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from cluster.cli import main


def test_prefill_writes_kv_and_summary(tmp_path, capsys):
    assert main(["prefill", "--random-tokens", "200", "--num-layers", "2", "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert summary["tokens"] == 200 and summary["backend"] == "TORCH_SDPA" and summary["layers"] == 2
    assert summary["ttft_s"] > 0 and summary["tokens_per_s"] > 0
    kv = load_file(tmp_path / "kv.safetensors")
    assert sorted(kv) == ["layers.0.latent", "layers.1.latent"]
    assert kv["layers.0.latent"].shape == (200, 64 + 16)


def test_prefill_from_a_token_file(tmp_path, capsys):
    tokens = tmp_path / "prompt.txt"
    tokens.write_text("1 2 3\n4 5\n")
    assert main(["prefill", "--tokens", str(tokens), "--num-layers", "1", "--output-dir", str(tmp_path / "out")]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 5


BAD_ARGS = [
    (["--backend", "aiter_flash_attn"], "AITER_FLASH_ATTN cannot run on"),
    (["--model", "nope"], "neither a built-in model (deepseek-r1, deepseek-v2-lite, deepseek-v3, kimi-k2, tiny)"),
    (["--random-tokens", "0"], "--random-tokens must be positive, got 0"),
    (["--model", "deepseek-v3"], "mlapool prefill --num-layers 3"),
]
if not torch.cuda.is_available():
    BAD_ARGS.append((["--device", "cuda:0"], "no CUDA device is available here"))


@pytest.mark.parametrize("argv,message", BAD_ARGS)
def test_prefill_errors_exit_2_with_the_reason(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["prefill", "--output-dir", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_backends_lists_reasons(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "FLASHINFER" in out and "selected: " in out
