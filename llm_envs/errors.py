"""The few exceptions tokengym raises beyond the built-in ``ValueError`` / ``TypeError`` / ``KeyError``."""

from __future__ import annotations

import collections

__all__ = ["TokenGymError", "TokenGymWarning", "ResetNeeded", "RewardFunctionError", "ContractError", "PromptError",
           "EpisodeError", "refill_error", "refill_failures"]


class TokenGymError(Exception):
    """Base class of tokengym's own exceptions."""


class TokenGymWarning(UserWarning):
    """A setting that runs but does not do what it seems to (a run that trains on nothing, say); the message names the fix."""


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

    what = "prompt(s) could not be loaded and were skipped"
    """What failed, in the summary of a refill's failures (``refill_failures``; subclasses say theirs)."""

    def __init__(self, message: str, *, slots: list[int] | None = None, observation=None) -> None:
        super().__init__(message)
        self.slots, self.observation, self.step = slots or [], observation, None


class EpisodeError(PromptError):
    """One episode failed and ended with reward 0 (a turn handler answered ``Turn.failed``, or raised it when the
    episode started); only that episode ended. Raised at the next refill, through the ``PromptError`` path: a refill
    in which an episode failed raises an ``EpisodeError`` (a ``PromptError`` too), its cause the first failure."""

    what = "episode(s) failed and ended with reward 0"

    def __init__(self, message: str, *, what: str | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        if what is not None:
            self.what = what


def refill_failures(failed: list[tuple[int, PromptError]]) -> str:
    """The message of a refill whose slots ``failed`` (``(slot, error)`` pairs): what failed, counted by kind (a
    prompt that could not be loaded, an episode that failed, a server that went away), then the first error.

    Example:
        >>> refill_failures([(2, PromptError("prompt 7 has 900 tokens")), (3, PromptError("prompt 8 ..."))])
        '2 prompt(s) could not be loaded and were skipped (slot 2: prompt 7 has 900 tokens); the slots are refilled with the next prompts on the next refill, nothing collected is lost'
    """
    kinds = collections.Counter(err.what for _, err in failed)
    slot, first = failed[0]
    head = ", ".join(f"{n} {what}" for what, n in kinds.items())
    return (f"{head} (slot {slot}: {first}); the slots are refilled with the next prompts on the next refill, "
            "nothing collected is lost")  # fmt: skip


def refill_error(failed: list[tuple[int, PromptError]], *, slots: list[int], observation) -> PromptError:
    """The error a refill whose slots ``failed`` raises (message: :func:`refill_failures`): an :class:`EpisodeError`
    when an episode failed among them (the kind the failed episodes share: an agent env's ``AgentError``), so that
    ``except EpisodeError`` catches it and ``except PromptError`` still does; else a :class:`PromptError`. ``slots``
    are the slots left to refill.

    Example:
        >>> err = refill_error([(1, EpisodeError("lost"))], slots=[], observation=None)
        >>> isinstance(err, EpisodeError), isinstance(err, PromptError), err.what
        (True, True, 'episode(s) failed and ended with reward 0')
    """
    episodes = [err for _, err in failed if isinstance(err, EpisodeError)]
    message = refill_failures(failed)
    if not episodes:
        return PromptError(message, slots=slots, observation=observation)
    # the most specific kind every failed episode shares (an agent env's AgentError), else EpisodeError
    kind = next(c for c in type(episodes[0]).__mro__ if all(isinstance(e, c) for e in episodes))
    try:
        return kind(message, what=episodes[0].what, slots=slots, observation=observation)
    except TypeError:  # a subclass with another signature
        return EpisodeError(message, what=episodes[0].what, slots=slots, observation=observation)
