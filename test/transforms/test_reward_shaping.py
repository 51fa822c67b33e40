import pytest
import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch
from tokengym.transforms import ClipReward, MissingEOSPenalty, OverlongPenalty, ScaleReward, TurnDiscount


def _final(td):
    return td[keys.REWARD].squeeze(-1).sum(-1).tolist()


def test_clip_and_scale_only_touch_done_steps():
    batch = make_trajectory_batch([2, 3], [5.0, -5.0], steps=4)
    batch[keys.REWARD][0, 0, 0] = 9.0  # not a done step: left alone
    out = ClipReward(-1.0, 1.0)(batch)
    assert out[keys.REWARD][0, :, 0].tolist() == [9.0, 1.0, 0.0, 0.0] and _final(out)[1] == -1.0
    out = ScaleReward(scale=2.0, bias=1.0)(make_trajectory_batch([2, 3], [5.0, -5.0]))
    assert _final(out) == [8.0, -12.0]


def test_overlong_penalty_dapo():
    batch = make_trajectory_batch([6, 8, 10, 12], [1.0] * 4)
    out = OverlongPenalty(max_length=10, cache=4, factor=1.0)(batch)
    assert _final(out) == pytest.approx([1.0, 0.5, 0.0, 0.0])  # L > L_max: -1


def test_missing_eos_penalty():
    out = MissingEOSPenalty(-0.5)(make_trajectory_batch([2, 2], [1.0, 1.0], truncated=[True, False]))
    assert _final(out) == [0.5, 1.0]


def test_inside_env_step():
    root = TensorDict({keys.ACTIVE: torch.tensor([True, False])}, [2])
    nxt = TensorDict({"reward": torch.tensor([[5.0], [5.0]]), "done": torch.ones(2, 1, dtype=torch.bool)}, [2])
    assert ClipReward(0.0, 1.0)._step(root, nxt)["reward"].flatten().tolist() == [1.0, 5.0]


def test_bad_input():
    with pytest.raises(ValueError, match="low <= high, got low=1.0, high=0.0"):
        ClipReward(1.0, 0.0)
    with pytest.raises(TypeError, match="scale must be a number, got str"):
        ScaleReward(scale="2")
    with pytest.raises(ValueError, match=r"cache must be in \(0, 10.0\], got 11.0"):
        OverlongPenalty(max_length=10, cache=11)
    with pytest.raises(ValueError, match=r"max_length must be in \(0, inf\], got -1.0"):
        OverlongPenalty(max_length=-1, cache=1)
    with pytest.raises(KeyError, match=r"MissingEOSPenalty reads \('next', 'truncated'\)"):
        MissingEOSPenalty()(make_trajectory_batch([2]).exclude(keys.TRUNCATED))


# -- issue 12 regressions --


def _two_turns(success, *, next_turn: bool):
    """One trajectory, two turns of two tokens; the turn rewards (AReaL success) sit on each turn's last token."""
    batch = make_trajectory_batch([4], [success[1]])
    batch[keys.TURN] = torch.tensor([[0, 0, 1, 1]])
    batch[keys.REWARD][0, 1, 0] = success[0]
    if next_turn:
        batch[(keys.NEXT, keys.TURN)] = torch.tensor([[0, 1, 1, 1]])
    return batch


@pytest.mark.parametrize("next_turn", [True, False])
def test_scale_reward_scales_every_turn_like_areal(next_turn):
    scale = ScaleReward(scale=1.0, bias=0.0, use_success_sign=True)
    out = TurnDiscount(1.0)(scale(_two_turns([0.0, 1.0], next_turn=next_turn)))
    assert out[keys.REWARD][0, :, 0].tolist() == [0.0, 0.0, 0.0, 1.0]  # AReaL: turns [-1, 1] -> [0, 1]
    plain = ScaleReward(scale=2.0, bias=0.5)(_two_turns([0.0, 1.0], next_turn=next_turn))
    assert plain[keys.REWARD][0, :, 0].tolist() == [0.0, -1.0, 0.0, 1.0]


def test_scale_reward_areal_formula():
    out = ScaleReward(scale=3.0, bias=0.5, use_success_sign=True)(_two_turns([0.0, 1.0], next_turn=True))
    # ((r - 0.5) * 2 - bias) * scale
    assert out[keys.REWARD][0, :, 0].tolist() == [0.0, -4.5, 0.0, 1.5]


def test_scale_reward_in_env_step_scales_turn_ends():
    root = TensorDict({keys.ACTIVE: torch.tensor([True, True, True]), keys.TURN: torch.tensor([0, 0, 1])}, [3])
    nxt = TensorDict({"reward": torch.tensor([[0.0], [0.0], [1.0]]), "done": torch.tensor([[False], [False], [True]]),
                      keys.TURN: torch.tensor([0, 1, 1])}, [3])  # fmt: skip
    out = ScaleReward(scale=2.0, bias=0.5)._step(root, nxt)
    assert out["reward"].flatten().tolist() == [0.0, -1.0, 1.0]  # mid-turn, turn end, done
