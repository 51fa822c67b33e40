"""The tree sampler: grows ``group_size``-leaf trees in a token env's slots by a branching rule's forks
(:mod:`~tokengym.collectors.branching` has the rules and what a tree guarantees;
:class:`~tokengym.collectors.tree_source.TreeSource` calls the sampler around each step or wave)."""

from __future__ import annotations

import torch

from tokengym.collectors.branching import Fork, TreeStep, check_rule
from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import PromptError

__all__ = ["TreeSampler"]


def _next_fork(rule, step: TreeStep, slot: int) -> int | None:
    """The rule's :meth:`BranchRule.next_fork` of the branch in ``slot`` (``None`` for a rule without one)."""
    method = getattr(rule, "next_fork", None)
    return None if method is None else method(step, slot)


class TreeSampler:
    """Grows ``group_size``-leaf trees in a token env's slots, driven by a step source: after each env step (before
    the finished slots are refilled) :meth:`after_step` makes the rule's forks, fills trees whose branches all ended
    with fresh samples of their prompt, frees the slots of complete trees and starts new trees there. A wave source
    caps each branch's wave at the rule's next fork (:meth:`wave_caps`) and calls :meth:`after_wave` after the wave.

    Args:
        rule: a :class:`~tokengym.collectors.branching.BranchRule`.
        env: the bare ``TokenEnv``.
        policy: the stepping policy; its ``fork`` (``TransformersPolicy``) copies KV cache rows, else branches are
            prefilled at their first step. ``None`` for waves (each wave prefills its rows; the engines' prefix
            caches share the common part).
        group_size: leaves per tree.
    """

    def __init__(self, rule, env, policy, group_size: int) -> None:
        check_rule(rule)
        self.rule, self.env, self.policy, self.group_size = rule, env, policy, group_size
        if callable(getattr(rule, "check", None)):
            rule.check(env, group_size)
        if hasattr(rule, "group_size"):
            rule.group_size = group_size
        B = env.batch_size[0]
        self.tree_of = [-1] * B  # the group whose tree reserves each slot (-1: free)
        self.live: dict[int, set[int]] = {}  # group -> slots of its live branches
        self.leaves: dict[int, int] = {}  # group -> leaves (branches) made so far
        self.roots: dict[int, int] = {}  # group -> the slot of its root branch (while it is live)
        self.depth = [0] * B  # forks between the root and each slot's branch
        self.surprise = torch.zeros(B, env.max_new_tokens) if rule.needs_surprise else None
        self.counters = {"tree_forks": 0, "tree_forks_skipped": 0, "tree_leaves_from_prompt": 0, "trees_started": 0}
        self._open: set[int] = set()  # trees with leaves to add before the forks being made (see _grow)

    # -- starting trees --
    def start(self):
        """Free every slot and start as many trees as fit; ``(observation, root slots, error or None)``."""
        B = self.env.batch_size[0]
        obs = self.env.vacate(range(B))
        return self._admit(obs)

    def _admit(self, obs):
        """Start trees in free slots, ``group_size`` at a time: a root drawn into the first."""
        roots: list[int] = []
        error = None
        while True:
            free = [b for b, g in enumerate(self.tree_of) if g == -1]
            if len(free) < self.group_size or self.env.source.is_exhausted:
                return obs, roots, error
            b = free[0]
            try:
                obs = self.env.refill([b])
            except PromptError as err:  # the slot idles; the next prompt is tried at once
                obs, error = self.env.vacate([b]), err
                continue
            prompt = self.env.slot_prompt(b)
            if prompt is None:  # the source ran out
                return obs, roots, error
            self.env.source.end_group()  # the tree's other samples are its branches
            group = prompt.group_id
            for r in free[: self.group_size]:
                self.tree_of[r] = group
            self.live[group], self.leaves[group], self.roots[group] = {b}, 1, b
            self.depth[b] = 0
            roots.append(b)
            self.counters["trees_started"] += 1

    # -- after a step --
    def after_step(self, td, obs, ended: list[int]):
        """Make the forks of this step (``td``: the step with its ``"next"``; ``obs``: the observation after it;
        ``ended``: slots done at it), then free and refill; ``(observation, new roots, forks, error or None)``
        where ``forks`` lists
        ``(parent slot, parent trajectory, child slot, child trajectory, at)`` for the recorder."""
        nxt = td.get(keys.NEXT)
        steps_t = nxt.get(keys.RESPONSE_LEN)
        active = td.get(keys.ACTIVE)
        rows = active.nonzero().squeeze(-1)
        if self.surprise is not None:
            at = (steps_t[rows] - 1).clamp(min=0, max=self.surprise.shape[1] - 1)
            self.surprise[rows, at] = -td.get(keys.ACTION_LOG_PROB)[rows].float()
        ended_set = set(ended)
        tree_of = self.tree_of
        slots = [b for b in rows.tolist() if tree_of[b] != -1]
        turn_ended = set()
        if self.env.max_turns > 1:
            moved = (nxt.get(keys.TURN) != td.get(keys.TURN)) & active
            turn_ended = {b for b in moved.nonzero().squeeze(-1).tolist() if b not in ended_set}
        all_steps = steps_t.tolist()
        view = self._view(slots, {b: all_steps[b] for b in slots}, ended_set, turn_ended)
        if self.env.max_turns > 1:  # where each slot's current turn began: a fork names a step from there on
            starts = (steps_t - (nxt.get(keys.SEQ_LEN) - nxt.get(keys.PROMPT_LEN))).tolist()
            view.turn_start.update({b: starts[b] for b in slots})
        return self._grow(view, ended, obs)

    def _view(self, slots: list[int], steps: dict[int, int], ended: set[int], turn_ended: set[int]) -> TreeStep:  # fmt: skip
        tree_of = self.tree_of
        budget = {b: self.group_size - self.leaves[tree_of[b]] for b in slots}
        return TreeStep(slots, steps, ended, turn_ended, budget, {b: self.depth[b] for b in slots},
                        {b for b in slots if self.roots.get(tree_of[b]) == b},
                        None if self.surprise is None else {b: self.surprise[b] for b in slots})  # fmt: skip

    def _grow(self, view: TreeStep, ended: list[int], obs):
        """The rule's forks of ``view``, the rest of the leaves of trees whose branches all ended, then the slots
        freed and new trees started (see :meth:`after_step`)."""
        env, slots = self.env, view.slots
        forks: list[tuple] = []
        changed = bool(ended)
        # trees with leaves to add before this step's forks: only there is a branch not made a skip (a rule may go
        # on asking at a complete tree; the wave source's next_fork stops asking there)
        self._open = {g for g, n in self.leaves.items() if n < self.group_size}
        for fork in self.rule.forks(view) if slots else []:
            forks += self._fork(fork)
        for b in ended:  # ended branches leave their trees' live sets
            group = self.tree_of[b]
            if group != -1:
                self.live[group].discard(b)
                if self.roots.get(group) == b:
                    del self.roots[group]
        for b in ended:  # a tree whose branches all ended: the rest of its leaves from the prompt, then done
            group = self.tree_of[b]
            if group == -1 or self.live[group]:
                continue
            missing = self.group_size - self.leaves[group]
            if missing > 0:
                self.counters["tree_leaves_from_prompt"] += missing
                self.live[group].add(b)  # its slot is not a free one for its own forks
                forks += self._fork(Fork(b, 0, missing), count=False)
                self.live[group].discard(b)
            if not self.live[group]:
                self._finish(group)
        if not (forks or changed):
            return obs, [], forks, None
        vacant = [b for b in ended if self.tree_of[b] == -1 or b not in self.live[self.tree_of[b]]]
        obs = env.vacate(vacant) if vacant else env.observation()
        obs, roots, error = self._admit(obs)
        return obs, roots, forks, error

    # -- around a wave (source="wave") --
    def wave_caps(self, slots: list[int], steps: list[int]) -> dict[int, int]:
        """Before a wave of the live ``slots`` (``steps``: each one's generated tokens so far): the tokens each tree
        branch may generate before the rule's next fork (:meth:`~tokengym.collectors.branching.BranchRule.next_fork`), by slot; a branch absent
        runs its turn out. The wave pauses a capped branch there (an unfinished row), :meth:`after_wave` forks it."""
        live = [(b, n) for b, n in zip(slots, steps, strict=True) if self.tree_of[b] != -1]
        view = self._view([b for b, _ in live], dict(live), set(), set())
        caps = {}
        for b, n in live:
            at = _next_fork(self.rule, view, b)
            if at is not None and at > n:
                caps[b] = at - n
        return caps

    def after_wave(self, steps, counts: torch.Tensor):
        """After a wave, given as its real steps (:meth:`~tokengym.llm_envs.TokenEnv.unroll_cells`: ``steps`` (n,)
        slot by slot, ``counts`` (B,)), before its finished slots are refilled: the rule sees each branch that took
        steps as it stands at the wave's end (paused at its planned fork, at its turn's end, or ended), then forks,
        frees and refills as :meth:`after_step` does; ``(observation, new roots, forks, error or None)``."""
        rows = (counts > 0).nonzero().squeeze(-1)
        last = (counts.cumsum(0) - 1).index_select(0, rows)  # each slot's last step
        nxt = steps.get(keys.NEXT)
        if self.surprise is not None and len(steps):
            slot = torch.repeat_interleave(torch.arange(len(counts)), counts)
            at = steps.get(keys.RESPONSE_LEN).clamp(max=self.surprise.shape[1] - 1)
            self.surprise[slot, at] = -steps.get(keys.ACTION_LOG_PROB).float()
        done = nxt.get(keys.DONE[1]).reshape(-1).index_select(0, last)
        ended = rows[done].tolist()
        turn_ended = set()
        if self.env.max_turns > 1:
            turns = nxt.get(keys.TURN).index_select(0, last), steps.get(keys.TURN).index_select(0, last)
            moved = (turns[0] != turns[1]) & ~done
            turn_ended = set(rows[moved].tolist())
        tree_of = self.tree_of
        after = nxt.get(keys.RESPONSE_LEN).index_select(0, last).tolist()
        resp = dict(zip(rows.tolist(), after, strict=True))
        slots = [b for b in resp if tree_of[b] != -1]
        view = self._view(slots, {b: resp[b] for b in slots}, set(ended), turn_ended)
        if self.env.max_turns > 1:  # where each slot's current turn began: a fork names a step from there on
            seq, start = (nxt.get(k).index_select(0, last).tolist() for k in (keys.SEQ_LEN, keys.PROMPT_LEN))
            view.turn_start.update({b: n - (q - p) for b, n, q, p in zip(resp, after, seq, start, strict=True)
                                    if tree_of[b] != -1})  # fmt: skip
        return self._grow(view, ended, None)

    def _fork(self, fork: Fork, *, count: bool = True) -> list[tuple]:
        group = self.tree_of[fork.slot] if 0 <= fork.slot < len(self.tree_of) else -1
        if group == -1 or not isinstance(fork, Fork):
            raise ValueError(f"the branching rule asked for {fork!r}: a Fork of a slot that holds a tree's branch")
        room = self.group_size - self.leaves[group]
        # the tree's slots without a live branch (a branch that ended at this step is still live here)
        free = [b for b, g in enumerate(self.tree_of) if g == group and b not in self.live[group]]
        n = min(fork.branches, room, len(free))
        if count and group in self._open:
            self.counters["tree_forks_skipped"] += fork.branches - n
        if n <= 0:
            return []
        children = free[:n]
        parent_traj = self.env.slot_trajectory(fork.slot)
        first = self.leaves[group]
        trajs = self.env.fork(fork.slot, children, at=fork.at, sample_ids=list(range(first, first + n)))
        length = int(self.env.history(children[0]).numel())
        policy_fork = getattr(self.policy, "fork", None)
        if callable(policy_fork):
            policy_fork([fork.slot] * n, children, [length] * n, trajs)
        if self.surprise is not None:
            self.surprise[children, : fork.at] = self.surprise[fork.slot, : fork.at]
        for c in children:
            self.depth[c] = self.depth[fork.slot] + (fork.at > 0)
        self.leaves[group] += n
        self.live[group].update(children)
        self.counters["tree_forks"] += n
        return [(fork.slot, parent_traj, c, t, fork.at) for c, t in zip(children, trajs, strict=True)]

    def _finish(self, group: int) -> None:
        for b, g in enumerate(self.tree_of):
            if g == group:
                self.tree_of[b] = -1
        del self.live[group], self.leaves[group]
        self.roots.pop(group, None)

    # -- checkpoints --
    def state_dict(self) -> dict:
        return {"tree_of": list(self.tree_of), "live": {str(g): sorted(s) for g, s in self.live.items()},
                "leaves": {str(g): n for g, n in self.leaves.items()}, "depth": list(self.depth),
                "roots": {str(g): b for g, b in self.roots.items()},
                "surprise": None if self.surprise is None else self.surprise.clone(), "counters": dict(self.counters)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.tree_of, self.depth = list(state["tree_of"]), list(state["depth"])
        self.live = {int(g): set(s) for g, s in state["live"].items()}
        self.leaves = {int(g): int(n) for g, n in state["leaves"].items()}
        self.roots = {int(g): int(b) for g, b in state.get("roots", {}).items()}
        if self.surprise is not None and state.get("surprise") is not None:
            self.surprise = state["surprise"].clone()
        self.counters.update(state.get("counters", {}))
