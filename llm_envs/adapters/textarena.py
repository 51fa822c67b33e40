"""TextArena games: single-player games as gym-style text envs (:func:`~.text_env.make_text_env`), and games of
several players played by the policy against itself (:func:`make_textarena_self_play_env`).

``pip install 'tokengym[textarena]'``. TextArena's own loop is ``reset(num_players)``,
``get_observation()``, ``step(action) -> (done, info)`` and ``close() -> (rewards, game_info)``;
:class:`TextArenaEnv` turns it into ``reset(seed) -> (obs, info)`` and
``step(text) -> (obs, reward, terminated, truncated, info)``: the first observation is the game's
prompt, each later one only what the game added since (the token sequence already holds the rest),
and the reward is the game's reward for player 0 when the game ends (0 before). Board and number
games run offline (GuessTheNumber, TowerOfHanoi, Minesweeper...); TextArena's word games download
NLTK data at run time.

Games of several players (TicTacToe, ConnectFour, KuhnPoker, Nim...) are :class:`TextArenaGame` objects, each
player shown its own view, played by :func:`make_textarena_self_play_env` with one env slot and one trajectory per
player (see ``tokengym.llm_envs.turns.self_play``).

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
from tokengym.llm_envs.self_play_env import make_self_play_env
from tokengym.llm_envs.token_env import TokenEnv

__all__ = ["TextArenaEnv", "TextArenaGame", "make_textarena_env", "make_textarena_self_play_env", "textarena_factory",
           "textarena_game_factory"]

_EXTRA = "textarena"
TWO_PLAYER_GAMES = ("TicTacToe-v0", "ConnectFour-v0", "KuhnPoker-v0", "Nim-v0")


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


class TextArenaGame:
    """A TextArena game of several players as a ``TurnGame`` (``tokengym.llm_envs.turns.self_play``), for self-play.

    Each player is shown what TextArena shows it, from its own point of view: its first observation is the game's
    prompt for that player, each later one what the game added since (the other players' moves, the board). A player
    is shown nothing until its turn (it reads it all then); once the game is over, each player is shown TextArena's
    reason for the end. The result is TextArena's reward per player (zero-sum in its two-player board and card games:
    win +1, loss -1, draw 0). An invalid move is shown to its player, who moves again (TextArena's rules decide when
    invalid moves lose).

    Args:
        env_id: a TextArena id of a game of ``num_players`` players, e.g. ``"TicTacToe-v0"`` or ``"KuhnPoker-v0"``.
        num_players: players per game.
        **make_kwargs: forwarded to ``textarena.make``.

    Example:
        >>> game = TextArenaGame("TicTacToe-v0")
        >>> game.reset(seed=0)
        >>> game.to_move(), "Tic Tac Toe" in game.observe(0), game.observe(1)
        (0, True, '')
        >>> game.play("[4]"); "placed their symbol (O) in cell 4" in game.observe(1)
        True
    """

    def __init__(self, env_id: str, *, num_players: int = 2, **make_kwargs) -> None:
        require("textarena", _EXTRA)
        if not isinstance(env_id, str):
            raise TypeError(f"env_id must be a TextArena id string, got {env_id!r}")
        if isinstance(num_players, bool) or not isinstance(num_players, int) or num_players < 2:
            raise ValueError(f"num_players must be an int >= 2 (one-player games: TextArenaEnv), got {num_players!r}")
        self.env_id, self.num_players, self.make_kwargs = env_id, num_players, make_kwargs
        self.env, self.rewards, self.reasons, self.seen = None, None, {}, [""] * num_players

    def reset(self, seed: int) -> None:
        """Start a game from ``seed`` (a new TextArena game object: its wrappers keep history across resets)."""
        ta = require("textarena", _EXTRA)
        try:
            self.env = ta.make(self.env_id, **self.make_kwargs)
            self.env.reset(num_players=self.num_players, seed=seed)
        except Exception as err:
            raise ValueError(f"TextArena game {self.env_id!r} cannot start with {self.num_players} players: {err}; "
                             f"two-player ids include {', '.join(TWO_PLAYER_GAMES)}") from err  # fmt: skip
        self.rewards, self.reasons, self.seen = None, {}, [""] * self.num_players

    def to_move(self) -> int:
        """The player whose turn it is."""
        return int(self.env.state.current_player_id)

    def observe(self, player: int) -> str:
        """What ``player`` has not been shown yet (nothing before its turn; the game's reason once it is over)."""
        if self.rewards is not None:
            return str(self.reasons.get(player, {}).get("reason", ""))
        if player != self.to_move():
            return ""
        _, obs = self.env.get_observation()
        new = obs[len(self.seen[player]) :] if obs.startswith(self.seen[player]) else obs
        self.seen[player] = obs
        return new.strip()

    def play(self, action: str) -> None:
        """The player to move plays ``action``."""
        done, _ = self.env.step(action)
        if done:
            rewards, info = self.env.close()
            self.rewards = [float(rewards.get(p, 0.0)) for p in range(self.num_players)]
            self.reasons = info if isinstance(info, dict) else {}

    def result(self) -> list[float] | None:
        """``None`` while the game goes on; each player's reward once it is over."""
        return None if self.rewards is None else list(self.rewards)


def textarena_game_factory(env_id: str, **kwargs) -> functools.partial:
    """A picklable ``factory()`` of :class:`TextArenaGame` for ``env_id`` (``kwargs``: ``num_players``, the
    ``textarena.make`` options), for :func:`~tokengym.llm_envs.make_self_play_env`."""
    return functools.partial(TextArenaGame, env_id, **kwargs)


def make_textarena_self_play_env(env_id: str, tokenizer, *, num_players: int = 2, game_factory=None,
                                 max_turns: int = 16, **env_kwargs) -> TokenEnv:  # fmt: skip
    """A self-play token env: the policy plays every seat of TextArena game ``env_id`` (one slot per player).

    Args:
        env_id: a TextArena id of a ``num_players``-player game, e.g. ``"TicTacToe-v0"``, ``"KuhnPoker-v0"``.
        tokenizer: as for :class:`~tokengym.llm_envs.TokenEnv` (with a chat template).
        num_players: players per game.
        game_factory: ``game_factory()`` -> a new game (default: :class:`TextArenaGame` of ``env_id``; pass a
            subclass's factory to record or alter games).
        max_turns: turns per player.
        **env_kwargs: the arguments of :func:`~tokengym.llm_envs.make_self_play_env`
            (``games_per_group``, ``num_games``, ``seed``, ``system_prompt``) and of
            :class:`~tokengym.llm_envs.TokenEnv` (``batch_size``, ``max_new_tokens``, ``max_turn_tokens``,
            ``max_length``...).

    Raises:
        ValueError: ``env_id`` is not a game of ``num_players`` players (named, with ids that are).
    """
    require_tokenizer("make_textarena_self_play_env", tokenizer)
    TextArenaGame(env_id, num_players=num_players).reset(seed=0)  # a bad id fails here, not at the first refill
    factory = textarena_game_factory(env_id, num_players=num_players) if game_factory is None else game_factory
    return make_self_play_env(factory, tokenizer, max_turns=max_turns, **env_kwargs)
