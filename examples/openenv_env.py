"""Collect multi-turn episodes from a running OpenEnv server, one WebSocket session per slot
(run: python examples/openenv_env.py --url http://127.0.0.1:8000; needs pip install 'tokengym[openenv]')."""

import argparse

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.llm_envs.adapters import make_openenv_env
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.transforms.layouts import to_padded

parser = argparse.ArgumentParser()
parser.add_argument("--url", required=True, help="the OpenEnv server, e.g. http://127.0.0.1:8000")
args = parser.parse_args()

tok = tiny_tokenizer()
model = tiny_model(tok)
# the reset observation is the prompt; each finished turn is sent as the action's text field (found
# from the server's /schema, or action_field="..."); the step's reward and observation come back
env = make_openenv_env(args.url, tok, batch_size=4, max_turns=3, max_turn_tokens=13, max_new_tokens=40, max_length=256,
                       eos_token_ids=list(range(1, len(tok), 7)), model_config=model.config)  # fmt: skip
collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4)
batch = next(iter(collector))
padded = to_padded(batch)  # server feedback sits between the turns, ACTION_MASK False
for row in range(batch.shape[0]):
    ends = batch[keys.DONE][row].squeeze(-1) | (batch[keys.TURN][row].diff(append=batch[keys.TURN][row, -1:]) > 0)
    print(f"episode {row}: per-turn rewards {batch[keys.REWARD][row].squeeze(-1)[ends & batch[keys.MASK][row]].tolist()}, "
          f"{int((~padded[keys.ACTION_MASK][row] & padded[keys.ATTENTION_MASK][row]).sum())} prompt + feedback tokens")
env.close()
