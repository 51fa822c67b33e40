"""The data contract: key names and make_spec."""

import pytest
import torch

from tokengym.llm_envs import keys


def test_observation_keys_are_unique_strings():
    assert len(set(keys.OBSERVATION_KEYS)) == len(keys.OBSERVATION_KEYS)
    assert all(isinstance(k, str) for k in keys.OBSERVATION_KEYS)


def test_outcome_keys_are_nested_under_next():
    for key in (keys.REWARD, keys.DONE, keys.TERMINATED, keys.TRUNCATED):
        assert key[0] == "next"
    assert tuple(k[1] for k in (keys.DONE, keys.TERMINATED, keys.TRUNCATED)) == keys.DONE_KEYS


@pytest.mark.parametrize("B", [1, 4])
def test_make_spec_shapes_and_dtypes(B):
    specs = keys.make_spec(B, vocab_size=100, max_length=32)
    obs = specs["observation"]
    assert set(obs.keys()) == set(keys.OBSERVATION_KEYS)
    for key in keys.OBSERVATION_KEYS:
        assert obs[key].shape == (B,)
        assert obs[key].dtype == (torch.bool if key == keys.ACTIVE else torch.int64)
    assert specs["action"].shape == (B,) and specs["action"].dtype == torch.int64
    assert specs["action"].space.n == 100
    assert specs["reward"].shape == (B, 1) and specs["reward"].dtype == torch.float32
    for name in keys.DONE_KEYS:
        assert specs["done"][name].shape == (B, 1) and specs["done"][name].dtype == torch.bool


def test_make_spec_bounds():
    specs = keys.make_spec(2, vocab_size=10, max_length=8)
    obs = specs["observation"]
    assert obs.is_in(obs.rand())
    assert obs[keys.TOKEN].is_in(torch.tensor([0, 9]))
    assert not obs[keys.TOKEN].is_in(torch.tensor([0, 10]))
    assert obs[keys.SEQ_LEN].is_in(torch.tensor([0, 8]))
    assert not obs[keys.SEQ_LEN].is_in(torch.tensor([0, 9]))
    assert specs["action"].is_in(specs["action"].rand())


def test_make_spec_returns_fresh_specs():
    a, b = keys.make_spec(2, 10, 8), keys.make_spec(2, 10, 8)
    assert a["observation"] is not b["observation"]
    assert a["done"]["done"] is not a["done"]["terminated"]
