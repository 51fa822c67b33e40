"""PromptTable: prompt ids stored once per group."""

import pytest
import torch

from tokengym.llm_envs import PromptTable


@pytest.fixture
def table():
    t = PromptTable()
    t.add(3, torch.tensor([5, 6, 7]), text="abc", metadata={"answer": "1"})
    t.add(9, torch.tensor([8]), text="d")
    return t


def test_lookup(table):
    assert table.ids(3).tolist() == [5, 6, 7]
    assert table.text(3) == "abc" and table.metadata(3) == {"answer": "1"}
    assert table.metadata(9) == {}
    assert len(table) == 2 and 3 in table and 4 not in table
    assert table.group_ids() == [3, 9]
    assert repr(table) == "PromptTable(groups=2, pad_token_id=None)"


def test_add_is_first_wins(table):
    table.add(3, torch.tensor([1]), text="other")
    assert table.ids(3).tolist() == [5, 6, 7] and table.text(3) == "abc"


def test_accepts_tensor_group_ids(table):
    assert table.ids(torch.tensor(3)).tolist() == [5, 6, 7]
    assert torch.tensor(9) in table


def test_left_padded(table):
    tokens, lengths = table.left_padded(torch.tensor([9, 3, 9]), pad_id=0)
    assert tokens.tolist() == [[0, 0, 8], [5, 6, 7], [0, 0, 8]]
    assert lengths.tolist() == [1, 3, 1]
    assert tokens.dtype == torch.int64


def test_left_padded_empty(table):
    tokens, lengths = table.left_padded(torch.tensor([], dtype=torch.int64), pad_id=0)
    assert tokens.shape == (0, 0) and lengths.shape == (0,)


def test_subset_and_merge(table):
    sub = table.subset(torch.tensor([9, 9]))
    assert sub.group_ids() == [9] and sub.ids(9) is table.ids(9)
    other = PromptTable()
    other.add(1, torch.tensor([2]))
    merged = other.merge(table)
    assert merged is other and merged.group_ids() == [1, 3, 9]


@pytest.mark.parametrize("method", ["ids", "text", "metadata"])
def test_missing_group_raises(table, method):
    with pytest.raises(KeyError, match=r"group id 4 is not in this PromptTable \(it holds 2 groups\)"):
        getattr(table, method)(4)


def test_subset_missing_group_raises(table):
    with pytest.raises(KeyError, match="group id 5"):
        table.subset([3, 5])
