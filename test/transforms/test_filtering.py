import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch, to_steps_layout
from tokengym.transforms import ClipFilterWeights, ZeroStdGroupFilter, clip_filter_weights


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


def test_clip_filter_weights():
    lp = torch.log(torch.tensor([[1.0, 0.1, 3.0, 1.2]]))
    b = make_trajectory_batch([3], steps=4)
    b[keys.RAW_LOG_PROB] = lp + b[keys.ACTION_LOG_PROB]
    out = ClipFilterWeights(low=0.5, high=2.0)(b)
    assert out[keys.LOSS_WEIGHT].tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_bad_input():
    with pytest.raises(ValueError, match="unknown filter mode 'keep'"):
        ZeroStdGroupFilter("keep")
    with pytest.raises(ValueError, match=r"eps must be in \[0.0, inf\], got -1.0"):
        ZeroStdGroupFilter(eps=-1)
    with pytest.raises(ValueError, match=r"high must be in \[1.0, inf\], got 0.5. Pass low <= high."):
        ClipFilterWeights(low=1.0, high=0.5)
    with pytest.raises(ValueError, match="must share a shape"):
        clip_filter_weights(torch.zeros(2), torch.zeros(2), torch.ones(3, dtype=torch.bool), low=0.5, high=2)
    with pytest.raises(KeyError, match="ClipFilterWeights reads 'raw_log_prob'"):
        ClipFilterWeights(low=0.5, high=2.0)(make_trajectory_batch([2]))
