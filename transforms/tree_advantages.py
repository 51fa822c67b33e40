"""Advantages for branching rollouts (trees): TreeRL's, TreePO's and GRPO over the leaves, with shared tokens
weighted to count once in the loss.

A tree batch is a TRAJECTORIES batch [N, T] whose rows are the leaves of trees: a tree is a group
(``keys.GROUP_ID``), each row holds one leaf's whole sequence of generated steps from the prompt, and
``keys.BRANCH_ID`` [N, T] names the trajectory that generated each step's token. Two rows of a group with the same
branch id at the same step hold one token of the tree, sampled once. The leaf's reward is the sum of its row's
rewards. A batch without ``keys.BRANCH_ID`` is a plain group: each row is its own branch and shares only the prompt,
so the tree is a root with one child per leaf.

Nodes: a node ``n`` is a maximal run of consecutive steps shared by one and the same set of leaves ``L(n)``; the root
is the prompt, shared by every leaf of the group; ``V(n)`` is the mean reward of ``L(n)``. The batch holds whole
trees: every branch id must be a leaf row of the same group (a tree split across batches raises).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import check_batch, check_number, require, set_loss_weight, squeeze_last
from tokengym.transforms.advantages import masked_whiten
from tokengym.transforms.group_advantages import group_advantages
from tokengym.transforms.sequences import check_trajectory_rows

__all__ = ["TreeAdvantage", "tree_leaf_counts"]

_ESTIMATORS = ("treerl", "treerl_code", "treepo", "grpo", "dr_grpo")
_REWEIGHTS = ("sqrt", "count", "none")  # TreeRL's repo: weighted_value_style "sqrt", "uniform", "original"
_SUBGROUP_WEIGHTS = ("average", "group_size")  # TreePO's repo: adv_weight_strategy
_TREE_CONTRACT = ("a leaf's steps before its fork are copies of its parent's (the same BRANCH_ID), its own steps "
                  "carry its own trajectory id")  # fmt: skip


class _Tree(NamedTuple):
    """Per-token tree facts of a batch (float64 values, 0 on padding)."""

    mask: torch.Tensor  # bool (N, T) valid steps
    count: torch.Tensor  # int64 (N, T) |L(n)| of the step's node
    value: torch.Tensor  # float64 (N, T) V(n) of the step's node
    parent: torch.Tensor  # float64 (N, T) V(parent(n)); V(root) for a node that starts a row
    parent_count: torch.Tensor  # int64 (N, T) |L(parent(n))|; the tree's leaves for a node that starts a row
    boundary: torch.Tensor  # bool (N, T) the step starts a node of its row
    score: torch.Tensor  # float64 (N,) the leaf's reward
    root: torch.Tensor  # float64 (N,) V(root) of the leaf's tree
    leaves: torch.Tensor  # int64 (N,) leaves of the leaf's tree
    group: torch.Tensor  # int64 (N,) the leaf's group


def _fail(owner: str, what: str) -> ValueError:
    return ValueError(
        f"{owner}: {what}; a tree batch holds whole trees, one leaf per row, and {_TREE_CONTRACT}"
    )


def _rows_of(ids: torch.Tensor, traj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row whose trajectory id is each of ``ids`` (any shape), and whether there is one."""
    order = torch.argsort(traj)
    ordered = traj[order]
    pos = (
        torch.searchsorted(ordered, ids.reshape(-1).contiguous()).clamp(max=len(traj) - 1).reshape(ids.shape)
    )
    return order[pos], ordered[pos] == ids


def _leaf_rows(td: TensorDictBase, owner: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mask, traj, group)``: the valid steps and each row's trajectory and group id; ValueError unless each row is
    one leaf (one trajectory, one group, at least one step, no trajectory in two rows)."""
    mask = check_trajectory_rows(td, owner)
    if mask.shape[1] == 0 or not bool(mask[:, 0].all()):
        row = 0 if mask.shape[1] == 0 else int((~mask[:, 0]).nonzero()[0])
        raise _fail(owner, f"row {row} has no valid step (a leaf holds at least one token)")
    traj = td.get(keys.TRAJ_ID)[:, 0]
    groups = require(td, keys.GROUP_ID, owner)
    group = groups[:, 0]
    if bool(((groups != group[:, None]) & mask).any()):
        row = int(((groups != group[:, None]) & mask).any(-1).nonzero()[0])
        raise _fail(owner, f"row {row} changes its {keys.GROUP_ID!r} (a leaf belongs to one tree)")
    ordered = torch.sort(traj).values
    if bool((ordered[1:] == ordered[:-1]).any()):
        tid = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
        rows = (traj == tid).nonzero().flatten().tolist()
        raise _fail(owner, f"trajectory {tid} fills rows {rows}")
    return mask, traj, group


def _generators(td: TensorDictBase, mask, traj, group, owner: str) -> torch.Tensor:
    """int64 (N, T): the row of the trajectory that generated each step's token (the row itself on padding), checked
    against the tree contract."""
    n, width = mask.shape
    rows = torch.arange(n, device=mask.device)[:, None].expand(n, width)
    branch = td.get(keys.BRANCH_ID, None)
    if branch is None:  # a plain group: every row its own branch
        return rows
    branch = squeeze_last(branch, mask.shape)
    gen, found = _rows_of(branch, traj)
    bad = mask & ~(found & (group[gen] == group[:, None]))
    if bool(bad.any()):
        i, t = (int(v) for v in bad.nonzero()[0])
        tids = sorted(traj[group == group[i]].tolist())
        raise _fail(owner, f"row {i} step {t} has {keys.BRANCH_ID!r} {int(branch[i, t])}, which is no leaf of its "
                           f"group {int(group[i])} in the batch (its leaves: {tids})")  # fmt: skip
    gen = torch.where(mask, gen, rows)
    cols = torch.arange(width, device=mask.device).expand(n, width)
    # the generating row holds the token itself, and rows that share step t shared step t - 1 too
    holds = mask[gen, cols] & (gen[gen, cols] == gen)
    prev = torch.cat([gen[:, :1], gen[:, :-1]], 1)
    nested = (cols == 0) | (prev == prev[gen, cols])  # the generator's row represents the token
    bad = mask & ~(holds & nested)
    if bool(bad.any()):
        i, t = (int(v) for v in bad.nonzero()[0])
        j = int(gen[i, t])
        why = (f"row {j} (trajectory {int(traj[j])}) does not hold that token at step {t}" if not bool(holds[i, t])
               else f"rows {i} and {j} share the token at step {t} but not the token before it")  # fmt: skip
        raise _fail(owner, f"row {i} step {t} has {keys.BRANCH_ID!r} {int(traj[j])}, but {why}")
    action = td.get(keys.ACTION, None)
    if action is not None:
        action = squeeze_last(action, mask.shape)
        bad = mask & (action[gen, cols] != action)
        if bool(bad.any()):
            i, t = (int(v) for v in bad.nonzero()[0])
            raise _fail(owner, f"rows {i} and {int(gen[i, t])} share step {t} by {keys.BRANCH_ID!r} but their "
                               f"{keys.ACTION!r} differ ({int(action[i, t])} and {int(action[gen[i, t], t])})")  # fmt: skip
    _check_forks(td, mask, traj, group, gen, owner)
    return gen


def _check_forks(td: TensorDictBase, mask, traj, group, gen, owner: str) -> None:
    """When the batch holds ``keys.PARENT_ID`` and ``keys.FORK_INDEX``: a leaf's steps from its fork are its own,
    those before are its parent's (a root has parent -1 and fork 0)."""
    parent_steps, fork_steps = td.get(keys.PARENT_ID, None), td.get(keys.FORK_INDEX, None)
    if parent_steps is None or fork_steps is None:
        return
    parent = squeeze_last(parent_steps, mask.shape)[:, 0]
    fork = squeeze_last(fork_steps, mask.shape)[:, 0]
    n, width = mask.shape
    rows = torch.arange(n, device=mask.device)
    prow, found = _rows_of(parent, traj)
    is_root = parent < 0
    bad = (is_root & (fork != 0)) | (~is_root & ~(found & (group[prow] == group)))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        what = (f"is a root ({keys.PARENT_ID!r} -1) but has {keys.FORK_INDEX!r} {int(fork[i])}" if bool(is_root[i])
                else f"forked from trajectory {int(parent[i])}, which is no leaf of its group {int(group[i])} "
                     "in the batch")  # fmt: skip
        raise _fail(owner, f"row {i} (trajectory {int(traj[i])}) {what}")
    cols = torch.arange(width, device=mask.device).expand(n, width)
    own = cols >= fork[:, None]
    prow = torch.where(is_root, rows, prow)[:, None].expand(n, width)
    bad = mask & torch.where(own, gen != rows[:, None], ~mask[prow, cols] | (gen != gen[prow, cols]))
    if bool(bad.any()):
        i, t = (int(v) for v in bad.nonzero()[0])
        side = "from" if bool(own[i, t]) else "before"
        raise _fail(owner, f"row {i} (trajectory {int(traj[i])}, {keys.FORK_INDEX!r} {int(fork[i])}, "
                           f"{keys.PARENT_ID!r} {int(parent[i])}) has {keys.BRANCH_ID!r} {int(traj[gen[i, t]])} at "
                           f"step {t}, {side} its fork")  # fmt: skip


def _tree(td: TensorDictBase, reward_key, owner: str) -> _Tree:
    mask, traj, group = _leaf_rows(td, owner)
    gen = _generators(td, mask, traj, group, owner)
    n, width = mask.shape
    rows = torch.arange(n, device=mask.device)
    reward = squeeze_last(require(td, reward_key, owner), mask.shape).double()
    # the leaf's reward summed in float64 in step order, as sequence_scores sums it (GRPO equals GroupAdvantage's)
    score = torch.zeros(n, dtype=torch.float64, device=mask.device)
    score.index_add_(0, rows[:, None].expand(n, width)[mask], reward[mask])
    _, inverse, leaves = torch.unique(group, return_inverse=True, return_counts=True)
    root = torch.zeros(len(leaves), dtype=torch.float64, device=mask.device).index_add_(0, inverse, score)
    root, leaves = (root / leaves)[inverse], leaves[inverse]
    # one tree token = (step, generating row): its leaves are the rows that hold it
    token = torch.arange(width, device=mask.device) * n + gen
    count = torch.bincount(token[mask], minlength=n * width)
    total = torch.zeros(n * width, dtype=torch.float64, device=mask.device)
    total.index_add_(0, token[mask], score[:, None].expand(n, width)[mask])
    value = torch.where(mask, total[token] / count[token].clamp(min=1), 0.0)
    count = torch.where(mask, count[token], 0)
    # leaf sets only shrink along a row (checked), so a node starts where the number of its leaves changes
    before = torch.cat([torch.zeros_like(count[:, :1]), count[:, :-1]], 1)
    boundary = mask & (count != before)
    parent_at = torch.cat([root[:, None], value[:, :-1]], 1)  # V of the step before; V(root) at step 0
    cols = torch.arange(width, device=mask.device).expand(n, width)
    start = torch.where(boundary, cols, 0).cummax(-1).values
    parent = torch.where(mask, parent_at.gather(1, start), 0.0)
    parent_count = torch.where(mask, torch.cat([leaves[:, None], count[:, :-1]], 1).gather(1, start), 0)
    return _Tree(mask, count, value, parent, parent_count, boundary, score, root, leaves, group)


def tree_leaf_counts(batch: TensorDictBase) -> torch.Tensor:
    """int64 [N, T]: how many leaves share each step's token (``|L(n)|`` of its node; 1 on a leaf's own steps, 0 on
    padding), the tree batch checked as :class:`TreeAdvantage` checks it.

    ``(1 / counts)[mask].sum()`` is the number of distinct tokens the batch's trees hold.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.TRAJ_ID: torch.tensor([[0, 0], [1, 1]]), keys.GROUP_ID: torch.zeros(2, 2, dtype=torch.long),
        ...                 keys.BRANCH_ID: torch.tensor([[0, 0], [0, 1]])}, [2, 2])
        >>> tree_leaf_counts(b).tolist()
        [[2, 1], [2, 1]]
    """
    check_batch(batch, "tree_leaf_counts", (keys.GROUP_ID, keys.TRAJ_ID))
    mask, traj, group = _leaf_rows(batch, "tree_leaf_counts")
    gen = _generators(batch, mask, traj, group, "tree_leaf_counts")
    n, width = mask.shape
    token = torch.arange(width, device=mask.device) * n + gen
    return torch.where(mask, torch.bincount(token[mask], minlength=n * width)[token], 0)


class TreeAdvantage(BatchTransform):
    """Advantages of a tree batch's tokens under ``keys.ADVANTAGE`` [N, T, 1] (float32, 0 on padding), and loss
    weights that count each shared token once (``keys.LOSS_WEIGHT`` [N, T]).

    Reads ``reward_key``, ``keys.GROUP_ID``, ``keys.TRAJ_ID`` and, when present, ``keys.MASK``, ``keys.BRANCH_ID``
    (absent: each row its own branch), ``keys.ACTION`` (shared steps must hold one token), ``keys.PARENT_ID`` and
    ``keys.FORK_INDEX`` (checked against the branch ids). Notation: ``r_i`` is leaf ``i``'s reward (its row's
    rewards summed), ``L(n)`` the leaves under node ``n``, ``V(n)`` their mean reward, ``V(root)`` the tree's mean.

    Estimators:
        ``"treerl"``: the formula of the TreeRL paper (Hou et al., "TreeRL: LLM Reinforcement Learning with
        On-Policy Tree Search", ACL 2025, arXiv 2506.11902, its process supervision), not its released code. Every
        token of node ``n`` gets ``R(n) = (G_A(n) + L_A(n)) / sqrt(|L(n)|)`` with the global advantage
        ``G_A(n) = V(n) - V(root)`` and the local advantage ``L_A(n) = V(n) - V(parent(n))``; the parent of a
        node that starts at the first step is the root. ``reweight="count"`` divides by ``|L(n)|`` instead,
        ``"none"`` not at all.
        ``"treerl_code"``: what the released code (github.com/THUDM/TreeRL, ``openrlhf/trainer/ppo_utils/
        parallel_mcts.py``: ``leaf_normalize``, ``compute_weighted_update``, ``path_from_root_to_node`` with
        ``parent_shift``) computes: each leaf's reward is centred leave-one-out, ``c_i = r_i - mean_{j != i} r_j``
        (a tree of one leaf: 0), ``V'(n)`` is the mean of ``c`` over ``L(n)`` (so ``V'(root) = 0``), and every
        token of node ``n`` gets ``V'(n) / sqrt(|L(n)|) - V'(parent(n)) / sqrt(|L(parent(n))|)`` (the value is
        divided by the square root of its leaves before the parent's is subtracted; the root's leaves are the
        tree's). ``reweight`` as above (the code's ``weighted_value_style`` "sqrt", "uniform", "original"). Its
        other options are not reproduced: ``use_state_value_reward`` averages this with ``V'(n) / sqrt(|L(n)|)``,
        ``fill_in_paths`` gives a node whose value is exactly 0 its parent's value.
        ``"treepo"``: TreePO ("TreePO: Bridging the Gap of Policy Optimization and Efficacy and Inference
        Efficiency with Heuristic Tree-based Modeling", arXiv 2508.17445, its tree-based advantage; as released
        in github.com/multimodal-art-projection/TreePO ``verl/trainer/ppo/core_algos.py``
        ``compute_tree_reinforce_plus_plus_baseline_outcome_advantage`` with the training recipe's
        ``adv_weight_strategy="average"``). Leaf ``i`` has the subgroups ``J_i``: the root and every node on its path holding more than
        one leaf; ``A_i = mean_{j in J_i} (r_i - V(j))`` (``subgroup_weight="group_size"``: the mean weighted by
        ``|L(j)|``), the same for every token of the row, then whitened over the batch's valid tokens
        (``normalize``, default True here: the ``masked_whiten`` of REINFORCE++-baseline). No subgroup divides by
        its std. A node is a subgroup once; TreePO's fixed-length segments each count once, so a segment that
        does not branch repeats its parent's subgroup: ``segment_length=L`` counts by segments as TreePO does
        (the subgroup of depth ``d`` is the leaves sharing step ``d * L - 1``).
        ``"grpo"``: ``(r_i - mean) / (std + eps)`` over the tree's leaves, to every step of the row, exactly
        :class:`~tokengym.transforms.GroupAdvantage`'s; ``"dr_grpo"``: ``r_i - mean``.

    A tree of one leaf gets 0.

    Shared tokens (``weight_shared=True``): a token of node ``n`` sits in the ``|L(n)|`` rows of its leaves, so a loss
    over rows counts it ``|L(n)|`` times. ``keys.LOSS_WEIGHT`` (created as 1, 0 on padding; one already in the batch is
    multiplied) is multiplied by ``1 / |L(n)|`` on each copy: the copies' weights sum to 1. Through
    :class:`~tokengym.transforms.WeightedLoss` (``"token_mean"``) the objective is
    ``sum_i sum_t mask * w * l_{i,t} / sum mask = sum_{tree tokens k} mean_{i in L(k)} l_{i,k} / sum mask``: each
    distinct token once, with the mean of its copies' terms (the copies share context and token, so log-prob and
    ratio; under ``"treerl"``/``"treerl_code"`` also the advantage, so the mean is the one term; under ``"grpo"``/``"treepo"`` the
    leaves' advantages differ, and for an unclipped ratio the mean is the term of their mean advantage, under
    ``"grpo"`` ``(V(n) - mean) / std``). The
    normaliser still counts every copy (row tokens, as ``WeightedLoss`` documents), a factor distinct / row tokens
    below a mean over distinct tokens, the same for every token of the batch. ``"sequence_mean"`` divides each copy
    by its own row's length, so there the weights sum to 1 before that division only. The papers' released code
    trains every leaf's full row unweighted: ``weight_shared=False`` reproduces that (with TreeRL's default a token of
    ``n`` then pulls ``|L(n)| / sqrt(|L(n)|) = sqrt(|L(n)|)`` times ``G_A + L_A``; with ``weight_shared=True``,
    ``1 / sqrt(|L(n)|)`` times).

    Args:
        estimator: ``"treerl"``, ``"treerl_code"``, ``"treepo"``, ``"grpo"`` or ``"dr_grpo"``.
        weight_shared: multiply ``keys.LOSS_WEIGHT`` by ``1 / |L(n)|`` (above).
        reweight: ``"treerl"`` and ``"treerl_code"`` only: ``"sqrt"`` (default, the paper's), ``"count"`` or
            ``"none"``.
        subgroup_weight: ``"treepo"`` only: ``"average"`` (default, the released recipe's) or ``"group_size"``.
        segment_length: ``"treepo"`` only: count subgroups per fixed-length segment of this many steps.
        normalize: whiten the token advantages over the batch; default True for ``"treepo"`` only.
        eps: added to the std (``"grpo"``).
        group_size: leaves per tree; a tree with another number raises ValueError (default: not checked).
        reward_key: the reward summed into a leaf's reward (``keys.REWARD_RAW`` ignores KL shaping).

    Raises:
        ValueError: an unknown estimator or option, an option of another estimator, or a batch that is not whole
            trees (a branch id that is no leaf of the group, shared steps that are not one token, a fork that does
            not match the branch ids, a row that is not one trajectory).
        KeyError: a missing ``reward_key``, ``keys.GROUP_ID`` or ``keys.TRAJ_ID``.

    Example:
        >>> from tensordict import TensorDict
        >>> # two leaves: trajectory 1 forks from trajectory 0 at step 1; rewards 1 and 0
        >>> b = TensorDict({keys.REWARD: torch.tensor([[[0.0], [1.0]], [[0.0], [0.0]]]), keys.GROUP_ID: torch.zeros(2, 2, dtype=torch.long),
        ...                 keys.TRAJ_ID: torch.tensor([[0, 0], [1, 1]]), keys.BRANCH_ID: torch.tensor([[0, 0], [0, 1]])}, [2, 2])
        >>> out = TreeAdvantage("treerl")(b)  # the shared step: V = V(root), so 0; own steps: (0.5 + 0.5) / sqrt(1)
        >>> out[keys.ADVANTAGE].squeeze(-1).tolist(), out[keys.LOSS_WEIGHT].tolist()
        ([[0.0, 1.0], [0.0, -1.0]], [[0.5, 1.0], [0.5, 1.0]])
    """

    def __init__(self, estimator: str = "treerl", *, weight_shared: bool = True, reweight: str | None = None,
                 subgroup_weight: str | None = None, segment_length: int | None = None, normalize: bool | None = None,
                 eps: float = 1e-6, group_size: int | None = None, reward_key=keys.REWARD) -> None:  # fmt: skip
        estimator = getattr(estimator, "value", estimator)  # AdvantageEstimator.GRPO / DR_GRPO
        if estimator not in _ESTIMATORS:
            raise ValueError(f"unknown tree estimator {estimator!r}; use one of {list(_ESTIMATORS)}")
        self.estimator = estimator
        for name, value, owners, choices in (("reweight", reweight, ("treerl", "treerl_code"), _REWEIGHTS),
                                             ("subgroup_weight", subgroup_weight, ("treepo",), _SUBGROUP_WEIGHTS),
                                             ("segment_length", segment_length, ("treepo",), None)):  # fmt: skip
            if value is not None and estimator not in owners:
                raise ValueError(f"{name} applies to the {' and '.join(map(repr, owners))} estimator"
                                 f"{'s' if len(owners) > 1 else ''} only, got {name}={value!r} with {estimator!r}; leave "
                                 "it out")  # fmt: skip
            if value is not None and choices is not None and value not in choices:
                raise ValueError(f"unknown {name} {value!r}; use one of {list(choices)}")
        if segment_length is not None and (isinstance(segment_length, bool) or not isinstance(segment_length, int)
                                           or segment_length < 1):  # fmt: skip
            raise ValueError(f"segment_length must be an int >= 1 or None, got {segment_length!r}")
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
        ):
            raise ValueError(f"group_size must be an int >= 1 or None, got {group_size!r}")
        self.weight_shared = bool(weight_shared)
        self.reweight = reweight or "sqrt"
        self.subgroup_weight, self.segment_length = subgroup_weight or "average", segment_length
        self.normalize = estimator == "treepo" if normalize is None else bool(normalize)
        self.eps = check_number("eps", eps, low=0.0)
        self.group_size, self.reward_key = group_size, reward_key
        out_keys = [keys.ADVANTAGE, keys.LOSS_WEIGHT] if self.weight_shared else [keys.ADVANTAGE]
        super().__init__(in_keys=[reward_key, keys.GROUP_ID, keys.TRAJ_ID], out_keys=out_keys)

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        tree = _tree(td, self.reward_key, owner)
        if self.group_size is not None and bool((tree.leaves != self.group_size).any()):
            i = int((tree.leaves != self.group_size).nonzero()[0])
            raise ValueError(f"{owner}: tree (group) {int(tree.group[i])} has {int(tree.leaves[i])} leaves, expected "
                             f"group_size={self.group_size}; collect whole trees of group_size leaves")  # fmt: skip
        if self.estimator == "treerl":
            adv = self._treerl(tree)
        elif self.estimator == "treerl_code":
            adv = self._treerl_code(tree)
        elif self.estimator == "treepo":
            adv = self._treepo(tree)[:, None]
        else:
            adv = group_advantages(tree.score.float(), tree.group, self.estimator, eps=self.eps)[:, None]
        adv = adv.float() * tree.mask
        if self.normalize:
            adv = masked_whiten(adv, tree.mask)
        td.set(keys.ADVANTAGE, adv.unsqueeze(-1))
        if self.weight_shared:
            set_loss_weight(td, torch.where(tree.mask, 1.0 / tree.count.clamp(min=1), 0.0).float())
        return td

    def _treerl(self, tree: _Tree) -> torch.Tensor:
        """``(G_A + L_A) / sqrt(|L(n)|)`` per token, float64 (N, T)."""
        advantage = (tree.value - tree.root[:, None]) + (tree.value - tree.parent)
        return advantage * self._scale(tree.count)

    def _treerl_code(self, tree: _Tree) -> torch.Tensor:
        """``V'(n) / sqrt(|L(n)|) - V'(parent) / sqrt(|L(parent)|)`` per token, float64 (N, T), with ``V'`` the mean
        leave-one-out centred reward: ``c_i = r_i - (S - r_i) / (N - 1) = N / (N - 1) * (r_i - V(root))``."""
        n = tree.leaves[:, None].double()
        loo = torch.where(n > 1, n / (n - 1).clamp(min=1), 0.0)  # a tree of one leaf: 0
        node = loo * (tree.value - tree.root[:, None]) * self._scale(tree.count)
        parent = loo * (tree.parent - tree.root[:, None]) * self._scale(tree.parent_count)
        return node - parent

    def _scale(self, count: torch.Tensor) -> torch.Tensor:
        """The ``reweight`` factor of ``|L|`` (float64): ``1 / sqrt``, ``1 / count`` or 1."""
        count = count.clamp(min=1).double()
        scales = {"sqrt": count.rsqrt, "count": count.reciprocal, "none": lambda: torch.ones_like(count)}
        return scales[self.reweight]()

    def _treepo(self, tree: _Tree) -> torch.Tensor:
        """The mean over the leaf's subgroups of ``r_i - V(subgroup)`` per leaf, float64 (N,)."""
        if self.segment_length is None:  # each node of the path once
            at = tree.boundary & (tree.count > 1)
        else:  # each segment of the path: depth d is the leaves sharing step d * L - 1
            cols = torch.arange(tree.mask.shape[1], device=tree.mask.device)
            at = tree.mask & (tree.count > 1) & ((cols + 1) % self.segment_length == 0)
        by_size = self.subgroup_weight == "group_size"
        weight = (tree.count.double() if by_size else torch.ones_like(tree.value)) * at
        root_weight = tree.leaves.double() if by_size else torch.ones_like(tree.root)
        total = ((tree.score[:, None] - tree.value) * weight).sum(-1) + (tree.score - tree.root) * root_weight
        return total / (weight.sum(-1) + root_weight)

    def __repr__(self) -> str:
        return f"TreeAdvantage(estimator={self.estimator!r}, weight_shared={self.weight_shared}, normalize={self.normalize})"
