"""The turn-handler protocol: what a :class:`~tokengym.llm_envs.TokenEnv` asks when turns end, and the answer.

A ``TokenEnv`` owns its slots (tokens, lengths, ids, budgets, termination). What happens when a slot's
turn ends is decided by the env's *turn handler*: the env hands it the finished turns of one step (or
one wave) as a :class:`FinishedTurns` batch and gets back one :class:`Turn` per slot. The env then
writes the reward at the turn's last token and, for a turn that continues the episode, appends the
feedback messages after the model's tokens as the tokenizer's chat template writes them.

Handlers are composed into the env, never subclassed from it, and read the env only through
:class:`FinishedTurns`. Single-turn scoring, feedback turns, tool turns and external episodes are
handlers (:mod:`tokengym.llm_envs.turns`); a new kind of turn (a game, an agent program) is one more::

    class Countdown(TurnHandler):
        def end_turns(self, turns):
            return [Turn(1.0 if "42" in r else 0.0, feedback=None if t == 2 else "again")
                    for r, t in zip(turns.responses, turns.turns)]

    env = TokenEnv(prompts, tokenizer, turns=Countdown(), max_turns=3)

Lifecycle hooks (optional, no-ops in :class:`TurnHandler`): :meth:`TurnHandler.release` before slots
drop what they held (refill, reset), :meth:`TurnHandler.refilled` after a refill, :meth:`TurnHandler.restart`
before slots start their trajectories over, :meth:`TurnHandler.close` with the env. A handler that
serves its own prompts (an external episode's first observation) gives them through the env's prompt
source, as :mod:`tokengym.llm_envs.adapters` does.

Agent programs (a loop of OpenAI-style chat calls, :mod:`tokengym.llm_envs.agents`) are one more handler:
its :meth:`TurnHandler.end_turns` answers each finished turn's pending chat call, then waits for each program's
next move (every program runs on, concurrently, while it waits): a call continues the episode with feedback
token ids rendered against the slot's tokens (:meth:`FinishedTurns.history`), a return ends it with that
reward. :attr:`FinishedTurns.ended` says whether an end id or a limit ended a turn, and a handler with
:attr:`TurnHandler.wants_log_probs` gets each turn's sampling log-probs (:meth:`FinishedTurns.log_probs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

from tokengym.llm_envs._env_checks import first_non_finite
from tokengym.llm_envs.errors import RewardFunctionError
from tokengym.llm_envs.prompts import Prompt

__all__ = ["FinishedTurns", "Turn", "TurnHandler", "check_turns"]

Message = Mapping[str, str]  # {"role": ..., "content": ...}


@dataclasses.dataclass(frozen=True)
class Turn:
    """What the environment answers to one finished turn: the one result type of every turn handler.

    Attributes:
        reward: reward of this turn, given at its last token (finite).
        feedback: the env's answer, appended in the slot before the model's next turn: a text (one message
            of ``role``), chat messages (``[{"role": "tool", "content": ...}, ...]``), rendered by the env with
            the chat template after the turn, or token ids (int64, 1-D) the handler rendered itself against
            the slot's tokens (:meth:`FinishedTurns.history`), appended as they are; ``None``: no answer.
        role: chat role of a text ``feedback`` (``"user"``, or ``"tool"`` for a tool result).
        done: whether the episode ends with this turn; ``None`` (default): it ends when there is no feedback.
            The env also ends it at ``max_turns``, at the episode budget and when the feedback does not fit.
        new_trajectory: the trajectory ends with this turn (truncated) but the episode goes on in a new
            trajectory, whose prompt the handler's prompt source serves next (an agent that rewrote its history).
            A TRAJECTORIES collector holds such a part until its episode ends, then gives it the episode's
            reward, in the same batch as the episode's last trajectory.

    Example:
        >>> Turn(1.0).is_done, Turn(0.0, "try again").is_done, Turn(0.5, "ok", done=True).is_done
        (True, False, True)
    """

    reward: float
    feedback: str | Sequence[Message] | torch.Tensor | None = None
    role: str = "user"
    done: bool | None = None
    new_trajectory: bool = False

    def __repr__(self) -> str:
        split = ", new_trajectory=True" if self.new_trajectory else ""
        return (f"Turn(reward={self.reward!r}, feedback={self.feedback!r}, role={self.role!r}, done={self.done!r}"
                f"{split})")

    @property
    def is_done(self) -> bool:
        """True when the trajectory ends with this turn (as far as the handler is concerned)."""
        return True if self.new_trajectory else self.feedback is None if self.done is None else bool(self.done)

    def messages(self) -> list[dict]:
        """The feedback as chat messages (``[]`` without feedback or with feedback token ids)."""
        if self.feedback is None or isinstance(self.feedback, torch.Tensor):
            return []
        if isinstance(self.feedback, str):
            return [{"role": self.role, "content": self.feedback}]
        return [dict(m) for m in self.feedback]


class FinishedTurns:
    """The turns that ended in one env step or wave, as a turn handler sees them (read-only).

    Every list is in the order of :attr:`slots`; the handler answers with one :class:`Turn` per entry.

    Attributes:
        slots: the env slots whose turn ended.
        turns: each slot's turn index (0 for the first turn of an episode).
        prompts: the :class:`~tokengym.llm_envs.prompts.Prompt` each slot works on (``text``, ``metadata``...).
        response_ids: the ids the model generated in this turn (views: do not write).
        is_final: True where the episode ends whatever the handler answers (its budget, the context limit
            or ``max_turns`` reached): its feedback would not be written.
        trajectories: each slot's trajectory id.
        ended: True where the turn ended on an end id or a stop string, False where a limit cut it.
    """

    def __init__(self, slots: list[int], turns: list[int], prompts: list[Prompt], response_ids: list[torch.Tensor],
                 is_final: list[bool], trajectories: list[int], *, decode: Callable[[list[torch.Tensor]], list[str]],
                 history: Callable[[int], torch.Tensor], ended: list[bool] | None = None,
                 log_probs: Callable[[int], list[float] | None] | None = None) -> None:  # fmt: skip
        self.slots, self.turns, self.prompts, self.response_ids = slots, turns, prompts, response_ids
        self.is_final, self.trajectories = is_final, trajectories
        self.ended = [True] * len(slots) if ended is None else ended
        self._decode, self._history, self._responses, self._log_probs = decode, history, None, log_probs

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def responses(self) -> list[str]:
        """The text of each turn (decoded once, vectorized, on first use)."""
        if self._responses is None:
            self._responses = self._decode(self.response_ids)
        return self._responses

    @property
    def metadata(self) -> list[dict]:
        """Each prompt's metadata (the dataset columns beside the prompt)."""
        return [p.metadata for p in self.prompts]

    def history(self, i: int) -> torch.Tensor:
        """All token ids of entry ``i``'s slot so far (prompt, earlier turns and feedback, this turn): a view."""
        return self._history(self.slots[i])

    def log_probs(self, i: int) -> list[float] | None:
        """The sampling log-prob of each token of entry ``i``'s turn, when the handler asked for them
        (:attr:`TurnHandler.wants_log_probs`) and the policy gave them; else ``None``."""
        return None if self._log_probs is None else self._log_probs(self.slots[i])

    def describe(self, i: int = 0) -> str:
        """Entry ``i`` for an error message: prompt index and text, trajectory."""
        p = self.prompts[i]
        return f"prompt {p.index} {p.text[:60]!r}, trajectory {self.trajectories[i]}"


class TurnHandler:
    """Base of turn handlers: :meth:`end_turns` answers finished turns; the hooks default to doing nothing.

    A handler never reads the env's private state: what it needs is in :class:`FinishedTurns`, and the
    hooks get the prompts the slots held.
    """

    name = "the turn handler"  # what error messages call the handler's answers
    may_split = False  # True: it may answer Turn(new_trajectory=True) (a TRAJECTORIES collector is needed)
    wants_log_probs = False  #: True: the env keeps each turn's sampling log-probs (FinishedTurns.log_probs)

    def end_turns(self, turns: FinishedTurns) -> Sequence[Turn] | torch.Tensor:
        """One :class:`Turn` per finished turn, in the order of ``turns.slots``; or, when every episode ends
        with its reward alone, the rewards as one (n,) float tensor (no ``Turn`` objects built per step).

        Raising ends nothing: the env rolls the step back and raises a ``RewardFunctionError`` naming the
        slots; a model's output is never a reason to raise (score it 0).
        """
        raise NotImplementedError

    def release(self, prompts: list[Prompt]) -> None:
        """The slots holding ``prompts`` drop them (refilled with new prompts, or reset)."""

    def refilled(self, held: list[Prompt]) -> None:
        """After a refill: the prompts every slot now holds."""

    def restart(self, prompts: list[Prompt]) -> None:
        """The slots holding ``prompts`` start their trajectories over from the prompt."""

    def close(self) -> None:
        """The env closes: release what the handler holds (sessions, processes)."""

    def describe(self) -> str:
        """A short name for the env's ``repr``."""
        return type(self).__name__


def check_turns(results, turns: FinishedTurns, *, who: str = "the turn handler") -> tuple[torch.Tensor, list[Turn]]:
    """Check a handler's answer: one :class:`Turn` with a finite reward per finished turn.

    Returns ``(rewards (n,) float32, turns as a list)`` (``None`` for a tensor of rewards: every episode ends);
    raises :class:`RewardFunctionError` naming the slot.
    """
    if isinstance(results, torch.Tensor):
        if results.shape != (len(turns),) or not results.is_floating_point():
            raise RewardFunctionError(f"{who} gave a reward tensor of dtype {results.dtype} and shape "
                                      f"{tuple(results.shape)}; give a ({len(turns)},) float tensor, one per slot "
                                      f"{turns.slots}")  # fmt: skip
        return _finite(results.detach().to(torch.float32), turns, who), None
    results = list(results)
    if len(results) != len(turns) or not all(isinstance(r, Turn) for r in results):
        raise RewardFunctionError(
            f"{who} must return one Turn per finished slot ({len(turns)} for slots {turns.slots}), got {results!r:.120}"
        )
    try:
        # detached: a reward function's autograd graph must not reach the collected batch
        rewards = torch.as_tensor([r.reward for r in results], dtype=torch.float32).detach().reshape(-1)
    except (TypeError, ValueError, RuntimeError) as err:
        raise RewardFunctionError(f"{who} gave rewards that are not numbers for slots {turns.slots}: {err}") from err
    return _finite(rewards, turns, who), results


def _finite(rewards: torch.Tensor, turns: FinishedTurns, who: str) -> torch.Tensor:
    bad = first_non_finite(rewards)
    if bad is not None:
        raise RewardFunctionError(
            f"{who} gave reward {rewards[bad].item()} for slot {turns.slots[bad]}; rewards must be finite "
            f"({turns.describe(bad)})"
        )
    return rewards
