"""Tests of llm_envs/trl_rewards.py: TRL-convention reward functions run unchanged as TokenEnv reward_fns."""

import re

import pytest
import torch
from torchrl.envs.utils import step_mdp

from tokengym.llm_envs import CombinedReward, MathAnswerReward, TokenEnv, keys
from tokengym.llm_envs.tasks import arithmetic_prompts, make_countdown_env
from tokengym.llm_envs.trl_rewards import TRLReward, as_reward_fn, from_trl_reward, is_trl_reward
from tokengym.llm_envs.waves import WaveResult
from tokengym.testing import tiny_tokenizer


# Reward functions written as in TRL's GRPOTrainer docs: completions first, dataset columns as kwargs.
def format_reward(completions, **kwargs):
    """Conversational format: completion[0]["content"]."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]


def accuracy_reward(completions, answer, prompts, **kwargs):
    """Standard format: strings; reads the ``answer`` column and the prompts."""
    assert all(isinstance(p, str) and p.endswith("=") for p in prompts)
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def only_some(completions, level, **kwargs):
    """Returns None where it does not apply (TRL: ignored in the weighted sum)."""
    return [None if lv is None else float(lv) for lv in level]


def test_standard_format_reads_columns_and_prompts():
    fn = from_trl_reward(accuracy_reward)
    out = fn(["19", " 7 ", "8"], ["12+7=", "3+4=", "3+4="], [{"answer": "19"}, {"answer": "7"}, {"answer": "7"}])
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 1.0, 0.0]


def test_conversational_format():
    fn = from_trl_reward(format_reward, conversational=True)
    out = fn(["<think>x</think><answer>4</answer>", "4"], ["", ""], [{}, {}])
    assert out.tolist() == [1.0, 0.0]


def test_none_and_missing_columns():
    metadata = [{"level": 2}, {"level": None}, {}]  # the last row lacks the column: None, as in TRL
    assert from_trl_reward(only_some)(["a", "b", "c"], [""] * 3, metadata).tolist() == [2.0, 0.0, 0.0]
    assert from_trl_reward(only_some, none_value=-1)(["a"], [""], [{"level": None}]).tolist() == [-1.0]


def test_runs_unchanged_in_a_token_env(tokenizer):
    prompts = arithmetic_prompts(4, seed=0, max_operand=9)
    reward = CombinedReward([from_trl_reward(accuracy_reward), from_trl_reward(format_reward, conversational=True)])
    env = TokenEnv(prompts, tokenizer, reward, batch_size=1, max_new_tokens=6, max_length=32)
    td = env.reset()
    ids = tokenizer(prompts[0]["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for token in ids:
        out = env.step(td.set(keys.ACTION, torch.tensor([token])))
        td = step_mdp(out)
    assert bool(out.get(keys.DONE)[0]) and out.get(keys.REWARD).item() == 1.0


def test_task_env_with_a_trl_reward():
    def reaches_target(completions, target, numbers, **kwargs):
        return [float(str(t) in c) for c, t in zip(completions, target, strict=True)]

    env = make_countdown_env(tokenizer=tiny_tokenizer(), batch_size=1, n_prompts=2, reward_fn=from_trl_reward(reaches_target))
    td = env.reset()
    text = str(env.source.prompts[0]["target"])
    for token in tokenizer_ids(env, text):
        out = env.step(td.set(keys.ACTION, torch.tensor([token])))
        td = step_mdp(out)
    assert out.get(keys.REWARD).item() == 1.0


def tokenizer_ids(env, text):
    return env.tokenizer(text, add_special_tokens=False)["input_ids"] + [env.tokenizer.eos_token_id]


def test_bad_functions_and_columns():
    with pytest.raises(TypeError, match="fn must be a TRL reward function"):
        TRLReward("not a function")
    with pytest.raises(TypeError, match="conversational must be a bool or None .*, got 1"):
        TRLReward(format_reward, conversational=1)
    with pytest.raises(TypeError, match="none_value must be a finite number, got nan"):
        TRLReward(format_reward, none_value=float("nan"))
    with pytest.raises(ValueError, match=r"returned 1 values for 2 completions"):
        from_trl_reward(lambda completions, **kw: [1.0])(["a", "b"], ["", ""], [{}, {}])
    with pytest.raises(TypeError, match=r"must return a list of floats, got 1.0"):
        from_trl_reward(lambda completions, **kw: 1.0)(["a"], [""], [{}])
    with pytest.raises(TypeError, match=r"returned 'yes'; return floats or None"):
        from_trl_reward(lambda completions, **kw: ["yes"])(["a"], [""], [{}])
    with pytest.raises(ValueError, match="metadata field 'prompts' would hide TRL's 'prompts' argument"):
        from_trl_reward(format_reward)(["a"], [""], [{"prompts": "x"}])
    assert repr(from_trl_reward(format_reward)) == "TRLReward(format_reward)"


# -- TRL functions passed as they are: detected by their signature, called as TRL calls them --


def generate(env, texts):
    """One wave answering the env's slots with ``texts`` (+ EOS); returns the last step of each row, (B,)."""
    tok = env.tokenizer
    rows = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(len(r) for r in rows)
    actions = torch.tensor([r + [tok.eos_token_id] * (width - len(r)) for r in rows])
    env.reset()
    request = env.wave_request()
    lengths = torch.tensor([len(r) for r in rows])
    steps = env.unroll(request, WaveResult(actions, lengths, torch.zeros(len(rows), width)))
    return steps[torch.arange(len(rows)), lengths - 1]


def test_readme_example_as_written(tokenizer):
    """The "TRL reward functions" example of docs/guides/environments.md, with its rewards checked."""
    from tokengym.llm_envs import TokenEnv

    def correct(prompts, completions, answer, **kwargs):  # as in TRL's docs: dataset columns by name
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    env = TokenEnv([{"prompt": "2+2=", "answer": "4"}], tokenizer, correct, batch_size=2, group_size=2,
                   max_new_tokens=4, max_length=32)  # fmt: skip
    out = generate(env, ["4", "5"])
    assert out[keys.REWARD].reshape(-1).tolist() == [1.0, 0.0]


def test_trl_function_with_answer_and_kwargs_gets_completions_not_prompts(tokenizer):
    seen = {}

    def accuracy(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, kwargs=kwargs)
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    prompts = [{"prompt": "3+4=", "answer": "7", "level": 1}, {"prompt": "1+1=", "answer": "2", "level": 2}]
    env = TokenEnv(prompts, tokenizer, accuracy, batch_size=2, max_new_tokens=4, max_length=32)
    out = generate(env, ["7", "3"])
    assert out[keys.REWARD].reshape(-1).tolist() == [1.0, 0.0]
    assert seen["prompts"] == ["3+4=", "1+1="] and seen["completions"] == ["7", "3"]
    assert seen["answer"] == ["7", "2"] and seen["kwargs"]["level"] == [1, 2]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in ("7", "3")]
    assert seen["kwargs"]["completion_ids"] == ids  # TRL passes the completion ids too


def test_two_argument_trl_function(tokenizer):
    def short(prompts, completions):  # no **kwargs: gets only what it names
        return [float(len(c) <= 2) for c in completions]

    env = TokenEnv(["1+1="], tokenizer, short, batch_size=2, group_size=2, max_new_tokens=6, max_length=32)
    assert generate(env, ["2", "2222"])[keys.REWARD].reshape(-1).tolist() == [1.0, 0.0]


def test_chat_prompts_are_conversational_as_in_trl(tokenizer):
    seen = {}

    def chat_reward(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [float(c[0]["content"] == "4") for c in completions]

    messages = [{"role": "user", "content": "2+2="}]
    env = TokenEnv([messages], tokenizer, chat_reward, batch_size=1, max_new_tokens=4, max_length=64)
    assert generate(env, ["4"])[keys.REWARD].item() == 1.0
    assert seen["prompts"] == [messages] and seen["completions"] == [[{"role": "assistant", "content": "4"}]]


def test_native_functions_keep_their_protocol_and_combined_rewards_detect_trl(tokenizer):
    def native(responses, prompts, metadata):
        return [float(r == m["answer"]) for r, m in zip(responses, metadata, strict=True)]

    def trl_len(completions, **kwargs):
        return [0.5 * len(c) for c in completions]

    assert not is_trl_reward(native) and not is_trl_reward(MathAnswerReward()) and is_trl_reward(trl_len)
    assert as_reward_fn(native) is native
    reward = CombinedReward([native, trl_len])
    env = TokenEnv([{"prompt": "1+1=", "answer": "2"}], tokenizer, reward, batch_size=1, max_new_tokens=4,
                   max_length=32)  # fmt: skip
    assert generate(env, ["2"])[keys.REWARD].item() == 1.5
