"""Sampling settings travel with the batch: the collector records the policy's SamplingConfig in the batch's
PromptTable, and SequenceActor / PaddedSequenceActor score with it or refuse a mismatch with a clear error."""

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    PaddedSequenceActor,
    PolicyWithReference,
    SamplingConfig,
    SequenceActor,
    StepwiseReference,
    TransformersPolicy,
)
from tokengym.collectors.policies.protocol import sampling_of
from tokengym.collectors.policies.sampling import batch_sampling
from tokengym.llm_envs import PromptTable, TokenEnv, keys
from tokengym.testing import make_trajectory_batch
from tokengym.transforms import GroupAdvantage, to_padded

PROMPTS = ["1+1=", "2+3=", "4+4=", "5+1="]
EOS_IDS = list(range(100, 140))  # trajectories end at different steps: the rows are padded


def _reward(responses, prompts, metadata):
    return torch.tensor([float(len(r) % 3) for r in responses])


def collect(tokenizer, model, sampling, *, source=None):
    env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=8, max_new_tokens=10, group_size=4,
                   model_config=model.config, eos_token_ids=EOS_IDS)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=sampling, seed=0)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source=source)
    return GroupAdvantage("grpo")(next(iter(collector)))


@pytest.fixture(scope="module")
def cold(tokenizer, model):
    """A batch sampled at temperature 0.7 with a banned token (what the issue's new user ran)."""
    return collect(tokenizer, model, SamplingConfig(temperature=0.7, banned_token_ids=(7,)))


def test_the_collector_records_the_policy_sampling_settings(tokenizer, model, cold):
    table = cold.get_non_tensor(keys.PROMPTS)
    assert table.sampling == {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "greedy": False, "banned_token_ids": (7,)}
    assert batch_sampling(cold) == SamplingConfig(temperature=0.7, banned_token_ids=(7,))
    assert to_padded(cold).get_non_tensor(keys.PROMPTS).sampling == table.sampling  # the padded layout keeps it
    waves = collect(tokenizer, model, SamplingConfig(temperature=0.5), source="wave")
    assert batch_sampling(waves).temperature == 0.5


def test_policies_expose_their_sampling(tokenizer, model):
    env = TokenEnv(PROMPTS, tokenizer, batch_size=2, max_new_tokens=2, model_config=model.config)
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=0.9))
    assert sampling_of(policy).temperature == 0.9
    assert sampling_of(PolicyWithReference(policy, StepwiseReference(model, env))).temperature == 0.9
    assert sampling_of(lambda td: td) is None


def test_first_on_policy_step_has_ratio_one(model, cold):
    """Actors at their default (temperature=None) take the batch's 0.7 and banned id: clip_fraction 0, ratio 1."""
    assert not bool(cold[keys.MASK].all())  # padding steps are in the batch
    out = ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False)(cold.clone())
    assert float(out["clip_fraction"]) == 0.0
    assert abs(float(out["kl_approx"])) < 1e-6
    assert float(out["max_ratio"]) == pytest.approx(1.0, abs=1e-5) and float(out["mean_ratio"]) == pytest.approx(1.0, abs=1e-6)
    grpo = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)(to_padded(cold))
    assert float(grpo.clip_fraction) == 0.0 and abs(float(grpo.kl_approx)) < 1e-6
    assert float(grpo.ESS) == pytest.approx(1.0, abs=1e-5)
    lp = SequenceActor(model).log_prob(cold)
    torch.testing.assert_close(lp, cold[keys.ACTION_LOG_PROB], atol=2e-5, rtol=1e-5)  # padding: 0 and 0
    padded = to_padded(cold)
    torch.testing.assert_close(PaddedSequenceActor(model).log_prob(padded), padded[keys.LOG_PROBS], atol=2e-5, rtol=1e-5)


def test_banned_tokens_have_no_probability(model, cold):
    logits = SequenceActor(model).logits(cold)
    assert bool((logits[..., 7][cold[keys.MASK]] == -float("inf")).all())


@pytest.mark.parametrize("actor_class", [SequenceActor, PaddedSequenceActor])
def test_a_temperature_mismatch_raises_naming_both_values_and_the_fix(model, cold, actor_class):
    """The issue's case: sampled at 0.7, trained at 1.0 (clip_fraction 0.03 on the first step before): now an error."""
    actor = actor_class(model, temperature=1.0)
    data = cold.clone() if actor_class is SequenceActor else to_padded(cold)
    match = (rf"{actor_class.__name__}\(temperature=1.0\) scores the batch at temperature 1.0, but its policy sampled "
             r"it at temperature 0.7 .*Pass temperature=0.7, or leave temperature=None")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        actor.get_dist(data)
    matching = actor_class(model, temperature=0.7).get_dist(data)
    assert matching.event_shape == () and bool(torch.isfinite(matching.log_prob(data[keys.ACTION if actor_class is SequenceActor else keys.TOKENS])).all())


@pytest.mark.parametrize("actor_class", [SequenceActor, PaddedSequenceActor])
def test_top_k_top_p_batches_are_refused_unless_use_unfiltered(tokenizer, model, actor_class):
    batch = collect(tokenizer, model, SamplingConfig(top_k=20, top_p=0.9))
    data = batch if actor_class is SequenceActor else to_padded(batch)
    with pytest.raises(ValueError, match=r"sampled with top_k=20, top_p=0.9.*use_unfiltered=True"):
        actor_class(model).get_dist(data)
    unfiltered = actor_class(model, use_unfiltered=True)
    assert unfiltered.scoring(data) == SamplingConfig()
    assert bool(torch.isfinite(unfiltered.log_prob(data)).all())


def test_a_batch_without_settings_uses_the_actor_temperature(model):
    batch = make_trajectory_batch([3, 2], seed=1)  # a synthetic PromptTable: no sampling recorded
    hot, plain = SequenceActor(model, temperature=2.0), SequenceActor(model)
    assert hot.scoring(batch).temperature == 2.0 and plain.scoring(batch).temperature == 1.0
    valid = batch[keys.MASK]
    torch.testing.assert_close(hot.logits(batch)[valid] * 2.0, plain.logits(batch)[valid])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SequenceActor(model, temperature=0.0)


def test_the_settings_survive_subset_merge_and_checkpoints():
    table = PromptTable(pad_token_id=0, sampling=SamplingConfig(temperature=0.7, banned_token_ids=(3,)))
    table.add(0, torch.tensor([5, 6]))
    assert table.subset([0]).sampling == table.sampling
    assert PromptTable().merge(table).sampling == table.sampling
    state = table.state_dict()
    assert state["sampling"]["banned_token_ids"] == [3]  # plain data for torch.load(weights_only=True)
    assert PromptTable.from_state_dict(state).sampling == table.sampling
    other = PromptTable(sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="cannot merge prompt tables of batches sampled with different settings"):
        PromptTable().merge(table).merge(other)
    stacked = TensorDict({}, [2, 1])
    stacked.set_non_tensor(keys.PROMPTS, [table, other])
    with pytest.raises(ValueError, match="the batch mixes rows sampled with different settings"):
        batch_sampling(stacked)
    with pytest.raises(ValueError, match=r"unknown sampling fields \['temp'\]"):
        PromptTable(sampling={"temp": 1.0})
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig, a mapping of its fields or None"):
        PromptTable(sampling=0.7)
