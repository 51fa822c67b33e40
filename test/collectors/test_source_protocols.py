"""The collector's seams: sources and recorders are protocols checked when a collector is built, a source of one's
own plugs in, trees wrap a plain source, and the collector sets nothing on its parts after building them."""

from __future__ import annotations

import pytest
import torch

from tokengym.collectors import (
    Advance,
    CollectorOptions,
    Recorder,
    SegmentRule,
    Source,
    StepSource,
    TokenCollector,
    TreeSource,
    WaveSource,
)
from tokengym.collectors.recorders import StepRecorder, TrajectoryRecorder, check_recorder
from tokengym.collectors.sources import check_source
from tokengym.llm_envs import PromptSource, keys


class _Counting:
    """A source of one's own: composes a step source, counts its advances and what it was asked."""

    def __init__(self, env, policy):
        self.inner, self.asked = StepSource(env, policy), []
        self.kind = self.inner.kind

    def start(self):
        return self.inner.start()

    def advance(self, *, min_finished=None, cells=False):
        self.asked.append((min_finished, cells))
        return self.inner.advance(min_finished=min_finished, cells=cells)

    def restart(self, slots):
        self.inner.restart(slots)

    def finished_slots(self):
        return self.inner.finished_slots()

    def counts(self):
        return {"advances": len(self.asked)}

    def state_dict(self):
        return {**self.inner.state_dict(), "advances": len(self.asked)}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def test_a_source_of_ones_own_gives_the_batches_of_the_builtin_one(make_env, make_policy):
    env = make_env(max_new_tokens=5)
    ours = TokenCollector(env, make_policy(env, seed=1), mode="steps", batch_size=4, total_steps=8)
    expected = [b.get(keys.ACTION).clone() for b in ours]
    env = make_env(max_new_tokens=5)
    policy = make_policy(env, seed=1)
    source = _Counting(env, policy)
    assert isinstance(source, Source)
    theirs = TokenCollector(env, policy, mode="steps", batch_size=4, total_steps=8, source=source)
    got = [b.get(keys.ACTION).clone() for b in theirs]
    assert len(got) == len(expected) == 2 and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert theirs.counts()["advances"] == 8 and source.asked[0] == (None, False)
    assert theirs.state_dict()["source"]["advances"] == 8  # the checkpoint holds the source's own state


def test_a_source_missing_part_of_the_protocol_is_refused_naming_it(make_env, make_policy):
    env = make_env()

    class Half:
        kind = "step"

        def start(self):
            return [], None

        def advance(self, **kwargs):
            return Advance({}, 0, [])

    with pytest.raises(TypeError, match=r"Half lacks \['restart', 'finished_slots', 'counts', 'state_dict'"):
        TokenCollector(env, make_policy(env), mode="steps", batch_size=2, source=Half())
    source = _Counting(env, make_policy(env))
    source.kind = "token"
    with pytest.raises(TypeError, match="kind must be a SourceKind.*kind='token'"):
        TokenCollector(env, make_policy(env), mode="steps", batch_size=2, source=source)
    with pytest.raises(ValueError, match="None or a Source, got 'stepping'"):
        TokenCollector(env, make_policy(env), mode="steps", batch_size=2, source="stepping")


def test_recorders_follow_their_protocol_and_a_partial_one_is_named():
    for recorder in (StepRecorder(4), TrajectoryRecorder(4, 6, group_size=2)):
        assert isinstance(recorder, Recorder)
        check_recorder(recorder)
    with pytest.raises(TypeError, match=r"lacks \[.*'peek'"):
        check_recorder(object())
    with pytest.raises(ValueError, match="mode='trajectories'"):  # a step batch cannot carry split episodes' parts
        StepRecorder(4).hold_parts([3])


@pytest.mark.parametrize("kind", ["step", "wave"])
def test_trees_wrap_a_plain_source_and_carry_their_counters(make_env, make_policy, kind):
    env = make_env(batch_size=4, group_size=2, max_new_tokens=6)
    collector = TokenCollector(env, make_policy(env), mode="trajectories", batch_size=4, source=kind,
                               options=CollectorOptions(tree=SegmentRule(2, 2)))  # fmt: skip
    assert isinstance(collector.source, TreeSource)
    assert isinstance(collector.source.source, StepSource if kind == "step" else WaveSource)
    check_source(collector.source)
    batch = next(iter(collector))
    assert keys.PARENT_ID in batch.keys(include_nested=True)  # the recorder was built for trees
    assert collector.counts()["trees_started"] >= 2
    with pytest.raises(TypeError, match="wraps a StepSource or a WaveSource"):
        TreeSource(object(), collector.source.sampler)


def test_the_group_being_drawn_is_known_to_the_prompt_source(tokenizer):
    source = PromptSource(["a", "b"], tokenizer, group_size=3)
    assert source.group_in_progress is None  # nothing drawn
    source.next()
    assert source.group_in_progress == 0  # two samples of group 0 still to come
    source.next(), source.next()
    assert source.group_in_progress is None  # group 0 given whole
    source.next()
    source.end_group()  # a tree samples its prompt once
    assert source.group_in_progress is None
