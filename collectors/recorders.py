"""Recorders: preallocated storage that turns a stream of steps into batches.

Both recorders take chunks of steps from a step source (a dict of flat keys, TensorDict's
``flatten_keys(".")`` names, each (B, k, ...) for k consecutive steps of the B slots) and give
TensorDict batches with ``keys.MASK`` and provenance filled in. One interface:
``write(chunk) -> leftover``, ``is_full``, ``peek()`` (the next batch, left in place) and ``commit()`` (drop it:
it was delivered), ``queued_trajectories()``, ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tokengym.collectors._packing import F_ACTIVE, F_MASK, Step, chunk_width, flat_name, to_tensordict
from tokengym.collectors._step_chunks import stack_steps
from tokengym.collectors.trajectory_recorder import TrajectoryRecorder

__all__ = ["Step", "StepRecorder", "TrajectoryRecorder", "flat_name"]


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
