"""Trees as a source decorator: :class:`TreeSource` wraps a step or wave source and grows each group as a tree.

The plain sources know nothing of trees; this one owns the ``TreeSampler`` (``collectors/tree_sampler.py``) and
its bookkeeping, and uses only the wrapped source's public parts (its env, policy and observation; how it builds a
step's chunk or a wave's cells), so a new source kind gets trees by exposing the same.
"""

from __future__ import annotations

import dataclasses

import torch

from tokengym.collectors.sources import Advance, SourceKind, StepSource, WaveSource
from tokengym.collectors.tree_sampler import TreeSampler
from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import PromptError

__all__ = ["TreeSource"]


class TreeSource:
    """A :class:`~tokengym.collectors.sources.Source` that grows trees of ``group_size`` leaves in ``source``'s slots.

    Stepping: after each env step (before refills) the sampler makes the rule's forks (the env's slots and the
    policy's KV cache rows copied), fills trees whose branches all ended, frees the slots of complete trees and starts
    new trees there. Waves: each wave of the live branches is paused at the rule's next fork (a row capped there and
    left unfinished: the env keeps it open, the next wave continues it), then the forks are made after it. Each
    advance's chunk carries the forks made after it (``chunk.forks``) for the recorder.

    Args:
        source: the :class:`~tokengym.collectors.sources.StepSource` or
            :class:`~tokengym.collectors.sources.WaveSource` to drive.
        sampler: the ``TreeSampler`` (``collectors/tree_sampler.py``) of the collector's rule.
    """

    def __init__(self, source: StepSource | WaveSource, sampler: TreeSampler) -> None:
        if not isinstance(source, StepSource | WaveSource):
            raise TypeError(f"TreeSource wraps a StepSource or a WaveSource, got {type(source).__name__}")
        self.source, self.sampler = source, sampler
        self.kind: SourceKind = source.kind

    def start(self) -> tuple[list[int], PromptError | None]:
        """Free every slot and start as many trees as fit: ``(root slots, error or None)``."""
        obs, roots, error = self.sampler.start()
        if self.kind is SourceKind.STEP:
            self.source.obs = obs
        return roots, error

    def advance(self, *, min_finished: int | None = None, cells: bool = False) -> Advance:
        """One step or wave of the trees' live branches, then their forks (from live branches, or ones that ended
        in it: their tokens are still in their slots), the slots no tree needs freed and new trees started there.
        ``min_finished`` does not apply (the collector refuses over-sampling with trees); a wave's chunk is always its
        real steps (``Cells``)."""
        return self._step() if self.kind is SourceKind.STEP else self._wave()

    def _step(self) -> Advance:
        source = self.source
        td = source.policy(source.obs)
        out, obs = source.env.step_and_maybe_reset(td, refill=False)
        nxt = out.get(keys.NEXT)
        ended = source.env.ended_slots(nxt.get(keys.DONE[1]))
        source.obs, roots, forks, error = self.sampler.after_step(out, obs, ended)
        step = source.step_chunk(td, nxt, ended)
        step.forks = forks
        return Advance(step, 1, roots, error)

    def _wave(self) -> Advance:
        source, env = self.source, self.source.env
        request = env.wave_request()
        if len(request) == 0:
            return Advance({}, 0, [])
        slots = request.slots.tolist()
        caps = self.sampler.wave_caps(slots, env.observation().get(keys.RESPONSE_LEN)[request.slots].tolist())
        paused = None
        if caps:  # rows capped below their budget stop at the fork: not an env limit, the turn goes on
            cap = torch.tensor([caps.get(b, -1) for b in slots], dtype=torch.int64)
            paused = (cap >= 0) & (cap < request.max_new_tokens)
            budget = torch.where(paused, cap, request.max_new_tokens)
            request = dataclasses.replace(request, max_new_tokens=budget)
        result, interrupted = source.generate(request)
        if paused is not None:
            paused &= result.lengths >= request.max_new_tokens
            if bool(paused.any()):
                finished = ~paused if result.finished is None else result.finished & ~paused
                result = dataclasses.replace(result, finished=finished)
        out, steps, counts = source.wave_cells(request, result)
        if not out:  # nothing generated: nothing to fork either
            return Advance(out, 0, [], interrupted=interrupted)
        _, roots, out.forks, error = self.sampler.after_wave(steps, counts)
        return Advance(out, int(counts.max()), roots, error, interrupted)

    def restart(self, slots: list[int]) -> None:
        self.source.restart(slots)

    def finished_slots(self) -> set[int]:
        """None: a tree's finished slots are freed or forked into after each step or wave."""
        return set()

    def counts(self) -> dict:
        """The trees' counters (forks made and skipped, leaves from the prompt, trees started)."""
        return dict(self.sampler.counters)

    def state_dict(self) -> dict:
        return {**self.source.state_dict(), "tree": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)
        if state.get("tree") is not None:
            self.sampler.load_state_dict(state["tree"])
