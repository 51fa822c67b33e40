"""PromptSource.shard: N shards split one prompt stream exactly, whole groups, global group ids."""

import pytest

from tokengym.llm_envs import PromptSource

ITEMS = [{"prompt": f"q{i}=", "answer": str(i)} for i in range(7)]


def _draws(source):
    return [(p.group_id, p.sample_id, p.index, p.text) for p in source]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_shards_partition_the_unsharded_stream(tokenizer, shuffle, num_shards):
    def make():
        return PromptSource(ITEMS, tokenizer, group_size=3, shuffle=shuffle, seed=5, epochs=2)

    full = _draws(make())
    shards = [_draws(make().shard(i, num_shards)) for i in range(num_shards)]
    assert sorted(d for shard in shards for d in shard) == sorted(full)
    for i, shard in enumerate(shards):
        assert {g % num_shards for g, *_ in shard} <= {i}
        # every group of a shard is whole: samples 0..2 of one draw of one item
        groups = {}
        for g, s, index, _ in shard:
            groups.setdefault(g, []).append((s, index))
        assert all(sorted(v) == [(0, v[0][1]), (1, v[0][1]), (2, v[0][1])] for v in groups.values())


def test_shard_resumes_from_a_checkpoint(tokenizer):
    src = PromptSource(ITEMS, tokenizer, group_size=2, shuffle=True, epochs=None).shard(1, 3)
    head = [src.next() for _ in range(5)]  # stops inside a group
    state = src.state_dict()
    rest = [(p.group_id, p.sample_id, p.text) for p in (src.next() for _ in range(6))]
    again = PromptSource(ITEMS, tokenizer, group_size=2, shuffle=True, epochs=None).shard(1, 3)
    again.load_state_dict(state)
    assert [(p.group_id, p.sample_id, p.text) for p in (again.next() for _ in range(6))] == rest
    assert all(p.group_id % 3 == 1 for p in head)


def test_a_shard_without_groups_is_exhausted(tokenizer):
    src = PromptSource(ITEMS[:2], tokenizer, epochs=1).shard(2, 3)
    assert src.next() is None and src.is_exhausted


@pytest.mark.parametrize(
    ("index", "num_shards", "error", "match"),
    [(2, 2, ValueError, "0 <= index < num_shards"), (0, 0, ValueError, "num_shards >= 1"),
     (-1, 2, ValueError, "index=-1"), (0.5, 2, TypeError, "index must be an int"),
     (0, True, TypeError, "num_shards must be an int")],
)  # fmt: skip
def test_bad_shards_are_rejected(tokenizer, index, num_shards, error, match):
    with pytest.raises(error, match=match):
        PromptSource(ITEMS, tokenizer).shard(index, num_shards)


def test_shard_after_a_draw_is_rejected(tokenizer):
    src = PromptSource(ITEMS, tokenizer)
    src.next()
    with pytest.raises(ValueError, match="before the first draw; this source has drawn 1 groups"):
        src.shard(0, 2)
