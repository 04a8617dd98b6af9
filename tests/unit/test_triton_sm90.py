"""The MoE, FP8, activation and MLA (RoPE, RMSNorm, key rows) Triton kernels built for an H100/H200 (SM90) on any machine, CI included: Triton
compiles each to a cubin with the ptxas in its own wheel, with the compile-time arguments the launchers choose for
every built-in model, as the first call on a GPU would (``tests/triton_sm90.py``); its cuobjdump then
reads the resources. A kernel that does not compile for the GPU, or spills registers to local
memory, fails here. (What the kernels compute is checked in Triton's interpreter by test_moe.py,
test_fp8.py, test_activation.py and test_mla.py, and on GPUs by their ``gpu`` cases.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_sm90 import TOOLS, cases

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(TOOLS, "cuobjdump")), reason="Triton's wheel has no NVIDIA tools here")
CASES = list(cases()) if os.path.exists(os.path.join(TOOLS, "cuobjdump")) else []


@pytest.fixture(scope="module")
def built():
    """Every kernel built once, in a process without Triton's interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parents[1] / "triton_sm90.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_kernel_is_built(built):
    assert set(built) == set(CASES) and any(name.startswith("route-") for name in built), sorted(built)


@pytest.mark.parametrize("name", CASES)
def test_the_kernel_builds_for_sm90_without_spills(built, name):
    resources = built[name]
    assert "error" not in resources, resources.get("error")
    assert resources["STACK"] == 0 and resources["LOCAL"] == 0, resources
