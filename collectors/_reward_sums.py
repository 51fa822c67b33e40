"""Scores of finished trajectories for dynamic sampling: each one's rewards summed over its steps, read where its
steps are (a wave's rows or real steps, a chain's pieces, the packed row store)."""

from __future__ import annotations

import torch

from tokengym.collectors._packing import Packer
from tokengym.collectors._segments import Chain
from tokengym.collectors.dynamic_sampling import SpreadFilter

__all__ = ["RewardSums"]


class RewardSums:
    """The summed rewards a :class:`SpreadFilter` judges a group by (a view of the rewards, no copy first).

    ``name``: the flat name of the reward summed (found on the first trajectories); ``column``: where it is in the
    packed store, ``(dtype, column)`` (forgotten with :meth:`clear` when the store's packing may change).
    """

    def __init__(self, sampling: SpreadFilter) -> None:
        self.sampling = sampling
        self.name: str | None = None
        self.column: tuple | None = None

    def clear(self) -> None:
        self.column = None

    def __call__(self, segs: list, rows: torch.Tensor, lengths: torch.Tensor, packer: Packer | None) -> list[float]:
        """The scores of finished trajectories (``segs``: one segment for all, or a chain each)."""
        seg = segs[0]
        if self.name is None:
            names = set(seg.tensors) if not seg.is_packed else {n for ns in packer.groups.values() for n, _ in ns}
            self.name = self.sampling.score_name(names)
        if isinstance(seg, Chain):
            return [sum(self([piece], torch.tensor([row]), torch.tensor([n]), packer)[0] for piece, row, n in c.pieces)
                    for c in segs]  # fmt: skip
        if seg.is_packed:
            if self.column is None:
                self.column = packer.column(self.name)
            dtype, column = self.column
            rewards = seg.tensors[dtype][:, :, column]  # (R, T_max): older steps past each end are not summed
        elif seg.starts is not None:  # a wave's real steps: each row's run of them
            rewards = seg.tensors[self.name].reshape(-1)
            return [float(rewards[seg.starts[r] : seg.starts[r] + n].sum(dtype=torch.float64))
                    for r, n in zip(rows.tolist(), lengths.tolist(), strict=True)]  # fmt: skip
        else:
            rewards = seg.tensors[self.name]
            rewards = rewards.reshape(rewards.shape[0], rewards.shape[1])  # (B, Tn), a view
        return self.sampling.scores(rewards, rows, lengths)
