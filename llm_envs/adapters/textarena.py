"""TextArena games as gym-style text envs (single-player games), for :func:`~.text_env.make_text_env`.

``pip install 'tokengym[textarena]'``. TextArena's own loop is ``reset(num_players)``,
``get_observation()``, ``step(action) -> (done, info)`` and ``close() -> (rewards, game_info)``;
:class:`TextArenaEnv` turns it into ``reset(seed) -> (obs, info)`` and
``step(text) -> (obs, reward, terminated, truncated, info)``: the first observation is the game's
prompt, each later one only what the game added since (the token sequence already holds the rest),
and the reward is the game's reward for player 0 when the game ends (0 before). Board and number
games run offline (GuessTheNumber, TowerOfHanoi, Minesweeper...); TextArena's word games download
NLTK data at run time.

Example:
    >>> env = TextArenaEnv("GuessTheNumber-v0")
    >>> obs, info = env.reset(seed=0)
    >>> "Guess The Number" in obs
    True
    >>> obs, reward, terminated, truncated, info = env.step("[10]")
    >>> terminated or "higher" in obs or "lower" in obs
    True
"""

from __future__ import annotations

import functools

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.adapters._kwargs import EPISODE_ENV_OPTIONS, EPISODE_HINTS, check_kwargs
from tokengym.llm_envs.adapters._lazy import require
from tokengym.llm_envs.adapters.text_env import make_text_env
from tokengym.llm_envs.token_env import TokenEnv

__all__ = ["TextArenaEnv", "make_textarena_env", "textarena_factory"]

_EXTRA = "textarena"


class TextArenaEnv:
    """A single-player TextArena game behind the gym-style text env API.

    Args:
        env_id: a TextArena id, e.g. ``"GuessTheNumber-v0"`` or ``"TowerOfHanoi-v0"``.
        **make_kwargs: forwarded to ``textarena.make``.
    """

    def __init__(self, env_id: str, **make_kwargs) -> None:
        ta = require("textarena", _EXTRA)
        if not isinstance(env_id, str):
            raise TypeError(f"env_id must be a TextArena id string, got {env_id!r}")
        self.env_id, self.make_kwargs, self.seen = env_id, make_kwargs, ""
        self.env = self.make(ta)

    def make(self, ta):
        """A new game object (TextArena's observation wrappers keep history across resets: one per game)."""
        try:
            return ta.make(self.env_id, **self.make_kwargs)
        except Exception as err:
            raise ValueError(f"textarena.make({self.env_id!r}) failed: {err}; single-player ids include "
                             "'GuessTheNumber-v0', 'TowerOfHanoi-v0', 'Minesweeper-v0'") from err  # fmt: skip

    def reset(self, *, seed: int | None = None) -> tuple[str, dict]:
        """Start a game; the observation is the game's prompt."""
        self.env = self.make(require("textarena", _EXTRA))
        self.env.reset(num_players=1, seed=seed)
        _, self.seen = self.env.get_observation()
        return self.seen, {}

    def step(self, text: str) -> tuple[str, float, bool, bool, dict]:
        """Play ``text``; returns what the game added to the observation, and its reward at the end."""
        done, info = self.env.step(text)
        if done:
            rewards, game_info = self.env.close()
            player = game_info.get(0, {}) if isinstance(game_info, dict) else {}
            return str(player.get("reason", "")), float(rewards.get(0, 0.0)), True, False, dict(player)
        _, obs = self.env.get_observation()
        new = obs[len(self.seen) :] if obs.startswith(self.seen) else obs
        self.seen = obs
        return new.strip() or obs, 0.0, False, False, dict(info or {})


def textarena_factory(env_id: str, **make_kwargs) -> functools.partial:
    """A picklable ``factory()`` of :class:`TextArenaEnv` for ``env_id`` (for :func:`make_text_env`, Ray)."""
    return functools.partial(TextArenaEnv, env_id, **make_kwargs)


def make_textarena_env(env_id: str, tokenizer, *, max_turns: int = 8, **env_kwargs) -> TokenEnv:
    """A multi-turn token env playing TextArena game ``env_id``, one game per slot (see :func:`make_text_env`).

    Raises:
        TypeError: an argument the env does not take (named, with the accepted ones).
    """
    require_tokenizer("make_textarena_env", tokenizer)
    check_kwargs(make_textarena_env, env_kwargs, (*EPISODE_ENV_OPTIONS, "render"), EPISODE_HINTS)
    TextArenaEnv(env_id)  # a bad id fails here, not at the first reset
    return make_text_env(textarena_factory(env_id), tokenizer, max_turns=max_turns, name=env_id, **env_kwargs)
