"""Loading prompts into a token env's slots: draw from the source, check length and ids, write them in a few ops."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys
from tokengym.llm_envs._slots import Slots
from tokengym.llm_envs.errors import EpisodeError, PromptError, refill_error
from tokengym.llm_envs.prompts import Prompt
from tokengym.llm_envs.turns.protocol import HeldEpisode, TurnHandler, Wait

__all__ = ["PromptLoader", "overrides"]

_log = logging.getLogger("tokengym.llm_envs")


def overrides(handler: TurnHandler, hook: str) -> bool:
    """True when ``handler``'s class overrides the :class:`TurnHandler` hook ``hook`` (else the env skips it)."""
    return getattr(type(handler), hook) is not getattr(TurnHandler, hook)


class PromptLoader:
    """Fills ``slots`` with prompts that fit (``max_length``) and hold ids of the vocabulary (``vocab_size``).

    A slot takes a split episode's next trajectory first (``slots.continuations``), else the source's next draw,
    which the turn handler may serve as a new episode's first observation (:meth:`TurnHandler.serve`). A prompt
    that cannot be loaded leaves its slot idle and done (the next refill gives it the next prompt) and is returned
    with its :class:`PromptError`; the others are loaded. The errors of episodes a handler failed since the last
    refill are raised with them.

    Args:
        slots: the env's slots.
        max_length: a slot's capacity.
        vocab_size: prompt ids must lie below it.
        encode: ``encode(item) -> (ids, text, metadata, messages)`` of a served first observation (as the source
            encodes a prompt item).
        counts: the env's turn counters (``failed_episodes`` counts episodes that could not start).
        wake: ``wake(handler)`` asks a handler that wakes waiting slots (:meth:`TurnHandler.wakes`) after a refill
            and applies its wakes.
    """

    def __init__(self, slots: Slots, *, max_length: int, vocab_size: int, encode: Callable | None = None,
                 counts: dict | None = None, wake: Callable[[TurnHandler], None] | None = None) -> None:  # fmt: skip
        self.slots, self.max_length, self.vocab_size, self.encode = slots, max_length, vocab_size, encode
        self.wake = wake
        self.counts = counts if counts is not None else {"failed_episodes": 0}

    def held(self, slot_ids) -> list[HeldEpisode]:
        """What ``slot_ids`` hold (slots without a prompt left out)."""
        slots = self.slots
        trajs = slots.state[keys.TRAJ_ID].tolist()
        return [HeldEpisode(b, trajs[b], slots.episodes[b], p) for b in slot_ids if (p := slots.prompts[b]) is not None]

    def refill(self, source, handler: TurnHandler, slot_ids: list[int]) -> TensorDict:
        """Load the next prompts of ``source`` into ``slot_ids`` (``handler`` told of the episodes released and
        held, if it listens, and serving first observations, if it serves); the observation of every slot, or a
        PromptError holding it."""
        listens = overrides(handler, "release") or overrides(handler, "refilled")
        serves = handler if overrides(handler, "serve") else None
        wakes = handler if self.wake is not None and overrides(handler, "wakes") else None
        if not listens:  # the usual handler: no lists to build on a refill (the step path's hot spot)
            return self._refill(source, serves, None, slot_ids, wakes)
        dropped = self.held(slot_ids)
        if dropped:
            handler.release(dropped)
        try:
            return self._refill(source, serves, handler, slot_ids, wakes)
        finally:
            handler.refilled(self.held(range(len(self.slots.prompts))))

    def _refill(self, source, serves: TurnHandler | None, listens: TurnHandler | None, slot_ids: list[int],
                wakes: TurnHandler | None = None) -> TensorDict:  # fmt: skip
        self.slots.copy_on_write()
        failed = self.fill(source, serves, listens, slot_ids)
        if wakes is not None:  # episodes served waiting, or woken because a partner's episode ended
            self.wake(wakes)
        self.slots.is_reset = True
        obs = self.slots.reset_observation()
        episodes = self.slots.pop_failures() if self.slots.failures else []
        if failed or episodes:  # only the slots whose prompt failed are left to refill: a failed episode's took one
            everything = episodes + failed  # in the order they failed
            raise refill_error(everything, slots=[s for s, _ in failed], observation=obs) from everything[0][1]
        return obs

    def restart(self, handler: TurnHandler, slot_ids: list[int]) -> TensorDict:
        """Start ``slot_ids`` over from their prompts, under new trajectory ids (the same episode ids); the
        observation of every slot."""
        slot_ids = [b for b in slot_ids if b not in self.slots.waiting]  # a waiting slot has nothing in flight
        dropped = self.held(slot_ids)
        self.slots.copy_on_write()
        for b in slot_ids:
            self.slots.done[b] = False
            self.load_one(b, self.slots.prompts[b])
        if dropped:
            handler.restart(dropped, self.held([h.slot for h in dropped]))
        return self.slots.reset_observation()

    def next_episode(self, source, handler: TurnHandler | None) -> tuple[Prompt | None, int, bool]:
        """The next prompt a slot takes, its episode id and whether it waits once loaded (the handler served a
        :class:`Wait`): a split episode's next trajectory, else a new episode on the source's next draw (served by
        ``handler`` when it serves); ``(None, -1, False)`` once the source is empty."""
        if self.slots.continuations:
            return (*self.slots.continuations.popleft(), False)
        draw = next_prompt(source)
        if draw is None:
            return None, -1, False
        episode = self.slots.new_episode()
        if handler is None:
            return draw, episode, False
        try:
            served = handler.serve(draw, episode)
        except Exception as err:  # that episode alone fails: raised at this refill, the other slots are loaded
            self.counts["failed_episodes"] += 1
            if isinstance(err, EpisodeError):
                _log.warning("%s", err)
                raise
            failure = EpisodeError(f"{handler.name} could not start episode {episode} (prompt {draw.index}): "
                                   f"{type(err).__name__}: {err}", what="episode(s) could not start")  # fmt: skip
            _log.warning("%s", failure)
            raise failure from err
        is_waiting = isinstance(served, Wait)  # loaded, then held until the handler wakes it
        if is_waiting:
            served = served.prompt
        if isinstance(served, Prompt):
            return served, episode, is_waiting
        try:
            ids, text, meta, messages = self.encode(served)
        except (TypeError, ValueError, KeyError) as err:
            raise PromptError(f"{handler.name} served episode {episode} a first observation that cannot be encoded "
                              f"({type(err).__name__}: {err}); serve a text, chat messages, token ids or a Prompt") from err  # fmt: skip
        metadata = {**draw.metadata, **meta} if meta else draw.metadata
        return Prompt(ids, text, metadata, draw.index, draw.group_id, draw.sample_id, messages), episode, is_waiting

    def fill(self, source, serves: TurnHandler | None, listens: TurnHandler | None,
             slot_ids: list[int]) -> list[tuple[int, PromptError]]:  # fmt: skip
        """Give each of ``slot_ids`` its next prompt and load them; returns the failures. An episode that started but
        could not be loaded is released at once (``listens``: the handler told, trajectory ``-1``)."""
        failed: list[tuple[int, PromptError]] = []
        loaded: list[tuple[int, Prompt]] = []
        episode_of: dict[int, int] = {}
        lost: list[HeldEpisode] = []
        waiting: list[int] = []
        for b in slot_ids:
            prompt, episode = None, -1
            try:
                prompt, episode, is_waiting = self.next_episode(source, serves)
                if prompt is None:
                    self.slots.idle(b, is_done=False)
                else:
                    self.check_length(prompt)
                    loaded.append((b, prompt))
                    episode_of[b] = episode
                    if is_waiting:
                        waiting.append(b)
            except PromptError as err:  # the slot idles, done: the next refill gives it the next prompt
                self.slots.idle(b, is_done=True)
                failed.append((b, err))
                if prompt is not None:
                    lost.append(HeldEpisode(b, -1, episode, prompt))
        prompts = dict(loaded)
        for b, err in self.load(loaded):
            self.slots.idle(b, is_done=True)
            failed.append((b, err))
            lost.append(HeldEpisode(b, -1, episode_of.pop(b), prompts[b]))
        for b, episode in episode_of.items():
            self.slots.episodes[b] = episode
        if waiting := [b for b in waiting if b in episode_of]:  # loaded: they wait until the handler wakes them
            self.slots.hold(waiting)
        if lost and listens is not None:
            listens.release(lost)
        return failed

    def load(self, loaded: list[tuple[int, Prompt]]) -> list[tuple[int, PromptError]]:
        """Load several slots' prompts with a few vectorized writes (not a dozen scalar writes per slot);
        returns the (slot, error) of prompts whose ids are outside the vocabulary (those slots are not loaded)."""
        if not loaded:
            return []
        lo, hi = (int(x) for x in torch.aminmax(torch.cat([p.ids for _, p in loaded])))
        if lo < 0 or hi >= self.vocab_size:  # rare: find the prompts at fault, load the others one by one
            failed = []
            for b, prompt in loaded:
                try:
                    self.load_one(b, prompt)
                except PromptError as err:
                    failed.append((b, err))
            return failed
        self.slots.load(loaded)
        return []

    def load_one(self, b: int, prompt: Prompt | None) -> None:
        """Load one slot (``None``: the source is exhausted and the slot idles with an empty sequence)."""
        if prompt is None:
            self.slots.idle(b, is_done=False)
            return
        self.check_length(prompt)
        self.check_ids(prompt)
        self.slots.load([(b, prompt)])

    def check_length(self, prompt: Prompt) -> None:
        n = prompt.ids.numel()
        if n >= self.max_length:
            raise PromptError(
                f"prompt {prompt.index} {prompt.text[:60]!r} has {n} tokens but max_length is {self.max_length} "
                "(prompt + response); shorten the prompt or raise max_length"
            )

    def check_ids(self, prompt: Prompt) -> None:
        lo, hi = (int(x) for x in torch.aminmax(prompt.ids))
        if lo < 0 or hi >= self.vocab_size:
            raise PromptError(
                f"prompt {prompt.index} {prompt.text[:60]!r} holds token id {lo if lo < 0 else hi}, outside the "
                f"vocabulary [0, {self.vocab_size}); encode it with the env's tokenizer (or pass model_config)"
            )


def next_prompt(source) -> Prompt | None:
    """The source's next prompt; an encoding error becomes a :class:`PromptError` (the source moved past it)."""
    try:
        return source.next()
    except PromptError:
        raise
    except (ValueError, KeyError, TypeError, OverflowError) as err:
        raise PromptError(f"{type(err).__name__}: {err}") from err
