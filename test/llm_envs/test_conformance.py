"""Every env the package builds passes the contract checker (in the spirit of dm_env's EnvironmentTestMixin)."""

import pytest

from tokengym.llm_envs import check_env
from tokengym.llm_envs.tasks import (
    make_arithmetic_env,
    make_countdown_env,
    make_multi_turn_math_env,
    make_reversal_env,
)

FACTORIES = {
    "arithmetic": lambda tok: make_arithmetic_env(tokenizer=tok, batch_size=3, max_new_tokens=6),
    "countdown": lambda tok: make_countdown_env(tokenizer=tok, batch_size=3, max_new_tokens=6),
    "reversal": lambda tok: make_reversal_env(tokenizer=tok, batch_size=3, max_new_tokens=6),
    "multi_turn_math": lambda tok: make_multi_turn_math_env(tokenizer=tok, batch_size=3, max_new_tokens=12),
    "multi_turn_math_tools": lambda tok: make_multi_turn_math_env(tokenizer=tok, batch_size=3, max_new_tokens=12,
                                                                  tools=True),  # fmt: skip
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_every_env_passes_the_contract_checker(tokenizer, name):
    check_env(FACTORIES[name](tokenizer), steps=60)
