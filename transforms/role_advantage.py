"""Per-role advantages of self-play batches: GRPO per (group, role), or SPIRAL's role-conditioned baseline.

In self-play (``tokengym.llm_envs.make_self_play_env``) one policy plays every seat of a game, and the
seats are not alike (the first player of TicTacToe wins more often): comparing a first player's return with a second
player's would credit the seat, not the play. A trajectory's role is ``sample_id % num_players`` (the self-play env
numbers player ``r`` of game ``j`` of a group ``j * num_players + r``), and its advantage compares it with its own role
only:

- ``baseline="group"`` (per-role GRPO): the group estimator (``"grpo"``, ``"dr_grpo"``, ``"rloo"``) over the
  trajectories of one ``(group_id, role)``, i.e. the same seat in the ``games_per_group`` games of one seed.
- ``baseline="ema"`` (SPIRAL's role-conditioned advantage estimation, Liu et al. 2025): one baseline per role, an
  exponential moving average of that role's returns over batches, ``b_r <- decay * b_r + (1 - decay) * mean_r``
  (``mean_r`` the mean return of role ``r`` in the batch; ``b_r`` starts at 0), then ``A = R - b_r`` with the updated
  baseline. The baselines are buffers (in ``state_dict``): one transform per game, as SPIRAL keeps one per (game,
  role).

Each trajectory's return is the sum of its rewards; its advantage is broadcast to its valid steps under
``keys.ADVANTAGE`` [N, T, 1], as :class:`~tokengym.transforms.GroupAdvantage` writes it.

A collected batch says how many players its games have (its prompt table's seat metadata,
:func:`~tokengym.llm_envs.turns.self_play.batch_players`): another ``num_players``, or a batch with no roles (not
self-play), raises a ValueError. With ``baseline="group"``, a batch in which every ``(group_id, role)`` holds one
trajectory (``games_per_group=1``, the env's default) gets advantages of 0 and a
:class:`~tokengym.errors.TokenGymWarning`, once per transform.
"""

from __future__ import annotations

import warnings

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import TokenGymWarning
from tokengym.llm_envs.turns.self_play import batch_players
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import check_number, require
from tokengym.transforms.advantages import AdvantageEstimator
from tokengym.transforms.group_advantages import group_advantages, sequence_scores

__all__ = ["RoleAdvantage", "trajectory_roles"]

_ONE_PER_ROLE = (
    "{owner}: every (group, role) of the batch holds one trajectory ({n} of them: games_per_group=1, the self-play "
    "env's default), so every advantage is 0 and the loss trains on nothing; play several games per seed: "
    "make_self_play_env(..., games_per_group=4) (games_per_group >= 2), or use baseline='ema' (SPIRAL's baseline per "
    "role)"
)
_BASELINES = ("group", "ema")
_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def trajectory_roles(td: TensorDictBase, seq: torch.Tensor, num_players: int, owner: str) -> torch.Tensor:
    """The role (M,) of each trajectory numbered by ``seq`` (from :func:`sequence_scores`): ``sample_id %
    num_players``."""
    sample = require(td, keys.SAMPLE_ID, owner)
    mask = seq >= 0
    roles = torch.zeros(int(seq.max()) + 1 if bool(mask.any()) else 0, dtype=torch.int64, device=sample.device)
    roles[seq[mask]] = sample[mask] % num_players
    return roles


class RoleAdvantage(BatchTransform):
    """Advantages per role of a self-play batch (see the module docstring), under ``keys.ADVANTAGE`` [N, T, 1].

    Args:
        num_players: seats per game (the role is ``sample_id % num_players``).
        baseline: ``"group"`` (the group estimator per ``(group_id, role)``) or ``"ema"`` (SPIRAL's role-conditioned
            moving-average baseline per role).
        estimator: for ``baseline="group"``: ``"grpo"`` (r - mean) / (std + eps), ``"dr_grpo"`` r - mean or
            ``"rloo"`` r - mean of the others.
        decay: for ``baseline="ema"``: the weight of the old baseline, in [0, 1).
        eps: added to the std (GRPO).
        reward_key: the reward summed into a trajectory's return.

    Raises:
        ValueError: at the call, a collected batch whose prompts say its games have another number of players, or
            that has no roles (not collected from a self-play env).

    Example:
        >>> from tokengym.testing import make_trajectory_batch
        >>> b = make_trajectory_batch([2, 2, 2, 2], [1.0, -1.0, -1.0, 1.0], group_size=4)  # 2 games, 2 players
        >>> RoleAdvantage(2, estimator="dr_grpo")(b)[keys.ADVANTAGE][:, -1, 0].tolist()
        [1.0, -1.0, -1.0, 1.0]
        >>> t = RoleAdvantage(2, baseline="ema", decay=0.5)
        >>> t(b)[keys.ADVANTAGE][:, -1, 0].tolist(), t.baselines.tolist()  # both roles' mean is 0
        ([1.0, -1.0, -1.0, 1.0], [0.0, 0.0])
    """

    def __init__(self, num_players: int = 2, *, baseline: str = "group", estimator: str = "grpo", decay: float = 0.95,
                 eps: float = 1e-6, reward_key=keys.REWARD) -> None:  # fmt: skip
        if isinstance(num_players, bool) or not isinstance(num_players, int) or num_players < 1:
            raise ValueError(f"num_players must be a positive int, got {num_players!r}")
        if baseline not in _BASELINES:
            raise ValueError(f"baseline must be one of {_BASELINES}, got {baseline!r}")
        estimator = AdvantageEstimator.parse(estimator).value
        if estimator not in _ESTIMATORS:
            raise ValueError(f"RoleAdvantage takes estimator in {_ESTIMATORS}, got {estimator!r}")
        super().__init__(in_keys=[reward_key, keys.GROUP_ID, keys.SAMPLE_ID, keys.TRAJ_ID, keys.DONE,
                                  keys.RESPONSE_LEN], out_keys=[keys.ADVANTAGE])  # fmt: skip
        self.num_players, self.baseline, self.estimator = num_players, baseline, estimator
        self.decay = check_number("decay", decay, low=0.0)
        if self.decay >= 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r} (1 would never move the baseline)")
        self.eps = check_number("eps", eps, low=0.0)
        self.reward_key = reward_key
        self.register_buffer("baselines", torch.zeros(num_players, dtype=torch.float64))
        self._has_warned = False

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        self._check_players(td, owner)
        seq, scores, groups = sequence_scores(td, reward_key=self.reward_key, owner=owner)
        roles = trajectory_roles(td, seq, self.num_players, owner)
        if self.baseline == "group":
            seats = groups * self.num_players + roles
            self._warn_one_per_role(td, seq, seats)
            adv = group_advantages(scores, seats, self.estimator, eps=self.eps)
        else:
            adv = (scores.double() - self._update_baselines(scores.double(), roles)[roles]).float()
        mask = seq >= 0
        td.set(keys.ADVANTAGE, (adv[seq.clamp(min=0)] * mask).unsqueeze(-1))
        return td

    def _check_players(self, td: TensorDictBase, owner: str) -> None:
        """A ValueError when the batch's prompts say its games have another number of players, or no roles."""
        players = batch_players(td)
        if players is None or players == self.num_players:
            return
        if not players:
            raise ValueError(f"{owner}(num_players={self.num_players}) got a batch with no roles: its prompts carry no "
                             f"'role' metadata (it was not collected from a self-play env); collect it from "
                             f"make_self_play_env(...) (or make_textarena_self_play_env), or use GroupAdvantage for "
                             f"single-player batches")  # fmt: skip
        sample, mask = td.get(keys.SAMPLE_ID), td.get(keys.MASK, None)
        seen = sorted(set((sample if mask is None else sample[mask]).remainder(players).tolist()))
        raise ValueError(f"{owner}(num_players={self.num_players}) got a batch of {players}-player games (roles seen "
                         f"{seen}, from its prompts' metadata): its roles would be sample_id % {self.num_players}, "
                         f"the wrong seats; build {owner}(num_players={players})")  # fmt: skip

    def _warn_one_per_role(self, td: TensorDictBase, seq: torch.Tensor, seats: torch.Tensor) -> None:
        """Warn (once) when every (group, role) holds one trajectory: per-role GRPO gives every advantage 0."""
        if self._has_warned or not len(seats) or len(torch.unique(seats)) != len(seats):
            return
        if bool((td.get(keys.SAMPLE_ID)[seq >= 0] >= self.num_players).any()):
            return  # fragments of groups of several games (split across batches): other batches hold the rest
        self._has_warned = True
        warnings.warn(_ONE_PER_ROLE.format(owner=type(self).__name__, n=len(seats)), TokenGymWarning, stacklevel=3)

    def _update_baselines(self, scores: torch.Tensor, roles: torch.Tensor) -> torch.Tensor:
        """Move each role's baseline toward the batch's mean return of that role (roles absent keep theirs)."""
        n = self.num_players
        sums = torch.zeros(n, dtype=torch.float64, device=scores.device).index_add_(0, roles, scores)
        counts = torch.zeros(n, dtype=torch.float64, device=scores.device).index_add_(0, roles, torch.ones_like(scores))
        base = self.baselines.to(scores.device)
        moved = self.decay * base + (1 - self.decay) * sums / counts.clamp(min=1)
        self.baselines.copy_(torch.where(counts > 0, moved, base).to(self.baselines.device))
        return self.baselines.to(scores.device)

    def __repr__(self) -> str:
        return f"RoleAdvantage(num_players={self.num_players}, baseline={self.baseline!r}, estimator={self.estimator!r})"
