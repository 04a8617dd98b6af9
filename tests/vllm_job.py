"""Starts ``tests/vllm_driver.py`` (stock vLLM with mlapool's connector) on a job, from a process that
need not import vLLM."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch


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
