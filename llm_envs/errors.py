"""The few exceptions tokengym raises beyond the built-in ``ValueError`` / ``TypeError`` / ``KeyError``."""

from __future__ import annotations

__all__ = ["TokenGymError", "ResetNeeded", "RewardFunctionError", "ContractError"]


class TokenGymError(Exception):
    """Base class of tokengym's own exceptions."""


class ResetNeeded(TokenGymError, ValueError):
    """An env was stepped before ``reset()`` or a finished slot was stepped without a reset."""


class RewardFunctionError(TokenGymError, ValueError):
    """A reward function raised or returned a bad value; the env state is unchanged."""


class ContractError(TokenGymError, ValueError):
    """An env broke the data contract of ``llm_envs/keys.py`` (raised by ``check_env``)."""
