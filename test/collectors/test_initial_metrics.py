"""``collector.metrics`` has its keys from construction: a logger set up before the first batch (or a
dashboard reading ``metrics`` after a failed first batch) sees the columns every batch has.

It was ``{}`` until a batch succeeded.
"""

import copy
import math

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.errors import PromptError
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.transforms import ZeroStdGroupFilter

PROMPTS = [f"{i}+{i}=" for i in range(6)]


def make_collector(tokenizer, model, *, mode, postproc=None, prompts=PROMPTS):
    env = TokenEnv(PromptSource(prompts, tokenizer, group_size=2, epochs=1), tokenizer, batch_size=4,
                   max_new_tokens=4, max_length=24, model_config=model.config)  # fmt: skip
    return TokenCollector(env, TransformersPolicy(model, env), mode=mode, batch_size=4, postproc=postproc)


def check_numbers(metrics):
    for name, value in metrics.items():  # what a logger takes: log_scalar(name, float(value))
        assert isinstance(value, int | float) and not isinstance(value, bool), (name, value)


def with_kl(batch):
    """A postproc writing ``keys.KL`` (as a KL transform does): the batch's metrics gain ``kl_mean``."""
    return batch.set(keys.KL, torch.zeros(batch.shape))


@pytest.mark.parametrize(("mode", "postproc"), [("steps", None), ("trajectories", None), ("steps", with_kl),
                                                ("trajectories", ZeroStdGroupFilter())])  # fmt: skip
def test_metrics_have_every_key_before_the_first_batch(tokenizer, model, mode, postproc):
    collector = make_collector(tokenizer, model, mode=mode, postproc=postproc)
    before = dict(collector.metrics)
    check_numbers(before)
    assert before["tokens"] == before["steps"] == 0 and math.isnan(before["mean_reward"])
    assert set(collector.base_env.prompt_counts) <= set(before)  # the env's counts, whatever it counts
    next(iter(collector))
    assert set(collector.metrics) == set(before)
    check_numbers(collector.metrics)


def test_metrics_keep_their_keys_when_the_first_batch_fails(tokenizer, model):
    collector = make_collector(tokenizer, model, mode="trajectories", prompts=["1+" * 20 + "1=", *PROMPTS])
    before = set(collector.metrics)
    it = iter(collector)
    with pytest.raises(PromptError):
        next(it)
    assert set(collector.metrics) == before  # still every column, not {}
    next(it)
    assert set(collector.metrics) == before and collector.metrics["failed_prompts"] == 1


def test_async_metrics_have_every_key_before_the_first_batch(tokenizer, model):
    inner = make_collector(tokenizer, copy.deepcopy(model), mode="trajectories")
    with AsyncCollector(inner, max_staleness=1) as collector:
        before = dict(collector.metrics)
        check_numbers(before)
        assert set(inner.metrics) < set(before)
        next(iter(collector))
        assert set(collector.metrics) == set(before)
