import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch, to_steps_layout
from tokengym.transforms import split_trajectories


def test_split_inverts_steps_layout():
    batch = make_trajectory_batch([3, 1, 4, 2, 2], group_size=1)
    steps = to_steps_layout(batch, rows=2)
    out = split_trajectories(steps)
    order = out[keys.TRAJ_ID][:, 0].argsort()
    out = out[order]
    assert torch.equal(out[keys.MASK], batch[keys.MASK])
    mask = batch[keys.MASK]
    assert (out.exclude(keys.PROMPTS)[mask] == batch.exclude(keys.PROMPTS)[mask]).all()  # padding fill may differ
    assert out.get_non_tensor(keys.PROMPTS) is batch.get_non_tensor(keys.PROMPTS)


def test_complete_only_drops_partial_trajectories():
    steps = to_steps_layout(make_trajectory_batch([3, 1, 4, 2]), rows=2)[:, 1:-1]
    out = split_trajectories(steps, complete_only=True)
    assert out[keys.TRAJ_ID][:, 0].tolist() == [3]  # 0 lost its start, 2 its end, 1 its only step
    assert len(split_trajectories(steps)) == 3


def test_bad_input():
    with pytest.raises(KeyError, match="split_trajectories reads 'traj_id'"):
        split_trajectories(make_trajectory_batch([2]).exclude(keys.TRAJ_ID))
    with pytest.raises(TypeError, match="expects a TensorDict batch"):
        split_trajectories(torch.zeros(2, 2))
