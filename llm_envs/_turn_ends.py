"""What a token env does when turns end: ask its turn handler, write the rewards, append the feedback of the
episodes that go on and move those slots to their next turn; record the episodes that failed or split."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from tokengym.llm_envs import keys
from tokengym.llm_envs._loading import overrides
from tokengym.llm_envs._slots import Slots
from tokengym.llm_envs.errors import EpisodeError, RewardFunctionError
from tokengym.llm_envs.prompts import Prompt
from tokengym.llm_envs.turns.protocol import FinishedTurns, Turn, TurnHandler, Wake, check_turns
from tokengym.llm_envs.turns.render import ChatRenderer
from tokengym.llm_envs.unroll import TurnEnd

__all__ = ["TurnEnds", "episode_error"]

_log = logging.getLogger("tokengym.llm_envs")


def episode_error(reason, where: str) -> EpisodeError:
    """The :class:`EpisodeError` of a failed episode: ``reason`` as it is when it is one, else a new one naming
    ``where`` (the trajectory and prompt), with an exception ``reason`` as its cause."""
    if isinstance(reason, EpisodeError):
        return reason
    text = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
    err = EpisodeError(f"{text} ({where}); that episode ended with reward 0, the others go on")
    if isinstance(reason, BaseException):
        err.__cause__ = reason
    return err


@dataclasses.dataclass
class _Wakes:
    """A step's waiting slots and wakes, checked, to apply once the step is committed."""

    waits: list[int]
    woken: set[int] = dataclasses.field(default_factory=set)
    appended: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # after a turn
    closing: list[int] = dataclasses.field(default_factory=list)  # one token left
    unfit: list[int] = dataclasses.field(default_factory=list)


class TurnEnds:
    """Answers the turns that ended in one step or wave of ``slots``.

    Args:
        slots: the env's slots.
        renderer: renders feedback messages (``None``: a single-turn env, every turn ends its episode).
        max_turns: turns per episode.
        max_length: the slots' capacity (feedback that does not fit ends the episode).
        vocab_size: feedback ids a handler renders itself must lie below it.
        decode: the env's response decoder (rows of ids -> texts).
        encode: ``encode(item) -> (ids, text, metadata, messages)`` of a split episode's next prompt (as the source
            encodes a prompt item).
        images: ``images(ids, images, where) -> (ids, ImageInputs)``: rendered feedback ids with their image
            placeholders expanded, and the images' inputs (an env with a vision-language processor; ``None``: feedback
            images are refused).

    Attributes:
        metrics: the env's turn counters: ``feedback_turns`` (turns that went on), ``feedback_tokens`` (tokens the
            env wrote after them), ``feedback_did_not_fit`` (episodes ended because their feedback did not fit the
            slot) and ``failed_episodes`` (episodes a handler failed).
    """

    def __init__(self, slots: Slots, renderer: ChatRenderer | None, *, max_turns: int, max_length: int,
                 vocab_size: int, decode: Callable[[list[torch.Tensor]], list[str]],
                 encode: Callable | None = None, images: Callable | None = None) -> None:  # fmt: skip
        self.slots, self.renderer, self.decode, self.encode = slots, renderer, decode, encode
        self.images = images
        self.max_turns, self.max_length, self.vocab_size = max_turns, max_length, vocab_size
        self.metrics = {"feedback_turns": 0, "feedback_tokens": 0, "feedback_did_not_fit": 0, "failed_episodes": 0}
        self.pending: _Wakes | None = None  # this step's waits and wakes, applied once it is committed (settle)

    def answer(self, handler: TurnHandler, ended, limited, new_len, cut) -> TurnEnd:
        """Ask ``handler`` about every ended turn; write the feedback of continuing slots after the model's
        tokens. A turn cut by ``max_turn_tokens`` is answered as any finished turn; an episode ending with it is
        truncated. Raises RewardFunctionError (nothing written or recorded then)."""
        reward = torch.zeros(len(self.slots.prompts), 1)
        stopped = limited if cut is None else limited | cut  # a limit ended the turn
        terminated, truncated = ended, stopped & ~ended
        index = (ended | stopped).nonzero().squeeze(-1)
        finished = index.tolist()
        if not finished:
            return TurnEnd(terminated=terminated, truncated=truncated, reward=reward)
        turns = self.finished_turns(finished, limited, new_len, ended)
        rewards, results = check_turns(handler.end_turns(turns), turns, who=handler.name)
        reward.view(-1).index_copy_(0, index, rewards)
        if results is None:  # rewards alone: every episode ends
            if self.renderer is not None:
                self.slots.archive(terminated | truncated, new_len)
            return TurnEnd(terminated=terminated, truncated=truncated, reward=reward)
        if self.renderer is None:
            self.check_single_turn(turns, results, who=handler.name)
        splits = {i: self.next_prompt(turns, i, r, who=handler.name) for i, r in enumerate(results) if r.new_trajectory}
        appended, unfit, shown = ({}, [], {}) if self.renderer is None else self.feedback(turns, results, new_len,
                                                                                            who=handler.name)  # fmt: skip
        waits = [turns.slots[i] for i, r in enumerate(results) if r.wait and r.error is None and not turns.is_final[i]]
        if waits or overrides(handler, "wakes"):
            self.pending = self.prepare_wakes(handler, new_len, waits)
        # checked: from here on nothing raises, the answers are recorded
        self.record_failures(turns, results, who=handler.name)
        cut_rows = [turns.slots[i] for i in splits] + unfit  # parts of episodes going on, feedback that did not fit
        if cut_rows:  # truncated here: the episode did not end on its own
            terminated, truncated = terminated.clone(), truncated.clone()
            terminated[cut_rows], truncated[cut_rows] = False, True
        for i, prompt in splits.items():
            self.slots.parts.append(turns.trajectories[i])
            self.slots.continuations.append((prompt, turns.episodes[i]))
        if unfit:
            self.metrics["feedback_did_not_fit"] += len(unfit)
            _log.info("the feedback of %d turn(s) did not fit their slot (max_length %d): slots %s ended there, "
                      "truncated", len(unfit), self.max_length, unfit)  # fmt: skip
        if appended or waits:  # continuing and waiting slots: not done (feedback written after the model's tokens)
            terminated, truncated = terminated.clone(), truncated.clone()
            rows = list(appended) + waits
            terminated[rows] = truncated[rows] = False
            self.slots.write_feedback(appended, new_len, images=shown)
        if self.renderer is not None:
            self.slots.archive(terminated | truncated, new_len)
        return TurnEnd(terminated=terminated, truncated=truncated, reward=reward, appended=appended)

    def prepare_wakes(self, handler: TurnHandler, new_len: torch.Tensor, waits: list[int]) -> _Wakes:
        """The handler's wakes (:meth:`TurnHandler.wakes`) checked and rendered, and the slots that start waiting
        (``waits``), to apply once the step is committed (:meth:`settle`). Raises RewardFunctionError."""
        plan = _Wakes(waits)
        wakes = handler.wakes() if overrides(handler, "wakes") else []
        if not wakes:
            return plan
        waiting = self.slots.waiting | set(waits)
        slot_of = {self.slots.episodes[b]: b for b in waiting}
        ends = new_len.tolist()
        for wake in wakes:
            b = slot_of.get(wake.episode) if isinstance(wake, Wake) else None
            if b is None or b in plan.woken:
                what = f"episode {wake.episode}" if isinstance(wake, Wake) else repr(wake)
                raise RewardFunctionError(f"{handler.name} woke {what:.80}, but no slot holds that episode waiting "
                                          f"(waiting: {sorted(slot_of)}); wake an episode once, after Turn.waiting() "
                                          "or Wait")  # fmt: skip
            plan.woken.add(b)
            if wake.is_last:
                plan.closing.append(b)
            ids = self.wake_ids(b, wake, ends[b], who=handler.name)
            if ends[b] + len(ids) + 1 <= self.max_length:  # room for the observation and one more token
                plan.appended[b] = ids
            else:  # it cannot be written: the slot closes with one token (there is room for one: it was waiting)
                plan.unfit.append(b)
                if not wake.is_last:
                    plan.closing.append(b)
        return plan

    def wake_ids(self, b: int, wake: Wake, end: int, *, who: str) -> torch.Tensor:
        """The ids a wake appends after slot ``b``'s last turn (which ends at ``end``); token ids as they are."""
        if isinstance(wake.observation, torch.Tensor):
            return self.checked_ids(wake.observation, b, who=who)
        if self.renderer is None:
            raise RewardFunctionError(f"{who} woke slot {b} after a turn, but the env is single-turn (max_turns=1); "
                                      "build it with max_turns > 1")  # fmt: skip
        obs = wake.observation
        messages = [{"role": wake.role, "content": obs}] if isinstance(obs, str) else [dict(m) for m in obs]
        start = int(self.slots.state[keys.PROMPT_LEN][b])
        return self.renderer.feedback_ids(self.slots.tokens[b, start:end], messages)

    def settle(self) -> None:
        """Apply the step's waits and wakes (:meth:`prepare_wakes`) once it is committed."""
        plan, self.pending = self.pending, None
        if plan is None:
            return
        if plan.waits:
            self.slots.hold(plan.waits)
        if plan.appended or plan.closing:
            self.metrics["feedback_tokens"] += self.slots.wake(plan.appended, plan.closing)
            self.metrics["feedback_turns"] += len(plan.appended)
        if plan.unfit:
            self.metrics["feedback_did_not_fit"] += len(plan.unfit)
            _log.info("the wake-up observation of %d waiting slot(s) did not fit (max_length %d): slots %s end after "
                      "one more token", len(plan.unfit), self.max_length, plan.unfit)  # fmt: skip

    def wake_now(self, handler: TurnHandler) -> None:
        """Ask ``handler`` for wakes outside a step (after a refill) and apply them."""
        self.pending = self.prepare_wakes(handler, self.slots.state[keys.SEQ_LEN], [])
        self.settle()

    def check_single_turn(self, turns: FinishedTurns, results: list[Turn], *, who: str) -> None:
        """A single-turn env writes no feedback: a handler asking it to go on has a bug (RewardFunctionError)."""
        for i, r in enumerate(results):
            if r.new_trajectory or not r.is_done:
                what = "split the episode (new_trajectory=True)" if r.new_trajectory else f"feedback {r.feedback!r:.60}"
                raise RewardFunctionError(
                    f"{who} gave {what} for slot {turns.slots[i]} ({turns.describe(i)}) but the env is single-turn "
                    "(max_turns=1), so the episode cannot go on; build the env with max_turns > 1, or answer "
                    "Turn(reward) (done=True) where turns.is_final says the episode ends"
                )

    def next_prompt(self, turns: FinishedTurns, i: int, result: Turn, *, who: str) -> Prompt:
        """The prompt of a split episode's next trajectory (``result.feedback`` encoded), under the same ids."""
        held = turns.prompts[i]
        if result.feedback is None or self.encode is None:
            raise RewardFunctionError(f"{who} split slot {turns.slots[i]}'s episode (new_trajectory=True) without "
                                      "its next trajectory's prompt; give it as feedback (token ids, a text or chat "
                                      "messages)")  # fmt: skip
        if isinstance(result.feedback, torch.Tensor):
            self.checked_ids(result.feedback, turns.slots[i], who=who)
        try:
            ids, text, _, messages = self.encode(result.feedback)
        except (TypeError, ValueError, KeyError) as err:
            raise RewardFunctionError(f"{who} gave a next prompt for slot {turns.slots[i]} that cannot be encoded: "
                                      f"{err}") from err  # fmt: skip
        return Prompt(ids, text, held.metadata, held.index, held.group_id, held.sample_id, messages)

    def record_failures(self, turns: FinishedTurns, results: list[Turn], *, who: str) -> None:
        """Keep the errors of the episodes the handler failed (raised at their slots' refill), counted and logged."""
        for i, r in enumerate(results):
            if r.error is not None:
                err = episode_error(r.error, f"{who}, {turns.describe(i)}, turn {turns.turns[i]}")
                self.record_failure(turns.slots[i], err)

    def record_failure(self, slot: int, err: EpisodeError) -> None:
        """Count, log and keep one failed episode's error (raised at the next refill)."""
        self.metrics["failed_episodes"] += 1
        _log.warning("%s", err)
        self.slots.failures.append((slot, err))

    def finished_turns(self, slots: list[int], limited: torch.Tensor, new_len: torch.Tensor,
                       ended: torch.Tensor) -> FinishedTurns:  # fmt: skip
        """The handler's view of the turns of ``slots`` ending at lengths ``new_len`` (``ended``: on an end id)."""
        s, tokens = self.slots.state, self.slots.tokens
        starts, ends, all_trajs = s[keys.PROMPT_LEN].tolist(), new_len.tolist(), s[keys.TRAJ_ID].tolist()  # three reads
        is_end = ended.tolist()  # and the end flags, once (not indexed per slot)
        trajs = [all_trajs[b] for b in slots]
        if self.renderer is None:
            turns, final = [0] * len(slots), [True] * len(slots)
        else:
            index = torch.tensor(slots)
            turns, is_limited = s[keys.TURN][index].tolist(), limited[index].tolist()
            final = [lim or t + 1 >= self.max_turns for lim, t in zip(is_limited, turns, strict=True)]
        log_probs = self.slots.log_probs
        turn_log_probs = None if log_probs is None else (lambda b: log_probs[b, starts[b] : ends[b]].tolist())
        episodes = self.slots.episodes
        return FinishedTurns(slots, turns, [self.slots.prompts[b] for b in slots], [tokens[b, starts[b] : ends[b]] for b in slots],
                             final, trajs, decode=self.decode, history=lambda b: tokens[b, : ends[b]],
                             ended=[is_end[b] for b in slots], log_probs=turn_log_probs,
                             episodes=[episodes[b] for b in slots])  # fmt: skip

    def feedback(self, turns: FinishedTurns, results: list[Turn], new_len: torch.Tensor, *,
                 who: str) -> tuple[dict[int, torch.Tensor], list[int], dict]:  # fmt: skip
        """The ids to append per continuing slot (feedback given, the episode not over, and it fits), the slots
        whose feedback does not fit (their episode ends there), and the image inputs of feedback that shows images."""
        appended, unfit, shown, ends = {}, [], {}, new_len.tolist()
        for i, (b, result) in enumerate(zip(turns.slots, results, strict=True)):
            if result.is_done or result.wait or turns.is_final[i]:
                continue
            if isinstance(result.feedback, torch.Tensor):
                if result.images:
                    raise RewardFunctionError(f"{who} gave feedback token ids with images for slot {b}: give the "
                                              'feedback as a text or chat messages with a {"type": "image"} item per '
                                              "image (the env expands them)")  # fmt: skip
                ids = self.checked_ids(result.feedback, turns.slots[i], who=who)
            else:
                ids = self.renderer.feedback_ids(turns.response_ids[i], result.messages())
            inputs = None
            if result.images:
                if self.images is None:
                    raise RewardFunctionError(f"{who} gave feedback with {len(result.images)} image(s) for slot {b}, but "
                                              "the env has no processor: build it with processor= (a vision-language "
                                              "model's processor)")  # fmt: skip
                try:
                    ids, inputs = self.images(ids, result.images, f"{who}, slot {b}: ")
                except (ValueError, TypeError, FileNotFoundError) as err:
                    raise RewardFunctionError(str(err)) from err
            if ends[b] + len(ids) + 1 <= self.max_length:  # room for the feedback and one more token
                appended[b] = ids
                if inputs is not None:
                    shown[b] = inputs
            else:
                unfit.append(b)
        return appended, unfit, shown

    def checked_ids(self, ids: torch.Tensor, slot: int, *, who: str) -> torch.Tensor:
        """Feedback ids a handler rendered itself, checked (int64, 1-D, in the vocabulary) and copied."""
        if ids.dtype != torch.int64 or ids.dim() != 1 or not len(ids):
            raise RewardFunctionError(f"{who} gave feedback ids of dtype {ids.dtype} and shape {tuple(ids.shape)} for "
                                      f"slot {slot}; give a non-empty int64 (n,) tensor")  # fmt: skip
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= self.vocab_size:
            raise RewardFunctionError(f"{who} gave feedback id {lo if lo < 0 else hi} for slot {slot}, outside the "
                                      f"vocabulary [0, {self.vocab_size})")  # fmt: skip
        return ids.clone()

    def continue_turns(self, appended: dict[int, torch.Tensor], new_len: torch.Tensor) -> None:
        """Move continuing slots to their next turn (after the step or wave is committed)."""
        if appended:
            self.metrics["feedback_tokens"] += self.slots.continue_turns(appended, new_len)
            self.metrics["feedback_turns"] += len(appended)
