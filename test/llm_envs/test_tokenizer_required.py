"""Every env builder needs the tokenizer of the model it trains: none falls back to the 512-token test tokenizer."""

import gymnasium
import pytest
from transformers import Qwen2Config

from tokengym.llm_envs.adapters import (  # registers tokengym/ReasoningGym-v0
    make_openenv_env,
    make_reasoning_gym_env,
    make_text_env,
    make_textarena_env,
)
from tokengym.llm_envs.gym_adapter import TASK_ENV_IDS
from tokengym.llm_envs.tasks import (
    make_arithmetic_env,
    make_countdown_env,
    make_multi_turn_math_env,
    make_reversal_env,
)

FIX = r"needs tokenizer=: the tokenizer of the model you train \(.*tokengym\.testing\.tiny_tokenizer\(\) in tests\)"


class Counter:
    def reset(self, seed=None):
        return "count", {}

    def step(self, text):
        return "next", 1.0, True, False, {}


# builder, its positional arguments (before the tokenizer); keyword-only builders take none
BUILDERS = {
    "make_arithmetic_env": (make_arithmetic_env, ()),
    "make_countdown_env": (make_countdown_env, ()),
    "make_reversal_env": (make_reversal_env, ()),
    "make_multi_turn_math_env": (make_multi_turn_math_env, ()),
    "make_reasoning_gym_env": (make_reasoning_gym_env, ("chain_sum",)),
    "make_text_env": (make_text_env, (Counter,)),
    "make_textarena_env": (make_textarena_env, ("GuessTheNumber-v0",)),
    "make_openenv_env": (make_openenv_env, ("http://127.0.0.1:8000",)),  # fails before any connection
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_builder_without_a_tokenizer_says_it_needs_one(name):
    """A user passes the config of the model they train and forgets the tokenizer: no toy tokenizer fills in."""
    build, args = BUILDERS[name]
    real = {"model_config": Qwen2Config(), "batch_size": 2}
    with pytest.raises(TypeError, match=rf"{name}\(\) missing 1 required .*argument: 'tokenizer'"):
        build(*args, **real)
    with pytest.raises(TypeError, match=rf"^{name} {FIX}$"):
        build(*args, tokenizer=None, **real)


@pytest.mark.parametrize("env_id", [*sorted(TASK_ENV_IDS), "tokengym/ReasoningGym-v0"])
def test_a_gymnasium_id_without_a_tokenizer_says_it_needs_one(env_id):
    with pytest.raises(TypeError, match=rf"^gymnasium.make\('{env_id}'\) {FIX}"):
        gymnasium.make(env_id, max_new_tokens=4)
