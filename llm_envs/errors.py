"""The few exceptions tokengym raises beyond the built-in ``ValueError`` / ``TypeError`` / ``KeyError``."""

from __future__ import annotations

__all__ = ["TokenGymError", "ResetNeeded", "RewardFunctionError", "ContractError", "PromptError"]


class TokenGymError(Exception):
    """Base class of tokengym's own exceptions."""


class ResetNeeded(TokenGymError, ValueError):
    """An env was stepped before ``reset()`` or a finished slot was stepped without a reset."""


class RewardFunctionError(TokenGymError, ValueError):
    """A reward function raised or returned a bad value; the env state is unchanged."""


class ContractError(TokenGymError, ValueError):
    """An env broke the data contract of ``llm_envs/keys.py`` (raised by ``check_env``)."""


class PromptError(TokenGymError, ValueError):
    """A prompt could not be loaded into a slot (encoding failed, too long, ids outside the vocabulary).

    The prompt is skipped (the source has moved past it) and the slot is refilled with the next one
    at the next refill; nothing collected is lost. ``slots`` are the slots left to refill,
    ``observation`` the env's observation after the refill and ``step`` the step TensorDict that
    finished them (when a step triggered the refill).
    """

    def __init__(self, message: str, *, slots: list[int] | None = None, observation=None) -> None:
        super().__init__(message)
        self.slots, self.observation, self.step = slots or [], observation, None
