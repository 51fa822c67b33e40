"""make_self_play_env: a :class:`TokenEnv` in which the policy plays every seat of a turn-based game.

The env's prompts are a :class:`~tokengym.llm_envs.turns.self_play.SeatSource` (one seat per slot) and its turn
handler is :class:`~tokengym.llm_envs.turns.SelfPlayTurns`; see :mod:`tokengym.llm_envs.turns.self_play` for how a
game is played. It lives beside the env (as :func:`~tokengym.llm_envs.MultiTurnTokenEnv` does): the turns package
never imports the env module, which imports it.
"""

from __future__ import annotations

from collections.abc import Callable

from tokengym.llm_envs.token_env import TokenEnv
from tokengym.llm_envs.turns.self_play import SYSTEM_PROMPT, SeatSource, SelfPlayTurns, TurnGame

__all__ = ["make_self_play_env"]


def make_self_play_env(game_factory: Callable[[], TurnGame], tokenizer, *, games_per_group: int = 1,
                       num_games: int | None = None, seed: int = 0, system_prompt: str = SYSTEM_PROMPT,
                       max_turns: int = 16, **kwargs) -> TokenEnv:  # fmt: skip
    """A :class:`~tokengym.llm_envs.TokenEnv` in which the policy plays every seat of ``game_factory``'s games.

    Args:
        game_factory: ``game_factory()`` -> a new :class:`~tokengym.llm_envs.turns.TurnGame`.
        tokenizer: as for :class:`~tokengym.llm_envs.TokenEnv` (with a chat template).
        games_per_group: games played from one seed; a group holds their ``games_per_group * num_players`` players.
        num_games: games to play (``None``: endless).
        seed: the games' seeds (``seed * 100_003 + group``).
        system_prompt: the system message every seat starts from (the prompt of every trajectory).
        max_turns: turns per player.
        **kwargs: the other :class:`~tokengym.llm_envs.TokenEnv` arguments (``batch_size`` at least the number of
            players; ``group_size`` is set from ``games_per_group``).

    Raises:
        ValueError: ``batch_size`` below the number of players, or ``group_size`` given.

    Example:
        >>> from tokengym.llm_envs.turns import CountingGame
        >>> from tokengym.testing import tiny_tokenizer
        >>> env = make_self_play_env(CountingGame, tiny_tokenizer(), batch_size=2, max_new_tokens=16, max_length=256)
        >>> env.reset()["active"].tolist()  # player 0 moves first; player 1 waits
        [True, False]
    """
    if "group_size" in kwargs:
        raise ValueError(f"group_size={kwargs['group_size']!r}: a self-play group is set by games_per_group "
                         "(group_size = games_per_group * num_players)")  # fmt: skip
    n = int(game_factory().num_players)
    batch_size = kwargs.get("batch_size", 8)
    if batch_size < n:
        raise ValueError(f"batch_size={batch_size} is below the game's {n} players: every seat of a game needs a slot")  # fmt: skip
    source = SeatSource(tokenizer, num_players=n, games_per_group=games_per_group, num_games=num_games, seed=seed)  # fmt: skip
    turns = SelfPlayTurns(game_factory, system_prompt=system_prompt)
    return TokenEnv(source, tokenizer, turns=turns, max_turns=max_turns, **kwargs)
