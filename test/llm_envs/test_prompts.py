"""PromptSource: item kinds, groups, order, epochs, resume, and bad input."""

import copy

import datasets
import pytest
import torch

from tokengym.errors import PromptError
from tokengym.llm_envs import Prompt, PromptSource, TokenEnv, keys


def _texts(src, n=None):
    out = []
    for p in src:
        out.append(p.text)
        if n is not None and len(out) == n:
            break
    return out


def test_strings(tokenizer):
    (p,) = list(PromptSource(["12+7="], tokenizer, epochs=1))
    assert isinstance(p, Prompt)
    assert p.text == "12+7=" and p.metadata == {} and (p.index, p.group_id, p.sample_id) == (0, 0, 0)
    assert (
        p.ids.dtype == torch.int64
        and p.ids.tolist() == tokenizer("12+7=", add_special_tokens=False)["input_ids"]
    )


def test_chat_messages_use_the_chat_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    (p,) = list(PromptSource([messages], tokenizer, epochs=1))
    assert p.text == "<|user|>hi<|end|><|assistant|>"
    assert p.ids.tolist() == tokenizer(p.text, add_special_tokens=False)["input_ids"]
    assert p.ids[-1].item() == tokenizer.convert_tokens_to_ids("<|assistant|>")


@pytest.mark.parametrize("ids", [[40, 41, 42], torch.tensor([40, 41, 42]), torch.tensor([[40, 41, 42]])])
def test_token_ids(tokenizer, ids):
    (p,) = list(PromptSource([ids], tokenizer, epochs=1))
    assert p.ids.tolist() == [40, 41, 42] and p.text == tokenizer.decode([40, 41, 42])


@pytest.mark.parametrize("field", ["prompt", "question", "messages", "input_ids"])
def test_mapping_fields_and_metadata(tokenizer, field):
    value = {"messages": [{"role": "user", "content": "x"}], "input_ids": [40, 41]}.get(field, "1+1=")
    (p,) = list(PromptSource([{field: value, "answer": "2", "level": 3}], tokenizer, epochs=1))
    assert p.metadata == {"answer": "2", "level": 3}
    assert p.ids.numel() > 0


def test_datasets_dataset(tokenizer):
    ds = datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    src = PromptSource(ds, tokenizer, epochs=1)
    assert src.is_sized
    assert [(p.text, p.metadata) for p in src] == [("a", {"answer": "1"}), ("b", {"answer": "2"})]


def test_generator_is_read_once(tokenizer):
    src = PromptSource((s for s in ["a", "b"]), tokenizer, epochs=3)
    assert not src.is_sized
    assert _texts(src) == ["a", "b"]
    assert src.is_exhausted and src.next() is None


def test_group_size(tokenizer):
    src = PromptSource(["a", "b"], tokenizer, group_size=3, epochs=1)
    got = [(p.text, p.index, p.group_id, p.sample_id) for p in src]
    assert got == [
        ("a", 0, 0, 0),
        ("a", 0, 0, 1),
        ("a", 0, 0, 2),
        ("b", 1, 1, 0),
        ("b", 1, 1, 1),
        ("b", 1, 1, 2),
    ]


def test_group_ids_keep_growing_across_epochs(tokenizer):
    src = PromptSource(["a", "b"], tokenizer, epochs=2)
    assert [(p.index, p.group_id) for p in src] == [(0, 0), (1, 1), (0, 2), (1, 3)]


def test_epochs_none_repeats_forever(tokenizer):
    src = PromptSource(["a", "b"], tokenizer)
    assert _texts(src, 7) == ["a", "b"] * 3 + ["a"]
    assert not src.is_exhausted


def test_shuffle_is_deterministic_under_a_seed(tokenizer):
    items = [str(i) for i in range(20)]

    def order(seed):
        return _texts(PromptSource(items, tokenizer, shuffle=True, seed=seed, epochs=2))

    first = order(3)
    assert first == order(3)
    assert first != order(4)
    assert sorted(first[:20]) == sorted(items) and sorted(first[20:]) == sorted(items)
    assert first[:20] != first[20:]  # a new permutation every epoch
    assert _texts(PromptSource(items, tokenizer, seed=3, epochs=1)) == items  # no shuffle: source order


@pytest.mark.parametrize("make", [list, lambda xs: iter(list(xs))], ids=["list", "iterator"])
@pytest.mark.parametrize("cut", [0, 1, 4, 5])
def test_state_dict_resume_equals_uninterrupted(tokenizer, make, cut):
    items = [f"p{i}" for i in range(4)]
    kw = {"group_size": 2, "shuffle": True, "seed": 1, "epochs": 2}
    full = [(p.text, p.group_id, p.sample_id) for p in PromptSource(make(items), tokenizer, **kw)]
    src = PromptSource(make(items), tokenizer, **kw)
    for _ in range(cut):
        src.next()
    resumed = PromptSource(make(items), tokenizer, **kw)
    resumed.load_state_dict(src.state_dict())
    assert [(p.text, p.group_id, p.sample_id) for p in resumed] == full[cut:]


# -- bad input --
def test_empty_list(tokenizer):
    with pytest.raises(ValueError, match="prompts is empty: give at least one prompt"):
        PromptSource([], tokenizer)


@pytest.mark.parametrize("item", ["", [], {"prompt": ""}])
def test_empty_prompt(tokenizer, item):
    src = PromptSource(["ok", item], tokenizer)
    src.next()
    with pytest.raises(ValueError, match="prompt item 1 is empty .* every prompt needs at least one token"):
        src.next()


@pytest.mark.parametrize("prompts", ["abc", b"abc", 3])
def test_not_an_iterable_of_prompts(tokenizer, prompts):
    with pytest.raises(TypeError, match="prompts must be an iterable of prompts"):
        PromptSource(prompts, tokenizer)


def test_mapping_without_prompt_field(tokenizer):
    with pytest.raises(
        KeyError, match=r"prompt item 0 is a mapping without a prompt field: it has keys \['text'\]"
    ):
        PromptSource([{"text": "a"}], tokenizer).next()


@pytest.mark.parametrize("item", [3.5, [1.0, 2.0], [True, False], None])
def test_bad_item_type(tokenizer, item):
    with pytest.raises(TypeError, match="prompt item 0 has type .*expected a string"):
        PromptSource([item], tokenizer).next()


def test_chat_without_template(tokenizer):
    plain = copy.deepcopy(tokenizer)  # the session tokenizer stays untouched
    plain.chat_template = None
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat message list but the tokenizer has no chat_template"):
        PromptSource(iter([chat]), plain).next()  # an iterable is not read ahead: the draw fails
    with pytest.raises(ValueError, match="the prompts are chat message lists .* has no chat_template"):
        PromptSource([chat], plain)  # a list fails at construction


def test_chat_prompts_without_template_fail_at_env_construction_not_at_every_refill(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    prompts = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(4)]
    with pytest.raises(ValueError, match="has no chat_template; set tokenizer.chat_template"):
        TokenEnv(prompts, plain, batch_size=2, max_length=64)


@pytest.mark.parametrize("tok", [None, "Qwen/Qwen2.5-0.5B"])
def test_tokenizer_is_required(tok):
    with pytest.raises(TypeError, match="a tokenizer is required .* got"):
        TokenEnv(["1+1="], tok, batch_size=1)


# -- over-long prompts: error / skip / truncate, counted in the collector's metrics --


def _overlong_run(tokenizer, model, policy_kind):
    """A 100-prompt list with one over-long prompt (index 37), iterated twice through the prompts."""
    from tokengym.collectors import TokenCollector
    from tokengym.collectors.policies import TransformersPolicy

    prompts = [f"{i % 10}+{i // 10}=" for i in range(100)]
    prompts[37] = "1+" * 40 + "1="  # 82 tokens, max_length is 32
    env = TokenEnv(prompts, tokenizer, batch_size=8, max_new_tokens=2, max_length=32, model_config=model.config,
                   overlong_prompts=policy_kind)  # fmt: skip
    env.source.epochs = 2
    collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=8)
    seen, errors, metrics = [], [], {}
    while True:
        try:
            for batch in collector:
                seen += batch[keys.GROUP_ID][:, 0].tolist()
                metrics = dict(collector.metrics)
            break
        except PromptError as err:  # "error": the prompt is skipped, iterating again goes on
            errors.append(str(err))
    return env, seen, errors, metrics


@pytest.mark.parametrize("policy_kind", ["error", "skip", "truncate"])
def test_one_overlong_prompt_in_100_under_each_policy(tokenizer, model, policy_kind):
    env, seen, errors, metrics = _overlong_run(tokenizer, model, policy_kind)
    if policy_kind == "error":
        assert len(errors) == 2 and all("prompt 37" in e and "overlong_prompts='skip'" in e for e in errors)
        assert len(seen) == 198 and metrics["failed_prompts"] == 2
    elif policy_kind == "skip":
        assert errors == [] and len(seen) == 198  # 99 prompts per pass, no error
        assert metrics["prompts_skipped_overlong"] == 2 and metrics["prompts_truncated"] == 0
    else:
        assert errors == [] and len(seen) == 200
        assert metrics["prompts_truncated"] == 2 and metrics["prompts_skipped_overlong"] == 0
    assert env.prompt_counts == {k: metrics[k] for k in env.prompt_counts}


def test_truncate_keeps_the_last_tokens(tokenizer):
    long = "1+" * 40 + "1="
    ids = tokenizer(long, add_special_tokens=False)["input_ids"]
    src = PromptSource([long, "2+2="], tokenizer, overlong="truncate", max_prompt_length=10, epochs=1)
    first, second = list(src)
    assert first.ids.tolist() == ids[-10:] and first.text == tokenizer.decode(ids[-10:])
    assert second.text == "2+2=" and src.counts == {"prompts_skipped_overlong": 0, "prompts_truncated": 1}


def test_skip_keeps_group_ids_and_shards_in_step(tokenizer):
    items = ["1+1=", "1+" * 20 + "1=", "2+2=", "3+3="]
    full = [(p.text, p.group_id) for p in PromptSource(items, tokenizer, overlong="skip", max_prompt_length=8, epochs=1)]
    assert full == [("1+1=", 0), ("2+2=", 2), ("3+3=", 3)]
    shards = [PromptSource(items, tokenizer, overlong="skip", max_prompt_length=8, epochs=1).shard(i, 2) for i in (0, 1)]
    assert sorted((p.text, p.group_id) for s in shards for p in s) == sorted(full)


def test_bad_overlong_options(tokenizer):
    with pytest.raises(ValueError, match=r"overlong_prompts must be one of \['error', 'skip', 'truncate'\], got 'drop'"):
        TokenEnv(["a"], tokenizer, batch_size=1, overlong_prompts="drop")
    with pytest.raises(ValueError, match="max_prompt_length must be a positive int or None, got 0"):
        PromptSource(["a"], tokenizer, max_prompt_length=0)
    with pytest.raises(ValueError, match="set it on the source"):
        TokenEnv(PromptSource(["a"], tokenizer), tokenizer, batch_size=1, overlong_prompts="skip")


@pytest.mark.parametrize("group_size", [0, -1, 1.5, "2"])
def test_bad_group_size(tokenizer, group_size):
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        PromptSource(["a"], tokenizer, group_size=group_size)


@pytest.mark.parametrize("epochs", [0, -2, 1.0])
def test_bad_epochs(tokenizer, epochs):
    with pytest.raises(ValueError, match="epochs must be a positive int or None"):
        PromptSource(["a"], tokenizer, epochs=epochs)
