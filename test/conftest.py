"""Test setup: one torch thread (two OpenMP threads make tiny models 20-50x slower here), fixed seeds."""

import pytest
import torch

torch.set_num_threads(1)


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
