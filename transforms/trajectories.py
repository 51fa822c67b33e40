"""Split a STEPS batch into one right-padded row per trajectory (a TRAJECTORIES-style batch)."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._checks import check_batch, sequence_index, trajectory_ends

__all__ = ["split_trajectories"]


def split_trajectories(batch: TensorDictBase, *, complete_only: bool = False) -> TensorDictBase:
    """One row per trajectory, right-padded (``keys.MASK`` False on padding); vectorized, no loop over rows.

    A trajectory is the valid steps of one row with the same ``keys.TRAJ_ID`` (masked steps are
    skipped and left out). The PromptTable under ``keys.PROMPTS`` is carried over.

    Args:
        batch: collected batch [N, T] (STEPS or TRAJECTORIES).
        complete_only: keep only trajectories that start at response step 0 and end (done) in the batch.

    Returns:
        TensorDict [M, T'] with the same keys, ``T'`` the longest trajectory.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.TRAJ_ID: torch.tensor([[0, 0, 2], [1, 3, 3]]), keys.ACTION: torch.tensor([[5, 6, 7], [8, 9, 4]])}, [2, 3])
        >>> out = split_trajectories(b)
        >>> out[keys.ACTION].tolist(), out[keys.MASK].tolist()
        ([[5, 6], [7, 0], [8, 0], [9, 4]], [[True, True], [True, False], [True, False], [True, True]])
    """
    owner = "split_trajectories"
    check_batch(batch, owner, (keys.TRAJ_ID,))
    seq, mask, num = sequence_index(batch, owner)
    flat = seq[mask]  # (K,) non-decreasing: rows are read in order
    k = torch.arange(flat.numel(), device=flat.device)
    first = torch.full((num,), flat.numel(), dtype=torch.int64, device=flat.device)
    first = first.scatter_reduce(0, flat, k, reduce="amin")
    pos = k - first[flat]
    width = int(pos.max()) + 1 if flat.numel() else 0
    prompts = batch.get(keys.PROMPTS, None)
    data = batch.exclude(keys.PROMPTS)
    steps = data[mask]  # (K,) valid steps

    def scatter(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((num, width, *x.shape[1:]))
        out[flat, pos] = x
        return out

    out = steps.apply(scatter, batch_size=[num, width])
    filled = torch.zeros((num, width), dtype=torch.bool, device=flat.device)
    filled[flat, pos] = True
    out.set(keys.MASK, filled)
    if complete_only:
        starts, ended = trajectory_ends(batch, seq, mask, num, owner)
        out = out[starts & ended]
    if prompts is not None:
        out.set_non_tensor(keys.PROMPTS, batch.get_non_tensor(keys.PROMPTS))
    return out
