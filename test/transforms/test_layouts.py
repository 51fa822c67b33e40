import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch
from tokengym.transforms import GroupAdvantage, dpo_pairs, padded_to_steps, to_packed, to_padded


def test_padded_layout_and_round_trip():
    batch = GroupAdvantage()(make_trajectory_batch([2, 4, 1], group_size=2, steps=5))
    padded = to_padded(batch)
    table = batch.get_non_tensor(keys.PROMPTS)
    width = padded.get_non_tensor(keys.RESPONSE_START)
    assert padded.batch_size == (3, width + 5)
    for i, n in enumerate([2, 4, 1]):
        prompt = table.ids(i // 2)
        row = padded[keys.TOKENS][i][padded[keys.ATTENTION_MASK][i]]
        assert row.tolist() == torch.cat([prompt, batch[keys.ACTION][i, :n]]).tolist()
        assert padded[keys.ACTION_MASK][i].sum() == n
        assert padded[keys.POSITION_IDS][i, width - len(prompt)] == 0
    aligned = padded[keys.ACTION_LOG_PROB][padded[keys.ACTION_MASK]]
    assert torch.equal(aligned, batch[keys.ACTION_LOG_PROB][batch[keys.MASK]])
    assert torch.equal(padded[keys.ADVANTAGE][:, width:], batch[keys.ADVANTAGE])
    back = padded_to_steps(padded)
    assert (back == batch).all()
    assert set(back.keys(True, True)) == set(batch.keys(True, True))
    assert back.get_non_tensor(keys.PROMPTS) is table


def test_packed_layout():
    batch = make_trajectory_batch([2, 4, 1], group_size=1)
    padded = to_padded(batch)
    packed = to_packed(batch)
    offsets = packed[keys.SEQ_OFFSETS]
    lengths = padded[keys.ATTENTION_MASK].sum(-1)
    assert offsets.tolist() == [0, *lengths.cumsum(0).tolist()]
    for i in range(3):
        seg = slice(int(offsets[i]), int(offsets[i + 1]))
        assert packed[keys.TOKENS][0, seg].tolist() == padded[keys.TOKENS][i][padded[keys.ATTENTION_MASK][i]].tolist()
        assert packed[keys.POSITION_IDS][0, seg].tolist() == list(range(int(lengths[i])))
    assert packed[keys.ACTION_MASK].sum() == 7


def test_dpo_pairs():
    batch = make_trajectory_batch([2, 3, 1, 2, 3, 3], [0.5, 1.0, 0.0, 1.0, 1.0, 1.0], group_size=3)
    pairs = dpo_pairs(batch)
    padded = to_padded(batch)
    assert pairs.batch_size[0] == 1  # group 1 is all ties: no pair
    assert torch.equal(pairs[keys.CHOSEN, keys.TOKENS][0], padded[keys.TOKENS][1])
    assert torch.equal(pairs[keys.REJECTED, keys.TOKENS][0], padded[keys.TOKENS][2])


def test_bad_input():
    batch = make_trajectory_batch([2, 3])
    with pytest.raises(KeyError, match="padded_to_steps reads 'response_start'"):
        padded_to_steps(to_padded(batch).exclude(keys.RESPONSE_START))
    with pytest.raises(KeyError, match=r"padded_to_steps reads \('tokens', 'full'\)"):
        padded_to_steps(batch)
    with pytest.raises(KeyError, match="reads the PromptTable"):
        to_padded(batch.exclude(keys.PROMPTS))
