"""Tests of llm_envs/rewards.py: math verifier, format, reward model wrapper, weighted sum."""

import types

import pytest
import torch

from tokengym.llm_envs.rewards import (
    CombinedReward,
    FormatReward,
    MathAnswerReward,
    RewardModelReward,
    extract_answer,
    normalize_answer,
)
from tokengym.testing import tiny_reward_model


def _call(fn, responses, metadata=None):
    metadata = metadata if metadata is not None else [{}] * len(responses)
    return fn(responses, [""] * len(responses), metadata).tolist()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first 3 then 4.", "4"),
        ("total: 1,234 apples", "1,234"),
        ("it is -7", "-7"),
        ("broken \\boxed{3 but 5", "5"),
        ("no digits", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [(" 19 ", "19"), ("+5", "5"), ("1,000", "1000"), ("3.0", "3"), ("2.50", "2.50"), ("$7$", "7"), (-0, "0")],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_math_answer_reward():
    reward = MathAnswerReward(correct=2.0, wrong=-1.0)
    meta = [{"answer": "19"}, {"answer": 19}, {"answer": "19.0"}, {"answer": "19"}, {"answer": "19"}]
    out = reward(["\\boxed{19}", "19", "it's +19", "\\boxed{20} 19", "nothing"], [""] * 5, meta)
    assert out.dtype == torch.float32
    assert out.tolist() == [2.0, 2.0, 2.0, -1.0, -1.0]


def test_math_answer_reward_custom_key_and_missing_key():
    assert _call(MathAnswerReward("gold"), ["4"], [{"gold": "4"}]) == [1.0]
    with pytest.raises(
        KeyError, match=r"reads metadata\['answer'\] but the prompt's metadata has keys \['gold'\]"
    ):
        MathAnswerReward()(["4"], [""], [{"gold": "4"}])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"answer_key": ""}, TypeError, "answer_key must be a non-empty string"),
        ({"answer_key": 3}, TypeError, "answer_key must be a non-empty string"),
        ({"correct": "1"}, TypeError, "correct must be a finite number, got '1'"),
        ({"wrong": float("nan")}, TypeError, "wrong must be a finite number, got nan"),
        ({"correct": True}, TypeError, "correct must be a finite number"),
    ],
)
def test_math_answer_reward_bad_args(kwargs, error, match):
    with pytest.raises(error, match=match):
        MathAnswerReward(**kwargs)


def test_format_reward():
    assert _call(FormatReward(), ["\\boxed{3}", "3", "\\boxed{\n3}"]) == [1.0, 0.0, 1.0]
    tags = FormatReward(r"<answer>.*?</answer>", value=0.25)
    assert _call(tags, ["<answer>x</answer>", "<answer>x"]) == [0.25, 0.0]


def test_format_reward_bad_args():
    with pytest.raises(TypeError, match="pattern must be a regex string, got int"):
        FormatReward(5)
    with pytest.raises(ValueError, match=r"is not a valid regex .*escape special characters"):
        FormatReward("(unclosed")
    with pytest.raises(TypeError, match="value must be a finite number"):
        FormatReward(value=None)


@pytest.fixture(scope="module")
def reward_model(tokenizer):
    return tiny_reward_model(tokenizer)


def test_reward_model_reward_scores_logits(tokenizer, reward_model):
    prompts, responses = ["12+7=", "3*4=", "Reverse abc:"], ["19", "a much longer response 12", "cba"]
    all_at_once = RewardModelReward(reward_model, tokenizer)(responses, prompts, [{}] * 3)
    one_by_one = RewardModelReward(reward_model, tokenizer, batch_size=1)(responses, prompts, [{}] * 3)
    assert all_at_once.shape == (3,) and all_at_once.dtype == torch.float32
    # left padding must not change the score: batched == unpadded single forwards
    torch.testing.assert_close(all_at_once, one_by_one, atol=1e-5, rtol=1e-4)
    ids = tokenizer(prompts[0] + responses[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        direct = reward_model(input_ids=ids).logits[0, 0]
    torch.testing.assert_close(all_at_once[0], direct, atol=1e-5, rtol=1e-4)


def test_reward_model_reward_truncates_from_the_left(tokenizer, reward_model):
    rm = RewardModelReward(reward_model, tokenizer, max_length=2)
    ids = tokenizer("12+7=19", add_special_tokens=False)["input_ids"][-2:]
    with torch.no_grad():
        direct = reward_model(input_ids=torch.tensor([ids])).logits[0, 0]
    torch.testing.assert_close(rm(["19"], ["12+7="], [{}])[0], direct, atol=1e-5, rtol=1e-4)
    assert rm([], [], []).shape == (0,)


def test_reward_model_reward_bad_args(tokenizer, reward_model):
    two_labels = types.SimpleNamespace(config=types.SimpleNamespace(num_labels=2, pad_token_id=0))
    with pytest.raises(
        ValueError, match=r"config.num_labels == 1\), got num_labels=2; load it with num_labels=1"
    ):
        RewardModelReward(two_labels, tokenizer)
    no_pad_tok = types.SimpleNamespace(pad_token_id=None)
    with pytest.raises(ValueError, match="the tokenizer has no pad_token_id"):
        RewardModelReward(reward_model, no_pad_tok)
    no_pad_model = types.SimpleNamespace(config=types.SimpleNamespace(num_labels=1, pad_token_id=None))
    with pytest.raises(ValueError, match="set model.config.pad_token_id = tokenizer.pad_token_id"):
        RewardModelReward(no_pad_model, tokenizer)
    with pytest.raises(ValueError, match="batch_size must be a positive int or None, got 0"):
        RewardModelReward(reward_model, tokenizer, batch_size=0)
    with pytest.raises(ValueError, match="max_length must be a positive int or None, got 1.5"):
        RewardModelReward(reward_model, tokenizer, max_length=1.5)


def test_combined_reward():
    combined = CombinedReward(
        [MathAnswerReward(), FormatReward(), lambda r, p, m: [0.5] * len(r)], [2.0, 1.0, -1.0]
    )
    assert _call(combined, ["\\boxed{4}", "4", "5"], [{"answer": "4"}] * 3) == [2.5, 1.5, -0.5]
    assert _call(CombinedReward([FormatReward()]), ["\\boxed{1}"]) == [1.0]


def test_combined_reward_bad_args():
    with pytest.raises(ValueError, match="reward_fns must be a non-empty list"):
        CombinedReward([])
    with pytest.raises(TypeError, match="every reward function must be callable"):
        CombinedReward([FormatReward(), 3])
    with pytest.raises(ValueError, match="got 1 weights for 2 reward functions"):
        CombinedReward([FormatReward(), FormatReward()], [1.0])
    with pytest.raises(TypeError, match="weight must be a finite number, got inf"):
        CombinedReward([FormatReward()], [float("inf")])
    bad = CombinedReward([lambda r, p, m: [1.0]])
    with pytest.raises(ValueError, match="returned 1 values for 2 responses"):
        bad(["a", "b"], ["", ""], [{}, {}])
