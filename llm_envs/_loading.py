"""Loading prompts into a token env's slots: draw from the source, check length and ids, write them in a few ops."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tokengym.llm_envs._slots import Slots
from tokengym.llm_envs.errors import PromptError, refill_failures
from tokengym.llm_envs.prompts import Prompt
from tokengym.llm_envs.turns.protocol import TurnHandler

__all__ = ["PromptLoader"]


class PromptLoader:
    """Fills ``slots`` with prompts that fit (``max_length``) and hold ids of the vocabulary (``vocab_size``).

    A prompt that cannot be loaded leaves its slot idle and done (the next refill gives it the next prompt)
    and is returned with its :class:`PromptError`; the others are loaded.
    """

    def __init__(self, slots: Slots, *, max_length: int, vocab_size: int) -> None:
        self.slots, self.max_length, self.vocab_size = slots, max_length, vocab_size

    def refill(self, source, handler: TurnHandler, slot_ids: list[int]) -> TensorDict:
        """Load the next prompts of ``source`` into ``slot_ids`` (``handler`` told of the prompts released and
        held, if it listens); the observation of every slot, or a PromptError holding it."""
        has_hooks = type(handler).release is not TurnHandler.release or type(handler).refilled is not TurnHandler.refilled
        if not has_hooks:  # the usual handler: no prompt lists to build on a refill (the step path's hot spot)
            return self._refill(source, slot_ids)
        held = [p for b in slot_ids if (p := self.slots.prompts[b]) is not None]
        if held:
            handler.release(held)
        try:
            return self._refill(source, slot_ids)
        finally:
            handler.refilled([p for p in self.slots.prompts if p is not None])

    def _refill(self, source, slot_ids: list[int]) -> TensorDict:
        self.slots.copy_on_write()
        failed = self.fill(source, slot_ids)
        self.slots.is_reset = True
        obs = self.slots.reset_observation()
        if failed:
            b, err = failed[0]
            raise PromptError(refill_failures(failed), slots=[s for s, _ in failed], observation=obs) from err
        return obs

    def restart(self, handler: TurnHandler, slot_ids: list[int]) -> TensorDict:
        """Start ``slot_ids`` over from their prompts, under new trajectory ids; the observation of every slot."""
        handler.restart([p for b in slot_ids if (p := self.slots.prompts[b]) is not None])
        self.slots.copy_on_write()
        for b in slot_ids:
            self.slots.done[b] = False
            self.load_one(b, self.slots.prompts[b])
        return self.slots.reset_observation()

    def fill(self, source, slot_ids: list[int]) -> list[tuple[int, PromptError]]:
        """Draw the next prompt of ``source`` for each of ``slot_ids`` and load them; returns the failures."""
        failed: list[tuple[int, PromptError]] = []
        loaded: list[tuple[int, Prompt]] = []
        for b in slot_ids:
            try:
                prompt = next_prompt(source)
                if prompt is None:
                    self.slots.idle(b, is_done=False)
                else:
                    self.check_length(prompt)
                    loaded.append((b, prompt))
            except PromptError as err:  # the slot idles, done: the next refill gives it the next prompt
                self.slots.idle(b, is_done=True)
                failed.append((b, err))
        for b, err in self.load(loaded):
            self.slots.idle(b, is_done=True)
            failed.append((b, err))
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
