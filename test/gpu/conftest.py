"""GPU tests: every test takes a device parameter; only ``cuda`` carries the ``gpu`` mark.

``make test`` deselects the mark (``-m "not gpu"`` in pyproject's addopts), so CI runs each test's logic on the CPU;
``benchmarks/gpu/run.sh`` runs ``-m gpu`` on a lent GPU machine. Nothing here imports Ray, vLLM, reasoning-gym or
TextArena: the GPU machine has the core requirements only.
"""

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(params=DTYPES, ids=["float32", "bfloat16", "float16"])
def dtype(request) -> torch.dtype:
    return request.param


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects
def pytest_collection_modifyitems(items):
    """The ``cuda`` parameters of this folder's tests are GPU tests, whichever fixture (or parametrize) brings them."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "cuda" in callspec.params.values():
            item.add_marker(pytest.mark.gpu)
