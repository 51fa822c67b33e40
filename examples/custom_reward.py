"""A user-defined reward function with TokenEnv + TokenCollector (run: python examples/custom_reward.py).

A reward function gets the decoded responses, prompts and per-prompt metadata of the trajectories
that just finished and returns one float per response.
"""

from __future__ import annotations

import argparse

import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer


def keyword_reward(responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """+1 if the response mentions the prompt's keyword, minus 0.05 per character (a length penalty)."""
    return torch.tensor(
        [float(meta["keyword"] in r) - 0.05 * len(r) for r, meta in zip(responses, metadata, strict=True)]
    )


def main(iterations: int = 3) -> list[float]:
    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=0)
    # prompts are dicts: "prompt" is the text, the other fields reach the reward fn as metadata
    prompts = [{"prompt": f"Say {word}:", "keyword": word} for word in ("a", "b", "cat", "7")]
    env = TokenEnv(prompts, tok, keyword_reward, batch_size=8, max_new_tokens=6, group_size=2, max_length=32,
                   model_config=model.config, seed=0)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=1.0), seed=0)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, total_steps=-1)
    means = []
    for i, batch in enumerate(collector):
        # the reward sits on each trajectory's last step; summing over time gives one number per trajectory
        means.append(float(batch.get(keys.REWARD).squeeze(-1).sum(-1).mean()))
        print(f"batch {i}: {batch.shape[0]} trajectories, mean reward {means[-1]:+.3f}")
        if i + 1 >= iterations:
            break
    return means


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    main(parser.parse_args().iterations)
