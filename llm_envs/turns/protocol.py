"""The turn-handler protocol: everything a :class:`~tokengym.llm_envs.TokenEnv` asks a turn handler, and the answers.

A ``TokenEnv`` owns its slots (tokens, lengths, ids, budgets, termination). What happens when a slot's turn ends is
decided by the env's *turn handler*: the env hands it the finished turns of one step (or one wave) as a
:class:`FinishedTurns` batch and gets back one :class:`Turn` per entry. The env then writes the reward at the turn's
last token and, for a turn that continues the episode, appends the feedback after the model's tokens as the
tokenizer's chat template writes it. A handler is composed into the env, never subclassed from it, and reads the env
only through what this module hands it::

    class Countdown(TurnHandler):
        def end_turns(self, turns):
            return [Turn(1.0 if "42" in r else 0.0, feedback=None if t == 2 else "again")
                    for r, t in zip(turns.responses, turns.turns)]

    env = TokenEnv(prompts, tokenizer, turns=Countdown(), max_turns=3)

Every channel a handler has is declared on :class:`TurnHandler`:

- :meth:`~TurnHandler.bind` tells it the env's facts once (:class:`EnvFacts`: tokenizer, end ids, ``max_turns``,
  ``max_length``, batch and group size), when the env is built;
- :meth:`~TurnHandler.serve` gives an episode's first observation (an external episode's reset, an agent program's
  first call) in place of the prompt source's draw; raising :class:`~tokengym.errors.EpisodeError` there fails that
  episode alone;
- :meth:`~TurnHandler.end_turns` answers finished turns: a reward, feedback (the episode goes on), ``done``,
  :meth:`Turn.failed` (this episode alone ends with reward 0; the error is raised at the slot's refill as an
  :class:`~tokengym.errors.EpisodeError`, counted in ``failed_episodes``; its neighbours go on) or
  ``new_trajectory=True`` (the trajectory ends, the episode goes on in a new one: :attr:`TurnHandler.may_split`);
- :meth:`~TurnHandler.metrics` reports its counters; they reach ``env.turn_metrics`` and every collector's metrics;
- the lifecycle hooks :meth:`~TurnHandler.release`, :meth:`~TurnHandler.refilled`, :meth:`~TurnHandler.restart`,
  :meth:`~TurnHandler.fork` and :meth:`~TurnHandler.close` get :class:`HeldEpisode` records (slot, trajectory id,
  episode id, prompt), so per-episode state is keyed by the episode id the env gives (:attr:`FinishedTurns.episodes`
  in :meth:`~TurnHandler.end_turns`, ``episode`` in :meth:`~TurnHandler.serve`);
- waiting (several slots in one game, as in self-play: ``tokengym.llm_envs.turns.self_play``): :meth:`Turn.waiting` ends a turn
  without ending the episode and holds the slot (inactive: it produces no step) until the handler wakes it with a
  :class:`Wake` from :meth:`~TurnHandler.wakes`; :meth:`~TurnHandler.serve` may answer :class:`Wait` (the slot
  loads its prompt and waits before its first turn);
- :meth:`~TurnHandler.state_dict` / :meth:`~TurnHandler.load_state_dict`: what the handler must keep in the env's
  checkpoint.

Nothing is dropped silently: feedback that asks a single-turn env (``max_turns=1``) to go on raises a
``RewardFunctionError`` (a handler's bug); feedback that does not fit the slot ends the episode (truncated), counted
in ``feedback_did_not_fit`` and logged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tokengym.llm_envs._env_checks import first_non_finite
from tokengym.llm_envs.errors import RewardFunctionError
from tokengym.llm_envs.prompts import Prompt

__all__ = ["EnvFacts", "FinishedTurns", "HeldEpisode", "Turn", "TurnHandler", "Wait", "Wake", "check_turns"]

Message = Mapping[str, str]  # {"role": ..., "content": ...}


@dataclasses.dataclass(frozen=True)
class EnvFacts:
    """What a turn handler is told about its env, once, by :meth:`TurnHandler.bind` (when the env is built).

    Attributes:
        tokenizer: the env's tokenizer (its chat template renders feedback).
        eos_token_ids: the ids that end a turn (the chat template's end-of-turn token included in a multi-turn env).
        max_turns: turns per episode.
        max_length: a slot's capacity (prompt, turns and feedback together).
        max_new_tokens: generated tokens per trajectory, all its turns together.
        max_turn_tokens: generated tokens per turn (``None``: no per-turn limit).
        max_prompt_length: the longest first observation a slot takes (``max_length - 1`` or the source's limit).
        batch_size: the env's slots ``B``.
        group_size: samples per prompt draw (they share ``group_id``).
        stop_strings: strings that end a turn.
    """

    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_turns: int
    max_length: int
    max_new_tokens: int
    max_turn_tokens: int | None
    max_prompt_length: int
    batch_size: int
    group_size: int
    stop_strings: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class HeldEpisode:
    """What one slot holds, as the lifecycle hooks name it.

    Attributes:
        slot: the env slot.
        trajectory: the trajectory id (``traj_id`` of the slot's steps); ``-1`` for an episode served that no slot
            took (its first observation could not be loaded).
        episode: the episode id the env gave when the episode started (:meth:`TurnHandler.serve`): unique per env,
            shared by the trajectories of one episode (a split episode's parts, a restarted trajectory); a forked
            child gets its own.
        prompt: the :class:`~tokengym.llm_envs.prompts.Prompt` the slot works on.
    """

    slot: int
    trajectory: int
    episode: int
    prompt: Prompt


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
            trajectory (an agent that rewrote its history), whose prompt is ``feedback``: token ids, a text or chat
            messages (encoded as the prompt source encodes prompts), served to the next slot the env refills, under
            the same episode id, ``group_id`` and ``sample_id``. A TRAJECTORIES collector holds such a part until its
            episode ends, then gives it the episode's reward, in the same batch as the episode's last trajectory.
        error: set by :meth:`failed`: this episode failed (a session lost, a program that raised); it ends here
            with ``reward``, and the env raises the error at the slot's refill as an
            :class:`~tokengym.errors.EpisodeError` (an ``EpisodeError`` given is raised as it is), counted in
            ``failed_episodes``.
        wait: set by :meth:`waiting`: the turn ends, the episode goes on, and the slot waits (it holds its tokens,
            inactive: it produces no step) until the handler wakes it (:class:`Wake`); the reward is given now.
        images: images the feedback shows (a game board, a screenshot: PIL images, arrays or paths), for an env
            with a vision-language ``processor``: the feedback (a text or chat messages) holds one image placeholder
            per image (a ``{"type": "image"}`` item of a message's content); the env expands each as the processor
            does and the trajectory's later tokens see them.

    Example:
        >>> Turn(1.0).is_done, Turn(0.0, "try again").is_done, Turn(0.5, "ok", done=True).is_done
        (True, False, True)
        >>> Turn.failed("the server went away")
        Turn(reward=0.0, feedback=None, role='user', done=True, error='the server went away')
        >>> Turn.waiting().is_done
        False
    """

    reward: float
    feedback: str | Sequence[Message] | torch.Tensor | None = None
    role: str = "user"
    done: bool | None = None
    new_trajectory: bool = False
    error: str | BaseException | None = None
    wait: bool = False
    images: Sequence | None = None

    @classmethod
    def waiting(cls, reward: float = 0.0) -> Turn:
        """This turn ends; the slot waits (inactive) until the handler wakes it with a :class:`Wake`."""
        return cls(reward, done=False, wait=True)

    @classmethod
    def failed(cls, reason: str | BaseException, *, reward: float = 0.0) -> Turn:
        """This episode failed for ``reason`` (a text or an exception): it alone ends, with ``reward``."""
        if not isinstance(reason, str | BaseException) or not reason:
            raise TypeError(f"Turn.failed needs a reason (a non-empty text or an exception), got {reason!r}")
        return cls(reward, done=True, error=reason)

    def __repr__(self) -> str:
        split = ", new_trajectory=True" if self.new_trajectory else ""
        error = "" if self.error is None else f", error={self.error!r}"
        wait = ", wait=True" if self.wait else ""
        return (f"Turn(reward={self.reward!r}, feedback={self.feedback!r}, role={self.role!r}, done={self.done!r}"
                f"{split}{error}{wait})")

    @property
    def is_done(self) -> bool:
        """True when the trajectory ends with this turn (as far as the handler is concerned)."""
        if self.new_trajectory or self.error is not None:
            return True
        if self.wait:
            return False
        return self.feedback is None if self.done is None else bool(self.done)

    def messages(self) -> list[dict]:
        """The feedback as chat messages (``[]`` without feedback or with feedback token ids)."""
        if self.feedback is None or isinstance(self.feedback, torch.Tensor):
            return []
        if isinstance(self.feedback, str):
            return [{"role": self.role, "content": self.feedback}]
        return [dict(m) for m in self.feedback]


@dataclasses.dataclass(frozen=True)
class Wake:
    """Wake a waiting slot (:meth:`Turn.waiting`, or :class:`Wait` from :meth:`TurnHandler.serve`): the handler's
    answer from :meth:`TurnHandler.wakes`.

    Attributes:
        episode: the episode id of the waiting slot.
        observation: what the slot reads before its next turn: a text (one message of ``role``) or chat messages,
            rendered as turn feedback is (after its last turn: the rest of the template's turn close, the messages,
            the generation prompt), or token ids the handler rendered itself against the slot's tokens, appended as
            they are (a slot that waits before its first turn: its prompt has no generation prompt to close).
        role: chat role of a text ``observation``.
        is_last: the episode ends after the slot's next token, with the reward :meth:`TurnHandler.end_turns` gives
            that one-token turn (``turns.is_final`` is True for it): a player whose game ended on another's move.
            A trajectory's reward sits on one of its own steps, so a waiting player needs one step to be scored.
    """

    episode: int
    observation: Any
    role: str = "user"
    is_last: bool = False


@dataclasses.dataclass(frozen=True)
class Wait:
    """What :meth:`TurnHandler.serve` returns for an episode that starts waiting: the slot loads ``prompt`` (a prompt
    item as ``serve`` returns one: token ids, a text, chat messages, a mapping with a ``prompt`` field) and holds it,
    inactive, until a :class:`Wake` gives its first turn's observation (a player whose first move comes after
    another's: its prompt is what it knows before, e.g. the rules, rendered without the generation prompt)."""

    prompt: Any


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
        episodes: each slot's episode id (see :class:`HeldEpisode`): the key of per-episode state.
        ended: True where the turn ended on an end id or a stop string, False where a limit cut it.
    """

    def __init__(self, slots: list[int], turns: list[int], prompts: list[Prompt], response_ids: list[torch.Tensor],
                 is_final: list[bool], trajectories: list[int], *, decode: Callable[[list[torch.Tensor]], list[str]],
                 history: Callable[[int], torch.Tensor], ended: list[bool] | None = None,
                 log_probs: Callable[[int], list[float] | None] | None = None,
                 episodes: list[int] | None = None) -> None:  # fmt: skip
        self.slots, self.turns, self.prompts, self.response_ids = slots, turns, prompts, response_ids
        self.is_final, self.trajectories = is_final, trajectories
        self.episodes = list(trajectories) if episodes is None else episodes
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

    def held(self, i: int) -> HeldEpisode:
        """Entry ``i`` as the lifecycle hooks name a slot's episode."""
        return HeldEpisode(self.slots[i], self.trajectories[i], self.episodes[i], self.prompts[i])

    def describe(self, i: int = 0) -> str:
        """Entry ``i`` for an error message: prompt index and text, trajectory and episode."""
        p = self.prompts[i]
        return f"prompt {p.index} {p.text[:60]!r}, trajectory {self.trajectories[i]}, episode {self.episodes[i]}"


class TurnHandler:
    """Base of turn handlers: :meth:`end_turns` answers finished turns; every other channel has a default.

    A handler never reads the env's private state: the env tells it its facts (:meth:`bind`), hands it the finished
    turns (:class:`FinishedTurns`) and names what slots hold (:class:`HeldEpisode`) in the hooks. Override what you
    need; the env calls nothing else.

    Attributes:
        name: what error messages call the handler's answers.
        may_split: True when :meth:`end_turns` may answer ``Turn(new_trajectory=True)`` (a collector then needs
            ``mode="trajectories"``).
        wants_log_probs: True: the env keeps each turn's sampling log-probs (:meth:`FinishedTurns.log_probs`).
        temperature: the sampling temperature the handler announces to its episodes (an agent env's), or ``None``;
            a collector refuses a policy sampling at another.
        facts: the env's facts, once :meth:`bind` ran (``None`` before).
    """

    name = "the turn handler"
    may_split: bool = False
    wants_log_probs: bool = False
    temperature: float | None = None
    facts: EnvFacts | None = None

    def bind(self, facts: EnvFacts) -> None:
        """Called once by the env when it is built: its tokenizer, end ids and limits. The default keeps them as
        ``facts``; an override may check them (``ValueError`` for an env it cannot serve) and must keep them."""
        self.facts = facts

    def end_turns(self, turns: FinishedTurns) -> Sequence[Turn] | torch.Tensor:
        """One :class:`Turn` per finished turn, in the order of ``turns.slots``; or, when every episode ends
        with its reward alone, the rewards as one (n,) float tensor (no ``Turn`` objects built per step).

        Raising ends nothing: the env rolls the step back and raises a ``RewardFunctionError`` naming the
        slots. To end one episode on an error (a lost session), answer :meth:`Turn.failed` for its entry; a model's
        output is never a reason to fail (score it 0).
        """
        raise NotImplementedError

    def serve(self, draw: Prompt, episode: int) -> Prompt | str | Sequence[Message] | torch.Tensor:
        """The first observation of a new episode, ``episode`` (its id), started on the prompt source's ``draw``.

        The default returns ``draw`` (the prompt is the observation). A handler that runs its episodes elsewhere
        (a server session, a game, an agent program) opens one here and returns its first observation: a prompt item
        as the prompt source takes one (a text, chat messages, token ids, or a mapping with a ``prompt`` field whose
        other fields join the draw's metadata), encoded as the source encodes prompts and kept under the draw's ids,
        or a whole :class:`~tokengym.llm_envs.prompts.Prompt`. Raise :class:`~tokengym.errors.EpisodeError` when it
        cannot start: that slot alone idles until the next refill, the error is raised at this refill (counted in
        ``failed_episodes`` and ``failed_prompts``). Every episode served is later released (:meth:`release`).
        """
        return draw

    def metrics(self) -> dict[str, float]:
        """The handler's counters (tool calls, reward errors, malformed calls...), cumulative: the env adds them to
        ``env.turn_metrics`` and every collector to its ``metrics``. Use names that say what they count."""
        return {}

    def release(self, held: list[HeldEpisode]) -> None:
        """The slots drop these trajectories (a refill after their episode ended, a reset), or an episode served
        could not be loaded (``trajectory == -1``). An episode that split (``Turn(new_trajectory=True)``) goes on in
        its next trajectory, under the same episode id."""

    def refilled(self, held: list[HeldEpisode]) -> None:
        """After a refill: what every slot now holds."""

    def restart(self, dropped: list[HeldEpisode], restarted: list[HeldEpisode]) -> None:
        """Slots start their trajectories over from their prompts (in-flight work dropped after a weight update):
        ``dropped[i]`` is what slot ``restarted[i].slot`` held, ``restarted[i]`` what it holds now (a new trajectory
        id, the same episode id and prompt). An episode run elsewhere starts over here."""

    def fork(self, parent: HeldEpisode, child: HeldEpisode) -> None:
        """Slot ``child.slot`` now continues a copy of ``parent``'s sequence (a tree's branch): ``child`` has its
        own trajectory and episode ids. Copy the per-episode state of ``parent.episode`` to ``child.episode`` (the
        default keeps nothing per episode)."""

    def wakes(self) -> list[Wake]:
        """Waiting slots to wake now (:class:`Wake`), and forget them: the env asks after each :meth:`end_turns`
        and after each refill (only a handler that overrides this method is asked). A wake for an episode no slot
        holds waiting raises a ``RewardFunctionError``."""
        return []

    def state_dict(self) -> dict:
        """What the handler keeps in the env's checkpoint (plain data: ``torch.load(weights_only=True)``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (the env's slots are restored first)."""

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
