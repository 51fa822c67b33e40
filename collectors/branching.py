"""Branching rollouts: a group's samples grown as a tree, forked from one another at chosen tokens; this module holds
the branching rules (where trees fork), :mod:`~tokengym.collectors.tree_sampler` grows the trees and
:mod:`~tokengym.collectors.tree_source` drives a step or wave source through them.

A tree is a group: its root is the group's prompt, sampled once; a *branch* continues a copy of another branch's
sequence from one of its tokens (:meth:`~tokengym.llm_envs.TokenEnv.fork`: tokens, lengths, turn state and ids
copied into a free slot; :meth:`~tokengym.collectors.policies.TransformersPolicy.fork` copies the KV cache rows, no forward). Every branch ends as
a *leaf*: a trajectory of the group, whose batch row holds its whole sequence from the prompt (its steps before the
fork are its ancestors', ``keys.BRANCH_ID`` says whose). A tree has exactly ``group_size`` leaves, so batches hold
whole groups as they always do and the group advantages, dynamic sampling and evaluation work unchanged;
:class:`~tokengym.transforms.TreeAdvantage` uses the tree.

Where a tree forks is a *branching rule*, a small object with one method (:class:`BranchRule`): given what the tree's
branches did at the last step (:class:`TreeStep`), the forks to make now (:class:`Fork`). Three are here:

- :class:`SegmentRule` (TreePO): every ``length`` tokens each live branch forks into ``width``;
- :class:`EntropyRule` (TreeRL's EPTree): ``chains`` independent chains, then each finished chain forks at its
  ``forks`` most uncertain tokens;
- :class:`TurnRule` (Tree-GRPO): at each turn boundary of a multi-turn episode, each branch forks into ``width``.

What the sampler guarantees whatever the rule says: a tree never has more than ``group_size`` leaves (branches asked
for past the budget are not made; those asked for while the tree still had leaves to add are counted in
``tree_forks_skipped``), and a tree whose branches have all ended with fewer leaves (a rule that gives fewer, or
branches that ended before a planned fork) gets the rest as fresh samples of its prompt (forks at step 0, sharing only
the prompt: plain GRPO samples; in a multi-turn env fresh episodes, :meth:`~tokengym.llm_envs.TokenEnv.fork` at 0),
counted in ``tree_leaves_from_prompt``. A fork names a step of its branch's current turn (or 0): the env cannot roll
an episode back to an earlier turn. Each tree holds ``group_size`` slots from its root to its last leaf, so
``batch_size // group_size`` trees grow at once. A rule that cannot fork in the env (a turn rule in a single-turn
env, segments as long as the budget, as many chains as leaves) is refused when the collector is built
(its ``check``).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

__all__ = ["BranchRule", "EntropyRule", "Fork", "SegmentRule", "TreeStep", "TurnRule", "check_rule"]


@dataclasses.dataclass(frozen=True)
class Fork:
    """Fork the branch in ``slot`` at its step ``at`` (its generated tokens before the fork) into ``branches`` new
    branches; the branch itself goes on (or stays ended). ``at`` lies in the branch's current turn
    (:attr:`TreeStep.turn_start` to its steps; before its last step if it ended), or is 0: fresh samples of the
    prompt."""

    slot: int
    at: int
    branches: int = 1


@dataclasses.dataclass(frozen=True)
class TreeStep:
    """What a rule is shown after each env step (or each wave): the branches of growing trees.

    Attributes:
        slots: slots holding a branch that took this step (live, or ended at it).
        steps: each slot's generated tokens so far (``keys.RESPONSE_LEN``), by slot.
        ended: slots whose branch ended at this step (their tokens are still there: a fork at an earlier step works).
        turn_ended: slots whose turn ended at this step and whose episode goes on (a turn boundary).
        budget: leaves the slot's tree may still add, by slot.
        depth: forks between the root and the slot's branch (0: the root, or a chain forked at step 0), by slot.
        roots: slots holding their tree's root (its first branch, drawn from the prompt source).
        surprise: by slot, the ``-log p`` of each token the branch sampled (its steps ``0 .. steps - 1``), when the
            rule asks for it (``needs_surprise``).
        turn_start: by slot, the step where its current turn began (0 in a single-turn env; a slot whose turn ended
            at this step and goes on: its steps): a fork names a step from there on, or 0 (see :class:`Fork`).
    """

    slots: list[int]
    steps: dict[int, int]
    ended: set[int]
    turn_ended: set[int]
    budget: dict[int, int]
    depth: dict[int, int]
    roots: set[int] = dataclasses.field(default_factory=set)
    surprise: dict[int, torch.Tensor] | None = None
    turn_start: dict[int, int] = dataclasses.field(default_factory=dict)


class BranchRule(Protocol):
    """Where a tree forks. ``needs_surprise``: the rule reads :attr:`TreeStep.surprise`.

    A rule may also say where a live branch forks next, ``next_fork(step, slot) -> int | None``: the number of
    generated tokens at which :meth:`forks` should next see the branch in ``slot`` (``step`` shows the live branches
    before a wave). The wave source (``source="wave"``) pauses the branch's generation there, as an unfinished row the
    next wave continues; the step source shows every step anyway. ``None`` (and the default for a rule without the
    method): the branch runs its turn out, and :meth:`forks` sees it at the wave's end (its turn's end, or its own).

    A rule may also check the env it grows trees in, ``check(env, group_size)``, called when the collector is built:
    ``ValueError`` naming the value and the fix where the rule could never fork there (its trees would be plain
    independent samples).
    """

    needs_surprise: bool

    def forks(self, step: TreeStep) -> list[Fork]:
        """The forks to make after this step."""


_CANNOT_FORK = "{rule} cannot fork in this env: {why}; {fix}"


class SegmentRule:
    """TreePO's segments: each live branch that has just generated a multiple of ``length`` tokens forks at its
    current token into ``width`` branches (itself and ``width - 1`` new ones), while its tree has leaves left.

    With ``length=32, width=2`` and 8 leaves, a tree forks at tokens 32 (1 -> 2 branches), 64 (-> 4) and 96 (-> 8):
    the leaves share their first 32 to 96 tokens. A branch that ends before the next boundary forks no more.

    Example:
        >>> SegmentRule(2, 2).forks(TreeStep([0, 1], {0: 2, 1: 3}, set(), set(), {0: 3, 1: 3}, {0: 0, 1: 0}))
        [Fork(slot=0, at=2, branches=1)]
    """

    needs_surprise = False

    def __init__(self, length: int = 32, width: int = 2) -> None:
        _check_positive("length", length)
        _check_positive("width", width, low=2)
        self.length, self.width = length, width

    def forks(self, step: TreeStep) -> list[Fork]:
        return [Fork(b, step.steps[b], self.width - 1) for b in step.slots
                if b not in step.ended and step.steps[b] % self.length == 0]  # fmt: skip

    def next_fork(self, step: TreeStep, slot: int) -> int | None:
        """The next multiple of ``length``; ``None`` once the tree has no leaves left (the branch runs out)."""
        return None if step.budget[slot] <= 0 else (step.steps[slot] // self.length + 1) * self.length

    def check(self, env, group_size: int) -> None:
        """``ValueError`` when no branch can reach ``length`` tokens alive (``length`` at least the tokens an episode
        may generate: ``max_new_tokens``, or ``max_turns * max_turn_tokens`` when that is less)."""
        budget, what = _episode_budget(env)
        if self.length >= budget:
            raise ValueError(_CANNOT_FORK.format(
                rule=self, why=f"length={self.length} >= {what}={budget} (a branch ends before its first fork)",
                fix=f"use a length below {budget} (e.g. SegmentRule({max(1, budget // 4)}, {self.width})) or raise "
                "the env's budget"))  # fmt: skip

    def __repr__(self) -> str:
        return f"SegmentRule(length={self.length}, width={self.width})"


class EntropyRule:
    """TreeRL's entropy-guided tree (EPTree), one iteration: the root forks at step 0 into ``chains`` independent
    chains (``chains - 1`` new ones); when a chain ends, it forks at its ``forks`` most uncertain tokens, one new
    branch each, which re-sample that token and go on (they fork no more).

    Uncertainty is the sampled token's surprise ``-log p`` under the sampling distribution (``action_log_prob``): a
    one-sample estimate of the entropy at that step (its expectation is the entropy), the same on every backend (vLLM
    returns only top-k log-probs, so the full entropy is not available there). The first ``skip`` tokens and the
    last one are never fork points, nor a token another fork took. In a multi-turn episode a chain forks within its
    last turn (the env cannot roll an episode back to an earlier turn's feedback and state).

    ``chains=None`` gives ``max(1, group_size // 4)`` chains, ``forks=None`` shares the rest of the leaves among
    them (``(group_size - chains) // chains`` each; 8 leaves: 2 chains forking at 3 tokens each). TreeRL's own
    defaults (6 chains, 2 forks of 1 branch, 1 iteration: 18 leaves) are ``EntropyRule(chains=6, forks=2)`` with
    ``group_size=18``.
    """

    needs_surprise = True

    def __init__(self, chains: int | None = None, forks: int | None = None, *, skip: int = 1) -> None:
        if chains is not None:
            _check_positive("chains", chains)
        if forks is not None:
            _check_positive("forks", forks)
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"skip must be an int >= 0 (tokens at the start that are never fork points), got {skip!r}")
        self.chains, self.per_chain, self.skip = chains, forks, skip
        self.group_size = 0  # set by the sampler

    def _sizes(self) -> tuple[int, int]:
        chains = self.chains or max(1, self.group_size // 4)
        return chains, self.per_chain or max(0, (self.group_size - chains) // chains)

    def forks(self, step: TreeStep) -> list[Fork]:
        chains, per_chain = self._sizes()
        out = []
        for b in step.slots:
            if step.depth[b] > 0:
                continue
            if b in step.roots and step.steps[b] == 1 and chains > 1 and b not in step.ended:
                out.append(Fork(b, 0, min(chains - 1, step.budget[b])))  # the root's chains: share the prompt only
            first = max(self.skip, step.turn_start.get(b, 0))  # a fork point of the chain's last turn
            if b in step.ended and per_chain and step.steps[b] > first + 1:
                surprise = step.surprise[b][first : step.steps[b] - 1]
                top = torch.topk(surprise, min(per_chain, surprise.numel())).indices + first
                out += [Fork(b, int(t), 1) for t in sorted(top.tolist())]
        return out

    def next_fork(self, step: TreeStep, slot: int) -> int | None:
        """A root that has its chains to fork: after its first token (they fork at step 0, sharing the prompt only);
        every other branch runs out (a chain forks once it ended)."""
        is_root = slot in step.roots and step.depth[slot] == 0 and step.steps[slot] == 0
        return 1 if is_root and self._sizes()[0] > 1 and step.budget[slot] > 0 else None

    def check(self, env, group_size: int) -> None:
        """``ValueError`` when the chains take every leaf (``chains >= group_size``: no chain has a leaf left to fork)
        or no token is ever a fork point (``skip + 2 > max_new_tokens``)."""
        if self.chains is not None and self.chains >= group_size:
            raise ValueError(_CANNOT_FORK.format(
                rule=self, why=f"chains={self.chains} >= the env's group_size={group_size} (the chains take every "
                "leaf: independent samples)", fix=f"use chains below {group_size} (e.g. chains=None: "
                f"{max(1, group_size // 4)}) or raise group_size"))  # fmt: skip
        budget, what = _episode_budget(env)
        if self.skip + 2 > budget:
            raise ValueError(_CANNOT_FORK.format(
                rule=self, why=f"skip={self.skip} leaves no fork point in {what}={budget} tokens (the first skip "
                "tokens and the last are never fork points)", fix=f"use skip <= {max(0, budget - 2)}"))  # fmt: skip

    def __repr__(self) -> str:
        return f"EntropyRule(chains={self.chains}, forks={self.per_chain}, skip={self.skip})"


class TurnRule:
    """Tree-GRPO's agent-step trees: each branch whose turn ends and whose episode goes on forks there, at its turn
    boundary, into ``width`` branches (the feedback is copied with it), while its tree has leaves left."""

    needs_surprise = False

    def __init__(self, width: int = 2) -> None:
        _check_positive("width", width, low=2)
        self.width = width

    def forks(self, step: TreeStep) -> list[Fork]:
        return [Fork(b, step.steps[b], self.width - 1) for b in step.slots if b in step.turn_ended]

    def check(self, env, group_size: int) -> None:
        """``ValueError`` for a single-turn env (``max_turns == 1``: no turn boundary to fork at)."""
        if env.max_turns < 2:
            raise ValueError(_CANNOT_FORK.format(
                rule=self, why=f"max_turns={env.max_turns} (no turn ends with its episode going on)",
                fix="build the env with max_turns >= 2 and a turn handler that answers with feedback "
                "(MultiTurnTokenEnv), or fork by tokens: SegmentRule or EntropyRule"))  # fmt: skip

    def __repr__(self) -> str:
        return f"TurnRule(width={self.width})"


def _episode_budget(env) -> tuple[int, str]:
    """The most tokens an episode of ``env`` generates, and what sets it (for error messages)."""
    per_turn = getattr(env, "max_turn_tokens", None)
    if per_turn is not None and env.max_turns * per_turn < env.max_new_tokens:
        return env.max_turns * per_turn, f"the env's max_turns * max_turn_tokens ({env.max_turns} * {per_turn})"
    return env.max_new_tokens, "the env's max_new_tokens"


def _check_positive(name: str, value, *, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_rule(rule) -> None:
    """``TypeError`` for something that is not a branching rule."""
    if not callable(getattr(rule, "forks", None)) or not isinstance(getattr(rule, "needs_surprise", None), bool):
        raise TypeError(f"tree must be a branching rule (SegmentRule, EntropyRule, TurnRule, or an object with "
                        f"forks(TreeStep) -> list[Fork] and a bool needs_surprise), got {type(rule).__name__}")  # fmt: skip
