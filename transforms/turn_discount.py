"""AReaL turn-level discount for multi-turn trajectories: ``r_i += gamma * r_{i+1}`` backwards over turns."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import (
    check_complete,
    check_number,
    next_valid,
    previous_valid,
    sequence_index,
    squeeze_last,
)
from tokengym.transforms.advantages import discounted_returns

__all__ = ["TurnDiscount"]


class TurnDiscount(BatchTransform):
    """Discount per-turn rewards backwards over the turns of each trajectory (AReaL multi-turn agents).

    A turn's reward is the sum of the rewards of its valid steps (``keys.TURN`` constant); after the
    discount it sits on the turn's last valid step and the turn's other valid steps get 0 (masked
    steps keep what they had). Any gamma in [0, 1] works, 0 included (each turn keeps its own
    reward). Needs complete trajectories (TRAJECTORIES batches, or STEPS batches whose trajectories
    all end in the batch).

    Args:
        gamma: turn discount in [0, 1].

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.REWARD: torch.tensor([[[0.0], [1.0], [0.0], [2.0]]]), keys.TURN: torch.tensor([[0, 0, 1, 1]]),
        ...                 keys.TRAJ_ID: torch.zeros(1, 4, dtype=torch.long), keys.RESPONSE_LEN: torch.tensor([[0, 1, 2, 3]]),
        ...                 keys.DONE: torch.tensor([[[False], [False], [False], [True]]])}, [1, 4])
        >>> TurnDiscount(0.5)(b)[keys.REWARD].flatten().tolist()  # turn 0: 1 + 0.5 * 2
        [0.0, 2.0, 0.0, 2.0]
    """

    def __init__(self, gamma: float) -> None:
        super().__init__(in_keys=[keys.REWARD, keys.TURN, keys.TRAJ_ID, keys.DONE, keys.RESPONSE_LEN],
                         out_keys=[keys.REWARD])  # fmt: skip
        self.gamma = check_number("gamma", gamma, low=0.0, high=1.0)

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        seq, mask, num = sequence_index(td, owner)
        check_complete(td, seq, mask, num, owner)
        turn = td.get(keys.TURN)
        # a segment is the valid steps of one trajectory and one turn, numbered in row-major order;
        # masked steps are skipped (a hole does not split a turn)
        prev = previous_valid(mask)
        at = prev.clamp(min=0)
        start = mask & ((prev < 0) | (seq != seq.gather(-1, at)) | (turn != turn.gather(-1, at)))
        segment = start.reshape(-1).cumsum(0).reshape(mask.shape) - 1
        num_segments = int(start.sum())
        reward = td.get(keys.REWARD)
        flat_reward = squeeze_last(reward, mask.shape).float()
        seg_reward = torch.zeros(num_segments, device=reward.device).index_add_(0, segment[mask], flat_reward[mask])
        seg_seq = torch.zeros(num_segments, dtype=torch.int64, device=reward.device)
        seg_seq[segment[mask]] = seq[mask]
        # lay the segments out as [trajectory, turn] and discount along the turns (a loop over turns)
        first = torch.full((num,), num_segments, dtype=torch.int64, device=reward.device)
        first = first.scatter_reduce(0, seg_seq, torch.arange(num_segments, device=reward.device), reduce="amin")
        col = torch.arange(num_segments, device=reward.device) - first[seg_seq]
        width = int(col.max()) + 1 if num_segments else 0
        per_turn = seg_reward.new_zeros(num, width)
        per_turn[seg_seq, col] = seg_reward
        no_stop = torch.zeros_like(per_turn, dtype=torch.bool)  # trailing zeros end each trajectory
        discounted = discounted_returns(per_turn, no_stop, self.gamma)[seg_seq, col]
        # the step where each segment ends: its last valid step
        nxt = next_valid(mask)
        end = mask & ((nxt < 0) | (segment.gather(-1, nxt.clamp(min=0)) != segment))
        new = torch.zeros_like(flat_reward)
        new[end] = discounted[segment[end]]
        new = torch.where(mask, new, flat_reward)  # masked steps keep what they had
        td.set(keys.REWARD, new.reshape(reward.shape).to(reward.dtype))
        return td
