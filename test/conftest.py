"""Test setup: one torch thread (two OpenMP threads make tiny models 20-50x slower here), fixed seeds, Ray workers
at the tests' own priority."""

import os

import pytest
import torch

torch.set_num_threads(1)
# Ray starts its workers at nice 15: beside other jobs at nice 0 (two CPU hogs) they get a few percent of a core,
# their imports take minutes and Ray's start-up waits run out. Every Ray these tests start (the module fixtures',
# a collector's embedded one) runs its workers at the pytest process's own priority (the setting is an increment
# over the raylet's niceness, which is the pytest process's: 0 keeps it, and needs no privilege).
os.environ.setdefault("RAY_worker_niceness", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def tokenizer():
    from tokengym.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer):
    from tokengym.testing import tiny_model

    return tiny_model(tokenizer)
