"""Collect a batch on a reasoning-gym task, rewarded by the dataset's own score_answer
(run: python examples/reasoning_gym_env.py; needs pip install 'tokengym[reasoning-gym]')."""

import argparse

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.llm_envs.adapters import make_reasoning_gym_env
from tokengym.testing import tiny_model, tiny_tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", default="chain_sum")
parser.add_argument("--batches", type=int, default=2)
args = parser.parse_args()

tok = tiny_tokenizer()
model = tiny_model(tok)  # an offline random-init model: swap in your own
# a name, several names (an equal mix), {name: weight} or [{"name", "weight", "config"}]
env = make_reasoning_gym_env(args.dataset, tokenizer=tok, size=100, batch_size=8, max_new_tokens=16,
                             group_size=4, model_config=model.config)  # fmt: skip
collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=8)
for i, batch in enumerate(collector):
    table = batch.get_non_tensor(keys.PROMPTS)
    entry = table.metadata(int(batch[keys.GROUP_ID][0, 0]))["entry"]  # the reasoning-gym entry travels along
    print(f"batch {i}: {batch.shape[0]} trajectories, mean reward {batch[keys.REWARD].sum(1).mean():.3f}; "
          f"e.g. {entry['question'][:50]!r} -> {entry['answer']!r}")
    if i + 1 >= args.batches:
        break
