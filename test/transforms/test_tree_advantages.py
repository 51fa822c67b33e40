"""TreeAdvantage: TreeRL / TreePO / GRPO advantages and shared-token loss weights on trees built by hand (the
expected numbers derived step by step below), against a loop-by-loop reference on random trees, on plain GRPO
batches (exactly GroupAdvantage's), bad input, and the weights' effect on the gradient of TorchRL's ClipPPOLoss."""

import math
import random

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors.policies import SequenceActor
from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch
from tokengym.transforms import GroupAdvantage, TreeAdvantage, WeightedLoss, masked_whiten, tree_leaf_counts

PAD = -1
# Group 0 is a tree of 4 leaves (trajectories 10..13, rows 0..3), 7 steps; group 1 a plain pair (rows 4, 5).
#   A=10 (root)                 steps 0-5   reward 1.0
#   B=11 forks from A at step 2 steps 0-4   reward 0.0
#   C=12 forks from A at step 4 steps 0-6   reward 0.5
#   D=13 forks from B at step 3 steps 0-4   reward 1.0
# BRANCH_ID (who generated each step's token):
#   A: 10 10 10 10 10 10 .
#   B: 10 10 11 11 11 .  .
#   C: 10 10 10 10 12 12 12
#   D: 10 10 11 13 13 .  .
# Nodes: n0 = steps 0-1, L = {A, B, C, D}; n1 = steps 2-3 of A/C, L = {A, C}; n2 = step 2 of B/D, L = {B, D};
# then each leaf's own steps (A 4-5, B 3-4, C 4-6, D 3-4), L = the leaf alone.
BRANCH = [[10, 10, 10, 10, 10, 10, PAD],
          [10, 10, 11, 11, 11, PAD, PAD],
          [10, 10, 10, 10, 12, 12, 12],
          [10, 10, 11, 13, 13, PAD, PAD],
          [20, 20, 20, PAD, PAD, PAD, PAD],
          [21, 21, PAD, PAD, PAD, PAD, PAD]]  # fmt: skip
TRAJ = [10, 11, 12, 13, 20, 21]
PARENT = [-1, 10, 10, 11, -1, -1]
FORK = [0, 2, 4, 3, 0, 0]
GROUP = [0, 0, 0, 0, 1, 1]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 2.0]
# V(root of group 0) = (1 + 0 + 0.5 + 1) / 4 = 0.625; V(n0) = 0.625; V(n1) = (1 + 0.5) / 2 = 0.75;
# V(n2) = (0 + 1) / 2 = 0.5; V(root of group 1) = (0 + 2) / 2 = 1.
S = 1 / math.sqrt(2)
# TreeRL, (G_A + L_A) / sqrt(|L|) with G_A = V(n) - V(root), L_A = V(n) - V(parent):
#   n0: (0.625 - 0.625) + (0.625 - 0.625) = 0                       -> 0
#   n1: (0.75 - 0.625) + (0.75 - 0.625 [n0]) = 0.25, / sqrt(2)      -> 0.25 S
#   n2: (0.5 - 0.625) + (0.5 - 0.625) = -0.25, / sqrt(2)            -> -0.25 S
#   A own: (1 - 0.625) + (1 - 0.75 [n1]) = 0.625, / 1
#   B own: (0 - 0.625) + (0 - 0.5 [n2]) = -1.125
#   C own: (0.5 - 0.625) + (0.5 - 0.75) = -0.375
#   D own: (1 - 0.625) + (1 - 0.5) = 0.875
#   group 1, parent = root: row 4 (0 - 1) + (0 - 1) = -2, row 5: +2
TREERL = [[0, 0, 0.25 * S, 0.25 * S, 0.625, 0.625, 0],
          [0, 0, -0.25 * S, -1.125, -1.125, 0, 0],
          [0, 0, 0.25 * S, 0.25 * S, -0.375, -0.375, -0.375],
          [0, 0, -0.25 * S, 0.875, 0.875, 0, 0],
          [-2, -2, -2, 0, 0, 0, 0],
          [2, 2, 0, 0, 0, 0, 0]]  # fmt: skip
# 1 / |L(n)| per token, 0 on padding
WEIGHTS = [[0.25, 0.25, 0.5, 0.5, 1, 1, 0],
           [0.25, 0.25, 0.5, 1, 1, 0, 0],
           [0.25, 0.25, 0.5, 0.5, 1, 1, 1],
           [0.25, 0.25, 0.5, 1, 1, 0, 0],
           [1, 1, 1, 0, 0, 0, 0],
           [1, 1, 0, 0, 0, 0, 0]]  # fmt: skip
LENGTHS = [6, 5, 7, 5, 3, 2]


def _tree_batch(*, forks: bool = True, rewards=REWARDS) -> TensorDict:
    """The batch above: rewards at each leaf's last step, actions equal where the branch id is (one tree token)."""
    n, width = len(TRAJ), len(BRANCH[0])
    branch = torch.tensor(BRANCH)
    mask = branch != PAD
    last = torch.arange(width) == (torch.tensor(LENGTHS) - 1)[:, None]
    per_row = lambda values: torch.tensor(values)[:, None].expand(n, width).clone()  # noqa: E731
    td = TensorDict({keys.REWARD: (last * torch.tensor(rewards)[:, None]).unsqueeze(-1).float(),
                     keys.MASK: mask, keys.TRAJ_ID: per_row(TRAJ), keys.GROUP_ID: per_row(GROUP),
                     keys.BRANCH_ID: branch, keys.ACTION: torch.where(mask, branch * 100 + torch.arange(width), 0)},
                    [n, width])  # fmt: skip
    if forks:
        td.set(keys.PARENT_ID, per_row(PARENT)).set(keys.FORK_INDEX, per_row(FORK))
    return td


def _adv(td):
    return td[keys.ADVANTAGE].squeeze(-1)


def test_treerl_equals_the_formula_by_hand():
    out = TreeAdvantage("treerl")(_tree_batch())
    assert out[keys.ADVANTAGE].shape == (6, 7, 1) and out[keys.ADVANTAGE].dtype == torch.float32
    torch.testing.assert_close(_adv(out), torch.tensor(TREERL), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[keys.LOSS_WEIGHT], torch.tensor(WEIGHTS), atol=0, rtol=0)


@pytest.mark.parametrize(("reweight", "scale"), [("count", 0.5), ("none", 1.0)])
def test_treerl_reweighting_options(reweight, scale):
    # only the shared nodes change: n1 -> 0.25 * scale, n2 -> -0.25 * scale (|L| = 2); |L| = 1 and n0 (0) do not
    want = torch.tensor(TREERL)
    want[[0, 2], 2:4] = 0.25 * scale
    want[[1, 3], 2] = -0.25 * scale
    torch.testing.assert_close(
        _adv(TreeAdvantage("treerl", reweight=reweight)(_tree_batch())), want, atol=1e-6, rtol=0
    )


# TreeRL's released code ("treerl_code"): leaf rewards centred leave-one-out, c_i = r_i - mean of the others:
#   group 0 (sum 2.5, N = 4): A 1 - 1.5 / 3 = 0.5, B 0 - 2.5 / 3 = -5/6, C 0.5 - 2 / 3 = -1/6, D 0.5
#   V'(n) = mean c over L(n): root = n0 = 0, n1 = (0.5 - 1/6) / 2 = 1/6, n2 = (-5/6 + 0.5) / 2 = -1/6
# every token of n gets V'(n) / sqrt|L(n)| - V'(parent) / sqrt|L(parent)| (the root's |L| = 4):
#   n0: 0 / 2 - 0 / 2 = 0;  n1: (1/6) S - 0 / 2 = S / 6;  n2: -S / 6
#   A own: 0.5 / 1 - (1/6) S;  B own: -5/6 + S / 6;  C own: -1/6 - S / 6;  D own: 0.5 + S / 6
#   group 1 (0, 2): c = -2, +2, each its own node under the root (V' = 0): -2, +2
TREERL_CODE = [[0, 0, S / 6, S / 6, 0.5 - S / 6, 0.5 - S / 6, 0],
               [0, 0, -S / 6, -5 / 6 + S / 6, -5 / 6 + S / 6, 0, 0],
               [0, 0, S / 6, S / 6, -1 / 6 - S / 6, -1 / 6 - S / 6, -1 / 6 - S / 6],
               [0, 0, -S / 6, 0.5 + S / 6, 0.5 + S / 6, 0, 0],
               [-2, -2, -2, 0, 0, 0, 0],
               [2, 2, 0, 0, 0, 0, 0]]  # fmt: skip


def test_treerl_code_equals_the_released_codes_formula_by_hand():
    out = TreeAdvantage("treerl_code")(_tree_batch())
    torch.testing.assert_close(_adv(out), torch.tensor(TREERL_CODE), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[keys.LOSS_WEIGHT], torch.tensor(WEIGHTS), atol=0, rtol=0)
    assert not torch.allclose(_adv(out), torch.tensor(TREERL))  # the paper's formula gives other numbers
    # reweight="none": V'(n) - V'(parent): n1 1/6, A own 0.5 - 1/6
    plain = _adv(TreeAdvantage("treerl_code", reweight="none")(_tree_batch()))
    assert plain[0, 2].item() == pytest.approx(1 / 6) and plain[0, 4].item() == pytest.approx(0.5 - 1 / 6)
    # a tree of one leaf gets 0 (the code has no leave-one-out mean for it)
    single = make_trajectory_batch([3], [1.0], group_size=1, steps=4)
    assert not _adv(TreeAdvantage("treerl_code")(single)).any()


def test_the_treerl_docstring_says_which_formula_each_estimator_is():
    doc = TreeAdvantage.__doc__
    assert "the formula of the TreeRL paper" in doc and "not its released code" in doc
    assert "``\"treerl_code\"``: what the released code" in doc


# TreePO: A_i = mean over J_i of (r_i - V(j)), J_i = the root and the nodes on leaf i's path with |L| > 1.
#   A: root 1 - 0.625 = 0.375, n0 0.375, n1 1 - 0.75 = 0.25         -> 1.0 / 3
#   B: root -0.625, n0 -0.625, n2 0 - 0.5 = -0.5                    -> -1.75 / 3
#   C: root -0.125, n0 -0.125, n1 0.5 - 0.75 = -0.25                -> -0.5 / 3
#   D: root 0.375, n0 0.375, n2 1 - 0.5 = 0.5                       -> 1.25 / 3
#   group 1: the root only: -1, +1
TREEPO_AVERAGE = [1 / 3, -1.75 / 3, -0.5 / 3, 1.25 / 3, -1.0, 1.0]
# weighted by |L(j)| (root 4, n0 4, n1/n2 2; total 10):
#   A: (0.375 * 4 + 0.375 * 4 + 0.25 * 2) / 10 = 0.35;  B: (-2.5 - 2.5 - 1) / 10 = -0.6
#   C: (-0.5 - 0.5 - 0.5) / 10 = -0.15;                 D: (1.5 + 1.5 + 1) / 10 = 0.4;   group 1: -1, +1
TREEPO_GROUP_SIZE = [0.35, -0.6, -0.15, 0.4, -1.0, 1.0]
# segment_length=1: every step is a segment, so a shared node counts once per step (TreePO's per-depth subgroups):
#   A: root, steps 0, 1 (n0), 2, 3 (n1): 0.375 * 3 + 0.25 * 2 = 1.625 / 5
#   B: root, steps 0, 1, 2 (n2):         -0.625 * 3 - 0.5 = -2.375 / 4
#   C: root, steps 0, 1, 2, 3:           -0.125 * 3 - 0.25 * 2 = -0.875 / 5
#   D: root, steps 0, 1, 2:              0.375 * 3 + 0.5 = 1.625 / 4;      group 1: -1, +1
TREEPO_SEGMENTS = [1.625 / 5, -2.375 / 4, -0.875 / 5, 1.625 / 4, -1.0, 1.0]


@pytest.mark.parametrize(("options", "per_leaf"), [({}, TREEPO_AVERAGE),
                                                   ({"subgroup_weight": "group_size"}, TREEPO_GROUP_SIZE),
                                                   ({"segment_length": 1}, TREEPO_SEGMENTS)])  # fmt: skip
def test_treepo_equals_the_formula_by_hand(options, per_leaf):
    batch = _tree_batch()
    mask = batch[keys.MASK]
    want = torch.tensor(per_leaf)[:, None] * mask  # a leaf's advantage on every step of its row
    torch.testing.assert_close(_adv(TreeAdvantage("treepo", normalize=False, **options)(batch.clone())), want,
                               atol=1e-6, rtol=0)  # fmt: skip
    # by default whitened over the valid tokens
    whitened = _adv(TreeAdvantage("treepo", **options)(batch.clone()))
    torch.testing.assert_close(whitened, masked_whiten(want, mask), atol=1e-6, rtol=0)
    assert abs(float(whitened[mask].mean())) < 1e-6


def test_treepo_with_one_segment_per_row_has_the_root_only():
    # segment_length=7: the depth-1 subgroup is the leaves sharing step 6, C alone (excluded), so J_i = {root}:
    # A 1 - 0.625, B 0 - 0.625, C 0.5 - 0.625, D 1 - 0.625; group 1: 0 - 1, 2 - 1
    out = _adv(TreeAdvantage("treepo", segment_length=7, normalize=False)(_tree_batch()))
    want = torch.tensor([0.375, -0.625, -0.125, 0.375, -1.0, 1.0])[:, None] * _tree_batch()[keys.MASK]
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


# GRPO over the leaves: group 0 rewards 1, 0, 0.5, 1: mean 0.625, deviations 0.375, -0.625, -0.125, 0.375,
# unbiased std sqrt((0.140625 + 0.390625 + 0.015625 + 0.140625) / 3) = sqrt(0.6875 / 3);
# group 1: 0, 2: mean 1, std sqrt(2)
STD0 = math.sqrt(0.6875 / 3)
GRPO = [0.375 / STD0, -0.625 / STD0, -0.125 / STD0, 0.375 / STD0, -1 / math.sqrt(2), 1 / math.sqrt(2)]
DR_GRPO = [0.375, -0.625, -0.125, 0.375, -1.0, 1.0]


@pytest.mark.parametrize(("estimator", "per_leaf"), [("grpo", GRPO), ("dr_grpo", DR_GRPO)])
def test_grpo_over_leaves_by_hand(estimator, per_leaf):
    batch = _tree_batch()
    out = TreeAdvantage(estimator, eps=0.0)(batch)
    torch.testing.assert_close(
        _adv(out), torch.tensor(per_leaf)[:, None] * batch[keys.MASK], atol=1e-6, rtol=0
    )
    torch.testing.assert_close(out[keys.LOSS_WEIGHT], torch.tensor(WEIGHTS), atol=0, rtol=0)


def test_shared_token_weights_sum_to_one_and_multiply_an_existing_weight():
    batch = _tree_batch()
    weight = TreeAdvantage("treerl")(batch.clone())[keys.LOSS_WEIGHT]
    branch, mask = batch[keys.BRANCH_ID], batch[keys.MASK]
    for t in range(branch.shape[1]):  # every tree token's copies: total weight 1
        for b in branch[:, t][mask[:, t]].unique().tolist():
            assert float(weight[:, t][(branch[:, t] == b) & mask[:, t]].sum()) == pytest.approx(1.0)
    assert weight[~mask].eq(0).all()
    counts = tree_leaf_counts(batch)
    assert counts.tolist()[0] == [4, 4, 2, 2, 1, 1, 0]
    # distinct tokens: n0 2, n1 2, n2 1, own steps A 2, B 2, C 3, D 2, group 1 3 + 2
    assert float((1 / counts[mask]).sum()) == pytest.approx(2 + 2 + 1 + 2 + 2 + 3 + 2 + 5)
    prior = torch.full((6, 7), 2.0)  # e.g. a mismatch correction's weights, nonzero on padding
    weighted = TreeAdvantage("treerl")(batch.clone().set(keys.LOSS_WEIGHT, prior))[keys.LOSS_WEIGHT]
    torch.testing.assert_close(weighted, 2 * torch.tensor(WEIGHTS), atol=0, rtol=0)
    untouched = TreeAdvantage("treerl", weight_shared=False)(batch.clone())
    assert keys.LOSS_WEIGHT not in untouched.keys()


def test_a_plain_grpo_batch_gives_group_advantage_exactly():
    batch = make_trajectory_batch([3, 5, 2, 4, 1, 6, 2, 2], group_size=4, steps=7)  # no BRANCH_ID
    assert keys.BRANCH_ID not in batch.keys()
    for estimator, normalize in (("grpo", False), ("grpo", True), ("dr_grpo", False)):
        ours = TreeAdvantage(estimator, normalize=normalize)(batch.clone())
        theirs = GroupAdvantage(estimator, normalize=normalize)(batch.clone())
        assert torch.equal(ours[keys.ADVANTAGE], theirs[keys.ADVANTAGE]), (estimator, normalize)
        assert torch.equal(ours[keys.LOSS_WEIGHT], batch[keys.MASK].float())  # nothing shared: weight 1


def test_treerl_on_a_depth_one_tree_is_twice_the_centred_reward():
    # each leaf its own node under the root: G_A = L_A = r_i - mean, |L| = 1, so A = 2 (r_i - mean) on every step
    batch = make_trajectory_batch([3, 5, 2, 4, 1, 6, 2, 2], group_size=4, steps=7)
    reward = batch[keys.REWARD].squeeze(-1).sum(-1).double()
    mean = reward.view(2, 4).mean(-1).repeat_interleave(4)
    want = (2 * (reward - mean)).float()[:, None] * batch[keys.MASK]
    torch.testing.assert_close(_adv(TreeAdvantage("treerl")(batch)), want, atol=1e-6, rtol=0)


def test_equal_rewards_give_exactly_zero():
    batch = _tree_batch(rewards=[100.1] * 6)  # float32 100.1 summed and averaged in float64: exactly equal
    for estimator in ("treerl", "treepo", "grpo"):
        assert _adv(TreeAdvantage(estimator)(batch.clone())).eq(0).all(), estimator


# -- a reference written loop by loop, on random trees --------------------------------------------------------------


def _random_trees(groups: int, leaves: int, width: int, seed: int) -> TensorDict:
    """Trees grown by forking: leaf k of a group forks from a random earlier leaf at a random step of it."""
    rng = random.Random(seed)
    n = groups * leaves
    branch = torch.full((n, width), PAD)
    parent, fork, reward = [-1] * n, [0] * n, [float(rng.randint(0, 1)) for _ in range(n)]
    lengths = [0] * n
    for g in range(groups):
        for k in range(leaves):
            i = g * leaves + k
            if k == 0:
                lengths[i] = rng.randint(width // 2, width)
                branch[i, : lengths[i]] = i
                continue
            j = g * leaves + rng.randrange(k)
            f = rng.randint(1, lengths[j] - 1) if lengths[j] > 1 else 0
            lengths[i] = rng.randint(f + 1, width)
            branch[i, :f] = branch[j, :f]
            branch[i, f : lengths[i]] = i
            parent[i], fork[i] = (j, f) if f else (-1, 0)
    mask = branch != PAD
    last = torch.arange(width) == (torch.tensor(lengths) - 1)[:, None]
    per_row = lambda values: torch.tensor(values)[:, None].expand(n, width).clone()  # noqa: E731
    rows = torch.arange(n)
    return TensorDict({keys.REWARD: (last * torch.tensor(reward)[:, None]).unsqueeze(-1).float(), keys.MASK: mask,
                       keys.TRAJ_ID: per_row(rows.tolist()), keys.GROUP_ID: per_row((rows // leaves).tolist()),
                       keys.BRANCH_ID: branch, keys.PARENT_ID: per_row(parent), keys.FORK_INDEX: per_row(fork)},
                      [n, width])  # fmt: skip


def _reference(batch: TensorDict):
    """TreeRL per token and TreePO per leaf, by walking every row's steps and comparing leaf sets."""
    branch, mask = batch[keys.BRANCH_ID].tolist(), batch[keys.MASK].tolist()
    group = batch[keys.GROUP_ID][:, 0].tolist()
    reward = batch[keys.REWARD].squeeze(-1).sum(-1).tolist()
    n, width = len(branch), len(branch[0])
    treerl, treepo = [[0.0] * width for _ in range(n)], [0.0] * n
    for i in range(n):
        tree = [j for j in range(n) if group[j] == group[i]]
        value = lambda leaves: sum(reward[j] for j in leaves) / len(leaves)  # noqa: E731
        root = value(tree)
        parent_set, node_set, terms = tree, None, [reward[i] - root]
        for t in range(width):
            if not mask[i][t]:
                break
            sharing = [j for j in tree if mask[j][t] and branch[j][t] == branch[i][t]]
            if sharing != node_set:  # a new node starts
                parent_set = node_set if node_set is not None else tree
                node_set = sharing
                if len(sharing) > 1:
                    terms.append(reward[i] - value(sharing))
            v = value(node_set)
            treerl[i][t] = ((v - root) + (v - value(parent_set))) / math.sqrt(len(node_set))
        treepo[i] = sum(terms) / len(terms)
    return torch.tensor(treerl), torch.tensor(treepo)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_trees_match_the_loop_reference(seed):
    batch = _random_trees(groups=3, leaves=5, width=12, seed=seed)
    treerl, treepo = _reference(batch)
    mask = batch[keys.MASK]
    torch.testing.assert_close(
        _adv(TreeAdvantage("treerl")(batch.clone())), treerl.float(), atol=1e-6, rtol=0
    )
    got = _adv(TreeAdvantage("treepo", normalize=False)(batch.clone()))
    torch.testing.assert_close(got, treepo.float()[:, None] * mask, atol=1e-6, rtol=0)


# -- bad input ---------------------------------------------------------------------------------------------------


def _edited(key, row, col, value, *, forks: bool = True):
    batch = _tree_batch(forks=forks)
    batch[key][row, col] = value
    return batch


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (_edited(keys.BRANCH_ID, 4, 0, 10), r"row 4 step 0 has 'branch_id' 10, which is no leaf of its group 1 in the "
                                            r"batch \(its leaves: \[20, 21\]\)"),
        (_tree_batch()[1:], r"row 0 step 0 has 'branch_id' 10, which is no leaf of its group 0 .*whole trees"),
        (_edited(keys.BRANCH_ID, 3, 1, 13, forks=False),
         r"row 3 step 2 has 'branch_id' 11, but rows 3 and 1 share the token at step 2 but not the token before it"),
        (_edited(keys.BRANCH_ID, 2, 6, 10), r"row 2 step 6 has 'branch_id' 10, but row 0 \(trajectory 10\) does not "
                                            r"hold that token at step 6"),
        (_edited(keys.ACTION, 2, 1, 7), r"rows 2 and 0 share step 1 by 'branch_id' but their 'action' differ "
                                        r"\(7 and 1001\)"),
        (_edited(keys.FORK_INDEX, 2, slice(None), 3), r"row 2 \(trajectory 12, 'fork_index' 3, 'parent_id' 10\) has "
                                                      r"'branch_id' 10 at step 3, from its fork"),
        (_edited(keys.PARENT_ID, 3, slice(None), 99), r"row 3 \(trajectory 13\) forked from trajectory 99, which is "
                                                      r"no leaf of its group 0"),
        (_edited(keys.FORK_INDEX, 0, slice(None), 1), r"row 0 \(trajectory 10\) is a root \('parent_id' -1\) but has "
                                                      r"'fork_index' 1"),
        (_edited(keys.TRAJ_ID, 5, slice(None), 20), r"trajectory 20 fills rows \[4, 5\]"),
        (_edited(keys.GROUP_ID, 5, 1, 0), r"row 5 changes its 'group_id'"),
        (_edited(keys.TRAJ_ID, 5, 1, 99), r"TreeAdvantage needs a TRAJECTORIES batch .* row 5 is not one"),
    ],
    ids=["other-group", "split-tree", "not-nested", "not-held", "action", "fork", "parent", "root-fork", "dup-traj",
         "group-changes", "two-trajectories"],
)  # fmt: skip
def test_inconsistent_trees_are_refused(batch, match):
    with pytest.raises(ValueError, match=match):
        TreeAdvantage("treerl")(batch)


def test_bad_arguments_and_missing_keys():
    with pytest.raises(
        ValueError, match=r"unknown tree estimator 'rloo'; use one of \['treerl', 'treerl_code', 'treepo', 'grpo'"
    ):
        TreeAdvantage("rloo")
    with pytest.raises(
        ValueError,
        match="reweight applies to the 'treerl' and 'treerl_code' estimators only, got reweight='count' with 'treepo'",
    ):
        TreeAdvantage("treepo", reweight="count")
    with pytest.raises(ValueError, match="segment_length applies to the 'treepo' estimator only"):
        TreeAdvantage("grpo", segment_length=4)
    with pytest.raises(
        ValueError, match=r"unknown subgroup_weight 'size'; use one of \['average', 'group_size'\]"
    ):
        TreeAdvantage("treepo", subgroup_weight="size")
    with pytest.raises(ValueError, match="segment_length must be an int >= 1 or None, got 0"):
        TreeAdvantage("treepo", segment_length=0)
    with pytest.raises(ValueError, match="group_size must be an int >= 1 or None"):
        TreeAdvantage(group_size=0)
    with pytest.raises(ValueError, match=r"tree \(group\) 0 has 4 leaves, expected group_size=3"):
        TreeAdvantage(group_size=3)(_tree_batch())
    assert TreeAdvantage(group_size=4, normalize=False)(_tree_batch()[:4]) is not None
    with pytest.raises(
        KeyError, match=r"TreeAdvantage reads 'group_id' \(tokengym.llm_envs.keys\) but got keys"
    ):
        TreeAdvantage()(_tree_batch().exclude(keys.GROUP_ID))
    with pytest.raises(KeyError, match=r"TreeAdvantage reads \('next', 'reward'\)"):
        TreeAdvantage()(_tree_batch().exclude(keys.REWARD))
    with pytest.raises(KeyError, match=r"tree_leaf_counts reads 'traj_id'"):
        tree_leaf_counts(_tree_batch().exclude(keys.TRAJ_ID))


# -- through a TorchRL loss ----------------------------------------------------------------------------------------


class _RecordingActor(SequenceActor):
    """The real SequenceActor on its whole-logits path (``full_logits=True``), keeping its last logits to read their
    gradient."""

    def __init__(self, model):
        super().__init__(model, full_logits=True)

    def logits(self, tensordict):
        out = super().logits(tensordict)
        if out.requires_grad:  # (log_prob under no_grad: nothing to keep)
            out.retain_grad()
            self.seen = out
        return out


def test_clip_ppo_gradient_flows_through_weighted_tokens_and_each_tree_token_counts_once(model):
    # the hand tree (group 0) on a real batch: one prompt, actions copied from the row that generated each token
    batch = make_trajectory_batch(LENGTHS[:4], REWARDS[:4], group_size=4, steps=7)
    branch = torch.tensor(BRANCH[:4]).sub(10).clamp(min=0)  # trajectory ids 0..3 here
    mask = batch[keys.MASK]
    cols = torch.arange(7).expand(4, 7)
    batch[keys.ACTION] = torch.where(mask, batch[keys.ACTION][branch, cols], 0)
    batch.set(keys.BRANCH_ID, torch.where(mask, branch, PAD))
    batch = TreeAdvantage("treerl")(batch)
    actor = _RecordingActor(model)
    with torch.no_grad():  # old log-probs = current: ratio 1, nothing clipped, the objective is -A per token
        batch[keys.ACTION_LOG_PROB] = actor.log_prob(batch)
    loss = WeightedLoss(ClipPPOLoss(actor, critic_network=None, entropy_bonus=False, functional=False,
                                    reduction="none"))  # fmt: skip
    model.zero_grad()
    out = loss(batch)
    out["loss_objective"].backward()
    grad = actor.seen.grad  # (N, T, V): d loss / d logits of each row's step
    weight, adv = batch[keys.LOSS_WEIGHT], _adv(batch)
    moves = grad.abs().sum(-1) > 0
    assert torch.equal(moves, (weight > 0) & (adv != 0))  # padding (weight 0) and n0 (A = 0) get nothing
    assert bool(moves.any()) and any(
        p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters()
    )
    # n1 (rows 0 and 2, steps 2-3): each copy carries half of one unweighted copy's gradient, together all of it
    for t in (2, 3):
        unweighted = grad[0, t] / weight[0, t]
        torch.testing.assert_close(grad[2, t] / weight[2, t], unweighted, atol=1e-7, rtol=1e-4)
        torch.testing.assert_close(grad[0, t] + grad[2, t], unweighted, atol=1e-7, rtol=1e-4)
    # the objective: each distinct tree token once (-A), over the row tokens (23):
    # n0 2 x 0, n1 2 x 0.25 S, n2 1 x -0.25 S, A 2 x 0.625, B 2 x -1.125, C 3 x -0.375, D 2 x 0.875
    distinct = 2 * 0.25 * S - 0.25 * S + 2 * 0.625 - 2 * 1.125 - 3 * 0.375 + 2 * 0.875
    assert float(out["loss_objective"].detach()) == pytest.approx(-distinct / sum(LENGTHS[:4]), abs=1e-6)
    model.zero_grad()
