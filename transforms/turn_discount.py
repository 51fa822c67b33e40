"""AReaL turn-level discount for multi-turn trajectories: ``r_i += gamma * r_{i+1}`` backwards over turns."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torchrl.objectives.value.functional import reward2go

from tokengym.llm_envs import keys
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import check_complete, check_number, sequence_index, squeeze_last

__all__ = ["TurnDiscount"]


class TurnDiscount(BatchTransform):
    """Discount per-turn rewards backwards over the turns of each trajectory (AReaL multi-turn agents).

    A turn's reward is the sum of the rewards of its steps (``keys.TURN`` constant); after the
    discount it sits on the turn's last step and the turn's other steps get 0. Needs complete
    trajectories (TRAJECTORIES batches, or STEPS batches whose trajectories all end in the batch).

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

    def _apply_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        seq, mask, num = sequence_index(td, owner)
        check_complete(td, seq, mask, num, owner)
        turn = td.get(keys.TURN)
        # a segment is a run of steps of one trajectory and one turn, numbered in row-major order
        start = mask.clone()
        start[:, 1:] &= (seq[:, 1:] != seq[:, :-1]) | (turn[:, 1:] != turn[:, :-1])
        segment = start.reshape(-1).cumsum(0).reshape(mask.shape) - 1
        num_segments = int(start.sum())
        reward = td.get(keys.REWARD)
        flat_reward = squeeze_last(reward, mask.shape).float()
        seg_reward = torch.zeros(num_segments, device=reward.device).index_add_(0, segment[mask], flat_reward[mask])
        seg_seq = torch.zeros(num_segments, dtype=torch.int64, device=reward.device)
        seg_seq[segment[mask]] = seq[mask]
        last_of_seq = torch.ones(num_segments, dtype=torch.bool, device=reward.device)
        last_of_seq[:-1] = seg_seq[1:] != seg_seq[:-1]
        discounted = reward2go(seg_reward[None, :, None], last_of_seq[None, :, None], self.gamma, time_dim=-2)
        discounted = discounted.reshape(-1)
        # the step where each segment ends: the last valid step with that segment number
        end = torch.zeros_like(mask)
        end[:, :-1] = mask[:, :-1] & (~mask[:, 1:] | (segment[:, 1:] != segment[:, :-1]))
        end[:, -1] = mask[:, -1]
        new = torch.zeros_like(flat_reward)
        new[end] = discounted[segment[end]]
        new = torch.where(mask, new, flat_reward)  # padding keeps what it had
        td.set(keys.REWARD, new.reshape(reward.shape).to(reward.dtype))
        return td
