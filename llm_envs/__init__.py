"""Token-level LLM environments and the data contract (``tokengym.llm_envs``).

Turn handlers live in :mod:`tokengym.llm_envs.turns`, tasks in ``.tasks``, tools in ``.tools``, adapters in
``.adapters``; the exceptions are exported from :mod:`tokengym.errors`.
"""

from tokengym.llm_envs import keys, tasks, tools, turns
from tokengym.llm_envs.checker import check_env
from tokengym.llm_envs.gym_adapter import GymTokenEnv, register_envs
from tokengym.llm_envs.multi_turn_env import MultiTurnTokenEnv
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.llm_envs.prompts import Prompt, PromptSource
from tokengym.llm_envs.rewards import CombinedReward, FormatReward, MathAnswerReward, RewardModelReward
from tokengym.llm_envs.self_play_env import make_self_play_env
from tokengym.llm_envs.token_env import RewardFn, TokenEnv
from tokengym.llm_envs.trl_rewards import TRLReward, from_trl_reward
from tokengym.llm_envs.vision import is_vision_model, mrope_positions, vision_token_ids

__all__ = [
    "MultiTurnTokenEnv",
    "tools",
    "turns",
    "keys",
    "check_env",
    "tasks",
    "GymTokenEnv",
    "register_envs",
    "CombinedReward",
    "FormatReward",
    "MathAnswerReward",
    "RewardModelReward",
    "Prompt",
    "PromptSource",
    "PromptTable",
    "RewardFn",
    "TokenEnv",
    "make_self_play_env",
    "TRLReward",
    "from_trl_reward",
    "is_vision_model",
    "mrope_positions",
    "vision_token_ids",
]
