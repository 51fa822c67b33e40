"""Turn handlers: what a :class:`~tokengym.llm_envs.TokenEnv` does when a slot's turn ends.

See :class:`TurnHandler` for the protocol; the handlers here are single-turn scoring
(:class:`RewardTurns`), feedback turns (:class:`FeedbackTurns`) and self-play (:class:`SelfPlayTurns`, the policy
playing every seat of a :class:`TurnGame`, in an env built by :func:`~tokengym.llm_envs.make_self_play_env`); tool
turns live in :mod:`tokengym.llm_envs.tools`, external episodes in :mod:`tokengym.llm_envs.adapters`, agent programs
in :mod:`tokengym.llm_envs.agents`.
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
from tokengym.llm_envs.turns.self_play import CountingGame, SelfPlayTurns, TurnGame

__all__ = ["CountingGame", "EnvFacts", "FeedbackTurns", "FinishedTurns", "HeldEpisode", "RewardTurns", "SelfPlayTurns",
           "Turn", "TurnFn", "TurnGame", "TurnHandler", "Wait", "Wake"]
