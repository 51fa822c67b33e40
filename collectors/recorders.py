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

    def unpack(self, packed: dict[torch.dtype, torch.Tensor], *, clone: bool = True) -> dict:
        """Flat names to tensors (copies, or views of ``packed`` with ``clone=False``)."""
        out = {}
        for dtype, names in self.groups.items():
            offset, data = 0, packed[dtype]
            for name, trailing in names:
                width = 1
                for d in trailing:
                    width *= d
                v = data[..., offset : offset + width].reshape(*data.shape[:-1], *trailing)
                out[name] = v.clone() if clone else v
                offset += width
        return out


class StepRecorder:
    """Fixed-step batches (B, T): every slot's next ``T`` steps; a trajectory may span batches.

    Args:
        steps: ``T``, env steps per batch.
    """

    def __init__(self, steps: int) -> None:
        self.steps, self.t, self.buf, self._packer = steps, 0, None, None
        self.pieces: list[dict] = []  # wave chunks (B, k, ...) as given: concatenated once, at pop

    def write(self, chunk: dict) -> dict | None:
        """Write the first columns of ``chunk`` (B, k, ...) (or a :class:`Step`) that fit; return the rest."""
        if isinstance(chunk, Step):
            if self.buf is None:
                self._packer = _Packer(chunk)
                B = next(iter(chunk.values())).shape[0]
                self.buf = {dt: v.new_empty(B, self.steps, v.shape[-1]) for dt, v in self._packer.pack(chunk).items()}
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
        self.pieces.append(chunk)
        self.t += take
        return rest

    @property
    def is_full(self) -> bool:
        return self.t == self.steps

    def pop(self) -> TensorDict:
        """The batch (B, T); the mask marks steps of live slots."""
        if self.pieces:
            flat = {name: torch.cat([p[name] for p in self.pieces], 1) if len(self.pieces) > 1 else self.pieces[0][name].clone()
                    for name in self.pieces[0]}  # fmt: skip
        else:
            buf = self.buf if self.t == self.steps else {dt: v[:, : self.t] for dt, v in self.buf.items()}
            flat = self._packer.unpack(buf)
        flat[_MASK] = flat[_ACTIVE].clone()
        self.buf, self.t, self.pieces = None, 0, []
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
        self.buf, self.t, self.pieces = None, 0, []


class _Segment:
    """Rows of finished trajectories, kept as they came (a wave's own tensors, or rows copied out of
    the live-slot buffer): flat names to (n, W, ...) tensors. A batch gathers its rows once, at pop."""

    __slots__ = ("tensors", "seq")

    def __init__(self, tensors: dict, seq: int) -> None:
        self.tensors, self.seq = tensors, seq


class TrajectoryRecorder:
    """Finished trajectories, right-padded to (N, T), released by whole groups.

    A finished trajectory is a reference (segment, row, length): a wave's rows that hold whole
    trajectories are kept as the wave gave them (no copy), and a trajectory built step by step (the
    step source, or a multi-turn turn that continues in the next wave) lives in packed (B, T_max)
    rows until it ends, then is copied out once. Finished trajectories wait per group until the
    group's ``group_size`` samples are in; complete groups are released in the order they completed,
    and a batch's tensors are gathered once, in :meth:`pop`. Waiting is bounded: every waiting group
    has a sample in a slot or in the prompt source (a group whose prompt failed is dropped with
    :meth:`drop_groups`), so at most ``(B + 1) * (group_size - 1)`` trajectories wait.

    Args:
        batch_size: ``N``, trajectories per batch (a multiple of ``group_size``).
        max_steps: the longest trajectory (the env's ``max_new_tokens``).
        group_size: samples per group; 1 releases every trajectory at once.
        is_fixed_width: pad every batch to ``max_steps`` (batches then stack in a replay buffer).
    """

    def __init__(self, batch_size: int, max_steps: int, *, group_size: int = 1, is_fixed_width: bool = True) -> None:
        if batch_size % group_size:
            raise ValueError(f"batch_size={batch_size} is not a multiple of group_size={group_size}")
        self.batch_size, self.max_steps, self.is_fixed_width = batch_size, max_steps, is_fixed_width
        self.group_size = group_size
        self.buf: dict | None = None  # dtype -> (B, T_max, n): trajectories written step by step
        self._packer: _Packer | None = None
        self.ready: list[tuple] = []  # (segment, row, length, group, traj) of complete groups
        self.waiting: dict[int, list[tuple]] = {}  # group -> its finished trajectories so far
        self._seq = 0
        self.counters = {"dropped_groups": 0, "dropped_trajectories": 0}

    # -- writing --
    def write(self, chunk: dict) -> None:
        """Record k steps (B, k, ...) (or a :class:`Step`); trajectories that end are queued by group."""
        if isinstance(chunk, Step):
            self._write_steps(chunk)
            return None
        active = chunk[_ACTIVE]  # (B, k)
        done = chunk[_DONE].reshape(active.shape) & active
        ends = done.any(1)
        whole = ends & active[:, 0] & (chunk[_RESP][:, 0] == 0)  # the wave holds the whole trajectory
        rest = active[:, 0] & ~whole
        if bool(rest.any()):
            self._write_steps(chunk, rows=rest.nonzero().squeeze(-1))
        if bool(whole.any()):
            rows = whole.nonzero().squeeze(-1)
            lengths = done[rows].int().argmax(1) + 1
            self._finish(_Segment(chunk, self._next_seq()), rows, lengths, chunk[_GROUP][rows, 0], chunk[_TRAJ][rows, 0])
        return None

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _write_steps(self, chunk: dict, rows: torch.Tensor | None = None) -> None:
        """Write live steps into the (B, T_max) rows at their response positions; copy out rows that end."""
        if self._packer is None:
            self._packer = _Packer(chunk)
        if isinstance(chunk, Step):
            packed = self._packer.pack(chunk)
            if self.buf is None:
                self.buf = {dt: v.new_zeros(v.shape[0], self.max_steps, v.shape[-1]) for dt, v in packed.items()}
            rows = chunk[_ACTIVE].nonzero().squeeze(-1)
            pos = chunk[_RESP][rows]
            for dt, v in packed.items():
                self.buf[dt][rows, pos] = v[rows]
            done = chunk[_DONE].reshape(-1)[rows]
        else:
            part = {name: v[rows] for name, v in chunk.items()}
            packed = self._packer.pack(part)
            if self.buf is None:
                B = chunk[_ACTIVE].shape[0]
                self.buf = {dt: v.new_zeros(B, self.max_steps, v.shape[-1]) for dt, v in packed.items()}
            r, cols = part[_ACTIVE].nonzero(as_tuple=True)
            pos = part[_RESP][r, cols]
            for dt, v in packed.items():
                self.buf[dt][rows[r], pos] = v[r, cols]
            done = part[_DONE].reshape(part[_ACTIVE].shape)[r, cols]
            rows = rows[r]
        if bool(done.any()):
            ended, lengths = rows[done], pos[done] + 1
            copies = {dt: v[ended] for dt, v in self.buf.items()}  # one copy per dtype for all ended rows
            seg = _Segment(self._packer.unpack(copies, clone=False), self._next_seq())
            g_dt, g_col = self._packer.column(_GROUP)
            t_dt, t_col = self._packer.column(_TRAJ)
            self._finish(seg, torch.arange(len(ended)), lengths, copies[g_dt][:, 0, g_col], copies[t_dt][:, 0, t_col])

    def _finish(self, seg: _Segment, rows, lengths, groups, trajs) -> None:
        for entry in zip([seg] * len(rows), rows.tolist(), lengths.tolist(), groups.tolist(), trajs.tolist(), strict=True):
            self._queue(entry)

    def _queue(self, entry: tuple) -> None:
        if self.group_size == 1:
            self.ready.append(entry)
            return
        members = self.waiting.setdefault(entry[3], [])
        members.append(entry)
        if len(members) == self.group_size:
            self.ready.extend(self.waiting.pop(entry[3]))

    def drop_groups(self, groups) -> int:
        """Drop the waiting trajectories of ``groups`` (groups that can no longer complete); returns how many."""
        n = 0
        for g in groups:
            members = self.waiting.pop(int(g), None)
            if members:
                n += len(members)
                self.counters["dropped_groups"] += 1
                self.counters["dropped_trajectories"] += len(members)
        return n

    # -- reading --
    @property
    def is_full(self) -> bool:
        return len(self.ready) >= self.batch_size

    @property
    def num_waiting(self) -> int:
        """Finished trajectories waiting for the rest of their group."""
        return sum(len(m) for m in self.waiting.values())

    def pop(self, n: int | None = None) -> TensorDict:
        """Right-padded (n, T) tensors of the first ``n`` ready trajectories, with mask and versions."""
        n = self.batch_size if n is None else n
        take, self.ready = self.ready[:n], self.ready[n:]
        take.sort(key=lambda e: (e[0].seq, e[1]))  # one gather per segment, in an order a resume reproduces
        lengths = torch.tensor([e[2] for e in take])
        width = self.max_steps if self.is_fixed_width else int(lengths.max())
        out = _gather(take, width)
        mask = torch.arange(width)[None, :] < lengths[:, None]
        for v in out.values():
            v.masked_fill_(~mask.reshape(*mask.shape, *([1] * (v.dim() - 2))), 0)  # padding is zeros
        out[_MASK] = mask
        version, last = out[_VERSION], (lengths - 1)[:, None]
        out[flat_name(keys.VERSION_START)] = version[:, :1].expand_as(version).clone()
        out[flat_name(keys.VERSION_END)] = version.gather(1, last).expand_as(version).clone()
        return _to_tensordict(out, mask.shape)

    def flush(self) -> TensorDict | None:
        """The ready trajectories (fewer than a batch), or ``None``; unfinished groups keep waiting."""
        return self.pop(len(self.ready)) if self.ready else None

    def queued_trajectories(self) -> list[int]:
        """Trajectory ids finished but not yet popped."""
        return [e[4] for e in self._entries()]

    def queued_groups(self) -> list[int]:
        return [e[3] for e in self._entries()]

    def _entries(self) -> list[tuple]:
        return self.ready + [e for members in self.waiting.values() for e in members]

    # -- checkpoints --
    def state_dict(self) -> dict:
        """Plain data per key (TensorDict's flat names), so checkpoints do not depend on the packing:
        the live rows, and every queued trajectory's rows compacted into one segment per segment."""
        entries = self._entries()
        segs: dict[int, list] = {}
        for e in sorted(entries, key=lambda e: (e[0].seq, e[1])):
            segs.setdefault(e[0].seq, [e[0], []])[1].append(e[1])
        saved, where = [], {}
        for seq, (seg, rows) in segs.items():
            index = torch.tensor(rows)
            saved.append({name: v[index].clone() for name, v in seg.tensors.items()})
            for i, r in enumerate(rows):
                where[(seq, r)] = (len(saved) - 1, i)
        as_data = [[*where[(e[0].seq, e[1])], e[2], e[3], e[4]] for e in entries]
        return {"buf": None if self.buf is None else self._packer.unpack(self.buf), "segments": saved,
                "entries": as_data, "num_ready": len(self.ready), "counters": dict(self.counters)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.buf, self._packer = None, None
        if state["buf"] is not None:
            self._packer = _Packer(state["buf"])  # (B, T_max, ...) per key
            self.buf = self._packer.pack(state["buf"])
        segs = [_Segment(tensors, i + 1) for i, tensors in enumerate(state["segments"])]
        self._seq = len(segs)
        entries = [(segs[s], r, n, g, t) for s, r, n, g, t in state["entries"]]
        self.ready, self.waiting = entries[: state["num_ready"]], {}
        for e in entries[state["num_ready"] :]:
            self.waiting.setdefault(e[3], []).append(e)
        self.counters.update(state.get("counters", {}))


def _gather(take: list[tuple], width: int) -> dict:
    """Per key, the rows of ``take`` (sorted by segment) cut or zero-padded to ``width``: one gather per segment."""
    parts: list[tuple[_Segment, torch.Tensor]] = []
    i = 0
    while i < len(take):
        j = i
        while j < len(take) and take[j][0] is take[i][0]:
            j += 1
        parts.append((take[i][0], torch.tensor([e[1] for e in take[i:j]])))
        i = j
    out = {}
    for name, first in parts[0][0].tensors.items():
        if len(parts) == 1 and first.shape[1] >= width:
            out[name] = first[:, :width].index_select(0, parts[0][1])
            continue
        v = first.new_zeros(len(take), width, *first.shape[2:])
        offset = 0
        for seg, rows in parts:
            src = seg.tensors[name][:, :width]
            v[offset : offset + len(rows), : src.shape[1]] = src.index_select(0, rows)
            offset += len(rows)
        out[name] = v
    return out
