"""vLLM's processes forked on the CPU, as vLLM forks them on a GPU, and its OpenAI servers forked from
one process that has imported vLLM.

vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` as it checks its configuration, so
every engine core and worker process vLLM starts on the CPU imports vLLM, torch and transformers
anew: 16 s on the 2-core CI machine, for each of the suite's dozen vLLM starts (a server killed
mid-answer is started again). On a GPU vLLM forks them (its default; spawn only where CUDA is already
initialized in the parent). :func:`fork_on_cpu` puts fork back on the CPU platform;
``tests/vllm_driver.py`` calls it before it builds its engine. Fork is safe there: neither vLLM's
API server nor the driver has run an OpenMP parallel region when vLLM starts its processes.

The API server's own imports take another 16 s a start. :class:`ForkServer` imports them once, in a
process of its own, and forks a server from it for each start (``vllm_server.VLLMServer`` on a
machine without a GPU): the child takes the server's environment, arguments and log, runs the module
as ``python -m`` would, with :func:`fork_on_cpu`, and is a session of its own, as
``subprocess.Popen(start_new_session=True)`` makes it. :class:`Forked` is its handle, with the part of
``Popen``'s interface the tests use (``pid``, ``poll``, ``wait``, ``terminate``, ``returncode``); the
fork server reaps it and files its exit status. Elsewhere (a GPU, another vLLM site) the servers run
as ``python -m vllm.entrypoints.openai.api_server`` in a process of their own.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# what vLLM 0.32's OpenAI server and engine core import (not the server's module itself: run as __main__ in each child)
PRELOAD = (
    "vllm.entrypoints.launchers.api_server.app_state", "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.launchers.api_server.routers", "vllm.entrypoints.launchers.app", "vllm.entrypoints.launchers.launcher",
    "vllm.v1.engine.core", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.deepseek_v2", "kv.vllm_connector",
)  # fmt: skip


def fork_on_cpu() -> None:
    """vLLM's CPU platform, when it checks a configuration, leaves vLLM's processes to fork."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    check = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    platform.check_and_update_config = classmethod(check_and_update_config)


class Forked:
    """A process the fork server forked: ``Popen``'s ``pid``, ``returncode``, ``poll``, ``wait`` and
    ``terminate``. Its exit status is the fork server's to collect; it files it in ``exit_path``."""

    def __init__(self, pid: int, exit_path: Path) -> None:
        self.pid, self.exit_path, self.returncode = pid, exit_path, None

    def poll(self) -> int | None:
        if self.returncode is None and self.exit_path.exists():
            self.returncode = int(self.exit_path.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"vLLM server {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)


class ForkServer:
    """A process with vLLM's server imported (``env`` its environment), forking a server per :meth:`start`."""

    def __init__(self, env: dict[str, str]) -> None:
        self.exits = Path(tempfile.mkdtemp(prefix="vllm-forks-"))
        self.log = open(self.exits / "fork-server.log", "w")  # noqa: SIM115 -- its own, for as long as it runs
        self.process = subprocess.Popen([sys.executable, __file__, "--fork-server", str(self.exits)], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)  # fmt: skip
        self.lock = threading.Lock()
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the vLLM fork server did not start: see {self.exits / 'fork-server.log'}")

    def start(self, module: str, args: list[str], env: dict[str, str], log: Path) -> Forked:
        """``python -m module args`` with ``env``, its output in ``log``, forked."""
        with self.lock:
            self.process.stdin.write(json.dumps({"module": module, "args": args, "env": env, "log": str(log), "cwd": os.getcwd()}) + "\n")
            self.process.stdin.flush()
            pid = int(self.process.stdout.readline())
        return Forked(pid, self.exits / str(pid))

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()
        shutil.rmtree(self.exits, ignore_errors=True)


def _serve_forks(exits: Path) -> None:
    """The fork server: imports, then one forked child per line of stdin; its pid on stdout."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # another vLLM: the child imports what it needs
            print(f"not preloaded: {name}: {exc}", file=sys.stderr, flush=True)

    def reap(*_) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            (exits / f"{pid}.tmp").write_text(str(os.waitstatus_to_exitcode(status)))  # negative: killed by that signal, as Popen says
            (exits / f"{pid}.tmp").rename(exits / str(pid))

    signal.signal(signal.SIGCHLD, reap)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(pid, flush=True)


def _child(request: dict) -> None:
    """In the forked child: become ``python -m module args`` in a session of its own; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [request["module"], *request["args"]]
        sys.path[0] = os.getcwd()  # as `python -m module` has it
        fork_on_cpu()
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 -- into its log, as a process of its own would print it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":  # python tests/vllm_cpu_fork.py --fork-server EXITS (ForkServer starts it)
    _serve_forks(Path(sys.argv[2]))
