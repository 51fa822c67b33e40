"""RoleAdvantage: per-(group, role) GRPO and SPIRAL's role-conditioned moving-average baseline, on hand-built batches."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tokengym.errors import TokenGymWarning
from tokengym.llm_envs import PromptTable, keys
from tokengym.testing import make_trajectory_batch, to_steps_layout
from tokengym.transforms import GroupAdvantage, RoleAdvantage


def _batch():
    # two groups of two games x two players (sample_id 0..3, role = sample_id % 2); rows of unequal lengths
    rewards = [1.0, -1.0, 0.0, 0.0, 1.0, -1.0, 1.0, -1.0]
    return make_trajectory_batch([2, 1, 3, 2, 2, 2, 1, 1], rewards, group_size=4)


def _last(td):
    """Each row's advantage (a trajectory per row, broadcast to its valid steps: read the first)."""
    adv = td[keys.ADVANTAGE].squeeze(-1)
    assert torch.equal(adv * td[keys.MASK], adv)  # 0 on padding
    return adv[:, 0].tolist()


def test_group_baseline_compares_each_role_with_itself():
    adv = RoleAdvantage(2, estimator="dr_grpo")(_batch())
    # group 0: role 0 returns {1, 0} (mean 0.5), role 1 {-1, 0} (mean -0.5); group 1: each role's returns are equal
    assert _last(adv) == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    # every valid step of a trajectory carries its advantage
    row = adv[keys.ADVANTAGE].squeeze(-1)[2]
    assert row.tolist() == [-0.5, -0.5, -0.5]
    grpo = _last(RoleAdvantage(2)(_batch()))
    s = 0.5 / (math.sqrt(0.5) + 1e-6)  # (r - mean) / (unbiased std + eps), std of {1, 0} = sqrt(0.5)
    torch.testing.assert_close(torch.tensor(grpo), torch.tensor([s, -s, -s, s, 0.0, 0.0, 0.0, 0.0]))
    # what a plain group baseline gives instead: group 0's mean is 0, so the seat's edge is credited to the play
    plain = GroupAdvantage("dr_grpo")(_batch())[keys.ADVANTAGE].squeeze(-1)[:, 0].tolist()
    assert plain[:4] == [1.0, -1.0, 0.0, 0.0]


def test_rloo_per_role():
    adv = _last(RoleAdvantage(2, estimator="rloo")(_batch()))
    assert adv == [1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # r - the other game's same seat


def test_ema_baseline_moves_per_role_across_batches():
    t = RoleAdvantage(2, baseline="ema", decay=0.5)
    first = _last(t(_batch()))
    # role 0 returns {1, 0, 1, 1}: mean 0.75, b0 = 0.5 * 0 + 0.5 * 0.75; role 1: -0.75, b1 = -0.375
    assert t.baselines.tolist() == [0.375, -0.375]
    assert first == [0.625, -0.625, -0.375, 0.375, 0.625, -0.625, 0.625, -0.625]
    second = _last(t(_batch()))
    assert t.baselines.tolist() == [0.5625, -0.5625]
    assert second == [0.4375, -0.4375, -0.5625, 0.5625, 0.4375, -0.4375, 0.4375, -0.4375]
    resumed = RoleAdvantage(2, baseline="ema", decay=0.5)
    resumed.load_state_dict(t.state_dict())  # the baselines are buffers: checkpoints carry them
    assert resumed.baselines.tolist() == [0.5625, -0.5625]


def test_steps_layout_gives_the_same_advantages():
    by_row = RoleAdvantage(2, estimator="dr_grpo")(_batch())
    packed = RoleAdvantage(2, estimator="dr_grpo")(to_steps_layout(_batch(), rows=3))
    mask = packed[keys.MASK]
    traj, adv = packed[keys.TRAJ_ID][mask], packed[keys.ADVANTAGE][mask].squeeze(-1)
    got = {int(t): float(a) for t, a in zip(traj, adv, strict=True)}
    assert got == {i: a for i, a in enumerate(_last(by_row))}


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="num_players must be a positive int"):
        RoleAdvantage(0)
    with pytest.raises(ValueError, match="baseline must be one of"):
        RoleAdvantage(2, baseline="spiral")
    with pytest.raises(ValueError, match="estimator in"):
        RoleAdvantage(2, estimator="gae")
    with pytest.raises(ValueError, match="decay must be in"):
        RoleAdvantage(2, baseline="ema", decay=1.0)


def _with_seats(batch, players: int | None):
    """``batch`` with a prompt table, as a collector records it (with its sampling settings), whose groups carry
    self-play seat metadata of ``players`` (``None``: no role)."""
    table = PromptTable(pad_token_id=0, sampling={"temperature": 1.0})
    for g in batch[keys.GROUP_ID][:, 0].unique().tolist():
        meta = {"answer": "3"} if players is None else {"game": g, "role": 0, "seed": g, "players": players}
        table.add(g, torch.tensor([1, 2]), metadata=meta)
    return batch.set_non_tensor(keys.PROMPTS, table)


def test_one_trajectory_per_group_and_role_warns_once_naming_games_per_group():
    # games_per_group=1: a group is one game, its two players sample_id 0 and 1, each (group, role) one trajectory
    batch = make_trajectory_batch([2, 1, 3, 2], [1.0, -1.0, -1.0, 1.0], group_size=2)
    t = RoleAdvantage(2)
    with pytest.warns(TokenGymWarning, match=r"every \(group, role\) of the batch holds one trajectory \(4 of them: "
                                             r"games_per_group=1.*games_per_group >= 2.*baseline='ema'"):  # fmt: skip
        out = t(batch.clone())
    assert not bool(out[keys.ADVANTAGE].any())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t(batch.clone())  # once per transform
        RoleAdvantage(2)(_batch())  # two games per group: no warning
        RoleAdvantage(2, baseline="ema")(batch.clone())  # the moving-average baseline has a signal: no warning


def test_a_batch_of_other_players_or_of_no_roles_is_refused():
    batch = make_trajectory_batch([2, 1, 3, 2, 2, 2], [1.0, -1.0, 0.0, 0.0, 1.0, -1.0], group_size=6)  # 3 games of 2
    with pytest.raises(ValueError, match=r"RoleAdvantage\(num_players=3\) got a batch of 2-player games \(roles seen "
                                         r"\[0, 1\], from its prompts' metadata\).*build RoleAdvantage\(num_players=2\)"):  # fmt: skip
        RoleAdvantage(3)(_with_seats(batch.clone(), 2))
    with pytest.raises(ValueError, match=r"RoleAdvantage\(num_players=2\) got a batch with no roles"):
        RoleAdvantage(2)(_with_seats(batch.clone(), None))
    RoleAdvantage(2)(_with_seats(batch.clone(), 2))  # the right number of players
    RoleAdvantage(3)(batch.clone())  # a batch built by hand (no sampling record, no roles): nothing to check against
