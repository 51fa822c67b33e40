"""Identity test (SB3 style): GRPO via ClipPPOLoss learns to answer with one fixed token in a bounded budget."""

from __future__ import annotations

import time

import torch
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, SequenceActor, TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.tasks import arithmetic_prompts
from tokengym.testing import tiny_model
from tokengym.transforms import GroupAdvantage

TARGET = "7"  # a single-token string in the tiny tokenizer (asserted below)


def starts_with_target(responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    return torch.tensor([float(r.startswith(TARGET)) for r in responses])


def train(tokenizer, *, iterations: int, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    model = tiny_model(tokenizer, seed=seed).eval()
    env = TokenEnv(arithmetic_prompts(32, seed=seed, max_operand=4), tokenizer, starts_with_target, batch_size=64,
                   max_new_tokens=1, group_size=8, max_length=64, model_config=model.config, shuffle=True,
                   seed=seed)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=1.0), seed=seed)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=64, total_steps=-1)
    loss = ClipPPOLoss(SequenceActor(model, pad_token_id=tokenizer.pad_token_id), critic_network=None,
                       entropy_bonus=False, functional=False, clip_epsilon=0.2)  # fmt: skip
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    advantage = GroupAdvantage("grpo")
    rewards: list[float] = []
    for i, batch in enumerate(collector):
        rewards.append(float(batch.get(keys.REWARD).squeeze(-1).sum(-1).mean()))
        batch = advantage(batch)
        model.train()
        for _ in range(4):
            out = loss(batch)
            optim.zero_grad()
            out["loss_objective"].backward()
            optim.step()
        model.eval()
        collector.update_policy_weights_()
        if i + 1 >= iterations or (len(rewards) >= 3 and min(rewards[-3:]) > 0.9):
            break
    return rewards


def test_learns_fixed_first_token(tokenizer):
    assert len(tokenizer.encode(TARGET)) == 1
    start = time.perf_counter()
    rewards = train(tokenizer, iterations=60)
    elapsed = time.perf_counter() - start
    print(f"start {rewards[:3]} end {rewards[-3:]} after {len(rewards)} iterations, {elapsed:.1f} s")
    assert sum(rewards[:2]) / 2 < 0.2  # the untrained policy rarely says it
    assert sum(rewards[-3:]) / 3 > 0.8, rewards
