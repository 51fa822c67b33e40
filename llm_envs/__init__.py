"""Token-level LLM environments and the data contract (``tokengym.llm_envs``)."""

from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import ResetNeeded, RewardFunctionError, TokenGymError
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.llm_envs.prompts import Prompt, PromptSource
from tokengym.llm_envs.token_env import RewardFn, TokenEnv

__all__ = [
    "keys",
    "Prompt",
    "PromptSource",
    "PromptTable",
    "ResetNeeded",
    "RewardFn",
    "RewardFunctionError",
    "TokenEnv",
    "TokenGymError",
]
