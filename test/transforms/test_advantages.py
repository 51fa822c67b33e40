import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch, to_steps_layout
from tokengym.transforms import (
    AdvantageEstimator,
    DiscountedReturns,
    GAEAdvantage,
    make_advantage,
    masked_whiten,
)


def _ordered(td):
    """Advantages of the valid steps, ordered by (trajectory, response step)."""
    mask = td[keys.MASK]
    order = (td[keys.TRAJ_ID] * 10_000 + td[keys.RESPONSE_LEN])[mask].argsort()
    return td[keys.ADVANTAGE][mask][order]


def _gae_by_hand(r, v, gamma, lmbda):
    adv, last = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nv = v[t + 1] if t + 1 < len(r) else 0.0
        last = r[t] + gamma * nv - v[t] + gamma * lmbda * last
        adv[t] = last
    return adv


def test_gae_hand_computed_and_masked():
    batch = make_trajectory_batch([3, 2], [1.0, -1.0], steps=4)
    batch[keys.STATE_VALUE] = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 0.4, 9.0, 9.0]]).unsqueeze(-1)
    out = GAEAdvantage(gamma=0.9, lmbda=0.8)(batch)
    expect0 = _gae_by_hand([0, 0, 1.0], [0.1, 0.2, 0.3], 0.9, 0.8)
    expect1 = _gae_by_hand([0, -1.0], [0.5, 0.4], 0.9, 0.8)
    torch.testing.assert_close(out[keys.ADVANTAGE][0, :3, 0], torch.tensor(expect0))
    torch.testing.assert_close(out[keys.ADVANTAGE][1, :2, 0], torch.tensor(expect1))
    assert out[keys.ADVANTAGE][1, 2:].eq(0).all()
    torch.testing.assert_close(out[keys.VALUE_TARGET][0, :3, 0], torch.tensor(expect0) + torch.tensor([0.1, 0.2, 0.3]))


def test_gae_steps_layout_matches_trajectories():
    batch = make_trajectory_batch([3, 2, 4, 1], steps=4)
    batch[keys.STATE_VALUE] = torch.rand(4, 4, 1) * batch[keys.MASK].unsqueeze(-1)
    ref = GAEAdvantage(lmbda=0.9)(batch.clone())
    steps = GAEAdvantage(lmbda=0.9)(to_steps_layout(batch, rows=2))
    torch.testing.assert_close(_ordered(steps), _ordered(ref))


def test_gae_bootstrap_from_next_value():
    batch = make_trajectory_batch([2], [0.0], truncated=[True])
    batch[keys.STATE_VALUE] = torch.zeros(1, 2, 1)
    batch[("next", keys.STATE_VALUE)] = torch.tensor([[[0.0], [5.0]]])
    out = GAEAdvantage(gamma=1.0, lmbda=1.0)(batch)
    assert out[keys.ADVANTAGE].flatten().tolist() == [5.0, 5.0]


def test_discounted_returns_hand_computed():
    batch = make_trajectory_batch([3], [2.0])
    batch[keys.REWARD][0, 0, 0] = 1.0
    out = DiscountedReturns(gamma=0.5)(batch)
    assert out[keys.ADVANTAGE].flatten().tolist() == [1.5, 1.0, 2.0]
    normed = DiscountedReturns(gamma=0.5, normalize=True)(make_trajectory_batch([3, 2]))
    assert normed[keys.ADVANTAGE][normed[keys.MASK]].mean().abs() < 1e-6


def test_masked_whiten_and_enum():
    x = torch.tensor([1.0, 3.0, 50.0])
    out = masked_whiten(x, torch.tensor([True, True, False]))
    assert out[2] == 0 and out[:2].sum().abs() < 1e-6
    assert AdvantageEstimator("grpo") is AdvantageEstimator.GRPO and AdvantageEstimator.GRPO == "grpo"
    assert isinstance(make_advantage("reinforce"), DiscountedReturns)


def test_bad_input():
    with pytest.raises(ValueError, match=r"gamma must be in \[0.0, 1.0\], got 1.5"):
        GAEAdvantage(gamma=1.5)
    with pytest.raises(ValueError, match=r"lmbda must be in \[0.0, 1.0\], got -0.1"):
        GAEAdvantage(lmbda=-0.1)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; use one of"):
        make_advantage("ppo")
    with pytest.raises(KeyError, match="GAEAdvantage reads 'state_value'"):
        GAEAdvantage()(make_trajectory_batch([2]))
    batch = make_trajectory_batch([2])
    batch[keys.STATE_VALUE] = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"'state_value' must have shape \(1, 2, 1\), got \(1, 2\)"):
        GAEAdvantage()(batch)
    with pytest.raises(ValueError, match="x and mask must share a shape"):
        masked_whiten(torch.zeros(2), torch.ones(3, dtype=torch.bool))


# -- issue 12 regressions --


def _holed(values=None, gamma_rewards=(0.0, 0.0, 1.0)):
    batch = make_trajectory_batch([3], [gamma_rewards[2]])
    batch[keys.REWARD][0, :2, 0] = torch.tensor(gamma_rewards[:2])
    batch[keys.MASK][0, 1] = False  # a hole in the middle of the trajectory
    batch[keys.STATE_VALUE] = torch.zeros(1, 3, 1) if values is None else torch.tensor(values).reshape(1, 3, 1)
    return batch


def test_mask_hole_does_not_cut_gae_or_returns():
    gae = GAEAdvantage(gamma=1.0, lmbda=1.0)(_holed())[keys.ADVANTAGE].flatten().tolist()
    assert gae == [1.0, 0.0, 1.0]  # the seeds give [1, 1, 1]; the masked step's own advantage is 0 here
    ret = DiscountedReturns(gamma=1.0)(_holed())[keys.ADVANTAGE].flatten().tolist()
    assert ret == [1.0, 0.0, 1.0]
    skip = DiscountedReturns(gamma=0.5)(_holed())[keys.ADVANTAGE].flatten().tolist()
    assert skip == [0.5, 0.0, 1.0]  # "skip": the masked step is not a step, one discount


def _seed_gae(r, v, mask, gamma, lmbda):
    """OpenRLHF / LightRFT get_advantages_and_returns: values and rewards times the mask, every column a step."""
    r, v = [a * m for a, m in zip(r, mask, strict=True)], [a * m for a, m in zip(v, mask, strict=True)]
    adv, last = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nv = v[t + 1] if t + 1 < len(r) else 0.0
        last = r[t] + gamma * nv - v[t] + gamma * lmbda * last
        adv[t] = last
    return adv


def test_masked_steps_zero_matches_the_seeds():
    values = [0.3, 0.7, 0.2]
    out = GAEAdvantage(gamma=0.9, lmbda=0.8, masked_steps="zero")(_holed(values, (0.5, 0.25, 1.0)))
    expect = _seed_gae([0.5, 0.25, 1.0], values, [1, 0, 1], 0.9, 0.8)
    expect[1] = 0.0  # the masked step's own advantage is 0
    torch.testing.assert_close(out[keys.ADVANTAGE].flatten(), torch.tensor(expect))
    ret = DiscountedReturns(gamma=0.5, masked_steps="zero")(_holed())[keys.ADVANTAGE].flatten().tolist()
    assert ret == [0.25, 0.0, 1.0]  # the masked step counts as a zero-reward step: two discounts


def test_masked_steps_skip_equals_the_trajectory_without_them():
    values = [0.3, 0.7, 0.2]
    holed = GAEAdvantage(gamma=0.9, lmbda=0.8)(_holed(values, (0.5, 0.25, 1.0)))
    plain = make_trajectory_batch([2], [1.0])
    plain[keys.REWARD][0, 0, 0] = 0.5
    plain[keys.STATE_VALUE] = torch.tensor([[[0.3], [0.2]]])
    plain = GAEAdvantage(gamma=0.9, lmbda=0.8)(plain)
    torch.testing.assert_close(holed[keys.ADVANTAGE][0, [0, 2]], plain[keys.ADVANTAGE][0])
    torch.testing.assert_close(holed[keys.VALUE_TARGET][0, [0, 2]], plain[keys.VALUE_TARGET][0])


def test_masked_first_step_starts_its_own_trajectory():
    steps = to_steps_layout(make_trajectory_batch([2, 3], [1.0, 2.0]), rows=1)
    steps[keys.MASK][0, 2] = False
    out = DiscountedReturns(gamma=1.0)(steps)[keys.ADVANTAGE].flatten().tolist()
    assert out == [1.0, 1.0, 0.0, 2.0, 2.0]


def test_whiten_of_equal_values_is_zero():
    x = torch.full((7,), 100.1)
    assert masked_whiten(x, torch.ones(7, dtype=torch.bool)).tolist() == [0.0] * 7


def test_bad_masked_steps():
    with pytest.raises(ValueError, match="unknown masked_steps 'drop'; use one of"):
        GAEAdvantage(masked_steps="drop")
