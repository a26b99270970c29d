import os

import pytest
import torch

# Without CUDA, Triton kernels run in its interpreter. The variable must be set before any module defines a kernel,
# and any test module may import one (the engine imports the fast decode path), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
