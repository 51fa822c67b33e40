"""The packed row store of a trajectory recorder: trajectories written step by step (the step source), one row each,
in one (R, T_max, n) tensor per dtype."""

from __future__ import annotations

import torch

from tokengym.collectors._packing import F_ACTIVE, F_DONE, F_GROUP, F_RESP, F_TRAJ, Packer, Step
from tokengym.collectors._segments import Segment
from tokengym.collectors._step_chunks import segment_rows
from tokengym.llm_envs import keys

__all__ = ["RowStore"]


class RowStore:
    """Rows of trajectories written step by step: each slot writes into its row; a trajectory that ends keeps its row
    (queued by reference, freed with :meth:`release` once delivered or dropped) and its slot moves on to a free row.
    The store grows when every row is taken (bounded: live slots plus waiting trajectories).

    ``segment`` is the store as the recorder's entries point at it (``None`` until the first chunk or a checkpoint's
    live rows), ``packer`` how a step packs into it, ``row_of_slot`` (B,) the row each slot writes into, ``free``
    the rows no trajectory holds (taken from the front).
    """

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.segment: Segment | None = None
        self.packer: Packer | None = None
        self.row_of_slot: torch.Tensor | None = None
        self.free: list[int] = []
        self.id_columns: tuple | None = None  # where group, trajectory and sample ids are: (dtype, column) x 3

    def write(self, chunk: dict) -> tuple | None:
        """Write consecutive steps (B, k, ...): a slot may end a trajectory and start the next within them (the next
        goes to a free row). Returns the finished trajectories ``(rows, lengths, groups, trajs, samples)`` in the
        order stepping finished them, or ``None``."""
        active = chunk[F_ACTIVE]  # (B, k)
        done = chunk[F_DONE].reshape(active.shape) & active
        cell, packed = self._pack_cells(chunk, active)
        n_ended = int(done.sum())
        new_rows = self._take_rows(n_ended) if n_ended else torch.zeros(0, dtype=torch.int64)
        cell_rows, e_slots, e_steps, e_rows, self.row_of_slot = segment_rows(done, self.row_of_slot, new_rows)
        pos = chunk[F_RESP].reshape(-1).index_select(0, cell).clamp(max=self.max_steps - 1)
        dst = cell_rows.reshape(-1).index_select(0, cell) * self.max_steps + pos  # (store row, position), flat
        for dt, v in packed.items():  # one index_copy_ per dtype
            self.segment.tensors[dt].view(-1, v.shape[-1]).index_copy_(0, dst, v)
        if not n_ended:
            return None
        lengths = chunk[F_RESP][e_slots, e_steps].clamp(max=self.max_steps - 1) + 1
        return (e_rows, lengths, *self._ids(e_rows, lengths))

    def _pack_cells(self, chunk: dict, sel: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The cells ``sel`` (B, k) of ``chunk`` as flat indices (slot * k + step) and packed (one tensor per dtype):
        gathered per key with one flat index, then packed, so the interleaving copy runs over them only. The store
        exists afterwards."""
        if self.packer is None:
            self.packer = Packer(chunk)
        slots, cols = sel.nonzero(as_tuple=True)
        cell = slots * sel.shape[1] + cols
        packed = self.packer.pack(Step({name: v.reshape(-1, *v.shape[2:]).index_select(0, cell)
                                        for name, v in chunk.items()}))  # fmt: skip
        if self.segment is None:
            B = sel.shape[0]
            self.segment = Segment({dt: v.new_zeros(B, self.max_steps, v.shape[-1]) for dt, v in packed.items()},
                                   is_packed=True)  # fmt: skip
            self.row_of_slot, self.free = torch.arange(B), []
        return cell, packed

    def _take_rows(self, n: int) -> torch.Tensor:
        """``n`` free rows of the store (it doubles when none are left)."""
        if n == 1 and self.free:
            return torch.tensor([self.free.pop(0)], dtype=torch.int64)
        if len(self.free) < n:
            tensors = self.segment.tensors
            size = next(iter(tensors.values())).shape[0]
            grow = max(size, n)
            self.segment.tensors = {dt: torch.cat([v, v.new_zeros(grow, *v.shape[1:])]) for dt, v in tensors.items()}
            self.free += range(size, size + grow)
        rows, self.free = self.free[:n], self.free[n:]
        return torch.tensor(rows, dtype=torch.int64)

    def _ids(self, rows: torch.Tensor, lengths: torch.Tensor) -> tuple:
        """Group, trajectory and sample ids of finished rows, read from each row's last step (a tree's branch holds
        its ancestors' steps first)."""
        if self.id_columns is None:
            self.id_columns = tuple(self.packer.column(f) for f in (F_GROUP, F_TRAJ, keys.SAMPLE_ID))
        last = lengths - 1
        return tuple(self.segment.tensors[dt][rows, last, col] for dt, col in self.id_columns)

    def release(self, entries) -> None:
        """The rows of ``entries`` (delivered or dropped) that are rows of the store are free again."""
        self.free += [e[1] for e in entries if e[0] is self.segment]

    def row(self, entries, slot: int) -> int:
        """The row of a trajectory: the store row of its entry when queued (``entries``, the matches), else the row
        it is going on in, ``slot``'s."""
        for e in entries:
            if e[0] is self.segment:
                return e[1]
        return int(self.row_of_slot[slot])

    def copy_prefix(self, src: int, slot: int, at: int) -> None:
        """Start ``slot``'s row with the first ``at`` steps of row ``src`` (a branch forked from it)."""
        dst = int(self.row_of_slot[slot])
        for v in self.segment.tensors.values():
            v[dst, :at] = v[src, :at]

    def live(self) -> dict | None:
        """Each slot's row by flat name (copies); ``None`` before the first chunk."""
        if self.segment is None:
            return None
        return self.packer.unpack({dt: v[self.row_of_slot] for dt, v in self.segment.tensors.items()})

    def load(self, live: dict | None) -> None:
        """Start over from a checkpoint's live rows (B, T_max, ...) by flat name: slot ``b`` writes into row ``b``."""
        self.segment, self.row_of_slot, self.free, self.packer, self.id_columns = None, None, [], None, None
        if live is not None:
            self.packer = Packer(live)
            packed = self.packer.pack(live)
            self.segment = Segment(packed, is_packed=True)
            self.row_of_slot = torch.arange(packed[next(iter(packed))].shape[0])
