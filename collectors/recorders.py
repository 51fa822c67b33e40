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
from torch.nn.utils.rnn import pad_sequence

from tokengym.llm_envs import keys

__all__ = ["Step", "StepRecorder", "TrajectoryRecorder", "flat_name"]


def flat_name(key) -> str:
    """The flat name of a (possibly nested) key, as ``TensorDict.flatten_keys(".")`` writes it."""
    return ".".join(key) if isinstance(key, tuple) else key


_MASK, _ACTIVE, _DONE, _RESP = flat_name(keys.MASK), keys.ACTIVE, flat_name(keys.DONE), keys.RESPONSE_LEN
_VERSION, _TRAJ, _GROUP = keys.POLICY_VERSION, keys.TRAJ_ID, keys.GROUP_ID


def _to_tensordict(flat: dict, batch_size) -> TensorDict:
    return TensorDict(flat, batch_size).unflatten_keys(".")


class Step(dict):
    """One env step of every slot: flat names to (B, ...) tensors (a chunk of width 1 without the
    (B, 1, ...) views, so a step source hands its tensors over as they are)."""


def _width(chunk: dict) -> int:
    return 1 if isinstance(chunk, Step) else next(iter(chunk.values())).shape[1]


class _Packer:
    """Packs a step's tensors into one tensor per dtype, so a chunk is written with a few copies."""

    def __init__(self, flat: dict) -> None:
        lead = 1 if isinstance(flat, Step) else 2
        self.groups: dict[torch.dtype, list[tuple[str, tuple]]] = {}
        for name, v in flat.items():
            self.groups.setdefault(v.dtype, []).append((name, tuple(v.shape[lead:])))
        # a step packs with one column_stack per dtype when every tensor is (B,) or (B, n)
        self.is_flat = all(len(trailing) <= 1 for names in self.groups.values() for _, trailing in names)

    def pack(self, flat: dict, lead: int | None = None) -> dict[torch.dtype, torch.Tensor]:
        """One tensor per dtype: (B, n) for a :class:`Step`, (B, k, n) for a chunk (``lead`` leading dims)."""
        if isinstance(flat, Step) and self.is_flat:
            return {dtype: torch.column_stack([flat[name] for name, _ in names]) for dtype, names in self.groups.items()}
        lead = next(iter(flat.values())).shape[: lead or (1 if isinstance(flat, Step) else 2)]
        return {dtype: torch.cat([flat[name].reshape(*lead, -1) for name, _ in names], dim=-1)
                for dtype, names in self.groups.items()}  # fmt: skip

    def column(self, name: str) -> tuple[torch.dtype, int]:
        """Where a (B,)-shaped key lives in the packed tensors: (dtype, column)."""
        for dtype, names in self.groups.items():
            offset = 0
            for other, trailing in names:
                if other == name:
                    return dtype, offset
                offset += int(torch.Size(trailing).numel())
        raise KeyError(name)

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
        """Write the first columns of ``chunk`` (B, k, ...) (or a :class:`Step`) that fit; return the rest."""
        if self.buf is None:
            self._packer = _Packer(chunk)
            B = next(iter(chunk.values())).shape[0]
            self.buf = {dt: v.new_empty(B, self.steps, v.shape[-1]) for dt, v in self._packer.pack(chunk).items()}
        if isinstance(chunk, Step):
            for dtype, v in self._packer.pack(chunk).items():
                self.buf[dtype][:, self.t] = v
            self.t += 1
            return None
        k = _width(chunk)
        take = min(k, self.steps - self.t)
        if take < k:
            rest = {name: v[:, take:] for name, v in chunk.items()}
            chunk = {name: v[:, :take] for name, v in chunk.items()}
        else:
            rest = None
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

    Steps are stored packed, one tensor per dtype (B, T_max, n), so a step is written with a few
    copies and a finished trajectory is copied out with one clone per dtype.

    Args:
        batch_size: ``N``, trajectories per batch.
        max_steps: the longest trajectory (the env's ``max_new_tokens``).
        is_fixed_width: pad every batch to ``max_steps`` (batches then stack in a replay buffer).
    """

    def __init__(self, batch_size: int, max_steps: int, *, is_fixed_width: bool = False) -> None:
        self.batch_size, self.max_steps, self.is_fixed_width = batch_size, max_steps, is_fixed_width
        self.buf: dict | None = None  # dtype -> (B, T_max, n)
        self._packer: _Packer | None = None
        self.finished: list[tuple[dict, int]] = []  # (packed rows {dtype: (length, n)}, length)

    def write(self, chunk: dict) -> None:
        """Write k steps (B, k, ...) (or a :class:`Step`) at each live slot's response position; copy out
        finished rows."""
        if self._packer is None:
            self._packer = _Packer(chunk)
        packed = self._packer.pack(chunk)
        if self.buf is None:
            self.buf = {dt: v.new_zeros(v.shape[0], self.max_steps, v.shape[-1]) for dt, v in packed.items()}
        live = chunk[_ACTIVE]  # (B,) or (B, k)
        if isinstance(chunk, Step):
            rows = live.nonzero().squeeze(-1)
            pos = chunk[_RESP][rows]  # response position of each live step
            for dt, v in packed.items():
                self.buf[dt][rows, pos] = v[rows]
            done = chunk[_DONE].reshape(-1)[rows]
        else:
            rows, cols = live.nonzero(as_tuple=True)
            pos = chunk[_RESP][rows, cols]
            for dt, v in packed.items():
                self.buf[dt][rows, pos] = v[rows, cols]
            done = chunk[_DONE].reshape(live.shape)[rows, cols]
        if bool(done.any()):
            ended = rows[done]
            copies = {dt: v[ended] for dt, v in self.buf.items()}  # one copy per dtype for all finished rows
            for i, n in enumerate((pos[done] + 1).tolist()):
                # views of the copies; steps past n hold an older trajectory of the slot
                self.finished.append(({dt: v[i, :n] for dt, v in copies.items()}, n))
        return None

    @property
    def is_full(self) -> bool:
        return len(self.finished) >= self.batch_size

    def pop(self, n: int | None = None) -> TensorDict:
        """Right-padded (n, T) tensors of the first ``n`` finished trajectories, with mask and versions."""
        n = self.batch_size if n is None else n
        take, self.finished = self.finished[:n], self.finished[n:]
        lengths = torch.tensor([length for _, length in take])
        width = self.max_steps if self.is_fixed_width else int(lengths.max())
        packed = {}
        for dt in take[0][0]:
            rows = pad_sequence([row[dt] for row, _ in take], batch_first=True)  # (n, longest, cols), zeros
            packed[dt] = torch.nn.functional.pad(rows, (0, 0, 0, width - rows.shape[1])) if rows.shape[1] < width else rows
        out = self._packer.unpack(packed)
        out[_MASK] = torch.arange(width)[None, :] < lengths[:, None]
        version, last = out[_VERSION], (lengths - 1)[:, None]
        out[flat_name(keys.VERSION_START)] = version[:, :1].expand_as(version).clone()
        out[flat_name(keys.VERSION_END)] = version.gather(1, last).expand_as(version).clone()
        return _to_tensordict(out, out[_MASK].shape)

    def flush(self) -> TensorDict | None:
        return self.pop(len(self.finished)) if self.finished else None

    def _queued(self, name: str) -> list[int]:
        if not self.finished:
            return []
        dt, col = self._packer.column(name)
        return [int(row[dt][0, col]) for row, _ in self.finished]

    def queued_trajectories(self) -> list[int]:
        """Trajectory ids finished but not yet popped."""
        return self._queued(_TRAJ)

    def queued_groups(self) -> list[int]:
        return self._queued(_GROUP)

    def state_dict(self) -> dict:
        """Per key (as TensorDict's flat names), so checkpoints do not depend on the packing."""
        if self.buf is None:
            return {"buf": None, "finished": []}
        return {"buf": self._packer.unpack(self.buf),
                "finished": [(self._packer.unpack(row), n) for row, n in self.finished]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if state["buf"] is None:
            self.buf, self._packer, self.finished = None, None, []
            return
        self._packer = _Packer(state["buf"])  # (B, T_max, ...) per key
        self.buf = self._packer.pack(state["buf"])
        self.finished = [(self._packer.pack(row, lead=1), int(n)) for row, n in state["finished"]]
