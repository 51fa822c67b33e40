"""Dynamic sampling (DAPO): ``TRAJECTORIES`` batches of whole groups whose rewards spread, drawn until full.

A group whose samples all score alike gives GRPO no signal (every advantage is 0). DAPO's dynamic sampling
(verl's ``algorithm.filter_groups``, AReaL's ``should_accept``, SkyRL's ``dynamic_sampling``) drops such
groups and keeps sampling until the batch holds ``N`` groups that carry signal. Here the filter runs where
complete groups are released (the collector's trajectory recorder), so it is the same for every source
(``step``, ``wave``), on each Ray worker (a group is complete within one worker) and behind an
:class:`~tokengym.collectors.AsyncCollector`; a post-hoc filter of a yielded batch
(:class:`~tokengym.transforms.ZeroStdGroupFilter`) shrinks the batch instead.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import TokenGymError

__all__ = ["COUNTERS", "DynamicSampling", "DynamicSamplingError", "SpreadFilter"]

COUNTERS = ("drawn_groups", "kept_groups", "dropped_zero_spread_groups", "draw_bound_reached", "partial_batches")
"""The metric keys dynamic sampling adds (cumulative counts; on Ray, summed over the workers)."""


class DynamicSamplingError(TokenGymError, RuntimeError):
    """Dynamic sampling drew its bound of groups since the last batch without filling the batch.

    Nothing is lost: the groups kept so far stay queued, and iterating again (the same iterator) draws up to
    the bound once more. ``drawn``, ``kept`` and ``needed`` are the counts of the attempt (groups).
    """

    def __init__(self, message: str, *, drawn: int = 0, kept: int = 0, needed: int = 0) -> None:
        super().__init__(message)
        self.drawn, self.kept, self.needed = drawn, kept, needed

    def __reduce__(self):  # keyword attributes survive pickling (Ray sends the error of a worker)
        return _rebuild, (self.args[0], self.drawn, self.kept, self.needed)


def _rebuild(message: str, drawn: int, kept: int, needed: int) -> DynamicSamplingError:
    return DynamicSamplingError(message, drawn=drawn, kept=kept, needed=needed)


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling, as verl's ``algorithm.filter_groups``: pass it as
    ``CollectorOptions(dynamic_sampling=DynamicSampling(...))`` (``TRAJECTORIES`` mode, ``group_size >= 2``).

    Every yielded batch holds ``N = batch_size / group_size`` whole groups whose scores spread: ``max - min >
    min_spread``, a trajectory's score being its reward summed over its steps (verl's ``seq_reward``). A
    complete group that does not spread is dropped when it completes, and sampling goes on until the batch
    is full. Sampling itself is unchanged: the batches are the spread groups of the stream the same collector
    yields without the option, in the same order.

    Bounds and ends, counted in ``metrics`` (cumulative: ``drawn_groups`` = ``kept_groups`` +
    ``dropped_zero_spread_groups``, plus ``draw_bound_reached`` and ``partial_batches``):

    - **The draw bound.** Once ``max_num_gen_batches * N`` groups have completed since the last batch without
      filling it, ``next()`` raises :class:`~tokengym.errors.DynamicSamplingError`, as verl raises when
      ``max_num_gen_batches`` is reached (``draw_bound_reached`` counts it). The kept groups stay queued and
      the same iterator goes on: the next ``next()`` draws up to the bound again. The bound is checked
      between source advances, so a wave that completes many groups at once may pass it by one wave.
    - **The prompts run out** (or ``total_steps`` is reached): the groups kept so far are the last, smaller
      batch, as without the option (``partial_batches`` counts it; none kept: iteration ends).

    Args:
        min_spread: a group is kept when ``max(score) - min(score) > min_spread`` (0: any difference).
        max_num_gen_batches: the draw bound, in batches' worth of groups (``N`` each) per yielded batch;
            0 draws without a bound (verl's ``max_num_gen_batches=0``).
        reward_key: the reward summed into a trajectory's score; ``None``: ``keys.REWARD_RAW`` where the
            steps have it (a KL transform in the env shapes ``keys.REWARD`` per token), else ``keys.REWARD``.

    Example:
        >>> from tokengym.collectors import CollectorOptions, DynamicSampling, TokenCollector
        >>> from tokengym.collectors.policies import TransformersPolicy
        >>> from tokengym.llm_envs import PromptSource, TokenEnv, keys
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> def reward(responses, prompts, metadata):  # even prompts score every sample alike: no signal
        ...     return [float(len(r)) if int(p[0]) % 2 else 0.0 for r, p in zip(responses, prompts, strict=True)]
        >>> source = PromptSource([f"{a}+{a}=" for a in range(10)], tok, group_size=4)
        >>> env = TokenEnv(source, tok, reward, batch_size=8, max_new_tokens=4, model_config=model.config)
        >>> options = CollectorOptions(dynamic_sampling=DynamicSampling(max_num_gen_batches=8))
        >>> collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=8,
        ...                            options=options)
        >>> batch = next(iter(collector))
        >>> scores = batch[keys.REWARD].sum((1, 2)).view(2, 4)  # 2 groups of 4 samples, in order
        >>> batch.shape[0], bool(((scores.amax(1) - scores.amin(1)) > 0).all())
        (8, True)
        >>> m = collector.metrics
        >>> m["kept_groups"] >= 2, m["drawn_groups"] == m["kept_groups"] + m["dropped_zero_spread_groups"]
        (True, True)
    """

    min_spread: float = 0.0
    """A group is kept when ``max(score) - min(score) > min_spread``."""
    max_num_gen_batches: int = 10
    """Groups drawn per yielded batch at most, in multiples of ``N``; 0: no bound."""
    reward_key: str | tuple[str, ...] | None = None
    """The reward summed into a trajectory's score (``None``: ``keys.REWARD_RAW`` if present, else ``keys.REWARD``)."""

    def __post_init__(self) -> None:
        if isinstance(self.min_spread, bool) or not isinstance(self.min_spread, int | float) or not (
                math.isfinite(self.min_spread) and self.min_spread >= 0):  # fmt: skip
            raise ValueError(f"min_spread must be a finite number >= 0 (0 keeps any group whose scores differ), "
                             f"got {self.min_spread!r}")  # fmt: skip
        n = self.max_num_gen_batches
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"max_num_gen_batches must be an int >= 0 (0: draw without a bound), got {n!r}")
        if self.reward_key is not None and not isinstance(self.reward_key, str | tuple):
            raise TypeError(f"reward_key must be a key (a string or a tuple of strings) or None, got {self.reward_key!r}")


def _flat(key) -> str:
    return ".".join(key) if isinstance(key, tuple) else key


class SpreadFilter:
    """The judge a trajectory recorder asks about each complete group, with the counts and the draw bound.

    Args:
        options: the :class:`DynamicSampling` settings.
        groups_per_batch: ``N``, the groups of one batch.
    """

    def __init__(self, options: DynamicSampling, groups_per_batch: int) -> None:
        self.options, self.groups_per_batch = options, groups_per_batch
        self.limit = options.max_num_gen_batches * groups_per_batch  # 0: no bound
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.drawn = 0  # groups judged since the last delivered batch (or the last DynamicSamplingError)

    def score_name(self, names) -> str:
        """The flat name of the reward to sum among the recorded ``names``."""
        if self.options.reward_key is not None:
            name = _flat(self.options.reward_key)
            if name not in names:
                raise KeyError(f"DynamicSampling(reward_key={self.options.reward_key!r}) reads {name!r}, which the "
                               f"collected steps do not have; they have {sorted(names)}")  # fmt: skip
            return name
        raw = _flat(keys.REWARD_RAW)
        return raw if raw in names else _flat(keys.REWARD)

    @staticmethod
    def scores(rewards: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> list[float]:
        """The reward (R, T) of each of ``rows`` summed over its first ``lengths`` steps, as floats."""
        if len(rows) <= 4:  # a step ends one trajectory or so: sums of row views beat a gather and a masked pass
            return [float(rewards[r, :n].sum(dtype=torch.float64)) for r, n in zip(rows.tolist(), lengths.tolist(), strict=True)]
        picked = rewards.index_select(0, rows)  # (n, T)
        steps = torch.arange(picked.shape[1])
        return torch.where(steps < lengths[:, None], picked, 0).sum(1, dtype=torch.float64).tolist()

    def keep(self, scores: list[float]) -> bool:
        """Whether a complete group with these scores goes into a batch (counted either way)."""
        is_kept = max(scores) - min(scores) > self.options.min_spread
        self.drawn += 1
        self.counters["drawn_groups"] += 1
        self.counters["kept_groups" if is_kept else "dropped_zero_spread_groups"] += 1
        return is_kept

    def check_bound(self, kept: int) -> None:
        """Raise :class:`DynamicSamplingError` when the bound is reached with ``kept`` groups (fewer than ``N``)
        waiting; the next attempt counts its draws from 0."""
        if not self.limit or self.drawn < self.limit:
            return
        drawn, self.drawn = self.drawn, 0
        self.counters["draw_bound_reached"] += 1
        n = self.groups_per_batch
        raise DynamicSamplingError(
            f"dynamic sampling drew {drawn} groups since the last batch (bound: max_num_gen_batches="
            f"{self.options.max_num_gen_batches} x {n} groups per batch) and kept {kept} of the {n} a batch needs: "
            f"most groups score every sample alike (max - min <= min_spread={self.options.min_spread}). The kept "
            "groups stay queued and iterating again draws as many more; raise max_num_gen_batches (0: no bound), "
            "or give prompts of a difficulty the policy sometimes solves", drawn=drawn, kept=kept, needed=n)  # fmt: skip

    def commit(self, delivered: int, batch_size: int) -> None:
        """A batch of ``delivered`` trajectories (of ``batch_size``) was delivered: draws count from 0 again."""
        self.drawn = 0
        if delivered < batch_size:
            self.counters["partial_batches"] += 1

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = int(state["drawn"])
        self.counters.update(state["counters"])
