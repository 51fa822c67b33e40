"""Step sources: how a collector advances the env — one token per step, or a whole wave per call.

Both give chunks of steps (a dict of flat keys, each (B, k, ...)) that a recorder stores, and
report which slots took a new prompt (for the batch's prompt table). Pick one with :class:`SourceKind`.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum

import torch
from tensordict import TensorDict

from tokengym.collectors._packing import Cells, Step, flat_name
from tokengym.collectors.policies.protocol import StepPolicy, WavePolicy, supports_steps, supports_waves
from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import PromptError

__all__ = ["SourceKind", "StepSource", "WaveSource", "make_source"]

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


class _StepKeys:
    """Which tensors of a step get recorded: every tensor the policy, the env and its transforms wrote
    (found once, on the first step), so e.g. ``keys.REF_LOG_PROB`` and ``("next", "reward_raw")`` from
    a KL transform inside a ``TransformedEnv`` are kept."""

    def __init__(self) -> None:
        self.root: tuple[str, ...] | None = None
        self.next: tuple[str, ...] = ()

    def chunk(self, td, nxt, lead: int) -> dict:
        """The tensors of a step (``lead`` = 1: a :class:`Step` of (B, ...) tensors) or a wave (``lead`` = 2)."""
        root, nxt_items = dict(td.items()), dict(nxt.items())
        if self.root is None:
            self.root = tuple(k for k, v in root.items() if k not in _ROOT_SKIP and isinstance(v, torch.Tensor))
            self.next = tuple(k for k, v in nxt_items.items() if k not in _NEXT_SKIP and isinstance(v, torch.Tensor))
        out = {k: root[k] for k in self.root}
        out.update({f"{_NEXT}.{k}": nxt_items[k] for k in self.next})
        return Step(out) if lead == 1 else out


class StepSource:
    """One env step per call: ``policy(obs)`` (a :class:`StepPolicy`) then ``env.step_and_maybe_reset``."""

    kind = SourceKind.STEP
    last_interrupted = 0  # a step is never interrupted: an update lands at the next step

    def __init__(self, env, policy: StepPolicy) -> None:
        if not supports_steps(policy):
            raise TypeError(f"source='step' needs a policy callable on the step TensorDict; {type(policy).__name__} "
                            "only generates waves: use source='wave'")  # fmt: skip
        self.env, self.policy, self.obs = env, policy, None
        self.is_bare = _base(env) is env and hasattr(type(env), "ended_slots")
        self.to_refill: list[int] = []  # slots whose prompt failed to load: refilled before the next step
        self._keys = _StepKeys()
        self.tree = None  # a TreeSampler (branching rollouts): forks after each step, before refills

    def start(self) -> tuple[list[int], PromptError | None]:
        """Reset every slot: ``(slots that took a prompt, error of the prompts skipped or None)``."""
        slots = list(range(self.env.batch_size[0]))
        if self.tree is not None:
            self.obs, roots, error = self.tree.start()
            return roots, error
        try:
            self.obs = self.env.reset()
        except PromptError as err:
            self.obs, self.to_refill = err.observation, list(err.slots)
            return [b for b in slots if b not in err.slots], err
        return slots, None

    def advance(self) -> tuple[dict, list[int], PromptError | None]:
        """One step of every slot: ``(chunk (B, 1, ...), refilled slots, error of skipped prompts or None)``.

        A prompt that cannot be loaded never loses the step that finished its slot: the step is
        recorded, the error returned, and the slot refilled with the next prompt on the next call.
        """
        if self.tree is not None:
            return self._advance_tree()
        refilled: list[int] = []
        if self.to_refill:
            slots, self.to_refill = self.to_refill, []
            try:
                self.obs = _base(self.env).refill(slots)
            except PromptError as err:
                self.obs, self.to_refill = err.observation, list(err.slots)
                return {}, [b for b in slots if b not in err.slots], err
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
        step = self._keys.chunk(td, nxt, 1)
        step.ended = ended  # the recorder needs no second look at the done flags
        return step, refilled, error

    def _advance_tree(self) -> tuple[dict, list[int], PromptError | None]:
        """One step of every slot, then the tree's forks (from live branches, or ones that ended at this step: their
        tokens are still in their slots), then the slots no tree needs are freed and new trees start there."""
        td = self.policy(self.obs)
        out, obs = self.env.step_and_maybe_reset(td, refill=False)
        nxt = out.get(_NEXT)
        ended = self.env.ended_slots(nxt.get(keys.DONE[1]))
        self.obs, roots, forks, error = self.tree.after_step(out, obs, ended)
        step = self._keys.chunk(td, nxt, 1)
        step.ended = ended
        step.forks = forks
        return step, roots, error

    def restart(self, slots: list[int]) -> None:
        """Start ``slots`` over from their prompts (in-flight work dropped)."""
        self.obs = _base(self.env).restart(slots)

    def finished_slots(self) -> set[int]:
        """Slots holding a finished trajectory until their refill: none, a step refills them at once."""
        return set()

    def state_dict(self) -> dict:
        out = {"obs": None if self.obs is None else self.obs.to_dict(), "to_refill": list(self.to_refill)}
        if self.tree is not None:
            out["tree"] = self.tree.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        obs = state["obs"]
        self.obs = None if obs is None else TensorDict(obs, self.env.batch_size)
        self.to_refill = list(state.get("to_refill", []))
        if self.tree is not None and state.get("tree") is not None:
            self.tree.load_state_dict(state["tree"])


class WaveSource:
    """One wave per call: every live slot's turn, generated by ``policy.generate`` (a :class:`WavePolicy`) and
    unrolled by the env.

    Done slots are refilled at the start of the next wave; a multi-turn slot whose turn continues
    goes on in the next wave with its whole history as context.
    """

    kind = SourceKind.WAVE

    def __init__(self, env, policy: WavePolicy) -> None:
        if not supports_waves(policy):
            raise TypeError(f"source='wave' needs a policy with generate(WaveRequest) -> WaveResult, "
                            f"got {type(policy).__name__}")  # fmt: skip
        if getattr(env, "base_env", env) is not env:
            raise TypeError("source='wave' needs a bare TokenEnv (env transforms run per step); use source='step'")
        self.env, self.policy, self.done = env, policy, None
        self.width: int | None = None  # pad waves to this many steps (a recorder's fixed batch width)
        self.cells = False  # give waves as their real steps (Cells): a recorder of trajectories that go on across waves
        self.last_steps = 0  # env steps of the last wave (without the padding)
        self.last_interrupted = 0  # rows of the last wave the policy did not finish (interrupted by an update)
        self.min_finished: int | None = None  # ask the policy to stop once this many rows ended (over-sampling)
        self.tree = None  # a TreeSampler (branching rollouts): waves paused at planned forks, forks after each

    def start(self) -> tuple[list[int], PromptError | None]:
        self.done = torch.zeros(self.env.batch_size[0], dtype=torch.bool)
        if self.tree is not None:
            _, roots, error = self.tree.start()
            return roots, error
        slots = list(range(self.env.batch_size[0]))
        try:
            self.env.reset()
        except PromptError as err:
            self.done[err.slots] = True
            return [b for b in slots if b not in err.slots], err
        return slots, None

    def advance(self) -> tuple[dict, list[int], PromptError | None]:
        """One wave: ``(chunk (B, T, ...), refilled slots, error of skipped prompts or None)``; the chunk is
        empty when nothing is live. A slot whose prompt fails to load is refilled at the next wave."""
        if self.tree is not None:
            return self._advance_tree()
        refilled = self.done.nonzero().squeeze(-1).tolist()
        if refilled:
            try:
                self.env.refill(refilled)
            except PromptError as err:
                self.done = torch.zeros_like(self.done)
                self.done[err.slots] = True
                return {}, [b for b in refilled if b not in err.slots], err
        request = self.env.wave_request()
        if len(request) == 0:
            self.done = torch.zeros_like(self.done)
            return {}, refilled, None
        if self.min_finished is not None:
            request = dataclasses.replace(request, min_finished=self.min_finished)
        result = self.policy.generate(request)
        self.last_interrupted = 0 if result.finished is None else int((~result.finished).sum())
        if self.cells:
            out, steps, counts = self._cells(request, result)
            self.done = torch.zeros_like(self.done)
            if out:
                live = (counts > 0).nonzero().squeeze(-1)
                done = steps.get(_NEXT).get(keys.DONE[1]).reshape(-1)
                self.done[live] = done[counts.cumsum(0).index_select(0, live) - 1]  # each slot's last step
            return out, refilled, None
        steps = self.env.unroll(request, result, width=self.width)
        self.last_steps = max(int(steps.get(keys.ACTIVE).any(0).sum()), 1) if self.width else steps.shape[1]
        self.done = steps.get(_NEXT).get(keys.DONE[1]).squeeze(-1).any(1)
        return _flat(steps.items(include_nested=True, leaves_only=True)), refilled, None

    def _cells(self, request, result) -> tuple[dict, TensorDict, torch.Tensor]:
        """The wave's real steps (:class:`Cells`), the env's steps and each slot's count; the chunk is empty (``{}``:
        nothing to record) for a wave stopped before its first token (an update landed as it started)."""
        steps, counts = self.env.unroll_cells(request, result)
        if int(counts.sum()) == 0:
            return {}, steps, counts
        self.last_steps = int(counts.max())
        return Cells(_flat(steps.items(include_nested=True, leaves_only=True)), counts), steps, counts

    def _advance_tree(self) -> tuple[dict, list[int], PromptError | None]:
        """One wave of the trees' live branches, each paused at its rule's next fork (a row capped there and left
        unfinished: the env keeps it open, the next wave continues it), then the forks (of paused branches, or of
        ones that ended in the wave: their tokens are still in their slots), the slots freed and new trees started.
        The chunk is the wave's real steps (:class:`Cells`) with the forks made after it (``forks``)."""
        env = self.env
        request = env.wave_request()
        if len(request) == 0:
            return {}, [], None
        slots = request.slots.tolist()
        caps = self.tree.wave_caps(slots, env.observation().get(keys.RESPONSE_LEN)[request.slots].tolist())
        paused = None
        if caps:  # rows capped below their budget stop at the fork: not an env limit, the turn goes on
            cap = torch.tensor([caps.get(b, -1) for b in slots], dtype=torch.int64)
            paused = (cap >= 0) & (cap < request.max_new_tokens)
            budget = torch.where(paused, cap, request.max_new_tokens)
            request = dataclasses.replace(request, max_new_tokens=budget)
        result = self.policy.generate(request)
        self.last_interrupted = 0 if result.finished is None else int((~result.finished).sum())
        if paused is not None:
            paused &= result.lengths >= request.max_new_tokens
            if bool(paused.any()):
                finished = ~paused if result.finished is None else result.finished & ~paused
                result = dataclasses.replace(result, finished=finished)
        out, steps, counts = self._cells(request, result)
        if not out:  # nothing generated: nothing to fork either
            return out, [], None
        _, roots, out.forks, error = self.tree.after_wave(steps, counts)
        return out, roots, error

    def restart(self, slots: list[int]) -> None:
        self.env.restart(slots)

    def finished_slots(self) -> set[int]:
        """Slots whose trajectory ended in the last wave (recorded, not in flight), refilled at the next one (none
        with trees: their slots are freed or forked into after each wave)."""
        return set() if self.done is None else set(self.done.nonzero().squeeze(-1).tolist())

    def state_dict(self) -> dict:
        out = {"done": None if self.done is None else self.done.clone()}
        if self.tree is not None:
            out["tree"] = self.tree.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.done = state["done"]
        if self.tree is not None and state.get("tree") is not None:
            self.tree.load_state_dict(state["tree"])


def _flat(items) -> dict:
    """A wave's steps by flat name, without the ids and ``active`` its ``"next"`` repeats (constant within a step)."""
    return {name: v for k, v in items if (name := flat_name(k)) not in _NEXT_SKIP_FLAT}


def make_source(kind: SourceKind | str | None, env, policy) -> StepSource | WaveSource:
    """The source of ``kind``; ``None`` picks stepping when the policy can step, else waves."""
    if kind is None:
        kind = SourceKind.STEP if supports_steps(policy) else SourceKind.WAVE
    try:
        kind = SourceKind(kind)
    except ValueError:
        raise ValueError(f"source must be one of {[k.value for k in SourceKind]} or None, got {kind!r}") from None
    return StepSource(env, policy) if kind is SourceKind.STEP else WaveSource(env, policy)
