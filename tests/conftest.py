"""Shared pytest setup.

Without a GPU the Triton merge kernels run in Triton's interpreter on CPU
tensors, so CI exercises the same kernel code the GPU runs. The variable must
be set before triton is first imported.
"""

import atexit
import logging
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
EXIT_STATUS = pytest.StashKey[int]()  # pytest's exit status, kept at the session's end for pytest_unconfigure


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process once pytest is done, with pytest's exit status, without tearing the
    interpreter down. The suite leaves native state in this process that nothing tests at exit: vLLM's
    CPU extension and Ray's core worker loaded, in-process workers' sockets and threads. CI saw
    the process segfault after ``819 passed`` (2026-11-29, exit 139) in that teardown, which turned a
    passing run into a failed one. Our own processes' exits are tested where they happen, in
    processes of their own (the CLI, ``ray job submit``, the workers and vLLM servers the tests stop).
    The exit handlers still run (the vLLM fork server is stopped, logs flushed)."""
    status = config.stash.get(EXIT_STATUS, None)
    if status is None:  # pytest ended before a session (a usage error): let it exit as it would
        return
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(status))


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)
