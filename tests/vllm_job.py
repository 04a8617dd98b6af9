"""Starts ``tests/vllm_driver.py`` (stock vLLM with mlapool's connector) on a job, from a process that
need not import vLLM."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

# vLLM's CPU MLA backend, float32, no prefix cache (every prompt prefilled or loaded whole), a small
# cache: 217 blocks of 16 for the tiny checkpoint, recycled after a few prompts
CPU_ENGINE = {
    "dtype": "float32", "enforce_eager": True, "max_model_len": 2048, "attention_backend": "CPU_MLA",
    "enable_prefix_caching": False, "skip_tokenizer_init": True, "gpu_memory_utilization": 0.25,
    "kv_cache_memory_bytes": 24 << 20, "seed": 0,
}  # fmt: skip


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny checkpoint's vocabulary (its 508 words), drawn from ``seed``."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, 508, size=n)]


def own_and_loaded_steps(kept, lengths: tuple[int, ...], batch: tuple[int, ...]) -> list[dict]:
    """The driver's steps for each of ``lengths``: a prompt prefilled by vLLM itself, then the same one
    loaded with its ticket; then ``batch``'s prompts, each prefilled by vLLM alone, then all loaded in
    one step. ``kept(name, prompt)``: the pool's prefill with the KV kept, its ticket."""
    steps = []
    for n in lengths:
        prompt = random_prompt(n, n)
        steps += [{"name": f"own-{n}", "prompts": [prompt], "tickets": [None]},
                  {"name": f"loaded-{n}", "prompts": [prompt], "tickets": [kept(f"p{n}", prompt)]}]  # fmt: skip
    prompts = [random_prompt(n, 100 + n) for n in batch]
    steps += [{"name": f"own-batch-{i}", "prompts": [p], "tickets": [None]} for i, p in enumerate(prompts)]
    steps.append({"name": "loaded-batch", "prompts": prompts, "tickets": [kept(f"b{i}", p) for i, p in enumerate(prompts)]})
    return steps


def run_vllm(job: dict, workdir: Path, *, vllm_pythonpath: str | None = None, timeout_s: float = 900, env: dict | None = None) -> dict:
    """Run ``job`` in a vLLM process of its own (``vllm_pythonpath``: vLLM's site, first on its path;
    ``env``: more of its environment); returns ``out.pt``'s results and the process's log (also in
    ``workdir/driver.log``)."""
    job_path, out = workdir / "job.json", workdir / "out.pt"
    job_path.write_text(json.dumps(job))
    here = Path(__file__).resolve().parent
    environment = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    environment.update(PYTHONPATH=os.pathsep.join(filter(None, [vllm_pythonpath, str(here), str(here.parent)])), OMP_NUM_THREADS="1",
                       VLLM_ALLOW_INSECURE_SERIALIZATION="1", **(env or {}))  # fmt: skip
    done = subprocess.run([sys.executable, str(here / "vllm_driver.py"), str(job_path), str(out)], env=environment, capture_output=True, text=True, timeout=timeout_s, check=False)
    (workdir / "driver.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM failed (whole log: {workdir / 'driver.log'}):\n" + done.stderr[-4000:])
    return {"results": torch.load(out), "log": done.stdout + done.stderr}
