"""ClipPPOLoss on a collected trajectory batch: a step moves the model; the loss matches a hand computation."""

from __future__ import annotations

import copy

import pytest
import torch
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, SequenceActor, TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.tasks import arithmetic_prompts, arithmetic_reward
from tokengym.transforms import GroupAdvantage


@pytest.fixture
def setup(tokenizer):
    from tokengym.testing import tiny_model

    model = tiny_model(tokenizer, seed=0).eval()
    env = TokenEnv(arithmetic_prompts(8, seed=0, max_operand=4), tokenizer, arithmetic_reward(), batch_size=8,
                   max_new_tokens=4, group_size=4, max_length=64, model_config=model.config, seed=0)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=1.0), seed=0)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, total_steps=-1)
    batch = next(iter(collector))
    actor = SequenceActor(model, pad_token_id=tokenizer.pad_token_id)
    loss = ClipPPOLoss(actor, critic_network=None, entropy_bonus=False, functional=False, clip_epsilon=0.2)
    return model, batch, loss


def test_one_step_changes_parameters(setup):
    model, batch, loss = setup
    # random advantages on valid steps so the gradient is surely nonzero (a real batch may have all-equal rewards)
    mask = batch.get(keys.MASK)
    batch.set(keys.ADVANTAGE, torch.where(mask, torch.randn(mask.shape), 0.0).unsqueeze(-1))
    before = copy.deepcopy(model.state_dict())
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    out = loss(batch)
    optim.zero_grad()
    out["loss_objective"].backward()
    optim.step()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no parameter moved"
    assert torch.isfinite(out["loss_objective"])


def test_loss_matches_hand_computation(setup):
    model, batch, loss = setup
    batch = GroupAdvantage("grpo")(batch)
    mask = batch.get(keys.MASK).clone()
    if bool(mask.all()):  # no response stopped early: pad the last step of every other row by hand
        mask[::2, -1] = False
        batch.set(keys.MASK, mask)
    assert not bool(mask.all()), "want padded steps in the batch to check how they are averaged"
    # perturb the behaviour log-probs so that some ratios leave [1 - eps, 1 + eps] and the clip matters
    gen = torch.Generator().manual_seed(1)
    old = batch.get(keys.ACTION_LOG_PROB) + 0.5 * torch.randn(mask.shape, generator=gen)
    batch.set(keys.ACTION_LOG_PROB, old)
    adv = torch.where(mask, torch.randn(mask.shape, generator=gen), 0.0)
    batch.set(keys.ADVANTAGE, adv.unsqueeze(-1))

    with torch.no_grad():
        out = loss(batch)
        dist = loss.actor_network.get_dist(batch)
        ratio = (dist.log_prob(batch.get(keys.ACTION)) - old).exp()
        surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        by_valid = -surrogate[mask].mean()  # padded steps excluded from the average
        by_all = -surrogate.masked_fill(~mask, 0.0).mean()  # padded steps counted as zeros
    clipped = ((ratio < 0.8) | (ratio > 1.2))[mask]
    assert bool(clipped.any()) and not bool(clipped.all())
    # torchrl reads ("collector", "mask") (LossModule.loss_mask_key="auto") and averages over valid steps only
    torch.testing.assert_close(out["loss_objective"], by_valid, rtol=1e-5, atol=1e-6)
    assert not torch.isclose(out["loss_objective"], by_all)
