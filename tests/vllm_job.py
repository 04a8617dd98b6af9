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


class VLLMRun:
    """``tests/vllm_driver.py`` started on ``job`` without its steps: vLLM boots (half a minute and more
    on the 2-core CPU) while the caller makes them (the pool's prefills, their tickets); :meth:`run`
    hands them over and waits for the results. ``vllm_pythonpath``: vLLM's site, first on its path;
    ``env``: more of its environment; its log in ``workdir/driver.log``."""

    def __init__(self, job: dict, workdir: Path, *, vllm_pythonpath: str | None = None, env: dict | None = None) -> None:
        job_path, self.out, self.log_path = workdir / "job.json", workdir / "out.pt", workdir / "driver.log"
        job_path.write_text(json.dumps(job))
        here = Path(__file__).resolve().parent
        environment = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
        environment.update(PYTHONPATH=os.pathsep.join(filter(None, [vllm_pythonpath, str(here), str(here.parent)])), OMP_NUM_THREADS="1",
                           VLLM_ALLOW_INSECURE_SERIALIZATION="1", **(env or {}))  # fmt: skip
        with open(self.log_path, "w") as log:  # the driver's own from here
            self.process = subprocess.Popen([sys.executable, str(here / "vllm_driver.py"), str(job_path), str(self.out)], env=environment,
                                            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True)  # fmt: skip

    def run(self, steps: list[dict], timeout_s: float = 900) -> dict:
        """``out.pt``'s results of ``steps`` and the driver's log."""
        try:
            self.process.communicate(json.dumps(steps), timeout=timeout_s)
        finally:
            self.close()
        log = self.log_path.read_text()
        if self.process.returncode != 0:
            raise RuntimeError(f"vLLM failed (whole log: {self.log_path}):\n" + log[-4000:])
        return {"results": torch.load(self.out), "log": log}

    def close(self) -> None:
        """Killed if still running (a caller that failed before :meth:`run`)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "VLLMRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_vllm(job: dict, workdir: Path, *, vllm_pythonpath: str | None = None, timeout_s: float = 900, env: dict | None = None) -> dict:
    """Run ``job`` (its steps included) in a vLLM process of its own (:class:`VLLMRun`)."""
    engine = {k: v for k, v in job.items() if k != "steps"}
    with VLLMRun(engine, workdir, vllm_pythonpath=vllm_pythonpath, env=env) as vllm:
        return vllm.run(job["steps"], timeout_s)
