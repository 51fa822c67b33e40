import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch, to_steps_layout
from tokengym.transforms import GroupAdvantage, group_advantages, group_stats, make_advantage


def _ordered(td):
    """Advantages of the valid steps, ordered by (trajectory, response step)."""
    mask = td[keys.MASK]
    order = (td[keys.TRAJ_ID] * 10_000 + td[keys.RESPONSE_LEN])[mask].argsort()
    return td[keys.ADVANTAGE][mask][order]

R = torch.tensor([1.0, 0.0, 0.0, 3.0, 5.0])
G = torch.tensor([0, 0, 0, 8, 8])


def test_group_stats():
    mean, std, n = group_stats(R, G)
    torch.testing.assert_close(mean, torch.tensor([1 / 3, 1 / 3, 1 / 3, 4.0, 4.0]))
    torch.testing.assert_close(std, torch.tensor([0.57735, 0.57735, 0.57735, 1.41421, 1.41421]), atol=1e-4, rtol=0)
    assert n.tolist() == [3, 3, 3, 2, 2]


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("grpo", [(2 / 3) / 0.57735, (-1 / 3) / 0.57735, (-1 / 3) / 0.57735, -1 / 1.41421, 1 / 1.41421]),
        ("dr_grpo", [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0]),
        ("reinforce_pp", [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0]),
        ("rloo", [1.0, -0.5, -0.5, -2.0, 2.0]),
    ],
)
def test_estimators_hand_computed(estimator, expected):
    torch.testing.assert_close(group_advantages(R, G, estimator, eps=0.0), torch.tensor(expected), atol=1e-4, rtol=0)


def test_broadcast_to_tokens_and_singletons():
    batch = make_trajectory_batch([2, 3, 1], [1.0, 0.0, 7.0], group_size=2, steps=4)
    out = GroupAdvantage("dr_grpo", use_partial_groups=True)(batch)
    adv = out[keys.ADVANTAGE].squeeze(-1)
    assert adv[0, :2].tolist() == [0.5, 0.5] and adv[1, :3].tolist() == [-0.5] * 3
    assert adv[2].tolist() == [0.0] * 4  # a lone sample has no baseline -> 0
    assert adv[0, 2:].eq(0).all()


def test_steps_batch_with_complete_trajectories():
    batch = make_trajectory_batch([2, 3, 1, 2], group_size=2)
    ref = GroupAdvantage("grpo")(batch.clone())
    steps = GroupAdvantage("grpo")(to_steps_layout(batch, rows=2))
    torch.testing.assert_close(_ordered(steps), _ordered(ref))


def test_normalize_default_for_reinforce_pp():
    assert make_advantage("reinforce_pp").normalize and not make_advantage("grpo").normalize
    out = GroupAdvantage("reinforce_pp")(make_trajectory_batch([2, 3, 1, 2], group_size=2))
    assert out[keys.ADVANTAGE].squeeze(-1)[out[keys.MASK]].mean().abs() < 1e-6


def test_bad_input():
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpoo'"):
        GroupAdvantage("grpoo")
    with pytest.raises(ValueError, match="GroupAdvantage takes a group estimator .* got 'gae'"):
        GroupAdvantage("gae")
    with pytest.raises(ValueError, match="'gae' is not a group estimator"):
        group_advantages(R, G, "gae")
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        GroupAdvantage(group_size=0)
    with pytest.raises(ValueError, match=r"group 1 has 1 samples, expected 2 \(sizes found \[1, 2\]\)"):
        GroupAdvantage(group_size=2)(make_trajectory_batch([2, 3, 1], group_size=2))
    with pytest.raises(ValueError, match="scores and group_ids must be 1-D"):
        group_stats(R, G[:2])
    batch = make_trajectory_batch([3, 3])
    batch[keys.DONE][0] = False
    with pytest.raises(ValueError, match="trajectory 0 has no done step in this batch. Collect in TRAJECTORIES"):
        GroupAdvantage()(batch)
    tail = make_trajectory_batch([3])[:, 1:]
    with pytest.raises(ValueError, match="does not start at response step 0"):
        GroupAdvantage()(tail)
    with pytest.raises(KeyError, match="reads 'group_id'"):
        GroupAdvantage()(make_trajectory_batch([3]).exclude(keys.GROUP_ID))


# -- issue 12 regressions --


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_equal_rewards_give_exactly_zero_advantage(estimator, eps):
    # float32 mean of seven 100.1s is one ulp off: the std was tiny but not 0 and GRPO gave ~0.9
    scores = torch.full((7,), 100.1, dtype=torch.float32)
    adv = group_advantages(scores, torch.zeros(7, dtype=torch.long), estimator, eps=eps)
    assert adv.tolist() == [0.0] * 7 and adv.dtype == torch.float32
    _, std, _ = group_stats(scores, torch.zeros(7, dtype=torch.long))
    assert std.eq(0).all()


def test_equal_reward_group_beside_others_is_zero_in_transform():
    batch = make_trajectory_batch([2, 3, 1, 2, 4], [100.1] * 3 + [0.0, 1.0], group_size=3)
    adv = GroupAdvantage("grpo", use_partial_groups=True)(batch)[keys.ADVANTAGE].squeeze(-1)
    assert adv[:3].eq(0).all() and adv[3, 0] < 0 < adv[4, 0]


def test_masked_first_step_keeps_trajectories_apart():
    # one row: trajectory 0 (score 1), then trajectory 1 (score 0) whose first step is masked
    steps = to_steps_layout(make_trajectory_batch([2, 3], [1.0, 0.0], group_size=2), rows=1)
    steps[keys.MASK][0, 2] = False
    adv = GroupAdvantage("dr_grpo")(steps)[keys.ADVANTAGE].squeeze(-1)
    assert adv[0].tolist() == [0.5, 0.5, 0.0, -0.5, -0.5]


# -- issue 20: a fragment of a group raises unless told otherwise --


def test_fragment_raises_by_default_and_partial_groups_is_explicit():
    fragment = make_trajectory_batch([2, 3, 1], [1.0, 0.0, 7.0], group_size=2, steps=4)  # group 1: one of 2 samples
    with pytest.raises(ValueError, match="group 1 has 1 samples, expected 2.*use_partial_groups=True"):
        GroupAdvantage("grpo")(fragment.clone())
    out = GroupAdvantage("grpo", use_partial_groups=True)(fragment)
    assert out[keys.ADVANTAGE].squeeze(-1)[2].eq(0).all()  # the lone sample: no baseline
    # equal-sized fragments: sample ids show the split (samples 2, 3 of groups of 4 without 0, 1)
    split = make_trajectory_batch([2, 3, 1, 2], group_size=2)
    split.set(keys.SAMPLE_ID, split[keys.SAMPLE_ID] + 2)
    with pytest.raises(ValueError, match="holds sample id 3 but only 2 samples are in the batch"):
        GroupAdvantage("grpo")(split)
    whole = make_trajectory_batch([2, 3, 1, 2], [1.0, 0.0, 0.0, 1.0], group_size=2)
    adv = GroupAdvantage("dr_grpo")(whole)[keys.ADVANTAGE].squeeze(-1)
    assert adv[:, 0].tolist() == [0.5, -0.5, -0.5, 0.5]
