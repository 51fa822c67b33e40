"""Checks the partial-rollout tests share (imported by name: test/collectors/conftest.py puts this folder on sys.path,
as --import-mode=importlib does not)."""

from __future__ import annotations

import copy

import torch

from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.testing import PublishAfter


def perturbed(model, seed: int):
    """``model`` moved a little: weights that sample and score differently from ``model``'s."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return out


def assert_log_probs_under_their_versions(batch, published: dict, env, *, atol: float = 2e-5) -> None:
    """Each token's log-prob is the one the weights of its stamped version give (``published``: version -> model),
    teacher-forced."""
    version, mask = batch[keys.POLICY_VERSION], batch[keys.MASK]
    for v in version[mask].unique().tolist():
        forced = TransformersPolicy(published[v], env).teacher_forced_log_probs(batch)
        rows = (version == v) & mask
        torch.testing.assert_close(batch[keys.ACTION_LOG_PROB][rows], forced[rows], atol=atol, rtol=0)


class PublishTwice(PublishAfter):
    """Publishes at the k-th and the (k + 1)-th check: the second update lands as the next wave starts."""

    def is_set(self) -> bool:
        if self.checks == self.k and not getattr(self, "again", False):  # the k-th check published: once more
            self.k, self.again = self.k + 1, True
        return super().is_set()



def tree_leaves(batch, group_size: int):
    """The checks every tree batch passes (each group one whole tree: ``group_size`` leaves, sample ids 0..n-1, one
    root, each leaf's steps from its fork on its own), then ``(rows, i, fork, parent, n)`` for each leaf ``i`` of
    each group's ``rows``: its fork index, parent trajectory (-1 at the root) and step count."""
    mask, groups, traj, branch = batch[keys.MASK], batch[keys.GROUP_ID][:, 0], batch[keys.TRAJ_ID][:, 0], batch[keys.BRANCH_ID]
    for g in groups.unique().tolist():
        rows = (groups == g).nonzero().squeeze(-1).tolist()
        assert len(rows) == group_size
        assert sorted(batch[keys.SAMPLE_ID][rows, 0].tolist()) == list(range(group_size))
        assert (batch[keys.PARENT_ID][rows, 0] == -1).sum() == 1  # one root
        for i in rows:
            fork, parent, n = int(batch[keys.FORK_INDEX][i, 0]), int(batch[keys.PARENT_ID][i, 0]), int(mask[i].sum())
            assert (branch[i, fork:n] == traj[i]).all()  # its own steps after the fork
            yield rows, i, fork, parent, n
