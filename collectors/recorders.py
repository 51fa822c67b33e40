"""Recorders: preallocated storage that turns a stream of steps into batches.

Both recorders take chunks of steps from a step source (a dict of flat keys, TensorDict's
``flatten_keys(".")`` names, each (B, k, ...) for k consecutive steps of the B slots) and give
TensorDict batches with ``keys.MASK`` and provenance filled in. One interface:
``write(chunk) -> leftover``, ``is_full``, ``pop()``, ``flush()``, ``queued_trajectories()``,
``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys

__all__ = ["StepRecorder", "TrajectoryRecorder", "flat_name"]


def flat_name(key) -> str:
    """The flat name of a (possibly nested) key, as ``TensorDict.flatten_keys(".")`` writes it."""
    return ".".join(key) if isinstance(key, tuple) else key


_MASK, _ACTIVE, _DONE, _RESP = flat_name(keys.MASK), keys.ACTIVE, flat_name(keys.DONE), keys.RESPONSE_LEN
_VERSION, _TRAJ, _GROUP = keys.POLICY_VERSION, keys.TRAJ_ID, keys.GROUP_ID


def _to_tensordict(flat: dict, batch_size) -> TensorDict:
    return TensorDict(flat, batch_size).unflatten_keys(".")


def _width(chunk: dict) -> int:
    return next(iter(chunk.values())).shape[1]


class _Packer:
    """Packs a step's tensors into one tensor per dtype, so a chunk is written with a few copies."""

    def __init__(self, flat: dict) -> None:
        self.groups: dict[torch.dtype, list[tuple[str, tuple]]] = {}
        for name, v in flat.items():
            self.groups.setdefault(v.dtype, []).append((name, tuple(v.shape[2:])))

    def pack(self, flat: dict) -> dict[torch.dtype, torch.Tensor]:
        lead = next(iter(flat.values())).shape[:2]
        return {dtype: torch.cat([flat[name].reshape(*lead, -1) for name, _ in names], dim=-1)
                for dtype, names in self.groups.items()}  # fmt: skip

    def unpack(self, packed: dict[torch.dtype, torch.Tensor]) -> dict:
        out = {}
        for dtype, names in self.groups.items():
            offset, data = 0, packed[dtype]
            for name, trailing in names:
                width = 1
                for d in trailing:
                    width *= d
                out[name] = data[..., offset : offset + width].reshape(*data.shape[:-1], *trailing).clone()
                offset += width
        return out


class StepRecorder:
    """Fixed-step batches (B, T): every slot's next ``T`` steps; a trajectory may span batches.

    Args:
        steps: ``T``, env steps per batch.
    """

    def __init__(self, steps: int) -> None:
        self.steps, self.t, self.buf, self._packer = steps, 0, None, None

    def write(self, chunk: dict) -> dict | None:
        """Write the first columns of ``chunk`` (B, k, ...) that fit; return the rest (or ``None``)."""
        k = _width(chunk)
        take = min(k, self.steps - self.t)
        if take < k:
            rest = {name: v[:, take:] for name, v in chunk.items()}
            chunk = {name: v[:, :take] for name, v in chunk.items()}
        else:
            rest = None
        if self.buf is None:
            self._packer = _Packer(chunk)
            B = next(iter(chunk.values())).shape[0]
            self.buf = {dt: v.new_empty(B, self.steps, v.shape[-1]) for dt, v in self._packer.pack(chunk).items()}
        for dtype, v in self._packer.pack(chunk).items():
            self.buf[dtype][:, self.t : self.t + take] = v
        self.t += take
        return rest

    @property
    def is_full(self) -> bool:
        return self.t == self.steps

    def pop(self) -> TensorDict:
        """The batch (B, T); the mask marks steps of live slots."""
        buf = self.buf if self.t == self.steps else {dt: v[:, : self.t] for dt, v in self.buf.items()}
        flat = self._packer.unpack(buf)
        flat[_MASK] = flat[_ACTIVE].clone()
        self.buf, self.t = None, 0
        return _to_tensordict(flat, flat[_MASK].shape)

    def flush(self) -> TensorDict | None:
        """A last, shorter batch of the steps written so far, or ``None``."""
        return self.pop() if self.t > 0 else None

    def queued_trajectories(self) -> list[int]:
        return []

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, state: dict) -> None:
        if state.get("t", 0):
            raise ValueError("a StepRecorder resumes only at a batch boundary (checkpoint between batches)")
        self.buf, self.t = None, 0


class TrajectoryRecorder:
    """Finished trajectories, right-padded to (N, T); each slot's live trajectory is kept in (B, T_max) rows.

    Args:
        batch_size: ``N``, trajectories per batch.
        max_steps: the longest trajectory (the env's ``max_new_tokens``).
        is_fixed_width: pad every batch to ``max_steps`` (batches then stack in a replay buffer).
    """

    def __init__(self, batch_size: int, max_steps: int, *, is_fixed_width: bool = False) -> None:
        self.batch_size, self.max_steps, self.is_fixed_width = batch_size, max_steps, is_fixed_width
        self.buf: dict | None = None
        self.finished: list[tuple[dict, int]] = []  # (row tensors (T_max, ...), length)

    def write(self, chunk: dict) -> None:
        """Write k steps (B, k, ...) at each live slot's response position; copy out finished rows."""
        if self.buf is None:
            self.buf = {name: v.new_zeros(v.shape[0], self.max_steps, *v.shape[2:]) for name, v in chunk.items()}
        live = chunk[_ACTIVE]  # (B, k)
        if not bool(live.any()):
            return None
        rows, cols = live.nonzero(as_tuple=True)
        pos = chunk[_RESP][rows, cols]  # response position of each live step
        for name, v in chunk.items():
            self.buf[name][rows, pos] = v[rows, cols]
        done = chunk[_DONE].reshape(live.shape)[rows, cols]
        for b, n in zip(rows[done].tolist(), (pos[done] + 1).tolist(), strict=True):
            row = {name: v[b, :n].clone() for name, v in self.buf.items()}  # steps past n hold an older trajectory
            self.finished.append((row, n))
        return None

    @property
    def is_full(self) -> bool:
        return len(self.finished) >= self.batch_size

    def pop(self, n: int | None = None) -> TensorDict:
        """Right-padded (n, T) tensors of the first ``n`` finished trajectories, with mask and versions."""
        n = self.batch_size if n is None else n
        take, self.finished = self.finished[:n], self.finished[n:]
        width = self.max_steps if self.is_fixed_width else max(length for _, length in take)
        out = {}
        for name in take[0][0]:
            rows = [row[name][:width] for row, _ in take]
            padded = [torch.cat([r, r.new_zeros(width - len(r), *r.shape[1:])]) if len(r) < width else r for r in rows]
            out[name] = torch.stack(padded)
        lengths = torch.tensor([length for _, length in take])
        out[_MASK] = torch.arange(width)[None, :] < lengths[:, None]
        version, last = out[_VERSION], (lengths - 1)[:, None]
        out[flat_name(keys.VERSION_START)] = version[:, :1].expand_as(version).clone()
        out[flat_name(keys.VERSION_END)] = version.gather(1, last).expand_as(version).clone()
        return _to_tensordict(out, out[_MASK].shape)

    def flush(self) -> TensorDict | None:
        return self.pop(len(self.finished)) if self.finished else None

    def queued_trajectories(self) -> list[int]:
        """Trajectory ids finished but not yet popped."""
        return [int(row[_TRAJ][0]) for row, _ in self.finished]

    def queued_groups(self) -> list[int]:
        return [int(row[_GROUP][0]) for row, _ in self.finished]

    def state_dict(self) -> dict:
        return {"buf": None if self.buf is None else {k: v.clone() for k, v in self.buf.items()},
                "finished": [({k: v.clone() for k, v in row.items()}, n) for row, n in self.finished]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.buf = state["buf"]
        self.finished = [(dict(row), int(n)) for row, n in state["finished"]]
