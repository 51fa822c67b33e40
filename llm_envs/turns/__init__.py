"""Turn handlers: what a :class:`~tokengym.llm_envs.TokenEnv` does when a slot's turn ends.

See :class:`TurnHandler` for the protocol; the handlers here are single-turn scoring
(:class:`RewardTurns`), feedback turns (:class:`FeedbackTurns`) and self-play (:class:`SelfPlayTurns`, the policy
playing every seat of a :class:`TurnGame`); tool turns live in
:mod:`tokengym.llm_envs.tools`, external episodes in :mod:`tokengym.llm_envs.adapters`, agent programs in
:mod:`tokengym.llm_envs.agents`.
"""

from tokengym.llm_envs.turns.feedback import FeedbackTurns, TurnFn
from tokengym.llm_envs.turns.protocol import (
           EnvFacts,
           FinishedTurns,
           HeldEpisode,
           Turn,
           TurnHandler,
           Wait,
           Wake,
)
from tokengym.llm_envs.turns.scoring import RewardTurns

__all__ = ["CountingGame", "EnvFacts", "FeedbackTurns", "FinishedTurns", "HeldEpisode", "RewardTurns", "SelfPlayTurns",
           "Turn", "TurnFn", "TurnGame", "TurnHandler", "Wait", "Wake", "make_self_play_env"]

_SELF_PLAY = ("CountingGame", "SelfPlayTurns", "TurnGame", "make_self_play_env")


def __getattr__(name: str):
    """The self-play names, imported on first use: self-play builds a ``TokenEnv``, whose module imports this package."""
    if name in _SELF_PLAY:
        from tokengym.llm_envs.turns import self_play

        return getattr(self_play, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
