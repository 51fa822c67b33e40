"""PromptSource: item kinds, groups, order, epochs, resume, and bad input."""

import copy

import datasets
import pytest
import torch

from tokengym.llm_envs import Prompt, PromptSource


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
    with pytest.raises(ValueError, match="chat message list but the tokenizer has no chat_template"):
        PromptSource([[{"role": "user", "content": "hi"}]], plain).next()


@pytest.mark.parametrize("group_size", [0, -1, 1.5, "2"])
def test_bad_group_size(tokenizer, group_size):
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        PromptSource(["a"], tokenizer, group_size=group_size)


@pytest.mark.parametrize("epochs", [0, -2, 1.0])
def test_bad_epochs(tokenizer, epochs):
    with pytest.raises(ValueError, match="epochs must be a positive int or None"):
        PromptSource(["a"], tokenizer, epochs=epochs)
