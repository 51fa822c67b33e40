"""Play the arithmetic task through the gymnasium API with random tokens (run: python examples/gym_adapter.py)."""

import argparse

import gymnasium

import tokengym.llm_envs.gym_adapter  # noqa: F401  (registers the tokengym/ env ids)
from tokengym.testing import tiny_tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--episodes", type=int, default=5)
args = parser.parse_args()

# one step = one token; max_new_tokens caps the response (the episode is then truncated);
# tokenizer: your model's (AutoTokenizer.from_pretrained(model_dir)), here the offline tiny one
env = gymnasium.make("tokengym/Arithmetic-v0", tokenizer=tiny_tokenizer(), max_new_tokens=8)
env.action_space.seed(0)  # the action space has its own RNG; reset(seed=...) seeds the prompts
obs, info = env.reset(seed=0)
for _ in range(args.episodes):
    terminated = truncated = False
    while not (terminated or truncated):
        action = env.action_space.sample()  # a random token id; a policy would pick one from obs
        obs, reward, terminated, truncated, info = env.step(action)
    # the reward (1.0 for a right answer) and the decoded text arrive with the last token
    print(f"{info['prompt']!r} -> {info['response']!r} (answer {info['metadata']['answer']}): reward {reward}")
    obs, info = env.reset()
env.close()
