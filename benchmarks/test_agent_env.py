"""Agent programs vs the same turns through a turn handler: episodes per second, same run, interleaved.

16 episodes of 3 turns of exactly 32 generated tokens (EOS banned, ``max_turn_tokens=32``), 8 slots, the tiny
and the small tiny model, stepping and waves. The agent pays the OpenAI SDK's own cost per call (~1.5-5 ms here,
most of it pydantic and httpx), so the ratio grows with the model's cost per turn. Compared:

* ``turn_fn``: ``MultiTurnTokenEnv`` whose turn function answers every turn with the same follow-up message.
* ``agent``: ``make_agent_env`` with an ``async def agent(client, task)`` that sends the same follow-up through the
  real ``openai.AsyncOpenAI`` client (in-process ASGI transport), three calls per episode.

Both render the same chat messages after the model's tokens, so both collect the same number of tokens; the
ratio is the agent env's cost over the turn handler's (goal >= 0.8). Run: ``.venv/bin/pytest
benchmarks/test_agent_env.py -s``.
"""

from __future__ import annotations

import statistics
import time

import pytest

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.llm_envs.agents import make_agent_env
from tokengym.llm_envs.multi_turn_env import MultiTurnTokenEnv, Turn
from tokengym.testing import tiny_model, tiny_tokenizer

B, EPISODES, TURNS, TURN_TOKENS, ROUNDS = 8, 16, 3, 32, 5
FOLLOW_UP = "Check your work and say it again."
TASKS = [f"Compute {a} + {a * 3} and explain every step." for a in range(EPISODES)]


def _turn_fn(responses, prompts, metadata, turns):
    return [Turn(0.0, feedback=FOLLOW_UP) for _ in responses]


async def _agent(client, task):
    messages = [{"role": "user", "content": task}]
    for _ in range(TURNS):
        reply = await client.chat.completions.create(model="p", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": FOLLOW_UP}]
    return 0.0


def _collect(kind: str, source: str, tok, model) -> tuple[float, int]:
    common = dict(batch_size=B, max_turns=TURNS, max_new_tokens=TURNS * TURN_TOKENS, max_turn_tokens=TURN_TOKENS,
                  model_config=model.config)  # fmt: skip
    if kind == "agent":
        env = make_agent_env(_agent, TASKS, tok, epochs=1, **common)
    else:
        env = MultiTurnTokenEnv([[{"role": "user", "content": t}] for t in TASKS], tok, _turn_fn, **common)
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(banned_token_ids=tuple(env.eos_token_ids)), seed=0)
    start = time.perf_counter()
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=EPISODES, source=source)))
    wall = time.perf_counter() - start
    tokens = int(batch[keys.MASK].sum())
    assert tokens == EPISODES * TURNS * TURN_TOKENS, tokens
    env.close()
    return wall, tokens


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("source", ["step", "wave"])
def test_agent_env_throughput_vs_turn_handler(source, size, benchmark):
    tok = tiny_tokenizer()
    model = tiny_model(tok, size=size)
    walls = {"turn_fn": [], "agent": []}
    for r in range(ROUNDS):  # interleaved, alternating which goes first
        for kind in (("turn_fn", "agent") if r % 2 == 0 else ("agent", "turn_fn")):
            walls[kind].append(_collect(kind, source, tok, model)[0])
    ratios = [t / a for t, a in zip(walls["turn_fn"], walls["agent"], strict=True)]
    eps = {k: EPISODES / statistics.median(v) for k, v in walls.items()}
    print(f"\n| model | source | turn_fn episodes/s | agent episodes/s | agent / turn_fn (median of {ROUNDS} rounds) |")
    print("|---|---|---|---|---|")
    print(f"| {size} | {source} | {eps['turn_fn']:.2f} | {eps['agent']:.2f} | {statistics.median(ratios):.2f} |")
    benchmark.extra_info.update(source=source, size=size, ratio=statistics.median(ratios), **{f"{k}_eps": v for k, v in eps.items()})
    benchmark.pedantic(lambda: None, rounds=1)
    assert statistics.median(ratios) > 0.3  # a gross regression fails; the goal (0.8) is read from the table
