"""Play TextArena games (one per slot) as a multi-turn token env, and a gym-style text env of your own
(run: python examples/textarena_env.py; needs pip install 'tokengym[textarena]')."""

import argparse

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.llm_envs.adapters import make_text_env, make_textarena_env
from tokengym.testing import tiny_model, tiny_tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--game", default="GuessTheNumber-v0")
args = parser.parse_args()

tok = tiny_tokenizer()
model = tiny_model(tok)
END_IDS = list(range(1, len(tok), 7))  # a random model rarely says EOS: end its turns on many ids


class Countdown:
    """Any object with reset(seed=...) -> (obs, info) and step(text) -> (obs, reward, terminated, truncated, info)."""

    def reset(self, seed=None):
        self.left = 3
        return "Say a number.", {}

    def step(self, text):
        self.left -= 1
        return f"{self.left} to go", float(any(c.isdigit() for c in text)), self.left == 0, False, {}


for name, env in [
    (args.game, make_textarena_env(args.game, tok, batch_size=4, max_turns=4, max_turn_tokens=12, max_new_tokens=48, max_length=1024,
                                   eos_token_ids=END_IDS, model_config=model.config)),
    ("Countdown", make_text_env(Countdown, tok, batch_size=4, max_turns=4, max_turn_tokens=12, max_new_tokens=48, max_length=256,
                                eos_token_ids=END_IDS, model_config=model.config)),
]:  # fmt: skip
    collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4)
    batch = next(iter(collector))
    turns = (batch[keys.TURN].amax(1) + 1).tolist()
    print(f"{name}: {batch.shape[0]} episodes, turns {turns}, rewards per episode "
          f"{[round(r, 3) for r in batch[keys.REWARD].sum((1, 2)).tolist()]}")
    env.close()
