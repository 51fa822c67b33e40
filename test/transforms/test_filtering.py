import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch, to_steps_layout
from tokengym.transforms import (
    ClipFilterLikeWeights,
    RatioWindowWeights,
    ZeroStdGroupFilter,
    clip_filter_like_weights,
    ratio_window_weights,
)


def _batch():
    return make_trajectory_batch([2, 3, 1, 2, 2, 2], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0], group_size=2)


def test_drop_and_mask():
    f = ZeroStdGroupFilter("drop")
    out = f(_batch())
    assert out[keys.GROUP_ID][:, 0].tolist() == [1, 1] and f.metrics()["filtered_fraction"] == pytest.approx(2 / 3)
    masked = ZeroStdGroupFilter("mask")(_batch())
    assert masked[keys.MASK].sum(-1).tolist() == [0, 0, 1, 2, 0, 0]


def test_mask_works_on_steps_batches_drop_does_not():
    steps = to_steps_layout(_batch(), rows=2)
    out = ZeroStdGroupFilter("mask")(steps.clone())
    assert out[keys.MASK].sum() == 3
    with pytest.raises(ValueError, match="needs a TRAJECTORIES batch"):
        ZeroStdGroupFilter("drop")(steps)


def test_ratio_window_weights():
    lp = torch.log(torch.tensor([[1.0, 0.1, 3.0, 1.2]]))
    b = make_trajectory_batch([3], steps=4)
    b[keys.RAW_LOG_PROB] = lp + b[keys.ACTION_LOG_PROB]
    out = RatioWindowWeights(low=0.5, high=2.0)(b)
    assert out[keys.LOSS_WEIGHT].tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_bad_input():
    with pytest.raises(ValueError, match="unknown filter mode 'keep'"):
        ZeroStdGroupFilter("keep")
    with pytest.raises(ValueError, match=r"eps must be in \[0.0, inf\], got -1.0"):
        ZeroStdGroupFilter(eps=-1)
    with pytest.raises(ValueError, match=r"high must be in \[1.0, inf\], got 0.5. Pass low <= high."):
        RatioWindowWeights(low=1.0, high=0.5)
    with pytest.raises(ValueError, match="must share a shape"):
        ratio_window_weights(torch.zeros(2), torch.zeros(2), torch.ones(3, dtype=torch.bool), low=0.5, high=2)
    with pytest.raises(KeyError, match="RatioWindowWeights reads 'raw_log_prob'"):
        RatioWindowWeights(low=0.5, high=2.0)(make_trajectory_batch([2]))


# -- issue 12 regressions --


def test_zero_std_filter_catches_float32_equal_groups():
    batch = make_trajectory_batch([2, 3, 1, 2, 4, 3, 2], [100.1] * 7, group_size=7)
    f = ZeroStdGroupFilter("mask")
    out = f(batch)
    assert f.filtered_fraction == 1.0 and not out[keys.MASK].any()


def _seed_clip_filter_like(rewards, clip_eps, lamda):
    """LightRFT's clip_filter_like_weight_func, written out for [groups, samples] rewards."""
    zero = rewards.std(-1, keepdim=True) == 0.0
    if zero.sum() == rewards.size(0):
        return torch.ones_like(rewards)
    weights = torch.ones_like(rewards) * (rewards.size(0) / (rewards.size(0) - zero.sum())).clamp(max=clip_eps)
    weights[zero.repeat(1, rewards.size(-1))] = lamda
    return weights


@pytest.mark.parametrize(("clip_eps", "lamda"), [(3.0, 1.0), (1.5, 0.0), (10.0, 0.3)])
def test_clip_filter_like_weights_match_lightrft(clip_eps, lamda):
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [2.0, 2.0, 2.0]])
    groups = torch.arange(5).repeat_interleave(3)
    out = clip_filter_like_weights(rewards.flatten(), groups, clip_eps=clip_eps, lamda=lamda)
    torch.testing.assert_close(out, _seed_clip_filter_like(rewards, clip_eps, lamda).flatten())
    same = torch.ones(6)
    assert clip_filter_like_weights(same, torch.tensor([0, 0, 0, 1, 1, 1]), lamda=0.0).tolist() == [1.0] * 6


def test_clip_filter_like_weights_transform_broadcasts_to_tokens():
    batch = make_trajectory_batch([2, 3, 1, 2], [1.0, 1.0, 0.0, 1.0], group_size=2, steps=3)
    out = ClipFilterLikeWeights(clip_eps=3.0, lamda=0.5)(batch)
    # group 0 has zero std (lamda), group 1 does not: n / (n - n_zero) = 2 / 1
    assert out[keys.LOSS_WEIGHT].tolist() == [[0.5, 0.5, 0.0], [0.5, 0.5, 0.5], [2.0, 0.0, 0.0], [2.0, 2.0, 0.0]]


def test_weights_compose_by_multiplying():
    batch = make_trajectory_batch([2, 2], [1.0, 0.0], group_size=1)
    batch[keys.RAW_LOG_PROB] = batch[keys.ACTION_LOG_PROB].clone()
    batch[keys.RAW_LOG_PROB][0, 1] += 5.0  # ratio e^5: outside the window
    out = RatioWindowWeights(low=0.5, high=2.0)(batch)
    out = ClipFilterLikeWeights(clip_eps=3.0, lamda=0.25)(out)  # two singleton groups: all zero-std -> 1
    assert out[keys.LOSS_WEIGHT].tolist() == [[1.0, 0.0], [1.0, 1.0]]


def test_clip_filter_like_bad_input():
    with pytest.raises(ValueError, match=r"clip_eps must be in \(0.0, inf\], got 0.0. LightRFT uses clip_eps=3.0."):
        ClipFilterLikeWeights(clip_eps=0.0)
    with pytest.raises(ValueError, match=r"lamda must be in \[0.0, inf\], got -1.0"):
        clip_filter_like_weights(torch.zeros(2), torch.zeros(2, dtype=torch.long), lamda=-1.0)
    with pytest.raises(ValueError, match="trajectory 0 has no done step"):
        ClipFilterLikeWeights()(make_trajectory_batch([3])[:, :2])
