"""Argument checks and trajectory indexing shared by the transforms (private)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs.prompt_table import PromptTable

_MISSING_KEY = "{owner} reads {key!r} (tokengym.llm_envs.keys) but got keys {found}"
_NOT_A_TD = "{owner} expects a TensorDict batch [N, T], got {kind}"
_BAD_BATCH_DIMS = "{owner} expects a collected batch with batch dims [N, T] (rows, steps), got batch_size {shape}"


def found_keys(td: TensorDictBase) -> list:
    """Sorted leaf keys of ``td`` (for error messages)."""
    return sorted((k if isinstance(k, str) else tuple(k) for k in td.keys(True, True)), key=str)


def check_batch(td, owner: str, required: Iterable = ()) -> None:
    """Raise TypeError / ValueError / KeyError unless ``td`` is an ``[N, T]`` TensorDict holding ``required``."""
    if not isinstance(td, TensorDictBase):
        raise TypeError(_NOT_A_TD.format(owner=owner, kind=type(td).__name__))
    if td.batch_dims != 2:
        raise ValueError(_BAD_BATCH_DIMS.format(owner=owner, shape=tuple(td.batch_size)))
    for key in required:
        require(td, key, owner)


def require(td: TensorDictBase, key, owner: str) -> torch.Tensor:
    """``td.get(key)``, or a KeyError naming the key, the component and the keys found."""
    value = td.get(key, None)
    if value is None:
        raise KeyError(_MISSING_KEY.format(owner=owner, key=key, found=found_keys(td)))
    return value


def check_number(name: str, value, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, fix: str = "") -> float:  # fmt: skip
    """Return ``float(value)``, raising TypeError/ValueError if it is not a finite number in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    bad = not math.isfinite(value)
    bad |= low is not None and (value <= low if low_open else value < low)
    bad |= high is not None and value > high
    if bad:
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value}. {fix}".rstrip())
    return value


def valid_mask(td: TensorDictBase) -> torch.Tensor:
    """``keys.MASK`` (bool [N, T]) or all-True when the batch has no padding."""
    mask = td.get(keys.MASK, None)
    if mask is None:
        return torch.ones(td.batch_size, dtype=torch.bool, device=td.device)
    return mask.bool()


def squeeze_last(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A ``[N, T]`` view of ``x`` given as [N, T] or [N, T, 1]."""
    return x.reshape(shape) if x.shape != shape else x


def set_loss_weight(td: TensorDictBase, weight: torch.Tensor) -> None:
    """Write ``keys.LOSS_WEIGHT``, multiplying the one already in the batch (weight transforms compose)."""
    old = td.get(keys.LOSS_WEIGHT, None)
    td.set(keys.LOSS_WEIGHT, weight if old is None else squeeze_last(old, weight.shape) * weight)


def previous_valid(mask: torch.Tensor) -> torch.Tensor:
    """int64 [N, T]: the column of the last valid step before ``t`` in its row, ``-1`` if none."""
    col = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, col, torch.full_like(col, -1)).cummax(-1).values  # last valid column <= t
    out = torch.full_like(last, -1)
    out[:, 1:] = last[:, :-1]
    return out


def next_valid(mask: torch.Tensor) -> torch.Tensor:
    """int64 [N, T]: the column of the first valid step after ``t`` in its row, ``-1`` if none."""
    width = mask.shape[-1]
    flipped = previous_valid(mask.flip(-1))
    return torch.where(flipped < 0, flipped, width - 1 - flipped).flip(-1)


def sequence_index(td: TensorDictBase, owner: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Number the trajectories of a batch from their ids: a trajectory is the valid steps of one row that
    share a ``keys.TRAJ_ID``, read in order.

    A step with ``keys.MASK`` False is skipped: a new trajectory starts at a valid step whose id differs
    from the previous *valid* step of its row, so a trajectory whose first step is masked does not merge
    with the one before it, and a hole inside a trajectory does not cut it in two.

    Returns ``(seq, mask, num_seqs)``: ``seq`` int64 [N, T] is the trajectory index of each step
    (in row-major order, ``-1`` on masked steps), ``mask`` the valid steps.
    """
    traj = require(td, keys.TRAJ_ID, owner)
    mask = valid_mask(td)
    start = mask.clone()
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):  # a valid step after a masked one: compare across the gap
        prev = previous_valid(mask)
        start &= (prev < 0) | (traj != traj.gather(-1, prev.clamp(min=0)))
    else:  # valid steps form a prefix of each row: the previous valid step is the previous column
        start[:, 1:] &= traj[:, 1:] != traj[:, :-1]
    seq = start.reshape(-1).cumsum(0).reshape(mask.shape) - 1
    seq = torch.where(mask, seq, torch.full_like(seq, -1))
    return seq, mask, int(start.sum())


def trajectory_ends(td: TensorDictBase, seq: torch.Tensor, mask: torch.Tensor, num: int,
                    owner: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(starts, ended)`` bool (M,): trajectory ``m`` starts at response step 0 in the batch, and has a
    valid done step in the batch.

    The start is read at the first step of the row's run of steps with the trajectory's id, masked or
    not: a trajectory whose first step is masked still starts in the batch.
    """
    traj = require(td, keys.TRAJ_ID, owner)
    response_len = require(td, keys.RESPONSE_LEN, owner)
    done = squeeze_last(require(td, keys.DONE, owner), mask.shape).bool()
    col = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    new_run = torch.ones_like(mask)
    new_run[:, 1:] = traj[:, 1:] != traj[:, :-1]
    run_start = torch.where(new_run, col, torch.zeros_like(col)).cummax(-1).values
    first = response_len.gather(-1, run_start)
    flat = seq[mask]
    starts = torch.zeros(num, dtype=torch.bool, device=mask.device)
    starts.index_put_((flat,), first[mask] == 0, accumulate=True)
    ended = torch.zeros(num, dtype=torch.bool, device=mask.device).index_put_((flat,), done[mask], accumulate=True)
    return starts, ended


def check_complete(td: TensorDictBase, seq: torch.Tensor, mask: torch.Tensor, num: int, owner: str) -> None:
    """Raise ValueError if a trajectory starts before the batch or ends after it (STEPS batches)."""
    starts, ended = trajectory_ends(td, seq, mask, num, owner)
    bad = ~starts | ~ended
    if bool(bad.any()):
        traj = require(td, keys.TRAJ_ID, owner)
        which = int(bad.nonzero()[0])
        tid = int(traj[seq == which][0])
        why = "does not start at response step 0" if not bool(starts[which]) else "has no done step in this batch"
        raise ValueError(
            f"{owner} needs complete trajectories, but trajectory {tid} {why}. Collect in TRAJECTORIES "
            f"mode, or keep only complete trajectories (e.g. tokengym.transforms.split_trajectories(batch, "
            f"complete_only=True))."
        )


def get_prompts(td: TensorDictBase, prompts: PromptTable | None, owner: str) -> PromptTable:
    """The PromptTable passed in, or the one the batch carries under ``keys.PROMPTS``."""
    if prompts is None:
        try:
            prompts = td.get_non_tensor(keys.PROMPTS)
        except KeyError:
            prompts = None
        if prompts is None:
            raise KeyError(
                f"{owner} reads the PromptTable under {keys.PROMPTS!r} (tokengym.llm_envs.keys) but got keys "
                f"{found_keys(td)}; pass prompts=PromptTable(...) or collect with a tokengym collector"
            )
    if isinstance(prompts, list | tuple):  # rows from a replay buffer: one table per stored batch
        prompts = _merge_tables(prompts, owner)
    if not isinstance(prompts, PromptTable):
        raise TypeError(f"{owner} expects prompts to be a PromptTable, got {type(prompts).__name__}")
    return prompts


def _merge_tables(tables, owner: str) -> PromptTable:
    """One PromptTable from the (nested) list of tables a stacked or sampled batch carries."""
    merged, seen, stack = PromptTable(), set(), [tables]
    while stack:
        item = stack.pop()
        if isinstance(item, PromptTable):
            if id(item) not in seen:
                seen.add(id(item))
                merged.merge(item)
        elif isinstance(item, list | tuple):
            stack.extend(item)
        else:
            raise TypeError(f"{owner} expects prompts to be PromptTables, got {type(item).__name__} in a stacked batch")
    return merged
