"""Shared pytest setup.

Without a GPU the Triton merge kernels run in Triton's interpreter on CPU
tensors, so CI exercises the same kernel code the GPU runs. The variable must
be set before triton is first imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
