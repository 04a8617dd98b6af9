"""The batch job the way Ray users run it: a real local Ray head (``ray start --head``), the job
submitted with ``ray job submit --working-dir``, its outputs checked, a second submission resuming
(nothing redone), then the cluster stopped. Uses its own Ray, not the module fixture of the others."""

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workers.worker import rendezvous_address

REPO = Path(__file__).resolve().parents[2]
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # token authentication, as a production cluster should run: the head and the CLI share the token
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    gcs, dashboard = rendezvous_address()[1], rendezvous_address()[1]
    subprocess.run(
        [*RAY, "start", "--head", f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         "--include-dashboard=true", "--num-cpus=2", "--num-gpus=2", "--disable-usage-stats"],
        check=True, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        subprocess.run([*RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def _submit(address, env, *job_args):
    runtime_env = json.dumps({"env_vars": {"OMP_NUM_THREADS": "1"}})
    return subprocess.run(
        [*RAY, "job", "submit", "--address", address, "--working-dir", str(REPO), "--runtime-env-json", runtime_env,
         "--", "python", "-m", "cluster.job", *job_args],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_ray_job_submit_prefills_the_file_and_a_resubmission_resumes(head, tmp_path):
    address, env = head
    gen = np.random.default_rng(7)
    prompts = [{"id": f"p{i}", "token_ids": gen.integers(0, 512, size=n).tolist()} for i, n in enumerate((5, 70, 200))]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "out"
    args = ["--input", str(source), "--output", str(out), "--device", "cpu", "--num-layers", "2", "--kv-cache-tokens", "1024"]
    first = _submit(address, env, *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "succeeded" in first.stdout and '"event": "prompt_done"' in first.stdout  # the job's log, streamed back
    summary = json.loads((out / "run_summary.json").read_text())
    assert (summary["prefilled"], summary["failed"], summary["pool"]["device"]) == (3, 0, "cpu")
    for prompt in prompts:
        record = json.loads((out / "prompts" / f"{prompt['id']}.json").read_text())
        assert record["tokens"] == len(prompt["token_ids"]) and (out / "prompts" / record["kv_file"]).stat().st_size > 0
    second = _submit(address, env, *args)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert json.loads((out / "run_summary.json").read_text())["already_done"] == 3
    assert '"event": "prompt_done"' not in second.stdout
