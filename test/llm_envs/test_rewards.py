"""Tests of llm_envs/rewards.py: math verifier, format, reward model wrapper, weighted sum; garbage answers
score wrong and never raise, an answer a verifier raises on is counted (reward_errors) and logged."""

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


# (reference answer, response, is correct): the cases first, then realistic model outputs
MATH_CASES = [
    (r"\frac{1}{2}", "0.5", True),
    ("0.5", "The answer is 0.50", True),
    ("1000", r"\boxed{10^{3}}", True),
    ("B", r"The answer is \boxed{\text{(B)}}", True),
    ("4", r"\boxed{x=4}", True),
    (r"4\%", r"The answer is $4\%$", True),
    ("5", "The answer is 5. Check: 5+2=7", True),
    ("19", "19", True),
    ("19", r"so it is \boxed{19}", True),
    ("19", "+19", True),
    ("1234", "The total is 1,234 apples.", True),
    ("-7", "The answer is $-7$.", True),
    (r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{1}{\sqrt{2}}}", True),
    (r"3\pi", r"\boxed{3\pi}", True),
    ("x^2+2x+1", r"\boxed{(x+1)^2}", True),
    (r"\frac{3}{4}", r"\boxed{0.75}", True),
    ("12", "Step 1: 3*4 = 12\n\nFinal answer: \\boxed{12}", True),
    ("25", r"The final answer is $\boxed{25}$. I hope it is correct.", True),
    (r"\{1,2,3\}", r"\boxed{\{3,2,1\}}", True),
    (r"90^\circ", r"\boxed{90}", True),
    (r"\dfrac{7}{3}", r"\boxed{\frac{7}{3}}", True),
    ("(1, 2)", r"\boxed{(1,2)}", True),
    ("19", "20", False),
    ("19", r"\boxed{20} and 19", False),
    ("0.5", r"\boxed{\frac{1}{3}}", False),
    ("4", "x=5", False),
    ("5", "no answer here", False),
    ("B", r"\boxed{C}", False),
    ("12", "", False),
    ("5", "x = 5 and y = 7", False),
    ("1000", r"\boxed{10^{4}}", False),
]


@pytest.fixture(scope="module")
def math_reward():
    return MathAnswerReward(correct=2.0, wrong=-1.0)


@pytest.mark.parametrize("answer, response, expected", MATH_CASES)
def test_math_answer_reward_cases(math_reward, answer, response, expected):
    assert math_reward.is_correct(response, answer) is expected
    out = math_reward([response], [""], [{"answer": answer}])
    assert out.dtype == torch.float32 and out.tolist() == [2.0 if expected else -1.0]


def test_math_answer_reward_scores_the_whole_table(math_reward):
    answers, responses, expected = zip(*MATH_CASES, strict=True)
    out = math_reward(list(responses), [""] * len(answers), [{"answer": a} for a in answers])
    assert out.tolist() == [2.0 if e else -1.0 for e in expected]
    old = MathAnswerReward(verifier="exact")(list(responses), [""] * len(answers), [{"answer": a} for a in answers])
    assert int(old.sum()) < sum(expected)  # the regex verifier misses cases math-verify gets


@pytest.mark.parametrize(
    "answer, response",
    [("19", r) for r in ["19", " 19 ", "19.", "\\boxed{19}", "$19$", "019", "20", "-19", "", "no answer", "\\boxed{x}"]]
    + [("0", "-0"), (19, "19"), ("-3", "-3")],
)
def test_fast_path_agrees_with_math_verify(answer, response):
    from math_verify import parse, verify

    assert MathAnswerReward().is_correct(response, answer) is verify(parse(f"${answer}$"), parse(response))


def test_math_answer_reward_integer_types_and_floats():
    reward = MathAnswerReward()
    meta = [{"answer": 19}, {"answer": "19.0"}, {"answer": 0.5}, {"answer": "-0"}]
    assert _call(reward, ["19", "\\boxed{19}", "1/2", "0"], meta) == [1.0, 1.0, 1.0, 1.0]


def test_math_answer_reward_off_the_main_thread():
    # math-verify's timeout uses signal.alarm, which raises off the main thread; it must still score
    import threading

    got = []
    thread = threading.Thread(target=lambda: got.append(MathAnswerReward().is_correct("\\boxed{0.5}", "\\frac{1}{2}")))
    thread.start()
    thread.join()
    assert got == [True]


def test_exact_verifier():
    reward = MathAnswerReward(correct=2.0, wrong=-1.0, verifier="exact")
    meta = [{"answer": "19"}, {"answer": 19}, {"answer": "19.0"}, {"answer": "19"}, {"answer": "19"}, {"answer": 7}]
    out = reward(["\\boxed{19}", "19", "it's +19", "\\boxed{20} 19", "nothing", "3+4"], [""] * 6, meta)
    assert out.tolist() == [2.0, 2.0, 2.0, -1.0, -1.0, -1.0]
    assert MathAnswerReward().is_correct("3+4", 7)  # math-verify evaluates expressions; exact does not


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
        ({"verifier": "sympy"}, ValueError, r"verifier must be one of \('math_verify', 'exact'\), got 'sympy'"),
        ({"timeout_s": 0.5}, ValueError, "timeout_s must be an int >= 1"),
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


# what a model can write: none of it may raise (DESIGN.md "Bad input"); 10,000 digits exceed int()'s limit
BIG = "9" * 10_000
GARBAGE = ["1e999", "", "\x00", "((((", BIG, "nan", "inf", "-inf", "\\boxed{" + BIG + "}", "\\boxed{1e999}",
           "\\boxed{((((}", "\\boxed{nan}", "{" * 2000, "}" * 2000, "\\frac{1}{0}", BIG + ".5"]  # fmt: skip


@pytest.fixture(scope="module")
def verifiers():
    return {v: MathAnswerReward(correct=2.0, wrong=-1.0, verifier=v) for v in ("math_verify", "exact")}


@pytest.mark.parametrize("response", GARBAGE, ids=lambda g: repr(g[:12]))
@pytest.mark.parametrize("verifier", ["math_verify", "exact"])
def test_garbage_answers_are_wrong_not_errors(verifiers, verifier, response):
    reward = verifiers[verifier]
    answers = ["7", "-7", "\\frac{1}{2}", "B", "0.5"]
    out = reward([response] * len(answers), [""] * len(answers), [{"answer": a} for a in answers])
    assert out.tolist() == [-1.0] * len(answers)
    assert reward.counts == {"reward_errors": 0}  # wrong, not unscorable: nothing raised
    both = CombinedReward([reward, FormatReward(value=0.5)])
    expected = -1.0 + (0.5 if "\\boxed{" in response and "}" in response else 0.0)
    assert _call(both, [response], [{"answer": "7"}]) == [expected]


def test_huge_integers_compare_exactly():
    reward = MathAnswerReward()
    assert _call(reward, [BIG, f"\\boxed{{{BIG}}}", "9" * 9_999, "-" + BIG, "0" + BIG], [{"answer": BIG}] * 5) == [
        1.0, 1.0, 0.0, 0.0, 1.0]  # fmt: skip
    assert _call(reward, ["\u0663", "-0", "+19"], [{"answer": 3}, {"answer": "0"}, {"answer": "019"}]) == [1.0] * 3


def test_an_answer_the_verifier_raises_on_scores_wrong_and_is_counted(monkeypatch, caplog):
    import math_verify

    from tokengym.llm_envs import TokenEnv
    from tokengym.testing import tiny_tokenizer

    def broken(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(math_verify, "verify", broken)
    reward = MathAnswerReward(correct=2.0, wrong=-1.0)
    with caplog.at_level("WARNING", logger="tokengym.rewards"):
        assert _call(reward, ["x = 1/2", "((((", "7"], [{"answer": "0.5"}] * 2 + [{"answer": 7}]) == [-1.0, -1.0, 2.0]
    assert reward.counts == {"reward_errors": 2}  # "7" takes the exact integer path
    warnings = [r.getMessage() for r in caplog.records if r.name == "tokengym.rewards"]
    assert len(warnings) == 1 and "RecursionError" in warnings[0] and "'x = 1/2'" in warnings[0]
    combined = CombinedReward([reward, FormatReward(), MathAnswerReward(verifier="exact")])
    assert combined.counts == {"reward_errors": 2}
    env = TokenEnv(["q"], tiny_tokenizer(), combined, batch_size=1)
    assert env.prompt_counts == {"prompts_skipped_overlong": 0, "prompts_truncated": 0, "reward_errors": 2}
    assert "reward_errors" not in TokenEnv(["q"], tiny_tokenizer(), FormatReward(), batch_size=1).prompt_counts


def test_counts_of_a_trl_reward_function_reach_prompt_counts():
    from tokengym.llm_envs import TokenEnv
    from tokengym.testing import tiny_tokenizer

    class Judge:  # a TRL-style reward function that keeps its own counts
        counts = {"reward_errors": 3}

        def __call__(self, prompts, completions, **kwargs):
            return [0.0] * len(completions)

    assert TokenEnv(["q"], tiny_tokenizer(), Judge(), batch_size=1).prompt_counts["reward_errors"] == 3
    assert CombinedReward([Judge(), Judge()]).counts == {"reward_errors": 6}
