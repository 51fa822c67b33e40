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

