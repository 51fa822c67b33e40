"""Fixtures for collector tests: a tiny model, prompts of different lengths, env/policy builders, a local Ray."""

import sys
from pathlib import Path

import pytest
import torch

from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.llm_envs import TokenEnv

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: the tests import collector_helpers

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]


@pytest.fixture
def make_env(tokenizer, model):
    def make(prompts=PROMPTS, **kwargs):
        kwargs.setdefault("batch_size", 4)
        kwargs.setdefault("max_new_tokens", 8)
        kwargs.setdefault("max_length", 64)
        return TokenEnv(prompts, tokenizer, model_config=model.config, **kwargs)

    return make


@pytest.fixture
def make_policy(model):
    def make(env, **kwargs):
        sampling = kwargs.pop("sampling", SamplingConfig())
        return TransformersPolicy(model, env, sampling=sampling, seed=kwargs.pop("seed", 0), **kwargs)

    return make


@pytest.fixture
def random_policy():
    """Factory of a cheap policy (no model): random in-vocab actions, zero log-probs, version 0."""
    return _random_policy


def _random_policy(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def policy(td):
        B = td.batch_size[0]
        action = torch.randint(0, vocab, (B,), generator=gen)
        td.set("action", action)
        td.set("action_log_prob", torch.zeros(B))
        td.set("policy_version", torch.zeros(B, dtype=torch.int64))
        return td

    return policy


@pytest.fixture
def prompts():
    return list(PROMPTS)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for a module (``pytestmark = pytest.mark.usefixtures("local_ray")``), shut down after it."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        # Ray kills workers when the *machine* runs low on memory; other jobs on a shared CI box must not fail these
        mp.setenv("RAY_memory_monitor_refresh_ms", "0")
        ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
        yield
        ray.shutdown()
