"""Token-level LLM environments and the data contract (``tokengym.llm_envs``)."""

from tokengym.llm_envs import keys, tasks, tools
from tokengym.llm_envs.checker import check_env
from tokengym.llm_envs.errors import (
    ContractError,
    PromptError,
    ResetNeeded,
    RewardFunctionError,
    TokenGymError,
)
from tokengym.llm_envs.gym_adapter import GymTokenEnv, register_envs
from tokengym.llm_envs.multi_turn_env import MultiTurnTokenEnv, Turn, TurnFn
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.llm_envs.prompts import Prompt, PromptSource
from tokengym.llm_envs.rewards import CombinedReward, FormatReward, MathAnswerReward, RewardModelReward
from tokengym.llm_envs.tasks import load_prompt_file
from tokengym.llm_envs.token_env import RewardFn, TokenEnv
from tokengym.llm_envs.trl_rewards import TRLReward, from_trl_reward

__all__ = [
    "MultiTurnTokenEnv",
    "Turn",
    "TurnFn",
    "tools",
    "keys",
    "check_env",
    "ContractError",
    "PromptError",
    "tasks",
    "GymTokenEnv",
    "register_envs",
    "CombinedReward",
    "FormatReward",
    "MathAnswerReward",
    "RewardModelReward",
    "load_prompt_file",
    "Prompt",
    "PromptSource",
    "PromptTable",
    "ResetNeeded",
    "RewardFn",
    "RewardFunctionError",
    "TokenEnv",
    "TokenGymError",
    "TRLReward",
    "from_trl_reward",
]
