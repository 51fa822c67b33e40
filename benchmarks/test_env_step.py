"""TokenEnv step overhead with no model, against TorchRL's LLMHashingEnv (one token per step too).

Run: ``pytest benchmarks/test_env_step.py --benchmark-only``. Each case reports ``us_per_step`` and
``tokens_per_s`` in ``extra_info``; ``test_step_vs_llm_hashing_env`` times both envs in one function
(same process, interleaved) so its ``ratio_*`` entries compare like with like. The target is
<= 100 us per step at B=32, flat in the buffer length.
"""

from __future__ import annotations

import timeit

import pytest
import torch
from tensordict import TensorDict
from torchrl.envs import LLMHashingEnv

from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_tokenizer

BATCHES = (8, 32)
LENGTHS = (128, 2048)
PROMPTS = ["1+1=", "the answer is", "abc", "Reverse hello:"]
TOKEN = 40  # "A": never EOS, never a stop string, so trajectories run to max_length
ROUNDS = 1000
STEPS_PER_ROUND = 100  # < the shortest trajectory at L=128, so env.step never meets a done slot


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _token_env(tokenizer, B: int, L: int) -> tuple[TokenEnv, TensorDict]:
    env = TokenEnv(PROMPTS, tokenizer, batch_size=B, max_new_tokens=L - 1, max_length=L)  # max_length binds first
    td = env.reset().set(keys.ACTION, torch.full((B,), TOKEN))
    return env, td


def _hashing_env(B: int, L: int) -> tuple[LLMHashingEnv, TensorDict]:
    # its observation is the whole sequence: feed a (B, L) one so each step works at length L
    env = LLMHashingEnv(vocab_size=512, text_output=False)
    td = env.reset(TensorDict(observation=torch.randint(0, 512, (B, L)), batch_size=[B]))
    return env, td.set("action", torch.randint(0, 512, (B, 1)))


def _stepper(env: TokenEnv, td: TensorDict):
    """A closure over ``step_and_maybe_reset`` that writes the (fixed) action, as a policy would."""
    action, state = td.get(keys.ACTION), {"td": td}

    def step() -> None:
        _, state["td"] = env.step_and_maybe_reset(state["td"].set(keys.ACTION, action))

    return step


def _reset(env: TokenEnv, td: TensorDict) -> TensorDict:
    return env.reset().set(keys.ACTION, td.get(keys.ACTION))


def _step_many(env: TokenEnv):
    """``STEPS_PER_ROUND`` calls of ``env.step`` on one tensordict (TokenEnv reads only its action)."""

    def steps(td: TensorDict) -> None:
        for _ in range(STEPS_PER_ROUND):
            env.step(td)

    return steps


def _record(benchmark, B: int, steps: int = 1) -> None:
    median, mean = benchmark.stats.stats.median / steps, benchmark.stats.stats.mean / steps
    # the mean includes the amortized partial resets of step_and_maybe_reset; the median does not
    benchmark.extra_info.update(
        us_per_step=round(median * 1e6, 1),
        us_per_step_mean=round(mean * 1e6, 1),
        tokens_per_s=round(B / median),
    )


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("B", BATCHES)
def test_token_env_step(benchmark, tokenizer, B, L):
    """``env.step(td)`` (the TorchRL API): ``STEPS_PER_ROUND`` steps per round, an untimed reset between rounds."""
    env, td = _token_env(tokenizer, B, L)

    def setup():
        return (_reset(env, td),), {}

    benchmark.pedantic(_step_many(env), setup=setup, rounds=ROUNDS // STEPS_PER_ROUND, warmup_rounds=2)
    _record(benchmark, B, STEPS_PER_ROUND)


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("B", BATCHES)
def test_token_env_step_and_maybe_reset(benchmark, tokenizer, B, L):
    """``env.step_and_maybe_reset``: the collector's loop, partial resets included (amortized)."""
    env, td = _token_env(tokenizer, B, L)
    benchmark.pedantic(_stepper(env, td), rounds=ROUNDS, warmup_rounds=20)
    _record(benchmark, B)


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("B", BATCHES)
def test_llm_hashing_env_step(benchmark, B, L):
    """TorchRL's ``LLMHashingEnv.step`` at sequence length ``L`` (the baseline)."""
    env, td = _hashing_env(B, L)
    benchmark.pedantic(env.step, args=(td,), rounds=ROUNDS, warmup_rounds=20)
    _record(benchmark, B)


def _us_per_step(fn, setup=lambda: None, number: int = STEPS_PER_ROUND, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, setup=setup, number=number, repeat=repeat)) / number * 1e6


@pytest.mark.parametrize("B", BATCHES)
def test_step_vs_llm_hashing_env(benchmark, tokenizer, B):
    """Both envs at both lengths in one function: ``env.step`` ratio vs LLMHashingEnv, flatness in length."""
    result: dict[str, float] = {}

    def compare() -> None:
        for L in LENGTHS:
            env, td = _token_env(tokenizer, B, L)
            hashing, htd = _hashing_env(B, L)
            state = {"td": td}

            def reset(env=env, state=state):
                state["td"] = _reset(env, state["td"])

            token_us = _us_per_step(lambda env=env, state=state: env.step(state["td"]), setup=reset)
            hashing_us = _us_per_step(lambda h=hashing, t=htd: h.step(t))
            result[f"token_env_us_L{L}"], result[f"hashing_env_us_L{L}"] = token_us, hashing_us
            result[f"step_and_maybe_reset_us_L{L}"] = _us_per_step(_stepper(*_token_env(tokenizer, B, L)))
            result[f"ratio_L{L}"] = token_us / hashing_us
        short, long = (result[f"token_env_us_L{L}"] for L in LENGTHS)
        result["token_env_length_ratio"] = long / short

    benchmark.pedantic(compare, rounds=1, iterations=1)
    benchmark.extra_info.update({k: round(v, 2) for k, v in result.items()})
    assert all(v > 0 for v in result.values())
