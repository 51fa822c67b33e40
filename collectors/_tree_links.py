"""Tree links of a trajectory recorder: each branch's parent and fork step, kept until the branch is delivered, and
the tree columns a batch of trees' leaves carries."""

from __future__ import annotations

import torch

from tokengym.collectors._packing import F_TRAJ, flat_name
from tokengym.llm_envs import keys

__all__ = ["TreeLinks"]


class TreeLinks:
    """``links``: branch trajectory -> (parent trajectory, fork step), from the fork until the branch is delivered."""

    def __init__(self) -> None:
        self.links: dict[int, tuple[int, int]] = {}

    def add(self, child: int, parent: int, at: int) -> None:
        self.links[child] = (parent, at)

    def release(self, take: list[tuple]) -> None:
        """Forget the links of delivered entries ``take``."""
        if self.links:
            for e in take:
                self.links.pop(e[4], None)

    def columns(self, out: dict, take: list[tuple], mask: torch.Tensor) -> None:
        """A tree's leaves (entries ``take``, assembled in ``out``): ``keys.BRANCH_ID`` the trajectory that generated
        each step (the steps as recorded), the row's own trajectory and sample ids on every step, its parent and fork
        step (``keys.PARENT_ID``, ``keys.FORK_INDEX``; -1 and 0 for a root)."""
        trajs = torch.tensor([e[4] for e in take])[:, None]
        links = [self.links.get(e[4], (-1, 0)) for e in take]
        out[flat_name(keys.BRANCH_ID)] = out[F_TRAJ].clone()
        out[F_TRAJ] = torch.where(mask, trajs, 0)
        out[keys.SAMPLE_ID] = torch.where(mask, torch.tensor([e[6] for e in take])[:, None], 0)
        out[flat_name(keys.PARENT_ID)] = torch.where(mask, torch.tensor([p for p, _ in links])[:, None], 0)
        out[flat_name(keys.FORK_INDEX)] = torch.where(mask, torch.tensor([a for _, a in links])[:, None], 0)

    def state_dict(self) -> list[list[int]]:
        return [[c, p, a] for c, (p, a) in self.links.items()]

    def load_state_dict(self, state: list) -> None:
        self.links = {int(c): (int(p), int(a)) for c, p, a in state}
