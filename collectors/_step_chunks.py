"""Steps kept as they come and written in chunks: a recorder stacks a few dozen env steps into one (B, k, ...)
chunk and writes it with a few copies, instead of a dozen small copies per step."""

from __future__ import annotations

import torch

from tokengym.collectors._packing import F_ACTIVE, F_DONE, F_GROUP, Step

__all__ = ["DeferredSteps", "segment_rows", "stack_steps"]

MAX_DEFERRED = 64  # steps kept before they are written anyway (bounds memory and the size of one chunk)


def stack_steps(steps: list[Step]) -> dict:
    """Steps (B, ...) by flat name -> one chunk (B, k, ...) by flat name (new tensors).

    A step source hands over the same tensor for a key as long as its value stands (the ids and lengths a refill
    sets, the policy's version): a run of steps holding one tensor is copied once, broadcast over its steps.
    """
    if len(steps) == 1:
        return {name: v.unsqueeze(1).clone() for name, v in steps[0].items()}
    return {name: _stack_runs([s[name] for s in steps]) for name in steps[0]}


def _stack_runs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors, 1)``, with each run of one tensor repeated broadcast instead of stacked."""
    first, k = tensors[0], len(tensors)
    if all(t is first for t in tensors):
        return first.unsqueeze(1).expand(first.shape[0], k, *first.shape[1:]).contiguous()
    runs, start = [], 0  # (tensor, length) of each run of one tensor
    for i in range(1, k + 1):
        if i == k or tensors[i] is not tensors[start]:
            runs.append((tensors[start], i - start))
            start = i
    if 2 * len(runs) > k:  # mostly distinct tensors: one stack
        return torch.stack(tensors, 1)
    return torch.cat([t.unsqueeze(1).expand(t.shape[0], n, *t.shape[1:]) for t, n in runs], 1)


class DeferredSteps:
    """Steps not yet written, and the groups their finished trajectories belong to.

    A trajectory recorder must write its steps before anyone can see a batch they complete: :meth:`add` says
    when the steps kept so far may complete enough groups (``could_fill``) or are too many; otherwise they wait.
    """

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.finished: dict[int, int] = {}  # group id -> trajectories of it finished in the kept steps

    def add(self, step: Step, could_fill) -> bool:
        """Keep ``step``; True when the kept steps must be written now: too many, or a trajectory that finished in
        them may complete a batch (``could_fill(finished)`` with the group counts)."""
        self.steps.append(step)
        ended = step.ended
        if ended is None:
            ended = (step[F_DONE].reshape(-1) & step[F_ACTIVE]).nonzero().squeeze(-1).tolist()
        if ended:
            counts = self.finished
            for g in step[F_GROUP][ended].tolist():
                counts[g] = counts.get(g, 0) + 1
            if could_fill(counts):
                return True
        return len(self.steps) >= MAX_DEFERRED

    def take(self) -> dict | None:
        """The kept steps as one chunk (B, k, ...) (``None``: none kept); they are forgotten."""
        if not self.steps:
            return None
        steps, self.steps, self.finished = self.steps, [], {}
        return stack_steps(steps)

    def clear(self) -> None:
        self.steps, self.finished = [], {}


def segment_rows(done: torch.Tensor, row_of_slot: torch.Tensor, new_rows: torch.Tensor):
    """Which store row each cell of a chunk of consecutive steps belongs to, when slots may end trajectories
    within the chunk and go on with a new one (in a new row).

    Args:
        done: (B, k) True at a live cell where a trajectory ends.
        row_of_slot: (B,) the row each slot writes into at the chunk's start.
        new_rows: (n,) free rows, one per True of ``done``, taken in time order (step, then slot).

    Returns ``(cell_rows (B, k), ended_slots, ended_steps, ended_rows, next_row_of_slot)``: the finished
    trajectories in the order stepping finishes them (step, then slot).
    """
    B, k = done.shape
    seg = done.long().cumsum(1) - done.long()  # trajectories each slot ended before each cell
    width = int(seg[:, -1].max()) + 2 if k else 1
    table = row_of_slot[:, None].expand(B, width).clone()  # (B, segments): the row of each slot's j-th trajectory
    steps, slots = done.T.nonzero(as_tuple=True)  # time order
    table[slots, seg[slots, steps] + 1] = new_rows
    cell_rows = table.gather(1, seg)
    ended_rows = table[slots, seg[slots, steps]]
    next_rows = table.gather(1, done.sum(1, keepdim=True)).squeeze(1)
    return cell_rows, slots, steps, ended_rows, next_rows
