"""Adapters for the environments users already have: reasoning-gym tasks, OpenEnv services, gym-style text envs.

Each adapter lives in its own module and imports its third-party package only when used, so a
missing one raises an ``ImportError`` naming the extra to install (``pip install 'tokengym[envs]'``
installs them all). Importing this package registers the gymnasium id ``tokengym/ReasoningGym-v0``.
"""

from __future__ import annotations

import gymnasium

from tokengym.llm_envs.adapters._episodes import EpisodeBackend, EpisodeError, EpisodeTokenEnv, EpisodeTurns
from tokengym.llm_envs.adapters.openenv import OpenEnvBackend, make_openenv_env
from tokengym.llm_envs.adapters.reasoning_gym import (
    ReasoningGymReward,
    ReasoningGymSpec,
    held_out_split,
    make_reasoning_gym_env,
    reasoning_gym_prompts,
)
from tokengym.llm_envs.adapters.text_env import TextEnvBackend, make_text_env
from tokengym.llm_envs.adapters.textarena import (
    TextArenaEnv,
    TextArenaGame,
    make_textarena_env,
    make_textarena_self_play_env,
    textarena_factory,
    textarena_game_factory,
)

__all__ = [
    "EpisodeTokenEnv",
    "OpenEnvBackend",
    "EpisodeBackend",
    "EpisodeError",
    "EpisodeTurns",
    "ReasoningGymReward",
    "ReasoningGymSpec",
    "TextArenaEnv",
    "TextArenaGame",
    "TextEnvBackend",
    "held_out_split",
    "make_openenv_env",
    "make_reasoning_gym_env",
    "make_text_env",
    "make_textarena_env",
    "make_textarena_self_play_env",
    "reasoning_gym_prompts",
    "textarena_factory",
    "textarena_game_factory",
]

REASONING_GYM_ID = "tokengym/ReasoningGym-v0"
if REASONING_GYM_ID not in gymnasium.registry:
    gymnasium.register(id=REASONING_GYM_ID, entry_point="tokengym.llm_envs.adapters.reasoning_gym:gym_env")
