import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch, to_steps_layout
from tokengym.transforms import TurnDiscount


def _multi_turn():
    batch = make_trajectory_batch([5, 3], [4.0, 2.0], steps=6)
    batch[keys.TURN] = torch.tensor([[0, 0, 1, 2, 2, 0], [0, 1, 1, 0, 0, 0]])
    batch[keys.REWARD][0, 1, 0] = 1.0  # turn 0 reward
    batch[keys.REWARD][1, 0, 0] = 1.0
    return batch


def test_hand_computed():
    out = TurnDiscount(0.5)(_multi_turn())
    # row 0: turns (1, 0, 4) -> (1 + 0.5 * (0 + 0.5 * 4), 0 + 0.5 * 4, 4) at each turn's last step
    assert out[keys.REWARD][0, :, 0].tolist() == [0.0, 2.0, 2.0, 0.0, 4.0, 0.0]
    assert out[keys.REWARD][1, :, 0].tolist() == [2.0, 0.0, 2.0, 0.0, 0.0, 0.0]


def test_gamma_one_keeps_total_of_first_turn_and_steps_layout():
    batch = _multi_turn()
    ref = TurnDiscount(1.0)(batch.clone())
    assert ref[keys.REWARD][0, 1, 0] == 5.0
    steps = TurnDiscount(0.5)(to_steps_layout(_multi_turn(), rows=1))
    assert steps[keys.REWARD][0, :, 0].tolist() == [0.0, 2.0, 2.0, 0.0, 4.0, 2.0, 0.0, 2.0]


def test_bad_input():
    with pytest.raises(ValueError, match=r"gamma must be in \[0.0, 1.0\], got 2.0"):
        TurnDiscount(2.0)
    with pytest.raises(KeyError, match="TurnDiscount reads 'turn'"):
        TurnDiscount(0.9)(make_trajectory_batch([2]).exclude(keys.TURN))
    with pytest.raises(ValueError, match="needs complete trajectories"):
        TurnDiscount(0.9)(make_trajectory_batch([3])[:, :2])


# -- issue 12 regressions --


def test_gamma_zero_keeps_each_turns_reward():
    out = TurnDiscount(0.0)(_multi_turn())
    assert out[keys.REWARD][0, :, 0].tolist() == [0.0, 1.0, 0.0, 0.0, 4.0, 0.0]
    assert out[keys.REWARD][1, :, 0].tolist() == [1.0, 0.0, 2.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("gamma", [1e-4, 1e-6, 1e-9])
def test_tiny_gamma_is_not_zero(gamma):
    out = TurnDiscount(gamma)(_multi_turn())
    torch.testing.assert_close(out[keys.REWARD][1, 0, 0], torch.tensor(1.0 + gamma * 2.0), rtol=0, atol=0)
    assert out[keys.REWARD][0, 1, 0].item() == pytest.approx(1.0 + gamma * (0.0 + gamma * 4.0), rel=1e-6)


def test_masked_hole_does_not_split_a_turn():
    batch = make_trajectory_batch([5], [4.0])
    batch[keys.TURN] = torch.tensor([[0, 0, 0, 1, 1]])
    batch[keys.REWARD][0, 0, 0] = 1.0
    batch[keys.MASK][0, 1] = False  # a hole inside turn 0: its steps 0 and 2 are still one turn
    out = TurnDiscount(0.5)(batch)
    assert out[keys.REWARD][0, :, 0].tolist() == [0.0, 0.0, 3.0, 0.0, 4.0]
