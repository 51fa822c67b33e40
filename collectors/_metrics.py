"""Metrics of a collected batch: what a user of an RL-for-LLM library expects to log."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs.turns.self_play import batch_players

__all__ = ["batch_metrics", "collector_metrics", "policy_counts", "sum_counts"]

_NAN = float("nan")
_GAUGES = {"servers_up": min}  # counters that are a state, not a sum: Ray workers sharing servers each count them all


def batch_metrics(batch: TensorDictBase | None, elapsed: float, version: int, steps: int, *,
                  is_last_step_only: bool = False) -> dict[str, float]:  # fmt: skip
    """Reward mean/std, zero-std groups, response lengths, truncation, KL, tokens/s and version lag.

    ``batch=None`` (no batch yet) gives the same keys: zeros, and NaN where no value exists (the rewards
    and lengths of a batch with no finished trajectory, ``kl_mean`` of a batch without ``keys.KL``).
    """
    out = {"tokens": 0, "tokens_per_s": 0.0, "finished": 0, "policy_version": version, "steps": steps,
           "staleness_mean": 0.0, "staleness_max": 0.0, "mean_reward": _NAN, "reward_std": _NAN,
           "mean_response_len": _NAN, "max_response_len": _NAN, "truncated_fraction": _NAN,
           "zero_std_group_fraction": _NAN, "kl_mean": _NAN}  # fmt: skip
    if batch is None:
        return out
    mask = batch.get(keys.MASK) if not is_last_step_only else torch.ones(batch.shape, dtype=torch.bool)
    done = batch.get(keys.DONE).squeeze(-1) & mask
    n_done = int(done.sum())
    names = batch.keys(True)
    reward = batch.get(keys.REWARD_RAW if keys.REWARD_RAW in names else keys.REWARD).squeeze(-1)
    tokens = int(batch.get(keys.MASK).sum()) if not is_last_step_only else int(batch.get(keys.RESPONSE_LEN).sum() + n_done)
    versions, n_valid = batch.get(keys.POLICY_VERSION), int(mask.sum())
    out.update(tokens=tokens, tokens_per_s=tokens / max(elapsed, 1e-9), finished=n_done)
    if n_valid:  # reductions over the mask, not a boolean-indexed copy of the versions
        out.update(staleness_mean=float(version - (versions * mask).sum(dtype=torch.float64) / n_valid),
                   staleness_max=float(version - torch.where(mask, versions, version).min()))  # fmt: skip
    if n_done:
        at = done.nonzero(as_tuple=True)  # once: each boolean index would resolve the mask again
        final = reward[at].double()
        resp = batch.get((keys.NEXT, keys.RESPONSE_LEN))[at].float()
        truncated = batch.get(keys.TRUNCATED).squeeze(-1)[at]
        groups = batch.get(keys.GROUP_ID)[at]
        players = batch_players(batch)
        if players:  # self-play: a role is compared with itself (RoleAdvantage), so count (group, role) pairs
            groups = groups * players + batch.get(keys.SAMPLE_ID)[at] % players
        out.update(mean_reward=float(final.mean()), reward_std=float(final.std()) if n_done > 1 else 0.0,
                   mean_response_len=float(resp.mean()), max_response_len=float(resp.max()),
                   truncated_fraction=float(truncated.float().mean()),
                   zero_std_group_fraction=_zero_std_fraction(final, groups))  # fmt: skip
    if keys.KL in names:
        out["kl_mean"] = float(batch.get(keys.KL)[mask].float().mean())
    return out


def collector_metrics(batch: TensorDictBase | None, elapsed: float, version: int, steps: int, *,
                      is_last_step_only: bool = False, counts: tuple[Mapping, ...] = (),
                      postproc=None) -> dict[str, float]:  # fmt: skip
    """A collector's ``metrics``: :func:`batch_metrics`, then each mapping of ``counts`` (counters), then
    ``postproc.metrics()`` when the postproc has it. ``batch=None`` gives the metrics before the first
    batch, with the keys every batch's metrics has."""
    out = batch_metrics(batch, elapsed, version, steps, is_last_step_only=is_last_step_only)
    for part in counts:
        out.update(part)
    extra = getattr(postproc, "metrics", None)
    if callable(extra):
        out.update(extra())
    return out


def policy_counts(policy) -> dict[str, int | float]:
    """A policy's counters (its optional ``counts()``: a server fleet's servers up, failovers, reloads...), which
    the collector adds to its metrics; ``{}`` for a policy without them."""
    counts = getattr(policy, "counts", None)
    return dict(counts()) if callable(counts) else {}


def sum_counts(parts) -> dict[str, int | float]:
    """Counters of several collectors (Ray workers) added up, key by key; ``servers_up`` (workers share the
    servers) is the smallest any worker reports.

    Example:
        >>> sum_counts([{"failed_prompts": 1, "servers_up": 2}, {"failed_prompts": 2, "servers_up": 1}])
        {'failed_prompts': 3, 'servers_up': 1}
    """
    out: dict[str, int | float] = {}
    for part in parts:
        for name, value in part.items():
            combine = _GAUGES.get(name)
            out[name] = value if name not in out else combine(out[name], value) if combine else out[name] + value
    return out


def _zero_std_fraction(rewards: torch.Tensor, groups: torch.Tensor) -> float:
    """Fraction of the groups of finished samples whose rewards are all equal, a group of one sample included (a
    group advantage gives it 0, as it gives equal rewards: no signal either way). A self-play batch's groups are its
    ``(group, role)`` pairs (:func:`~tokengym.llm_envs.turns.self_play.batch_players`).

    Example:
        >>> _zero_std_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5], dtype=torch.float64), torch.tensor([0, 0, 1, 1, 2]))
        0.6666666666666666
    """
    _, inverse = groups.unique(return_inverse=True)
    n = int(inverse.max()) + 1
    lo = torch.full((n,), float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, rewards, "amin")
    hi = torch.full((n,), -float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, rewards, "amax")
    return float((lo == hi).double().mean())
