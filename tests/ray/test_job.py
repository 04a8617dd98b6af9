"""The batch job (``cluster.job``) run in-process on the module's local Ray: outputs, resume after an
interruption, prompts the pool refuses, text through a tokenizer, and input errors before any pool starts."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
import torch
from safetensors.torch import load_file

from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import plan_prefill_batch
from cluster import job
from configs.pool import PoolConfig
from workers.model import DeepseekPrefillModel
from workers.weights import load_weights

POOL_ARGS = ["--device", "cpu", "--num-layers", "2", "--chunk-tokens", "64", "--kv-cache-tokens", "1024", "--seed", "3"]


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _run(tmp_path, input_path, *extra):
    return job.main(["--input", str(input_path), "--output", str(tmp_path / "out"), *POOL_ARGS, *extra])


@pytest.fixture(scope="module")
def reference():
    model = DeepseekPrefillModel.create(PoolConfig(num_layers=2).model_config(), TorchSDPAPrefillBackend, dtype=torch.float32)
    load_weights(model, None, 3)

    def run(tokens):
        out = model(torch.tensor(tokens), plan_prefill_batch([len(tokens)]))
        return int(out.logits[0].argmax()), torch.stack(out.latents)

    return run


@pytest.fixture(scope="module")
def prompts():
    gen = np.random.default_rng(1)
    return [{"id": f"doc-{i}", "token_ids": gen.integers(0, 512, size=n).tolist()} for i, n in enumerate((1, 63, 64, 150, 300))]


def test_the_job_writes_every_prompts_kv_and_summary_and_a_run_summary(ray_cluster, tmp_path, prompts, reference):
    assert _run(tmp_path, _write(tmp_path / "in.jsonl", prompts)) == 0
    folder = tmp_path / "out" / "prompts"
    for prompt in prompts:
        record = json.loads((folder / f"{prompt['id']}.json").read_text())
        kv = load_file(folder / record["kv_file"])
        first, expected_kv = reference(prompt["token_ids"])
        assert record["tokens"] == len(prompt["token_ids"]) and record["first_token"] == first
        assert torch.allclose(torch.stack([kv[f"layers.{i}.latent"] for i in range(2)]), expected_kv, atol=1e-4)
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["prefilled"] == 5 and summary["failed"] == 0 and summary["already_done"] == 0
    assert summary["tokens_prefilled"] == sum(len(p["token_ids"]) for p in prompts)
    assert summary["weights"]["format"] == "float32" and summary["expert_load"] is None  # a dense model


def test_a_rerun_resumes_redoing_only_unfinished_changed_and_failed_prompts(ray_cluster, tmp_path, prompts, capsys):
    path = _write(tmp_path / "in.jsonl", prompts)
    assert _run(tmp_path, path) == 0
    folder = tmp_path / "out" / "prompts"
    (folder / "doc-1.json").unlink()  # interrupted after its KV was written, before its JSON
    (folder / "doc-2.json").unlink()
    (folder / "doc-2.kv.safetensors").unlink()  # never started
    kept = {p: (folder / f"{p}.json").stat().st_mtime_ns for p in ("doc-0", "doc-3")}
    changed = [dict(p, token_ids=p["token_ids"][::-1]) if p["id"] == "doc-4" else p for p in prompts]
    capsys.readouterr()
    assert _run(tmp_path, _write(path, changed)) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert sorted(e["request_id"] for e in events if e["event"] == "prompt_done") == ["doc-1", "doc-2", "doc-4"]
    assert {p: (folder / f"{p}.json").stat().st_mtime_ns for p in kept} == kept  # not redone
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert (summary["already_done"], summary["prefilled"]) == (2, 3)
    assert _run(tmp_path, path) == 0  # everything done: no pool is started at all
    assert json.loads((tmp_path / "out" / "run_summary.json").read_text())["already_done"] == 5


def test_prompts_the_pool_refuses_are_recorded_and_the_others_finish(ray_cluster, tmp_path, capsys):
    records = [{"id": "ok", "token_ids": [1, 2, 3]}, {"id": "long", "token_ids": [1] * 1025}, {"id": "oov", "token_ids": [1, 99999]}]
    assert _run(tmp_path, _write(tmp_path / "in.jsonl", records)) == 1
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["prefilled"] == 1 and set(summary["failures"]) == {"long", "oov"}
    assert summary["failures"]["long"] == "prompt of 1025 tokens is longer than 1024: the KV cache holds 1024 tokens (1024 per worker x pcp=1)"
    assert summary["failures"]["oov"] == "token id 99999 is outside the vocabulary [0, 512)"
    events = [json.loads(line)["event"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert events.index("pool_ready") > max(i for i, e in enumerate(events) if e == "prompt_failed")  # refused before Ray


def test_an_output_folder_that_is_a_file_is_refused_before_any_pool_starts(tmp_path, capsys):
    (tmp_path / "out").write_text("")
    assert _run(tmp_path, _write(tmp_path / "in.jsonl", [{"token_ids": [1]}])) == 2
    assert "--output " + str(tmp_path / "out") + ": exists and is not a directory" in capsys.readouterr().err


def test_a_stopped_job_cancels_its_prompts_in_the_pool_and_says_so(ray_cluster, tmp_path):
    """``ray job stop`` sends SIGTERM to the job's driver: here, the job in a subprocess of its own."""
    records = [{"id": f"p{i}", "token_ids": (np.arange(1000) * (i + 1) % 512).tolist()} for i in range(40)]
    path = _write(tmp_path / "in.jsonl", records)
    command = [sys.executable, "-m", "cluster.job", "--input", str(path), "--output", str(tmp_path / "out"),
               *POOL_ARGS, "--chunk-tokens", "16", "--max-in-flight", "4"]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:  # stop it once its first prompt is done
        if '"prompt_done"' in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    events = {json.loads(line)["event"]: json.loads(line) for line in out.splitlines() if line.startswith("{")}
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["cancelled"] >= 1 and summary["failed"] == 0
    assert summary["prefilled"] + summary["cancelled"] + summary["not_started"] == 40
    assert events["stopped"]["cancelled"] == summary["cancelled"]
    done = sorted(p.name for p in (tmp_path / "out" / "prompts").glob("*.json"))
    assert len(done) == summary["prefilled"] >= 1  # finished prompts stay done for the next run


def test_text_lines_are_tokenized_with_the_given_tokenizer(ray_cluster, tmp_path, reference):
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the cat sat on a mat".split())}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    path = _write(tmp_path / "in.jsonl", [{"id": "t", "text": "the cat sat on the mat"}])
    assert _run(tmp_path, path, "--tokenizer", str(tmp_path / "tokenizer.json")) == 0
    record = json.loads((tmp_path / "out" / "prompts" / "t.json").read_text())
    assert record["tokens"] == 6 and record["first_token"] == reference([1, 2, 3, 4, 1, 6])[0]


def test_bad_input_lines_are_all_named_before_any_pool_starts(tmp_path, capsys):
    lines = ['{"id": "a", "token_ids": [1, 2]}', "not json", '{"id": "a", "token_ids": [3]}', '{"token_ids": "12"}',
             '{"id": "../x", "token_ids": [1]}', '{"id": "b", "text": "hi"}', '{"id": "c", "tokens": [1]}']  # fmt: skip
    assert _run(tmp_path, _write(tmp_path / "in.jsonl", lines)) == 2
    err = capsys.readouterr().err
    for expected in ("6 bad line(s)", "line 2: not JSON", "line 3: id 'a' is already used on line 1",
                     "line 4: token_ids must be a non-empty list of integers", "line 5: id '../x'",
                     "line 6: has text, but no --tokenizer", "line 7: unknown keys ['tokens']"):  # fmt: skip
        assert expected in err
    assert not (tmp_path / "out" / "run_summary.json").exists()
