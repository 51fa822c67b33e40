"""Held-out evaluation on the adapters: make_reasoning_gym_env(epochs=1) is a source evaluate() reads once, the
train / held-out splits of a seed are disjoint and stable, an argument no factory takes is named in a TypeError
(the episode adapters say what they take instead of epochs= and split=), ReasoningGymSpec is exported."""

import pytest

import tokengym.llm_envs.adapters.reasoning_gym as reasoning_gym_module
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.evaluation import evaluate
from tokengym.llm_envs.adapters import (
    ReasoningGymSpec,
    held_out_split,
    make_openenv_env,
    make_reasoning_gym_env,
    make_text_env,
    make_textarena_env,
    reasoning_gym_prompts,
)
from tokengym.testing import tiny_model

# 2000 draws of two one-digit terms: ~200 distinct questions, each drawn ~10 times
CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _questions(env) -> list[str]:
    return [item["entry"]["question"] for item in env.source.prompts]


def test_epochs_1_is_a_source_evaluate_reads_once_per_problem(tok):
    env = make_reasoning_gym_env("chain_sum", tokenizer=tok, size=12, epochs=1, group_size=3, batch_size=6,
                                 max_new_tokens=2, max_length=128)  # fmt: skip
    texts = [env.source.encode(item, i)[1] for i, item in enumerate(env.source.prompts)]
    result = evaluate(env, TransformersPolicy(tiny_model(tok), env, sampling=SamplingConfig(), seed=0))
    assert [row["text"] for row in result.per_prompt] == texts  # each entry once, in order
    assert [len(row["rewards"]) for row in result.per_prompt] == [3] * 12
    assert result.metrics["prompts"] == 12 and result.metrics["samples"] == 36
    assert env.source.is_exhausted and env.source.next() is None


def test_without_epochs_the_source_repeats_and_evaluate_says_so(tok):
    env = make_reasoning_gym_env("chain_sum", tokenizer=tok, size=4, batch_size=2, max_new_tokens=2)
    assert env.source.epochs is None
    with pytest.raises(ValueError, match="evaluate needs a prompt source that ends"):
        evaluate(env, TransformersPolicy(tiny_model(tok), env))


def _split(tok, split, **kwargs):
    return make_reasoning_gym_env("chain_sum", tokenizer=tok, config=CHAIN_SUM, size=2000, split=split, **kwargs)


def test_the_splits_of_a_seed_are_disjoint_stable_and_cover_the_distinct_problems(tok):
    train, held = (_questions(_split(tok, s, held_out=0.2, split_seed=7)) for s in ("train", "held_out"))
    every = {item["entry"]["question"] for item in _split(tok, None).source.prompts}
    assert not set(train) & set(held)
    assert set(train) | set(held) == every and len(train) + len(held) == len(every)  # a duplicate counts once
    assert len(held) == round(0.2 * len(every))
    assert _questions(_split(tok, "held_out", held_out=0.2, split_seed=7)) == held  # the same seed, the same set
    other = _questions(_split(tok, "held_out", held_out=0.2, split_seed=8))
    assert len(other) == len(held) and set(other) != set(held)
    assert _questions(_split(tok, "held_out", held_out=5, split_seed=7)) == held[:5]  # a count: the first 5
    default = _questions(_split(tok, "held_out", seed=0))  # split_seed defaults to seed, held_out to 0.2
    assert default == _questions(_split(tok, "held_out", seed=0, held_out=0.2, split_seed=0))


def test_held_out_split_depends_on_the_set_of_questions_and_the_seed_only():
    items = reasoning_gym_prompts(ReasoningGymSpec.parse("chain_sum", config=CHAIN_SUM, size=300, seed=1), use_chat=False)
    train, held = held_out_split(items, held_out=10, seed=3)
    assert len(held) == 10 and not {p["prompt"] for p in train} & {p["prompt"] for p in held}
    again = held_out_split(list(reversed(items)), held_out=10, seed=3)[1]  # another order of the same questions
    assert [p["entry"]["question"] for p in again] == [p["entry"]["question"] for p in held]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"split": "test"}, ValueError, r"split must be one of \('train', 'held_out'\).*got 'test'"),
    ({"held_out": 0.2}, ValueError, r"held_out= and split_seed= choose a split: add split='train'"),
    ({"split_seed": 1}, ValueError, r"held_out= and split_seed= choose a split"),
    ({"split": "train", "held_out": 1.0}, ValueError, r"held_out=1.0: a fraction must be in \(0, 1\)"),
    ({"split": "train", "held_out": 0}, ValueError, r"held_out=0 holds out 0 of the \d+ distinct problems"),
    ({"split": "train", "held_out": 10_000}, ValueError, r"held_out=10000 holds out 10000 of the \d+ distinct"),
    ({"split": "train", "held_out": "5"}, TypeError, r"held_out must be an int .* or a float"),
    ({"split": "train", "split_seed": "a"}, TypeError, r"the seed of the split must be an int, got 'a'"),
    ({"epochs": 0}, ValueError, r"epochs must be a positive int or None"),
])  # fmt: skip
def test_bad_split_arguments_name_the_value_and_the_fix(tok, kwargs, error, match):
    with pytest.raises(error, match=match):
        make_reasoning_gym_env("chain_sum", tokenizer=tok, size=50, **kwargs)


def test_an_unknown_keyword_names_itself_and_the_accepted_ones(tok):
    with pytest.raises(TypeError, match=r"make_reasoning_gym_env\(\) got unexpected keyword argument\(s\) 'epoch'\. "
                                        r"It accepts tokenizer, .*epochs, split, held_out, split_seed and the env's "
                                        r"max_turns, batch_size, .*group_size"):  # fmt: skip
        make_reasoning_gym_env("chain_sum", tokenizer=tok, size=8, epoch=1)
    with pytest.raises(TypeError, match=r"'num_episodes'; num_episodes: reasoning-gym problems are a list: epochs=1"):
        make_reasoning_gym_env("chain_sum", tokenizer=tok, size=8, num_episodes=8)


class Echo:
    def reset(self, seed=None):
        return "say hi", {}

    def step(self, text):
        return "again", 1.0, True, False, {}


@pytest.mark.parametrize("build", [
    lambda tok, **kw: make_text_env(Echo, tok, **kw),
    lambda tok, **kw: make_textarena_env("GuessTheNumber-v0", tok, **kw),
    lambda tok, **kw: make_openenv_env("http://127.0.0.1:9", tok, **kw),  # fails before any connection
], ids=["text_env", "textarena", "openenv"])  # fmt: skip
def test_the_episode_adapters_say_what_replaces_epochs_and_a_split(tok, build):
    with pytest.raises(TypeError, match=r"got unexpected keyword argument\(s\) 'epochs'; epochs: external episodes "
                                        r"are not a list of problems.*num_episodes=N runs N episodes.*It accepts "
                                        r"max_turns.* and the env.s .*num_episodes"):  # fmt: skip
        build(tok, epochs=1)
    with pytest.raises(TypeError, match=r"'split', 'split_seed'; split: .* a second env with another seed="):
        build(tok, split="held_out", split_seed=1)
    with pytest.raises(TypeError, match=r"'shuffle'\. It accepts"):  # an episode source has no order to shuffle
        build(tok, shuffle=True)


def test_reasoning_gym_spec_is_exported():
    assert ReasoningGymSpec is reasoning_gym_module.ReasoningGymSpec
    spec = ReasoningGymSpec.parse("chain_sum", size=4, seed=2)
    assert spec == ReasoningGymSpec((("chain_sum", 1.0, {}),), 4, 2)
