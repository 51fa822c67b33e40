"""AsyncCollector, nothing silent (issue 47): a policy built on the trained model is refused, the staleness bound is
reported for the tokens that train, and a batch that stale work left short warns once, naming the fix."""

import copy
import re
import warnings

import pytest
import torch

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.policies import PolicyWithReference, StepwiseReference, TransformersPolicy
from tokengym.errors import TokenGymWarning
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model

PROMPTS = [f"{a}+{b}=" for a in range(5) for b in range(4)]


def make_env(tokenizer):
    return TokenEnv(PROMPTS, tokenizer, None, batch_size=4, max_new_tokens=10, max_length=32, group_size=2)


def make_collector(tokenizer, policy_model, *, env=None, batch_size=8):
    env = env or make_env(tokenizer)
    policy = TransformersPolicy(policy_model, env, seed=1)
    return TokenCollector(env, policy, mode="trajectories", batch_size=batch_size,
                          options=CollectorOptions(in_flight="continue"))  # fmt: skip


# -- a policy built on the trained model: its weights change under it while it generates --
_OWN_COPY = r"TransformersPolicy\(copy\.deepcopy\(model\), env\).*update_policy_weights_\(model\.state_dict\(\)\).*weights=model\.state_dict"


@pytest.mark.parametrize("publish", ["state_dict", "module"])
def test_publishing_the_tensors_the_policy_generates_with_is_refused(tokenizer, publish):
    model = tiny_model(tokenizer, seed=0)
    inner = make_collector(tokenizer, model)  # built on the trained model itself, not on a copy
    with AsyncCollector(inner, max_staleness=1) as collector:
        next(iter(collector))
        weights = model.state_dict() if publish == "state_dict" else model
        with pytest.raises(ValueError, match=r"the tensors its policy's Qwen2ForCausalLM generates with .*" + _OWN_COPY):
            collector.update_policy_weights_(weights)
        assert collector.version == 0 and inner.policy.version == 0  # nothing went out


def test_a_policy_behind_a_wrapper_is_seen_through(tokenizer):
    model = tiny_model(tokenizer, seed=0)
    env = make_env(tokenizer)
    policy = PolicyWithReference(TransformersPolicy(model, env, seed=1), StepwiseReference(copy.deepcopy(model), env))
    inner = TokenCollector(env, policy, mode="trajectories", batch_size=8)
    with AsyncCollector(inner, max_staleness=1) as collector:
        with pytest.raises(ValueError, match=_OWN_COPY):
            collector.update_policy_weights_(model.state_dict())


def test_the_policys_own_copy_takes_the_trained_weights(tokenizer):
    model = tiny_model(tokenizer, seed=0)
    inner = make_collector(tokenizer, copy.deepcopy(model))
    with AsyncCollector(inner, max_staleness=1) as collector:
        next(iter(collector))
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        assert collector.update_policy_weights_(model.state_dict()) == 1
        next(iter(collector))  # the update lands at the collector's next step boundary
    assert torch.equal(inner.policy.model.lm_head.weight, model.lm_head.weight)
    assert inner.policy.model.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()


# -- the staleness bound: every token that trains is at most max_staleness updates old --
def _collect(tokenizer, *, stale_tokens, batches=5, updates_per_batch=3):
    """A trainer that publishes three times per batch: the work collected ahead falls behind the bound of 1."""
    model = tiny_model(tokenizer, seed=0)
    inner = make_collector(tokenizer, copy.deepcopy(model))
    out = []
    with AsyncCollector(inner, max_staleness=1, stale_tokens=stale_tokens) as collector:
        for i, batch in enumerate(collector):
            out.append((batch, collector.version, dict(collector.metrics)))
            for _ in range(updates_per_batch):
                collector.update_policy_weights_(model.state_dict())
            if i == batches - 1:
                break
    return out


def test_mask_mode_holds_older_tokens_at_weight_0_and_reports_the_bound_of_those_that_train(tokenizer):
    seen_older = False
    for batch, version, metrics in _collect(tokenizer, stale_tokens="mask"):
        mask = batch[keys.MASK]
        lag = version - batch[keys.POLICY_VERSION]
        weight = batch.get(keys.LOSS_WEIGHT, torch.ones(mask.shape)).reshape(mask.shape)
        trains = mask & (weight != 0)
        expected = float(lag[trains].max()) if trains.any() else 0.0
        assert metrics["staleness_max_weighted"] == expected <= 1  # the documented bound, over the tokens that train
        assert metrics["staleness_max"] == float(lag[mask].max())  # every token the batch holds, weight 0 included
        seen_older |= metrics["staleness_max"] > 1
    assert seen_older  # the batches did hold tokens older than the bound (at weight 0): the two metrics differ


def test_drop_mode_bounds_every_token_and_both_metrics_agree(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TokenGymWarning)  # the short batches' warning: its own test below
        results = _collect(tokenizer, stale_tokens="drop")
    for batch, version, metrics in results:
        assert metrics["staleness_max_weighted"] == metrics["staleness_max"] <= 1
        assert int((version - batch[keys.POLICY_VERSION])[batch[keys.MASK]].max()) <= 1


def test_the_metric_is_there_before_the_first_batch(tokenizer):
    with AsyncCollector(make_collector(tokenizer, tiny_model(tokenizer, seed=0)), max_staleness=1) as collector:
        assert collector.metrics["staleness_max_weighted"] == 0.0


# -- drop mode: a batch left short by stale work says so, once --
def test_a_batch_left_short_by_dropped_stale_work_warns_once_naming_mask_mode(tokenizer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _collect(tokenizer, stale_tokens="drop", batches=6)
    sizes = [batch.shape[0] for batch, _, _ in results]
    assert min(sizes) < 8 and results[-1][2]["dropped_tokens"] > 0  # stale groups were dropped: batches shrank
    ours = [w for w in caught if issubclass(w.category, TokenGymWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]  # once per collector, not once per batch
    assert re.search(r"kept \d of a batch's 8 trajectories: \d+ group\(s\) \(\d+ tokens\).*max_staleness=1.*"
                     r"stale_tokens='mask'.*WeightedLoss\(loss\).*larger max_staleness", str(ours[0].message))  # fmt: skip


def test_mask_mode_keeps_batches_full_and_does_not_warn(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenGymWarning)
        results = _collect(tokenizer, stale_tokens="mask")
    assert [batch.shape[0] for batch, _, _ in results] == [8] * len(results)
