"""Feedback turns: a ``turn_fn(responses, prompts, metadata, turns) -> [Turn]`` scores each turn and may answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokengym.llm_envs._env_checks import check_arguments
from tokengym.llm_envs.errors import RewardFunctionError
from tokengym.llm_envs.turns.protocol import FinishedTurns, Turn, TurnHandler

__all__ = ["FeedbackTurns", "TurnFn"]

TurnFn = Callable[[list[str], list[str], list[dict], list[int]], Sequence[Turn]]


class FeedbackTurns(TurnHandler):
    """The turn handler of a ``turn_fn``: called once per step with the text of the finished turns.

    ``turn_fn(responses, prompts, metadata, turns)`` gets each turn's text, prompt text, metadata and
    turn index and returns a :class:`Turn` per slot (reward, and the feedback that continues the episode).

    Example:
        >>> handler = FeedbackTurns(lambda r, p, m, t: [Turn(0.0, "again") for _ in r])
        >>> handler.describe()
        '<lambda>'
    """

    name = "turn_fn"

    def __init__(self, turn_fn: TurnFn) -> None:
        if not callable(turn_fn):
            raise TypeError(f"turn_fn must be callable(responses, prompts, metadata, turns), got {turn_fn!r}")
        check_arguments(turn_fn, "turn_fn", ("responses", "prompts", "metadata", "turns"), "one Turn per response")
        self.turn_fn = turn_fn

    def metrics(self) -> dict[str, float]:
        """The turn function's counters, if it keeps any (a ``metrics`` or ``counts`` dict attribute, or a
        ``metrics()`` method)."""
        fn = self.turn_fn
        found = getattr(fn, "metrics", None) or getattr(fn, "counts", None) or {}
        return dict(found() if callable(found) else found)

    def describe(self) -> str:
        return getattr(self.turn_fn, "__name__", type(self.turn_fn).__name__)

    def end_turns(self, turns: FinishedTurns) -> Sequence[Turn]:
        prompts = turns.prompts
        try:
            return self.turn_fn(turns.responses, [p.text for p in prompts], [p.metadata for p in prompts], turns.turns)
        except Exception as err:
            raise RewardFunctionError(
                f"turn_fn raised {type(err).__name__}: {err} for slots {turns.slots} (first: {turns.describe()}); "
                "the env state is unchanged"
            ) from err
