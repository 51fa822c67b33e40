"""An agent program's time limit counts its own time: a call waiting for a slow model is not the program's fault,
a program that sleeps past the limit is ended. Real ``openai`` clients over the in-process transport; the test
thread answers the calls as the env would."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokengym.llm_envs.agents.messages import chat_reply
from tokengym.llm_envs.agents.runner import AgentRunner, AgentTimeout


def _reply() -> dict:
    message = {"role": "assistant", "content": "4"}
    return chat_reply("p", message, "stop", prompt_tokens=3, token_ids=[7], log_probs=None, tokens=None)


def _serve(runner: AgentRunner, episode_id: int, model_seconds: float = 0.0) -> tuple[str, object]:
    """Play the env for one episode: answer each call after ``model_seconds`` (the model generating its turn);
    the program's last move."""
    ep = runner.episodes[episode_id]
    while True:
        kind, value = ep.next_move()
        if kind != "call":
            return kind, value
        time.sleep(model_seconds)
        ep.answer(_reply())


def test_time_waiting_for_the_model_is_not_the_programs_time():
    calls = []

    async def agent(client, task):
        for _ in range(2):
            reply = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": task}])
            calls.append(reply.choices[0].message.content)
        return 1.0

    runner = AgentRunner(agent, time_limit=0.2)
    try:
        runner.start(0, "2+2", 0)
        # the model takes 3x the limit per reply (a loaded machine, a big batch): the program still finishes
        assert _serve(runner, 0, model_seconds=0.6) == ("return", 1.0)
        assert calls == ["4", "4"]
        assert runner.episodes[0].waited >= 1.2
    finally:
        runner.close()


@pytest.mark.parametrize("where", ["before its first call", "between calls"])
def test_a_program_past_its_own_time_is_ended(where):
    async def agent(client, task):
        if where == "between calls":
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": task}])
        await asyncio.sleep(60)  # a hung tool
        return 1.0

    runner = AgentRunner(agent, time_limit=0.2)
    try:
        runner.start(0, "2+2", 0)
        kind, err = _serve(runner, 0)
        assert kind == "error" and isinstance(err, AgentTimeout), (kind, err)
        assert "time limit of 0.2 s" in str(err) and "waited for the model is not counted" in str(err)
    finally:
        runner.close()


def test_no_limit_lets_a_program_run():
    async def agent(client, task):
        await asyncio.sleep(0.3)
        return 2.0

    runner = AgentRunner(agent)
    try:
        runner.start(0, "x", 0)
        assert _serve(runner, 0) == ("return", 2.0)
    finally:
        runner.close()
