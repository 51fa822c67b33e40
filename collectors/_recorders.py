"""Preallocated storage for collected steps: fixed-step batches (B, T) or per-slot trajectories."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys

# ids and ``active`` are constant within a step, so the collected ("next", ...) leaves them out
_NEXT_SKIP = (keys.TRAJ_ID, keys.GROUP_ID, keys.SAMPLE_ID, keys.ACTIVE)
_ROOT_SKIP = (keys.NEXT, keys.RESET, keys.REWARD[1], *keys.DONE_KEYS)  # done flags live under "next"


class StepKeys:
    """Which tensors of a step get recorded: every top-level tensor the policy, the env and its
    transforms wrote (found once, on the first step), so e.g. ``keys.REF_LOG_PROB`` and
    ``("next", "reward_raw")`` from a KL transform inside a ``TransformedEnv`` are kept."""

    def __init__(self) -> None:
        self.root: tuple[str, ...] | None = None
        self.next: tuple[str, ...] = ()

    def flat(self, td, nxt) -> dict:
        """The tensors of one step (B, ...) keyed by flat names (``"next.reward"``): O(1) in length."""
        root = _as_dict(td)
        nxt_dict = _as_dict(nxt)
        if self.root is None:
            self.root = tuple(k for k, v in root.items() if k not in _ROOT_SKIP and isinstance(v, torch.Tensor))
            self.next = tuple(k for k, v in nxt_dict.items() if k not in _NEXT_SKIP and isinstance(v, torch.Tensor))
        out = {k: root[k] for k in self.root}
        out.update({f"next.{k}": nxt_dict[k] for k in self.next})
        return out


def _as_dict(td) -> dict:
    inner = getattr(td, "_tensordict", None)  # a plain TensorDict's dict: skips get()'s key parsing
    return inner if inner is not None else {k: td.get(k) for k in td.keys()}


def to_tensordict(flat: dict, batch_size) -> TensorDict:
    """Nest dotted names back into keys: ``"next.reward"`` -> ``("next", "reward")``."""
    out = TensorDict({}, batch_size)
    for name, value in flat.items():
        out.set(tuple(name.split(".")) if "." in name else name, value)
    return out


class _Packer:
    """Packs a step's tensors into one tensor per dtype, so a step is written with a few copies."""

    def __init__(self, flat: dict, lead: int) -> None:
        self.groups: dict[torch.dtype, list[tuple[str, tuple]]] = {}
        for name, v in flat.items():
            self.groups.setdefault(v.dtype, []).append((name, tuple(v.shape[lead:])))

    def pack(self, flat: dict, lead: tuple) -> dict[torch.dtype, torch.Tensor]:
        return {
            dtype: torch.cat([flat[name].reshape(*lead, -1) for name, _ in names], dim=-1)
            for dtype, names in self.groups.items()
        }

    def unpack(self, packed: dict[torch.dtype, torch.Tensor]) -> dict:
        out = {}
        for dtype, names in self.groups.items():
            offset, data = 0, packed[dtype]
            for name, trailing in names:
                width = 1
                for d in trailing:
                    width *= d
                out[name] = data[..., offset : offset + width].reshape(*data.shape[:-1], *trailing)
                offset += width
        return out


class StepRecorder:
    """Fills (B, T) buffers one step (or one chunk of steps) at a time."""

    def __init__(self, steps: int) -> None:
        self.steps, self.t, self.buf, self._packer = steps, 0, None, None

    def write(self, flat: dict) -> None:
        """Write a chunk of steps: each tensor is (B, k, ...) with k <= free columns."""
        first = next(iter(flat.values()))
        B, k = first.shape[:2]
        if self.buf is None:
            self._packer = _Packer(flat, lead=2)
            self.buf = {dt: v.new_empty(B, self.steps, v.shape[-1]) for dt, v in self._packer.pack(flat, (B, k)).items()}
        for dtype, v in self._packer.pack(flat, (B, k)).items():
            self.buf[dtype][:, self.t : self.t + k] = v
        self.t += k

    @property
    def free(self) -> int:
        return self.steps - self.t

    def truncate(self) -> None:
        """Keep only the columns written so far (a last, shorter batch)."""
        self.steps = self.t
        self.buf = {dt: v[:, : self.t] for dt, v in self.buf.items()}

    def pop(self) -> dict:
        out = {name: v.clone() for name, v in self._packer.unpack(self.buf).items()}  # own storage per key
        self.buf, self.t = None, 0
        return out


class TrajectoryRecorder:
    """Keeps each slot's current trajectory in (B, T_max) rows; finished ones are copied out once."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps, self.buf = max_steps, None
        self.finished: list[tuple[dict, int]] = []  # (row tensors (T_max, ...), length)

    def write(self, flat: dict) -> None:
        """Write one step (B, ...) at each active slot's response position; copy out finished rows."""
        if self.buf is None:
            self.buf = {k: v.new_zeros(v.shape[0], self.max_steps, *v.shape[1:]) for k, v in flat.items()}
        rows = flat[keys.ACTIVE].nonzero().squeeze(-1)
        if len(rows) == 0:
            return
        cols = flat[keys.RESPONSE_LEN][rows]
        for name, v in flat.items():
            self.buf[name][rows, cols] = v[rows]
        done = flat["next.done"].reshape(-1)[rows]
        for b, n in zip(rows[done].tolist(), (cols[done] + 1).tolist(), strict=True):
            row = {k: v[b, :n].clone() for k, v in self.buf.items()}  # steps past n hold an older trajectory
            self.finished.append((row, n))

    def write_rows(self, flat: dict) -> None:
        """Add whole trajectories (rows of (B, T, ...)), e.g. a generate-then-unroll wave."""
        lengths = flat[keys.ACTIVE].sum(1)
        for b in (lengths > 0).nonzero().squeeze(-1).tolist():
            n = int(lengths[b])
            self.finished.append(({k: v[b, :n] for k, v in flat.items()}, n))

    def pop(self, n: int) -> dict:
        """Right-padded (n, T) tensors of the first ``n`` finished trajectories, plus the mask."""
        take, self.finished = self.finished[:n], self.finished[n:]
        width = max(length for _, length in take)
        out = {}
        for name in take[0][0]:
            rows = [row[name][:width] for row, _ in take]
            padded = [torch.cat([r, r.new_zeros(width - len(r), *r.shape[1:])]) if len(r) < width else r for r in rows]
            out[name] = torch.stack(padded)
        lengths = torch.tensor([length for _, length in take])
        out["collector.mask"] = torch.arange(width)[None, :] < lengths[:, None]
        return out

    def state_dict(self) -> dict:
        return {"buf": None if self.buf is None else {k: v.clone() for k, v in self.buf.items()},
                "finished": list(self.finished)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.buf, self.finished = state["buf"], list(state["finished"])
