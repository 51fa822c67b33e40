"""Turn handlers: what a :class:`~tokengym.llm_envs.TokenEnv` does when a slot's turn ends.

See :class:`TurnHandler` for the protocol; the handlers here are single-turn scoring
(:class:`RewardTurns`) and feedback turns (:class:`FeedbackTurns`); tool turns live in
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

__all__ = ["EnvFacts", "FeedbackTurns", "FinishedTurns", "HeldEpisode", "RewardTurns", "Turn", "TurnFn", "TurnHandler",
           "Wait", "Wake"]
