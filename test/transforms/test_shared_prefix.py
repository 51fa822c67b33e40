"""The prefix-shared layout: each shared prefix packed once, the prefix tree's parent pointers, the block mask, the map
back to the padded layout; refusing what is not a padded layout."""

import pytest
import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch
from tokengym.transforms import SharedPrefixLayout, to_packed, to_padded, to_shared_prefix


def _padded(rows: list[list[int]], prompt_lens: list[int]) -> TensorDict:
    """A hand-made padded layout: row ``i``'s tokens left-padded to the longest prompt, the rest right-padded."""
    width = max(prompt_lens)
    length = width + max(len(r) - p for r, p in zip(rows, prompt_lens, strict=True))
    tokens = torch.zeros(len(rows), length, dtype=torch.int64)
    mask, generated = torch.zeros_like(tokens, dtype=torch.bool), torch.zeros_like(tokens, dtype=torch.bool)
    for i, (row, p) in enumerate(zip(rows, prompt_lens, strict=True)):
        tokens[i, width - p : width - p + len(row)] = torch.tensor(row)
        mask[i, width - p : width - p + len(row)] = True
        generated[i, width : width - p + len(row)] = True
    return TensorDict({keys.TOKENS: tokens, keys.ATTENTION_MASK: mask, keys.ACTION_MASK: generated}, tokens.shape)


def _check_maps(layout: SharedPrefixLayout, padded) -> None:
    """Every real padded token is at its source; its predictor is its predecessor's source; positions are depths."""
    tokens, mask = padded[keys.TOKENS], padded[keys.ATTENTION_MASK]
    assert bool(((layout.source >= 0) == mask).all())
    assert torch.equal(layout.tokens.flatten()[layout.source[mask]], tokens[mask])
    assert torch.equal(layout.position_ids.flatten()[layout.source[mask]], (mask.cumsum(-1) - 1)[mask])
    has = layout.predictor >= 0
    assert torch.equal(has[:, 1:], mask[:, 1:] & mask[:, :-1]) and not bool(has[:, 0].any())
    assert torch.equal(layout.predictor[:, 1:][has[:, 1:]], layout.source[:, :-1][has[:, 1:]])


def _check_mask(layout: SharedPrefixLayout, padded) -> None:
    """Brute force: on row r's path, the token at depth d attends to exactly row r's tokens at depths <= d (no
    other row's, no padding)."""
    mask = layout.attention_mask()
    real = layout.segment_ids >= 0
    width = layout.tokens.shape[1]
    for r in range(padded.shape[0]):
        flat = layout.source[r][layout.source[r] >= 0]
        pack = int(flat[0]) // width
        cols = flat % width
        for d, col in enumerate(cols.tolist()):
            expected = torch.zeros(width, dtype=torch.bool)
            expected[cols[: d + 1]] = True
            assert torch.equal(mask[pack, 0, col], expected), (r, d)
    assert bool(mask[:, 0][~real].any(-1).all())  # a padding query sees something: no NaN row in the softmax
    additive = layout.attention_mask(torch.float32)
    assert torch.equal(additive == 0, mask) and float(additive.min()) == torch.finfo(torch.float32).min


def test_a_group_packs_its_prompt_once_and_each_sample_is_a_child_of_it():
    batch = make_trajectory_batch([3, 2, 4, 1, 2, 2], group_size=3, prompt_len=4)  # groups of 3, prompts of 4 and 5
    padded = to_padded(batch)
    layout = to_shared_prefix(padded)
    assert layout.tokens.shape[0] == 2  # one pack per group
    real = int((layout.segment_ids >= 0).sum())
    assert real <= 4 + 5 + int(batch[keys.MASK].sum())  # each prompt once (a common first token shares more)
    for r in range(6):
        path = layout.path(r)
        assert layout.parents[path[0]] == -1 and all(int(layout.parents[b]) == a for a, b in zip(path, path[1:], strict=False))
        assert int(layout.lengths[path].sum()) == int(padded[keys.ATTENTION_MASK][r].sum())
    assert {int(layout.packs[layout.path(r)[0]]) for r in range(3)} == {0}
    _check_maps(layout, padded)
    _check_mask(layout, padded)


def test_groups_with_different_prompt_lengths_and_one_sample_groups():
    batch = make_trajectory_batch([2, 3, 1, 4, 2], group_size=1, prompt_len=2)  # five one-sample groups
    padded = to_padded(batch)
    layout = to_shared_prefix(padded)
    assert layout.tokens.shape[0] == 5 and torch.equal(layout.parents, torch.full((5,), -1))  # one segment each
    assert layout.row_segments.tolist() == [0, 1, 2, 3, 4]
    _check_maps(layout, padded)
    _check_mask(layout, padded)


def test_rows_sharing_more_than_the_prompt_nest_in_the_tree():
    """Segments split where rows part; a row that is a prefix of others ends inside the tree and adds no token."""
    p = [9, 8, 7]
    padded = _padded([p + [1, 2, 3], p + [1, 2, 4], p + [1, 5], p + [6], p + [1, 2]], [3] * 5)
    layout = to_shared_prefix(padded)
    assert layout.tokens.shape == (1, 9)  # 3 + 6 single tokens instead of 27
    tokens = layout.tokens[0].tolist()

    def text(seg):
        return tokens[int(layout.starts[seg]) : int(layout.starts[seg] + layout.lengths[seg])]

    assert [[text(s) for s in layout.path(r)] for r in range(5)] == [
        [p, [1], [2], [3]], [p, [1], [2], [4]], [p, [1], [5]], [p, [6]], [p, [1], [2]]]
    root, one, two = layout.path(0)[:3]
    assert int(layout.parents[root]) == -1 and int(layout.parents[one]) == root and int(layout.parents[two]) == one
    assert [int(layout.parents[layout.path(r)[-1]]) for r in range(5)] == [two, two, one, root, one]
    assert bool((layout.parents < torch.arange(len(layout.parents))).all())  # parents first in the packed order
    _check_maps(layout, padded)
    _check_mask(layout, padded)


def test_multi_turn_rows_share_their_longest_common_prefix():
    """Feedback inside the rows (not generated): rows whose first turn agrees share it, not only the prompt."""
    p, feedback = [9, 8], [30, 31]
    rows = [p + [1, 2] + feedback + [3], p + [1, 2] + feedback + [4, 5], p + [6] + feedback + [7]]
    padded = _padded(rows, [2] * 3)
    padded[keys.ACTION_MASK][:, 4:6] = torch.tensor([[False, False], [False, False], [True, False]])  # feedback
    layout = to_shared_prefix(padded)
    assert layout.tokens.shape == (1, 2 + 4 + 1 + 2 + 4)
    shared = layout.path(0)[:-1]
    assert shared == layout.path(1)[:-1] and int(layout.lengths[shared].sum()) == 6
    _check_maps(layout, padded)
    _check_mask(layout, padded)


def test_min_shared_packs_rows_of_different_prompts_sharing_their_first_tokens():
    rows = [[5, 6, 1, 2], [5, 6, 1, 3], [5, 6, 4, 2], [7, 6, 4]]
    padded = _padded(rows, [3, 3, 3, 2])
    assert to_shared_prefix(padded).tokens.shape[0] == 3  # by prompt: [5, 6, 1] x2, [5, 6, 4], [7, 6]
    layout = to_shared_prefix(padded, min_shared=2)
    assert layout.tokens.shape[0] == 2 and layout.tokens[0, :2].tolist() == [5, 6]
    _check_maps(layout, padded)
    _check_mask(layout, padded)


def test_a_trajectories_batch_is_laid_out_with_to_padded_first():
    batch = make_trajectory_batch([3, 1, 2, 2], group_size=2)
    direct, via = to_shared_prefix(batch), to_shared_prefix(to_padded(batch))
    assert all(torch.equal(a, b) for a, b in zip(direct, via, strict=True))


@pytest.mark.parametrize("bad", [
    "tensor", "no tokens", "packed", "holes",
])  # fmt: skip
def test_what_is_not_a_padded_layout_raises_naming_to_padded(bad):
    batch = make_trajectory_batch([2, 3], group_size=2)
    padded = to_padded(batch)
    data = {"tensor": padded[keys.TOKENS], "no tokens": padded.exclude(keys.TOKENS, keys.ACTION),
            "packed": to_packed(batch), "holes": padded.clone()}[bad]  # fmt: skip
    if bad == "holes":
        data[keys.ATTENTION_MASK][0, -3] = False
    with pytest.raises(ValueError, match=r"to_shared_prefix reads a padded layout.*to_padded\(batch\) first"):
        to_shared_prefix(data)
    with pytest.raises(ValueError, match="min_shared must be an int >= 1"):
        to_shared_prefix(padded, min_shared=0)
