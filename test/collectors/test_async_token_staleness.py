"""AsyncCollector(stale_tokens="mask"): tokens older than the bound get loss weight 0; nothing is dropped."""

import copy

import pytest
import torch
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.policies import PaddedSequenceActor, TransformersPolicy
from tokengym.errors import TokenGymWarning
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model
from tokengym.transforms import GroupAdvantage, WeightedLoss, to_padded

PROMPTS = [f"{a}+{b}=" for a in range(5) for b in range(4)]


def length_reward(responses, prompts, metadata):
    return [float(len(r) % 3) for r in responses]


def make_collector(tokenizer, model, *, mode="trajectories", batch_size=8):
    env = TokenEnv(PROMPTS, tokenizer, length_reward, batch_size=4, max_new_tokens=10, max_length=32, group_size=2)
    policy = TransformersPolicy(copy.deepcopy(model), env, seed=1)
    return TokenCollector(env, policy, mode=mode, batch_size=batch_size, options=CollectorOptions(in_flight="continue"))


def collect_with_updates(tokenizer, model, *, mode, stale_tokens, batches=4, updates_per_batch=3):
    """A trainer publishing three times per batch: queued work falls behind the bound of 1."""
    inner = make_collector(tokenizer, model, mode=mode, batch_size=8 if mode == "trajectories" else 6)
    out = []
    with AsyncCollector(inner, max_staleness=1, stale_tokens=stale_tokens) as collector:
        for i, batch in enumerate(collector):
            out.append((batch, collector.version, dict(collector.metrics)))
            for _ in range(updates_per_batch):
                collector.update_policy_weights_(model)
            if i == batches - 1:
                break
    return out


@pytest.mark.parametrize("mode", ["trajectories", "steps"])
def test_stale_tokens_are_weighted_zero_and_nothing_is_dropped(tokenizer, mode):
    model = tiny_model(tokenizer, seed=0)
    masked = 0
    results = collect_with_updates(tokenizer, model, mode=mode, stale_tokens="mask")
    for batch, version, metrics in results:
        mask, lag = batch[keys.MASK], version - batch[keys.POLICY_VERSION]
        if mode == "trajectories":  # every trajectory asked for is there, in whole groups
            assert batch.shape[0] == 8
            groups = batch[keys.GROUP_ID][:, 0]
            assert all(int((groups == g).sum()) == 2 for g in groups.unique())
        stale = mask & (lag > 1)
        if keys.LOSS_WEIGHT in batch.keys():  # exactly the tokens older than the bound have weight 0
            weight = batch[keys.LOSS_WEIGHT]
            assert torch.equal(weight[mask] == 0, stale[mask])
        else:
            assert not stale.any()
        masked += int(stale.sum())
        assert metrics["masked_stale_tokens"] == masked
        assert 0.0 <= metrics["version_spanning_fraction"] <= 1.0
    assert masked > 0  # the trainer outran the bound: there was something to mask
    assert results[-1][2]["dropped_tokens"] == 0


def test_the_default_still_drops_whole_groups(tokenizer):
    model = tiny_model(tokenizer, seed=0)
    with pytest.warns(TokenGymWarning, match="stale_tokens='mask'"):  # the batches left short say so (issue 47)
        results = collect_with_updates(tokenizer, model, mode="trajectories", stale_tokens="drop")
    assert results[-1][2]["dropped_tokens"] > 0 and results[-1][2]["masked_stale_tokens"] == 0
    for batch, version, _ in results:
        assert int(batch[keys.POLICY_VERSION][batch[keys.MASK]].min()) >= version - 1


def test_the_loss_ignores_masked_tokens(tokenizer):
    """What a stale token holds does not reach the loss: changing its sampling log-prob leaves the loss as it was."""
    model = tiny_model(tokenizer, seed=0)
    batches = collect_with_updates(tokenizer, model, mode="trajectories", stale_tokens="mask")
    batch = next(b for b, _, _ in batches if keys.LOSS_WEIGHT in b.keys() and (b[keys.LOSS_WEIGHT] == 0).any())
    data = to_padded(GroupAdvantage("grpo")(batch))
    loss = WeightedLoss(GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False, aggregation="none"))
    before = loss(data)["loss_objective"]
    moved = data.clone()
    zero = moved[keys.LOSS_WEIGHT] == 0
    moved[keys.LOG_PROBS] = torch.where(zero & moved[keys.ACTION_MASK], moved[keys.LOG_PROBS] - 3.0, moved[keys.LOG_PROBS])
    torch.testing.assert_close(loss(moved)["loss_objective"], before)
    live = ~zero & moved[keys.ACTION_MASK]  # and a token that is not stale does reach it
    moved[keys.LOG_PROBS] = torch.where(live, moved[keys.LOG_PROBS] - 3.0, moved[keys.LOG_PROBS])
    assert not torch.allclose(loss(moved)["loss_objective"], before)


def test_a_bad_stale_tokens_option_is_named(tokenizer):
    inner = make_collector(tokenizer, tiny_model(tokenizer, seed=0))
    with pytest.raises(ValueError, match=r"stale_tokens must be one of \('drop', 'mask'\).*'zero'"):
        AsyncCollector(inner, stale_tokens="zero")
