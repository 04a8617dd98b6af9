"""The mlapool command line, in-process, on the module's Ray (logical GPUs, CPU workers)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cluster.cli import main


def test_prefill_writes_kv_and_summary_and_verifies(ray_cluster, tmp_path, capsys):
    argv = ["prefill", "--device", "cpu", "--random-tokens", "200", "--num-layers", "2", "--pcp", "2", "--chunk-tokens", "64"]
    assert main([*argv, "--output-dir", str(tmp_path), "--verify"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert summary["tokens"] == 200 and summary["tp"] == 1 and summary["pcp"] == 2 and summary["layers"] == 2
    context = summary["pcp_context"]  # 4 chunks: the first has no context
    assert context["batches_per_strategy"]["none"] == 1 and sum(context["batches_per_strategy"].values()) == 4
    assert context["bytes_received_per_worker"] > 0
    assert summary["backend"] == "TORCH_SDPA" and summary["device"] == "cpu"
    assert summary["ttft_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["verify"]["ok"] and summary["verify"]["same_first_token"]
    assert summary["verify"]["max_abs_err_logits"] < 1e-4 and summary["verify"]["max_abs_err_kv"] < 1e-4
    kv = load_file(tmp_path / "kv.safetensors")
    assert sorted(kv) == ["layers.0.latent", "layers.1.latent"]
    assert kv["layers.0.latent"].shape == (200, 64 + 16) and kv["layers.0.latent"].dtype == torch.float32


def test_prefill_from_a_token_file(ray_cluster, tmp_path, capsys):
    tokens = tmp_path / "prompt.txt"
    tokens.write_text("1 2 3\n4 5\n")
    argv = ["prefill", "--device", "cpu", "--tokens", str(tokens), "--num-layers", "1"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 5


@pytest.mark.parametrize(
    "argv,code,message",
    [
        (["--model", "nope"], 2, "neither a built-in model (deepseek-r1, deepseek-v2, deepseek-v2-lite, deepseek-v3, kimi-k2, tiny)"),
        (["--random-tokens", "0"], 2, "--random-tokens must be positive, got 0"),
        (["--model", "deepseek-v3"], 1, "GiB of weights per rank at TP=1 x PCP=1, routed experts split over 1 ranks; this host has"),
        (["--tp", "3"], 2, "TP=3 does not divide tiny's 8 attention heads"),
        (["--pcp", "0"], 2, "pcp must be a positive integer, got 0"),
        (["--ep-comm-sms", "-1"], 2, "ep_comm_sms must be an integer in 0..64, got -1"),
        (["--ep-schedule", "overlap"], 2, "invalid choice: 'overlap' (choose from"),
        (["--kv-cache-tokens", "10"], 2, "kv_cache_tokens must be None or an integer >= block_size (64), got 10"),
        (["--tokens", "/no/such/file"], 2, "No such file"),
        (["--num-layers", "1", "--backend", "aiter_flash_attn"], 1, "replica 0 failed to start: ValueError: MLA prefill backend AITER_FLASH_ATTN cannot run"),
    ],
)
def test_prefill_errors_exit_with_the_reason(ray_cluster, argv, code, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["prefill", "--device", "cpu", "--output-dir", str(tmp_path), *argv])
    assert exit_info.value.code == code
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--random-tokens", "1000000000"], "--random-tokens 1000000000 is longer than 8192: tiny has 8192 positions"),
        (["--kv-cache-tokens", "256", "--random-tokens", "300"], "--random-tokens 300 is longer than 256: the KV cache holds 256 tokens (256 per worker x pcp=1)"),
        (["--kv-cache-tokens", "256", "--pcp", "2", "--tokens", "{long}"], "prompt of 600 tokens is longer than 512: the KV cache holds 512 tokens (256 per worker x pcp=2)"),
        (["--tokens", "{outside}"], "token id 512 is outside the vocabulary [0, 512)"),
        (["--output-dir", "{file}"], "exists and is not a directory"),
        (["--checkpoint", "{empty}"], "has no *.safetensors files"),
    ],
    ids=["positions", "kv-cache", "kv-cache-pcp", "vocabulary", "output-is-a-file", "checkpoint"],
)
def test_what_can_be_checked_before_ray_starts_is_refused_before_it_starts(argv, message, tmp_path, capsys, monkeypatch):
    import cluster.pool

    monkeypatch.setattr(cluster.pool, "connect_ray", lambda *a: pytest.fail("Ray was started for an input error"))
    paths = {"long": tmp_path / "long.json", "outside": tmp_path / "outside.json", "file": tmp_path / "a-file", "empty": tmp_path / "empty"}
    paths["long"].write_text(str(list(range(600)))), paths["outside"].write_text("[1, 2, 512]"), paths["file"].write_text("")
    paths["empty"].mkdir()
    (paths["empty"] / "config.json").write_text((Path(cluster.pool.__file__).parents[1] / "configs/models/tiny.json").read_text())
    argv = [a.format(**{k: str(v) for k, v in paths.items()}) for a in argv]
    started = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(["prefill", "--device", "cpu", "--output-dir", str(tmp_path / "out"), *argv])
    assert exit_info.value.code == 2 and time.perf_counter() - started < 5
    assert message in capsys.readouterr().err


def test_backends_lists_reasons(capsys):
    assert main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "TORCH_SDPA        ok" in out and "selected: TORCH_SDPA" in out
    assert "FLASHINFER        no: runs on cuda devices, not on cpu" in out


def test_the_embedded_cluster_starts_without_rays_authentication_notice(tmp_path):
    """The cluster ``mlapool prefill`` starts for itself is local: Ray's token-authentication notice is
    not printed on every run (the authentication itself stays as Ray sets it)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "-m", "cluster.cli", "prefill", "--device", "cpu", "--num-layers", "1",
                          "--random-tokens", "16", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Token authentication" not in run.stderr and json.loads(run.stdout)["tokens"] == 16
