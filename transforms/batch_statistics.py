"""Batch statistics over every rank's rows while :func:`~tokengym.train` prepares a batch under ``torch.distributed``.

With N ranks each rank prepares its own B/N rows; a transform that whitens over the batch or feeds a KL controller the
batch's mean would use B/N rows' statistics where one process uses B. Inside :func:`across_ranks` (which ``train()``
enters around ``prepare`` when a process group is initialized) those transforms sum their statistics over the ranks
first, so every rank sees the whole batch's mean and spread. Outside it nothing is reduced, so a transform called on
one rank alone (an evaluation on rank 0) never waits for a collective the others do not enter.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

__all__ = ["across_ranks", "all_reduce_floats", "sum_across_ranks"]

_STATE = threading.local()


def is_across_group() -> bool:
    """Whether a process group of 2 or more ranks is initialized (a group of one, which vLLM's in-process engine
    initializes for itself, is one process: nothing to reduce)."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)  # fmt: skip


@contextlib.contextmanager
def across_ranks() -> Iterator[None]:
    """Inside: :func:`sum_across_ranks` sums over the ranks of the initialized process group (nothing without one)."""
    before = getattr(_STATE, "on", False)
    _STATE.on = is_across_group()
    try:
        yield
    finally:
        _STATE.on = before


def is_across_ranks() -> bool:
    """Whether batch statistics are summed over the ranks here (inside :func:`across_ranks`, a group up)."""
    return bool(getattr(_STATE, "on", False)) and is_across_group()


def all_reduce_floats(values: Sequence[float], op: str = "sum") -> list[float]:
    """``values`` summed (``op="sum"``) or maxed (``"max"``) element-wise over the ranks, in float64 (one collective
    on the backend's device: the CPU for gloo, this rank's GPU for nccl)."""
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}
    device = torch.device("cpu")
    if torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    out = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(out, op=ops[op])
    return out.tolist()


def sum_across_ranks(*values: torch.Tensor) -> list[torch.Tensor]:
    """Each 0-d ``value`` summed over the ranks inside :func:`across_ranks`; as given outside it (float64)."""
    if not is_across_ranks():
        return [v.double() for v in values]
    sums = all_reduce_floats([float(v) for v in values])
    return [torch.tensor(s, dtype=torch.float64, device=v.device) for s, v in zip(sums, values, strict=True)]
