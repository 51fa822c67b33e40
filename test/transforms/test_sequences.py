import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer, to_steps_layout
from tokengym.transforms import check_trajectory_rows, sequence_layout, sequence_log_probs, step_log_probs


@pytest.fixture(scope="module")
def lm():
    return tiny_model(tiny_tokenizer())


def _naive(model, ids):
    logits = model(input_ids=ids[None]).logits[0, :-1].log_softmax(-1)
    return logits.gather(-1, ids[1:, None]).squeeze(-1)


def test_left_padding_matches_unpadded(lm):
    a, b = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])
    tokens = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    attn = tokens != 0
    out = sequence_log_probs(lm, tokens, attn)
    torch.testing.assert_close(out[0, 1:], _naive(lm, a), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 3:], _naive(lm, b), atol=1e-5, rtol=1e-5)
    assert out[1, :3].eq(0).all()


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_temperature(family):
    model = tiny_model(tiny_tokenizer(), family=family)
    tokens = torch.tensor([[5, 6, 7]])
    hot = sequence_log_probs(model, tokens, torch.ones_like(tokens), temperature=2.0)
    logits = model(input_ids=tokens).logits[0, :-1] / 2.0
    expect = logits.log_softmax(-1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(hot[0, 1:], expect, atol=1e-5, rtol=1e-5)


def test_step_log_probs_aligned_with_steps(lm):
    batch = make_trajectory_batch([3, 1, 2], group_size=1)
    out = step_log_probs(lm, batch)
    table = batch.get_non_tensor(keys.PROMPTS)
    for i, n in enumerate([3, 1, 2]):
        ids = torch.cat([table.ids(i), batch[keys.ACTION][i, :n]])
        torch.testing.assert_close(out[i, :n], _naive(lm, ids)[-n:], atol=1e-5, rtol=1e-5)
    assert out[1, 1:].eq(0).all()


def test_sequence_layout_rows():
    batch = make_trajectory_batch([2, 1], group_size=1)
    layout = sequence_layout(batch)
    tokens, attn, width = layout.tokens, layout.attention_mask, layout.response_start
    table = batch.get_non_tensor(keys.PROMPTS)
    assert width == max(len(table.ids(0)), len(table.ids(1)))
    assert tokens[1, width:].tolist() == [batch[keys.ACTION][1, 0].item(), 0]
    assert attn.sum(-1).tolist() == [len(table.ids(0)) + 2, len(table.ids(1)) + 1]


def test_bad_args(lm):
    tokens = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"temperature must be in \(0.0, inf\], got 0.0"):
        sequence_log_probs(lm, tokens, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="attention_mask must have the shape of tokens"):
        sequence_log_probs(lm, tokens, tokens[:, :2])
    with pytest.raises(ValueError, match=r"tokens must be an int64 tensor \(N, L\)"):
        sequence_log_probs(lm, tokens[0], tokens[0])
    batch = make_trajectory_batch([2, 3, 1])
    with pytest.raises(KeyError, match="PromptTable under"):
        sequence_layout(batch.exclude(keys.PROMPTS))
    with pytest.raises(TypeError, match="prompts to be a PromptTable"):
        sequence_layout(batch, prompts={0: [1]})
    with pytest.raises(ValueError, match="needs a TRAJECTORIES batch .* row 0"):
        check_trajectory_rows(to_steps_layout(batch, rows=1), "x")
    empty = PromptTable(pad_token_id=0)
    for g in range(3):
        empty.add(g, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty prompt"):
        sequence_layout(batch, empty)
    batch[keys.TURN][0, 1] = 1  # multi-turn rows need their full sequence in the table
    with pytest.raises(KeyError, match="trajectory id 0 is not in this PromptTable"):
        sequence_layout(batch)
