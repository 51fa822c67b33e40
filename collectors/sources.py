"""Step sources: how a collector advances the env — one token per step, or a whole wave per call.

A source is anything that follows the :class:`Source` protocol: ``start()`` resets the env's slots, each
``advance()`` returns one :class:`Advance` (the steps to record, how many env steps they are, which slots took a new
prompt), and the collector hands its chunk to a recorder (:class:`~tokengym.collectors.recorders.Recorder`). Two are
here, picked with :class:`SourceKind`: :class:`StepSource` and :class:`WaveSource`; trees wrap either one
(:class:`~tokengym.collectors.tree_source.TreeSource`).
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDict, TensorDictBase

from tokengym.collectors._packing import Cells, Step, flat_name
from tokengym.collectors.policies.protocol import StepPolicy, WavePolicy, supports_steps, supports_waves
from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import PromptError

__all__ = ["Advance", "Source", "SourceKind", "StepSource", "WaveSource", "check_source", "make_source"]

# ids and ``active`` are constant within a step, so the collected ("next", ...) leaves them out
_NEXT_SKIP = (keys.TRAJ_ID, keys.GROUP_ID, keys.SAMPLE_ID, keys.ACTIVE)
_ROOT_SKIP = (keys.NEXT, keys.RESET, keys.REWARD[1], *keys.DONE_KEYS)  # done flags live under "next"
_NEXT = keys.NEXT
_NEXT_SKIP_FLAT = frozenset(f"{_NEXT}.{name}" for name in _NEXT_SKIP)  # the same, by flat name


def _base(env):
    return getattr(env, "base_env", env)


class SourceKind(StrEnum):
    """``STEP``: the policy picks one token per slot per env step. ``WAVE``: the policy generates
    every live slot's whole turn at once (``model.generate``, vLLM) and the env unrolls it."""

    STEP = "step"
    WAVE = "wave"


@dataclasses.dataclass
class Advance:
    """What one ``advance()`` of a :class:`Source` produced.

    Attributes:
        chunk: the steps to record: a ``Step`` (one env step, (B, ...) tensors), a
            wave's steps by flat name ((B, T, ...)), or a wave's real steps (``Cells``);
            empty (``{}``) when nothing ran.
        steps: the env steps ``chunk`` holds (what a collector's ``total_steps`` counts): 1 for a step, a wave's
            longest row; 0 for an empty chunk.
        refilled: the slots that took a new prompt (their prompts join the batch's prompt table).
        error: the :class:`~tokengym.llm_envs.errors.PromptError` of prompts that could not be loaded (their slots
            are refilled at the next advance); the collector records the chunk, then raises it.
        interrupted: rows the policy left unfinished (a weight update interrupted the wave; they go on in the next).
    """

    chunk: dict
    steps: int
    refilled: list[int]
    error: PromptError | None = None
    interrupted: int = 0


@runtime_checkable
class Source(Protocol):
    """How a collector advances its env. Built once with everything it needs (no attribute is set on it afterwards);
    what varies per call comes as ``advance()``'s arguments.

    - ``kind``: the :class:`SourceKind` it gives (a checkpoint records it).
    - ``start()``: reset every slot; ``(slots that took a prompt, PromptError of the skipped ones or None)``.
    - ``advance(min_finished=, cells=)``: one step or wave of every live slot, an :class:`Advance`.
      ``min_finished``: a wave may stop once that many rows ended (over-sampling; a step source ignores it);
      ``cells``: give a wave as its real steps (``Cells``: a recorder of
      trajectories going on across waves copies them anyway).
    - ``restart(slots)``: start those slots over from their prompts (in-flight work dropped).
    - ``finished_slots()``: slots holding a recorded, finished trajectory until their refill.
    - ``counts()``: the source's own counters (a tree's forks), merged into the collector's ``counts()``.
    - ``state_dict()`` / ``load_state_dict(state)``: resume between batches.
    """

    kind: SourceKind

    def start(self) -> tuple[list[int], PromptError | None]: ...

    def advance(self, *, min_finished: int | None = None, cells: bool = False) -> Advance: ...

    def restart(self, slots: list[int]) -> None: ...

    def finished_slots(self) -> set[int]: ...

    def counts(self) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def check_source(source) -> None:
    """A ``TypeError`` naming what ``source`` lacks of the :class:`Source` protocol."""
    missing = [name for name in ("kind", "start", "advance", "restart", "finished_slots", "counts", "state_dict",
                                 "load_state_dict") if not hasattr(source, name)]  # fmt: skip
    if missing:
        raise TypeError(f"a collector's source must follow tokengym.collectors.sources.Source; "
                        f"{type(source).__name__} lacks {missing}")  # fmt: skip
    if source.kind not in tuple(SourceKind):
        raise TypeError(f"a source's kind must be a SourceKind ({[k.value for k in SourceKind]}), "
                        f"{type(source).__name__} has kind={source.kind!r}")  # fmt: skip


class _StepKeys:
    """Which tensors of a step get recorded: every tensor the policy, the env and its transforms wrote
    (found once, on the first step), so e.g. ``keys.REF_LOG_PROB`` and ``("next", "reward_raw")`` from
    a KL transform inside a ``TransformedEnv`` are kept."""

    def __init__(self) -> None:
        self.root: tuple[str, ...] | None = None
        self.next: tuple[tuple[str, str], ...] = ()  # (key under "next", its flat name)

    def chunk(self, td, nxt, lead: int) -> dict:
        """The tensors of a step (``lead`` = 1: a :class:`Step` of (B, ...) tensors) or a wave (``lead`` = 2)."""
        root, nxt_items = dict(td.items()), dict(nxt.items())
        if self.root is None:
            self.root = tuple(k for k, v in root.items() if k not in _ROOT_SKIP and isinstance(v, torch.Tensor))
            self.next = tuple((k, f"{_NEXT}.{k}") for k, v in nxt_items.items()
                              if k not in _NEXT_SKIP and isinstance(v, torch.Tensor))  # fmt: skip
        out = {k: root[k] for k in self.root}
        for k, name in self.next:
            out[name] = nxt_items[k]
        return Step(out) if lead == 1 else out


class StepSource:
    """One env step per call: ``policy(obs)`` (a :class:`StepPolicy`) then ``env.step_and_maybe_reset``."""

    kind = SourceKind.STEP

    def __init__(self, env, policy: StepPolicy) -> None:
        if not supports_steps(policy):
            raise TypeError(f"source='step' needs a policy callable on the step TensorDict; {type(policy).__name__} "
                            "only generates waves: use source='wave'")  # fmt: skip
        self.env, self.policy = env, policy
        self.obs: TensorDictBase | None = None  # the observation the next step acts on
        self.is_bare = _base(env) is env and hasattr(type(env), "ended_slots")
        self.to_refill: list[int] = []  # slots whose prompt failed to load: refilled before the next step
        self._keys = _StepKeys()

    def start(self) -> tuple[list[int], PromptError | None]:
        """Reset every slot: ``(slots that took a prompt, error of the prompts skipped or None)``."""
        slots = list(range(self.env.batch_size[0]))
        try:
            self.obs = self.env.reset()
        except PromptError as err:
            self.obs, self.to_refill = err.observation, list(err.slots)
            return [b for b in slots if b not in err.slots], err
        return slots, None

    def advance(self, *, min_finished: int | None = None, cells: bool = False) -> Advance:
        """One step of every slot (a ``Step`` chunk); the slots refilled after it.

        A prompt that cannot be loaded never loses the step that finished its slot: the step is
        recorded, the error returned, and the slot refilled with the next prompt on the next call.
        """
        refilled: list[int] = []
        if self.to_refill:
            slots, self.to_refill = self.to_refill, []
            try:
                self.obs = _base(self.env).refill(slots)
            except PromptError as err:
                self.obs, self.to_refill = err.observation, list(err.slots)
                return Advance({}, 0, [b for b in slots if b not in err.slots], err)
            refilled = slots
        td = self.policy(self.obs)
        error = None
        try:
            out, self.obs = self.env.step_and_maybe_reset(td)
        except PromptError as err:
            if err.step is None:
                raise
            out, self.obs, self.to_refill, error = err.step, err.observation, list(err.slots), err
        nxt = out.get(_NEXT)
        done = nxt.get(keys.DONE[1])
        ended = self.env.ended_slots(done) if self.is_bare else None  # the env's own flags: it knows the slots
        if ended is None:  # flags a transform (a step counter, say) or an override wrote: read them
            done = done.reshape(-1)
            ended = done.nonzero().squeeze(-1).tolist() if bool(done.any()) else []
        if ended:
            refilled += [b for b in ended if b not in self.to_refill]
        return Advance(self.step_chunk(td, nxt, ended), 1, refilled, error)

    def step_chunk(self, td: TensorDictBase, nxt: TensorDictBase, ended: list[int]) -> Step:
        """The recorded tensors of a step (``td`` the policy's input and output, ``nxt`` its ``"next"``), with the
        slots that ended in it."""
        step = self._keys.chunk(td, nxt, 1)
        step.ended = ended  # the recorder needs no second look at the done flags
        return step

    def restart(self, slots: list[int]) -> None:
        """Start ``slots`` over from their prompts (in-flight work dropped)."""
        self.obs = _base(self.env).restart(slots)

    def finished_slots(self) -> set[int]:
        """Slots holding a finished trajectory until their refill: none, a step refills them at once."""
        return set()

    def counts(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"obs": None if self.obs is None else self.obs.to_dict(), "to_refill": list(self.to_refill)}

    def load_state_dict(self, state: dict) -> None:
        obs = state["obs"]
        self.obs = None if obs is None else TensorDict(obs, self.env.batch_size)
        self.to_refill = list(state.get("to_refill", []))


class WaveSource:
    """One wave per call: every live slot's turn, generated by ``policy.generate`` (a :class:`WavePolicy`) and
    unrolled by the env.

    Done slots are refilled at the start of the next wave; a multi-turn slot whose turn continues
    goes on in the next wave with its whole history as context.

    Args:
        env: a bare :class:`~tokengym.llm_envs.TokenEnv`.
        policy: a :class:`WavePolicy`.
        width: pad each wave to this many steps (a recorder's fixed batch width: no padding copy later); ``None``: as
            wide as its longest row.
    """

    kind = SourceKind.WAVE

    def __init__(self, env, policy: WavePolicy, *, width: int | None = None) -> None:
        if not supports_waves(policy):
            raise TypeError(f"source='wave' needs a policy with generate(WaveRequest) -> WaveResult, "
                            f"got {type(policy).__name__}")  # fmt: skip
        if getattr(env, "base_env", env) is not env:
            raise TypeError("source='wave' needs a bare TokenEnv (env transforms run per step); use source='step'")
        self.env, self.policy, self.width = env, policy, width
        self.done: torch.Tensor | None = None  # slots whose trajectory ended in the last wave: refilled at the next

    def start(self) -> tuple[list[int], PromptError | None]:
        self.done = torch.zeros(self.env.batch_size[0], dtype=torch.bool)
        slots = list(range(self.env.batch_size[0]))
        try:
            self.env.reset()
        except PromptError as err:
            self.done[err.slots] = True
            return [b for b in slots if b not in err.slots], err
        return slots, None

    def advance(self, *, min_finished: int | None = None, cells: bool = False) -> Advance:
        """One wave: its steps (B, T, ...), or its real steps with ``cells``; the chunk is empty when nothing is live.
        A slot whose prompt fails to load is refilled at the next wave."""
        refilled = self.done.nonzero().squeeze(-1).tolist()
        if refilled:
            try:
                self.env.refill(refilled)
            except PromptError as err:
                self.done = torch.zeros_like(self.done)
                self.done[err.slots] = True
                return Advance({}, 0, [b for b in refilled if b not in err.slots], err)
        request = self.env.wave_request()
        if len(request) == 0:
            self.done = torch.zeros_like(self.done)
            return Advance({}, 0, refilled)
        if min_finished is not None:
            request = dataclasses.replace(request, min_finished=min_finished)
        result, interrupted = self.generate(request)
        if cells:
            out, steps, counts = self.wave_cells(request, result)
            self.done = torch.zeros_like(self.done)
            if not out:
                return Advance(out, 0, refilled, interrupted=interrupted)
            live = (counts > 0).nonzero().squeeze(-1)
            done = steps.get(_NEXT).get(keys.DONE[1]).reshape(-1)
            self.done[live] = done[counts.cumsum(0).index_select(0, live) - 1]  # each slot's last step
            return Advance(out, int(counts.max()), refilled, interrupted=interrupted)
        steps = self.env.unroll(request, result, width=self.width)
        n = max(int(steps.get(keys.ACTIVE).any(0).sum()), 1) if self.width else steps.shape[1]
        self.done = steps.get(_NEXT).get(keys.DONE[1]).squeeze(-1).any(1)
        return Advance(_flat(steps.items(include_nested=True, leaves_only=True)), n, refilled, interrupted=interrupted)

    def generate(self, request) -> tuple:
        """``(the policy's WaveResult for request, rows it left unfinished)``."""
        result = self.policy.generate(request)
        return result, 0 if result.finished is None else int((~result.finished).sum())

    def wave_cells(self, request, result) -> tuple[dict, TensorDict, torch.Tensor]:
        """The wave's real steps (``Cells``), the env's steps and each slot's count; the chunk is empty (``{}``:
        nothing to record) for a wave stopped before its first token (an update landed as it started)."""
        steps, counts = self.env.unroll_cells(request, result)
        if int(counts.sum()) == 0:
            return {}, steps, counts
        return Cells(_flat(steps.items(include_nested=True, leaves_only=True)), counts), steps, counts

    def restart(self, slots: list[int]) -> None:
        self.env.restart(slots)

    def finished_slots(self) -> set[int]:
        """Slots whose trajectory ended in the last wave (recorded, not in flight), refilled at the next one."""
        return set() if self.done is None else set(self.done.nonzero().squeeze(-1).tolist())

    def counts(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"done": None if self.done is None else self.done.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.done = state["done"]


def _flat(items) -> dict:
    """A wave's steps by flat name, without the ids and ``active`` its ``"next"`` repeats (constant within a step)."""
    return {name: v for k, v in items if (name := flat_name(k)) not in _NEXT_SKIP_FLAT}


def make_source(kind, env, policy, *, width: int | None = None) -> Source:
    """The source of ``kind`` (a :class:`SourceKind` or its string); ``None`` picks stepping when the policy can step,
    else waves (``width``: see :class:`WaveSource`; a step source has none). An object following :class:`Source` is
    the source itself (built by the caller on the same env and policy)."""
    if kind is not None and not isinstance(kind, str):
        check_source(kind)
        return kind
    if kind is None:
        kind = SourceKind.STEP if supports_steps(policy) else SourceKind.WAVE
    try:
        kind = SourceKind(kind)
    except ValueError:
        raise ValueError(f"source must be one of {[k.value for k in SourceKind]}, None or a Source, got {kind!r}") from None
    return StepSource(env, policy) if kind is SourceKind.STEP else WaveSource(env, policy, width=width)
