"""Recorders: preallocated storage that turns a stream of steps into batches.

Both recorders take chunks of steps from a step source (a dict of flat keys, TensorDict's
``flatten_keys(".")`` names, each (B, k, ...) for k consecutive steps of the B slots) and give
TensorDict batches with ``keys.MASK`` and provenance filled in. One interface, the :class:`Recorder` protocol.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from tokengym.collectors._packing import F_ACTIVE, F_MASK, Step, chunk_width, flat_name, to_tensordict
from tokengym.collectors._step_chunks import stack_steps
from tokengym.collectors.trajectory_recorder import TrajectoryRecorder

__all__ = ["Recorder", "Step", "StepRecorder", "TrajectoryRecorder", "check_recorder", "flat_name"]


@runtime_checkable
class Recorder(Protocol):
    """What a collector needs of its recorder (built once, with everything it needs; nothing is set on it later).

    - ``write(chunk)``: record a source's chunk (:class:`~tokengym.collectors.sources.Advance`); returns what did not
      fit (a step recorder's next batch starts with it), or ``None`` when it took everything.
    - ``is_full`` / ``num_ready``: whether a batch is complete / how many of its units (steps or trajectories) are.
    - ``peek(partial=False)``: the next batch, left in place (``partial``: whatever is there, at the end of a run);
      ``None`` when there is none. ``commit()``: drop it, it was delivered.
    - ``continues_turns``: whether trajectories go on across waves (then a wave source gives real steps, ``cells``).
    - ``queued_trajectories()`` / ``queued_groups()``: the trajectories and groups recorded and not yet delivered (the
      collector keeps their prompts). ``waiting_groups()`` / ``drop_groups(groups)``: groups waiting for more
      samples, and dropping those that can no longer complete (their prompt failed).
    - ``hold_parts(trajs)``: trajectories that end as parts of a split episode (``TokenEnv.pop_parts``).
    - ``check_draws()``: dynamic sampling's bound, between advances. ``counts()``: its counters.
    - ``state_dict()`` / ``load_state_dict(state)``: resume between batches.
    """

    def write(self, chunk: dict) -> dict | None: ...

    @property
    def is_full(self) -> bool: ...

    @property
    def num_ready(self) -> int: ...

    @property
    def continues_turns(self) -> bool: ...

    def peek(self, *, partial: bool = False) -> TensorDict | None: ...

    def commit(self) -> None: ...

    def queued_trajectories(self) -> list[int]: ...

    def queued_groups(self) -> list[int]: ...

    def waiting_groups(self) -> list[int]: ...

    def drop_groups(self, groups) -> int: ...

    def hold_parts(self, trajs) -> None: ...

    def check_draws(self) -> None: ...

    def counts(self) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


_RECORDER = ("write", "is_full", "num_ready", "continues_turns", "peek", "commit", "queued_trajectories",
             "queued_groups", "waiting_groups", "drop_groups", "hold_parts", "check_draws", "counts", "state_dict",
             "load_state_dict")  # fmt: skip


def check_recorder(recorder) -> None:
    """A ``TypeError`` naming what ``recorder`` lacks of the :class:`Recorder` protocol."""
    missing = [name for name in _RECORDER if not hasattr(recorder, name)]
    if missing:
        raise TypeError(f"a collector's recorder must follow tokengym.collectors.recorders.Recorder; "
                        f"{type(recorder).__name__} lacks {missing}")  # fmt: skip


class StepRecorder:
    """Fixed-step batches (B, T): every slot's next ``T`` steps; a trajectory may span batches.

    Args:
        steps: ``T``, env steps per batch.
    """

    def __init__(self, steps: int) -> None:
        self.steps, self.t = steps, 0
        self.pieces: list[dict] = []  # wave chunks (B, k, ...) as given: concatenated once, at peek
        self.kept: list[Step] = []  # single steps as given: stacked once, at peek (no copy per step)

    def write(self, chunk: dict) -> dict | None:
        """Write the first columns of ``chunk`` (B, k, ...) (or a :class:`Step`) that fit; return the rest."""
        if isinstance(chunk, Step):
            if self.pieces:  # a restored partial batch: go on in its layout
                return self.write({name: v.unsqueeze(1) for name, v in chunk.items()})
            self.kept.append(chunk)
            self.t += 1
            return None
        k = chunk_width(chunk)
        take = min(k, self.steps - self.t)
        if take < k:
            rest = {name: v[:, take:] for name, v in chunk.items()}
            chunk = {name: v[:, :take] for name, v in chunk.items()}
        else:
            rest = None
        self.pieces.append(chunk)
        self.t += take
        return rest

    @property
    def is_full(self) -> bool:
        return self.t == self.steps

    @property
    def num_ready(self) -> int:
        """Env steps of the batch written so far."""
        return self.t

    continues_turns = False  # a step batch cuts trajectories at its width: waves come padded

    def queued_groups(self) -> list[int]:
        return []

    def waiting_groups(self) -> list[int]:
        return []

    def drop_groups(self, groups) -> int:
        return 0

    def hold_parts(self, trajs) -> None:
        raise ValueError(f"trajectories {list(trajs)} end as parts of split episodes, which only mode='trajectories' "
                         "batches carry: collect with mode='trajectories'")  # fmt: skip

    def check_draws(self) -> None:
        return None

    def counts(self) -> dict:
        return {}

    def peek(self, *, partial: bool = False) -> TensorDict | None:
        """The batch (B, T), left here until :meth:`commit`; the mask marks steps of live slots. ``partial``: the
        steps written so far when fewer than ``T`` (a last, shorter batch). ``None`` when there is none."""
        if not (self.is_full or (partial and self.t > 0)):
            return None
        flat = self._steps()
        flat[F_MASK] = flat[F_ACTIVE].clone()
        return to_tensordict(flat, flat[F_MASK].shape)

    def commit(self) -> None:
        """Drop the batch :meth:`peek` gave (it was delivered)."""
        self.t, self.pieces, self.kept = 0, [], []

    def _steps(self) -> dict:
        """The steps written so far by flat name, (B, t, ...) (new tensors)."""
        if self.kept:
            return stack_steps(self.kept)
        return {name: torch.cat([p[name] for p in self.pieces], 1) if len(self.pieces) > 1 else self.pieces[0][name].clone()
                for name in self.pieces[0]}  # fmt: skip

    def queued_trajectories(self) -> list[int]:
        return []

    def state_dict(self) -> dict:
        """The steps written so far (a batch not yet delivered, or a partial one), as plain tensors."""
        if self.t == 0:
            return {"t": 0}
        return {"t": self.t, "steps": self._steps()}  # copies

    def load_state_dict(self, state: dict) -> None:
        self.t, self.pieces, self.kept = 0, [], []
        if state.get("t", 0):
            if "steps" not in state:
                raise ValueError("a StepRecorder resumes only at a batch boundary (checkpoint between batches)")
            self.pieces, self.t = [dict(state["steps"])], int(state["t"])
