"""Tests of llm_envs/tasks: prompt generators, task rewards, env constructors, prompt files."""

import json
import warnings
from fractions import Fraction

import datasets
import pytest
import torch
from torchrl.envs.utils import step_mdp

from tokengym.llm_envs import keys
from tokengym.llm_envs.rewards import MathAnswerReward
from tokengym.llm_envs.tasks import (
    CountdownReward,
    ReversalReward,
    arithmetic_prompts,
    countdown_prompts,
    evaluate_expression,
    load_prompt_file,
    make_arithmetic_env,
    make_countdown_env,
    make_reversal_env,
    reversal_prompts,
)
from tokengym.llm_envs.token_env import TokenEnv
from tokengym.testing import tiny_tokenizer

TASKS = {
    "arithmetic": (arithmetic_prompts, make_arithmetic_env),
    "countdown": (countdown_prompts, make_countdown_env),
    "reversal": (reversal_prompts, make_reversal_env),
}


def _play(env: TokenEnv, text: str) -> float:
    """Reset a single-slot env, feed the tokens of ``text`` then eos, return the final reward."""
    td = env.reset()
    ids = env.tokenizer(text, add_special_tokens=False)["input_ids"] + [env.tokenizer.eos_token_id]
    for i, token in enumerate(ids):
        out = env.step(td.set(keys.ACTION, torch.tensor([token])))
        assert bool(out.get(keys.DONE)[0]) == (i == len(ids) - 1)
        td = step_mdp(out)
    assert bool(out.get(keys.TERMINATED)[0])
    return out.get(keys.REWARD).item()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_prompts_are_seeded(task):
    generate = TASKS[task][0]
    assert generate(20, seed=3) == generate(20, seed=3)
    assert generate(20, seed=3) != generate(20, seed=4)
    assert all(isinstance(p["prompt"], str) and isinstance(p["answer"], str) for p in generate(20))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_task_env_rewards_the_scripted_answer(task):
    env = TASKS[task][1](tokenizer=tiny_tokenizer(), batch_size=1, n_prompts=5, seed=1)
    answer = env.source.prompts[0]["answer"]
    assert _play(env, answer) == 1.0
    assert _play(env, "0 wrong") == 0.0  # next prompt, a wrong answer


@pytest.mark.parametrize("task", sorted(TASKS))
def test_task_env_steps_with_random_actions(task):
    env = TASKS[task][1](tokenizer=tiny_tokenizer(), batch_size=4, n_prompts=8, max_new_tokens=3)
    rollout = env.rollout(4, break_when_any_done=False)
    assert rollout.batch_size == (4, 4)
    assert bool(rollout.get(keys.DONE)[:, 2].all())  # the 3-token budget ends every response
    assert rollout.get(keys.REWARD).dtype == torch.float32


@pytest.mark.parametrize("task", sorted(TASKS))
def test_task_env_takes_a_reward_fn(task):
    seen = []

    def says_hello(responses, prompts, metadata):
        seen.extend(metadata)
        return [float(r == "hello") for r in responses]

    env = TASKS[task][1](tokenizer=tiny_tokenizer(), batch_size=1, n_prompts=3, max_new_tokens=8,
                         reward_fn=says_hello)  # fmt: skip
    assert _play(env, "hello") == 1.0
    assert _play(env, env.source.prompts[1]["answer"]) == 0.0  # the task's own reward is replaced
    assert [m["answer"] for m in seen] == [p["answer"] for p in env.source.prompts[:2]]


def test_arithmetic_reward_wants_a_number():
    from tokengym.llm_envs.tasks import arithmetic_reward

    meta = [{"answer": "19"}] * 4
    assert arithmetic_reward()(["19", "12+7", "\\boxed{19}", "19.0"], [""] * 4, meta).tolist() == [1, 0, 1, 1]


def test_make_env_forwards_kwargs(tokenizer):
    env = make_arithmetic_env(
        tokenizer=tokenizer, batch_size=2, max_new_tokens=5, max_length=64, group_size=2
    )
    assert env.tokenizer is tokenizer and env.max_new_tokens == 5 and env.max_length == 64
    assert env.source.group_size == 2


def test_arithmetic_prompts():
    prompts = arithmetic_prompts(50, max_operand=9, ops="+-*")
    assert {p["prompt"][1] for p in prompts} == {"+", "-", "*"}
    for p in prompts:
        assert int(p["answer"]) == eval(p["prompt"].removesuffix("=")) >= 0, p


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "n must be an int >= 1, got 0"),
        ({"n": 2, "max_operand": -1}, "max_operand must be an int >= 0, got -1"),
        ({"n": 2, "ops": "/"}, "ops must be a non-empty string of operators from '\\+-\\*', got '/'"),
        ({"n": 2, "ops": ""}, "ops must be a non-empty string"),
    ],
)
def test_arithmetic_prompts_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        arithmetic_prompts(**kwargs)


def test_countdown_answers_are_solutions():
    prompts = countdown_prompts(300, seed=2, n_numbers=4)
    assert CountdownReward()([p["answer"] for p in prompts], [""] * 300, prompts).tolist() == [1.0] * 300


@pytest.mark.parametrize(
    "expression, numbers, expected",
    [
        ("(2+3)*4", [2, 3, 4], Fraction(20)),
        ("6/(3-1)", [6, 3, 1], Fraction(3)),
        ("7/2", [7, 2], Fraction(7, 2)),
        ("2+2", [2, 2, 5], Fraction(4)),
        ("2+2", [2, 5], None),  # 2 used twice
        ("2*9", [2, 5], None),  # 9 not given
        ("2**3", [2, 3], None),
        ("-2+3", [2, 3], None),
        ("2.5+1", [1], None),
        ("1/(2-2)", [1, 2, 2], None),
        ("__import__('os')", [], None),
        ("2 3", [2, 3], None),
        ("+".join(["1"] * 150), [1] * 150, None),  # too long
    ],
)
def test_evaluate_expression(expression, numbers, expected):
    assert evaluate_expression(expression, numbers) == expected


def test_countdown_scores_model_output_without_warnings():
    # "3and 4" used to reach ast.parse, whose tokenizer warns "invalid decimal literal" on every call
    noisy = ["3and 4", "2x+3", "1if 2 else 3", "0x1f", "1e5", "1_0+2", "\\boxed{3 4}", "3 + 4 is 7", "3 + 4 = 7", "(3+4)"]
    meta = [{"numbers": [3, 4], "target": 7}] * len(noisy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = CountdownReward()(noisy, [""] * len(noisy), meta)
    assert [str(w.message) for w in caught] == []
    assert out.tolist() == [0.0] * 8 + [1.0, 1.0]


def test_countdown_reward():
    meta = [{"numbers": [2, 3, 5], "target": 25}] * 4
    reward = CountdownReward(correct=2.0, wrong=-1.0)
    assert reward(["(2+3)*5 = 25", "\\boxed{(3+2)*5}", "5*5", "(2+3)*5\nmore"], [""] * 4, meta).tolist() == [
        2.0,
        2.0,
        -1.0,
        2.0,
    ]
    with pytest.raises(
        KeyError, match=r"reads metadata \['target'\] but the prompt's metadata has keys \['numbers'\]"
    ):
        reward(["1"], [""], [{"numbers": [1]}])
    with pytest.raises(TypeError, match="wrong must be a finite number, got None"):
        CountdownReward(wrong=None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_numbers": 1}, "n_numbers must be an int >= 2, got 1"),
        ({"max_number": 0}, "max_number must be an int >= 1, got 0"),
    ],
)
def test_countdown_prompts_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        countdown_prompts(3, **kwargs)


def test_reversal():
    prompts = reversal_prompts(30, min_len=2, max_len=5, alphabet="xyz")
    assert all(p["prompt"] == f"Reverse {p['answer'][::-1]}:" and 2 <= len(p["answer"]) <= 5 for p in prompts)
    meta = [{"answer": "cba"}] * 4
    assert ReversalReward()([" cba\n", "cbx", "abc", ""], [""] * 4, meta).tolist() == [1.0, 0.0, 0.0, 0.0]
    partial = ReversalReward(partial_credit=True)(["cba", "cbx", "cb", ""], [""] * 4, meta)
    torch.testing.assert_close(partial, torch.tensor([1.0, 2 / 3, 2 / 3, 0.0]))


def test_reversal_bad_args():
    with pytest.raises(ValueError, match="max_len must be >= min_len, got max_len=2 and min_len=3"):
        reversal_prompts(2, min_len=3, max_len=2)
    with pytest.raises(ValueError, match="min_len must be an int >= 1"):
        reversal_prompts(2, min_len=0)
    with pytest.raises(ValueError, match="alphabet must be a non-empty string of visible characters"):
        reversal_prompts(2, alphabet=" ")
    with pytest.raises(TypeError, match="partial_credit must be a bool, got 1"):
        ReversalReward(partial_credit=1)
    with pytest.raises(KeyError, match=r"reads metadata\['answer'\] but the prompt's metadata has keys \[\]"):
        ReversalReward()(["x"], [""], [{}])


ROWS = [
    {"question": "12+7=", "solution": "19", "level": 1},
    {"question": "3+4=", "solution": "7", "level": 2},
]


@pytest.fixture(params=["jsonl", "parquet"])
def prompt_file(request, tmp_path):
    path = tmp_path / f"prompts.{request.param}"
    if request.param == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    else:
        datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    return path


def test_load_prompt_file(prompt_file, tokenizer):
    data = load_prompt_file(prompt_file, prompt_key="question", answer_key="solution")
    assert isinstance(data, datasets.Dataset) and len(data) == 2
    assert data[0] == {"prompt": "12+7=", "answer": "19", "level": 1}
    env = TokenEnv(data, tokenizer, MathAnswerReward(), batch_size=1, max_new_tokens=4, max_length=32)
    assert _play(env, "19") == 1.0
    assert env.slot_prompt(0).metadata == {"answer": "19", "level": 1}


def test_load_prompt_file_default_columns(tmp_path):
    path = tmp_path / "p.JSONL"
    path.write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n")
    assert load_prompt_file(path).column_names == ["prompt", "answer"]
    assert load_prompt_file(path, answer_key=None)[0] == {"prompt": "hi", "answer": "1"}


def test_load_prompt_file_errors(prompt_file, tmp_path):
    with pytest.raises(ValueError, match="does not exist \\(or is not a file\\); check the path"):
        load_prompt_file(tmp_path / "missing.jsonl")
    (tmp_path / "p.csv").write_text("prompt\nhi\n")
    with pytest.raises(
        ValueError, match=r"has extension '.csv'; use one of \['.json', '.jsonl', '.parquet', '.pq'\]"
    ):
        load_prompt_file(tmp_path / "p.csv")
    with pytest.raises(
        ValueError,
        match=r"has no column 'prompt' \(prompt_key\); its columns are \['question', 'solution', 'level'\]",
    ):
        load_prompt_file(prompt_file)
    with pytest.raises(ValueError, match=r"has no column 'answer' \(answer_key\).*or answer_key=None"):
        load_prompt_file(prompt_file, prompt_key="question")
    clash = tmp_path / "clash.jsonl"
    clash.write_text(json.dumps({"prompt": "a", "q": "b"}) + "\n")
    with pytest.raises(ValueError, match="already has a column 'prompt'"):
        load_prompt_file(clash, prompt_key="q", answer_key=None)
