"""Tests of llm_envs/gym_adapter.py: registration, gymnasium's check_env, seeding, scripted episodes."""

import runpy
import sys
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import ResetNeeded
from tokengym.llm_envs.gym_adapter import TASK_ENV_IDS, GymTokenEnv, register_envs
from tokengym.llm_envs.prompts import PromptSource
from tokengym.llm_envs.tasks import make_arithmetic_env, make_reversal_env
from tokengym.llm_envs.token_env import TokenEnv
from tokengym.testing import tiny_tokenizer

EXAMPLE = Path(__file__).parents[2] / "examples" / "gym_adapter.py"


def _answer_ids(env, text: str) -> list[int]:
    tok = env.unwrapped.tokenizer
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


@pytest.mark.parametrize("env_id", sorted(TASK_ENV_IDS))
def test_registered_env_passes_check_env(env_id):
    env = gymnasium.make(env_id, tokenizer=tiny_tokenizer())
    check_env(env.unwrapped)  # warnings are errors in this test suite
    env.close()


def test_register_envs_is_idempotent():
    register_envs()
    register_envs()
    assert set(TASK_ENV_IDS) <= set(gymnasium.registry)


@pytest.mark.parametrize("env_id", sorted(TASK_ENV_IDS))
def test_scripted_correct_answer_gets_reward_one(env_id):
    env = gymnasium.make(env_id, tokenizer=tiny_tokenizer(), n_prompts=16)
    obs, info = env.reset(seed=5)
    answer = info["metadata"]["answer"]
    assert obs[keys.RESPONSE_LEN] == 0 and obs[keys.SEQ_LEN] == obs[keys.PROMPT_LEN] > 0
    actions = _answer_ids(env, answer)
    for i, action in enumerate(actions):
        obs, reward, terminated, truncated, step_info = env.step(action)
        assert obs in env.observation_space and obs[keys.TOKEN] == action
        assert terminated == (i == len(actions) - 1) and not truncated
    assert reward == 1.0 and obs[keys.RESPONSE_LEN] == len(actions)
    assert step_info == {"prompt": info["prompt"], "response": answer, "metadata": info["metadata"]}


def test_seeded_reset_is_deterministic():
    env = gymnasium.make("tokengym/Arithmetic-v0", tokenizer=tiny_tokenizer(), n_prompts=64)
    prompts = {}
    for seed in (1, 2, 1):
        first = env.reset(seed=seed)[1]["prompt"]
        prompts.setdefault(seed, []).append((first, env.reset()[1]["prompt"]))
    assert prompts[1][0] == prompts[1][1]
    assert prompts[1][0] != prompts[2][0]


def test_truncation_and_step_after_done():
    env = gymnasium.make("tokengym/Reversal-v0", tokenizer=tiny_tokenizer(), max_new_tokens=3, render_mode="ansi")
    _, info = env.reset(seed=0)
    token = env.unwrapped.tokenizer("a", add_special_tokens=False)["input_ids"][0]
    results = [env.step(np.int64(token)) for _ in range(3)]
    assert [(r[2], r[3]) for r in results] == [(False, False), (False, False), (False, True)]
    assert results[-1][4]["response"] == "aaa" and results[-1][1] == 0.0
    assert env.render() == info["prompt"] + "aaa"
    with pytest.raises(ResetNeeded, match="after the episode ended; call reset"):
        env.unwrapped.step(token)


def test_gym_token_env_errors():
    with pytest.raises(TypeError, match="env_factory must be a callable returning a TokenEnv, got 3"):
        GymTokenEnv(3)
    with pytest.raises(ValueError, match=r"render_mode must be None or one of \['ansi'\], got 'human'"):
        GymTokenEnv(make_arithmetic_env, render_mode="human", tokenizer=tiny_tokenizer(), batch_size=1)
    with pytest.raises(TypeError, match="env_factory must return a TokenEnv, got list"):
        GymTokenEnv(list)
    with pytest.raises(
        ValueError, match=r"needs a single-slot TokenEnv, got batch_size=\(2,\); build it with batch_size=1"
    ):
        GymTokenEnv(make_arithmetic_env, tokenizer=tiny_tokenizer(), batch_size=2)
    env = GymTokenEnv(make_reversal_env, tokenizer=tiny_tokenizer(), batch_size=1, n_prompts=2)
    assert env.render() is None
    with pytest.raises(ResetNeeded, match=r"step\(\) before reset\(\)"):
        env.step(0)
    env.reset()
    with pytest.raises(ValueError, match=r"action must be a token id in \[0, 512\), got 512"):
        env.step(512)


def test_exhausted_source(tokenizer):
    def one_prompt_once():
        source = PromptSource(["1+1="], tokenizer, epochs=1)
        return TokenEnv(source, tokenizer, batch_size=1, max_new_tokens=2, max_length=16)

    env = GymTokenEnv(one_prompt_once)
    env.reset()
    with pytest.raises(ValueError, match="the prompt source is exhausted"):
        env.reset()


def test_example_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--episodes", "2"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("reward" in line for line in lines)
