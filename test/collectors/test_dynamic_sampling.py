"""Issue 24 item 3: dynamic sampling in the collector (DAPO; verl's ``filter_groups``).

Every group of every batch spreads, batches are full, the counts are right and draws are bounded, with the
step and wave sources, on Ray workers and behind an AsyncCollector; STEPS mode refuses the option; resume
is exact. The strongest check: sampling is the same with and without the option, so a filtered run yields
exactly the spread groups of the unfiltered run's stream, in order, row for row.
"""

import copy
import io
import sys

import pytest
import ray
import torch
from ray import cloudpickle

from tokengym.collectors import (
    AsyncCollector,
    CollectorOptions,
    DynamicSampling,
    RayTokenCollector,
    TokenCollector,
)
from tokengym.collectors.dynamic_sampling import COUNTERS, SpreadFilter
from tokengym.collectors.policies import TransformersPolicy
from tokengym.errors import DynamicSamplingError
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import test modules by name

PROMPTS = [f"{a}+{b}=" for a in range(6) for b in range(4)]  # 24 prompts
GROUP = 4


def mostly_flat(responses, prompts, metadata):
    """Samples of a prompt ``a+b=`` with ``a % 3 == 0`` score their length (they spread); others all score 1."""
    return [float(len(r)) if int(p.split("+")[0]) % 3 == 0 else 1.0 for r, p in zip(responses, prompts, strict=True)]


def always_flat(responses, prompts, metadata):
    return [1.0] * len(responses)


def make_env(reward=mostly_flat, *, epochs=None, batch_size=8, tokenizer=None):
    tokenizer = tokenizer or tiny_tokenizer()
    source = PromptSource(PROMPTS, tokenizer, group_size=GROUP, epochs=epochs)
    return TokenEnv(source, tokenizer, reward, batch_size=batch_size, max_new_tokens=6, max_length=32)


def make_policy(env, model=None):
    return TransformersPolicy(model or tiny_model(env.tokenizer), env)


def options(**kwargs):
    return CollectorOptions(dynamic_sampling=DynamicSampling(**kwargs))


def make(tokenizer, model, *, reward=mostly_flat, epochs=None, batch_size=8, source="step", **kwargs):
    env = make_env(reward, epochs=epochs, tokenizer=tokenizer)
    return TokenCollector(env, make_policy(env, model), mode="trajectories", batch_size=batch_size, source=source,
                          **kwargs)  # fmt: skip


def group_scores(batch) -> dict[int, list[float]]:
    """Each group's samples' scores (reward summed over the steps), in the order the groups are in the batch."""
    out: dict[int, list[float]] = {}
    for g, s in zip(batch[keys.GROUP_ID][:, 0].tolist(), batch[keys.REWARD].sum((1, 2)).tolist(), strict=True):
        out.setdefault(g, []).append(s)
    return out


def check_batch(batch, groups: int) -> list[int]:
    """The batch holds ``groups`` whole groups, each with reward spread; returns its group ids in order."""
    scores = group_scores(batch)
    assert len(scores) == groups and all(len(s) == GROUP for s in scores.values())
    assert all(max(s) > min(s) for s in scores.values()), scores
    return list(scores)


def check_counts(metrics) -> None:
    assert metrics["drawn_groups"] == metrics["kept_groups"] + metrics["dropped_zero_spread_groups"]


@pytest.mark.parametrize("source", ["step", "wave"])
def test_batches_are_the_spread_groups_of_the_unfiltered_stream(tokenizer, model, source):
    plain = list(make(tokenizer, model, epochs=1, source=source))
    collector = make(tokenizer, model, epochs=1, source=source, options=options())
    assert set(COUNTERS) <= set(collector.metrics)  # from construction
    batches = list(collector)

    stream = [(g, s) for b in plain for g, s in group_scores(b).items()]  # every group, in the order released
    spread = [g for g, s in stream if max(s) > min(s)]
    assert len(stream) == len(PROMPTS) and 0 < len(spread) < len(stream) // 2
    assert [g for b in batches for g in check_batch(b, b.shape[0] // GROUP)] == spread
    assert all(b.shape[0] == 8 for b in batches[:-1]) and batches[-1].shape[0] == 8 - 4 * (len(spread) % 2)
    m = collector.counts()  # the metrics are the last batch's: the groups drawn after it count here
    assert (m["drawn_groups"], m["kept_groups"]) == (len(stream), len(spread))
    assert m["dropped_zero_spread_groups"] == len(stream) - len(spread) and collector.metrics["zero_std_group_fraction"] == 0
    assert m["partial_batches"] == len(spread) % 2 and m["draw_bound_reached"] == 0

    rows = torch.cat([b.exclude(keys.PROMPTS) for b in plain])  # a dropped group's store rows were reused: intact
    where = {t: i for i, t in enumerate(rows[keys.TRAJ_ID][:, 0].tolist())}
    for b in batches:
        index = torch.tensor([where[t] for t in b[keys.TRAJ_ID][:, 0].tolist()])
        expected = rows[index]
        for key in expected.keys(True, True):
            assert torch.equal(b[key], expected[key]), key
        assert set(b.get_non_tensor(keys.PROMPTS).group_ids()) == set(b[keys.GROUP_ID][:, 0].tolist())


@pytest.mark.parametrize("source", ["step", "wave"])
def test_the_draw_bound_raises_and_the_same_iterator_goes_on(tokenizer, model, source):
    collector = make(tokenizer, model, reward=always_flat, source=source, options=options(max_num_gen_batches=2))
    it = iter(collector)
    for attempt in (1, 2):
        with pytest.raises(DynamicSamplingError, match=r"drew \d+ groups .*max_num_gen_batches=2 x 2 groups") as caught:
            next(it)
        assert caught.value.kept == 0 and caught.value.needed == 2 and 4 <= caught.value.drawn <= 5  # 2 groups a step
        counts = collector.counts()
        assert counts["draw_bound_reached"] == attempt and counts["kept_groups"] == 0
        check_counts(counts)


def test_groups_kept_before_the_bound_stay_queued_for_the_next_batch(tokenizer, model):
    def rare(responses, prompts, metadata):  # only the groups of "0+b=" spread: 4 of 24
        return [float(len(r)) if p.startswith("0+") else 1.0 for r, p in zip(responses, prompts, strict=True)]

    collector = make(tokenizer, model, reward=rare, batch_size=12, options=options(max_num_gen_batches=1))
    it = iter(collector)
    errors, batches, queued = [], [], None
    while len(batches) < 2:
        try:
            batches.append(next(it))
        except DynamicSamplingError as err:
            errors.append(err)
            if err.kept and queued is None:  # the groups kept when the bound was first reached with some kept
                queued = list(dict.fromkeys(e[3] for e in collector.recorder.ready))
                assert len(queued) == err.kept
    assert queued  # some groups were kept when the bound was reached...
    assert check_batch(batches[1], 3)[: len(queued)] == queued  # they lead the next batch: nothing lost
    m = collector.metrics
    assert m["draw_bound_reached"] == len(errors) and m["kept_groups"] >= 6
    check_counts(m)


def test_no_bound_draws_until_full(tokenizer, model):
    collector = make(tokenizer, model, options=options(max_num_gen_batches=0))
    for _, batch in zip(range(3), collector, strict=False):
        check_batch(batch, 2)
    check_counts(collector.metrics)
    assert collector.metrics["kept_groups"] >= 6  # a step may complete more than the batch needs: kept for the next


def test_resume_is_exact(tokenizer, model):
    def build():
        return make(tokenizer, copy.deepcopy(model), source="wave", options=options())

    collector = build()
    it = iter(collector)
    next(it)
    buffer = io.BytesIO()
    torch.save(collector.state_dict(), buffer)
    after = [next(it) for _ in range(3)]
    resumed = build()
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    again = [b for _, b in zip(range(3), resumed, strict=False)]
    for a, b in zip(after, again, strict=True):
        check_batch(b, 2)
        for key in a.exclude(keys.PROMPTS).keys(True, True):
            assert torch.equal(a[key], b[key]), key
    assert {k: resumed.metrics[k] for k in COUNTERS} == {k: collector.metrics[k] for k in COUNTERS}


def test_async_collector_yields_spread_groups_and_passes_the_bound_on(tokenizer, model):
    inner = make(tokenizer, copy.deepcopy(model), options=options())
    with AsyncCollector(inner, max_staleness=1) as collector:
        assert set(COUNTERS) <= set(collector.metrics)
        for _, batch in zip(range(3), collector, strict=False):
            check_batch(batch, 2)
        check_counts(collector.metrics)
        assert collector.metrics["kept_groups"] >= 6
    inner = make(tokenizer, copy.deepcopy(model), reward=always_flat, options=options(max_num_gen_batches=1))
    with AsyncCollector(inner, max_staleness=1) as collector:
        it = iter(collector)
        for _ in range(2):  # raised in the trainer's next(), in the batch's place; collection goes on
            with pytest.raises(DynamicSamplingError, match="max_num_gen_batches=1"):
                next(it)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"mode": "steps"}, ValueError, "dynamic_sampling .* needs mode='trajectories' .*got mode='steps'"),
     ({"options": CollectorOptions(is_whole_groups=False, dynamic_sampling=DynamicSampling())}, ValueError,
      "with whole groups, got is_whole_groups=False"),
     ({"group_size": 1, "batch_size": 4}, ValueError, r"dynamic_sampling needs group_size >= 2 \(.*got group_size=1")],
)  # fmt: skip
def test_bad_settings_are_refused_at_construction(tokenizer, model, kwargs, error, match):
    group_size = kwargs.pop("group_size", GROUP)
    kwargs = {"mode": "trajectories", "batch_size": 8, "options": options(), **kwargs}
    env = TokenEnv(PromptSource(PROMPTS, tokenizer, group_size=group_size), tokenizer, mostly_flat, batch_size=4,
                   max_new_tokens=4, max_length=32)  # fmt: skip
    with pytest.raises(error, match=match):
        TokenCollector(env, make_policy(env, model), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"min_spread": -0.1}, "min_spread must be a finite number >= 0"),
     ({"min_spread": float("nan")}, "min_spread must be a finite number >= 0"),
     ({"max_num_gen_batches": -1}, r"max_num_gen_batches must be an int >= 0 \(0: draw without a bound\), got -1"),
     ({"max_num_gen_batches": 2.0}, "max_num_gen_batches must be an int")],
)  # fmt: skip
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicSampling(**kwargs)


def test_the_option_takes_a_dynamic_sampling_object():
    with pytest.raises(TypeError, match="dynamic_sampling must be a DynamicSampling or None, got bool"):
        CollectorOptions(dynamic_sampling=True)


def test_the_score_reads_the_task_reward_and_min_spread_sets_the_threshold():
    spread = SpreadFilter(DynamicSampling(min_spread=0.5), groups_per_batch=2)
    assert spread.score_name({"next.reward", "next.reward_raw"}) == "next.reward_raw"  # not the KL-shaped one
    assert spread.score_name({"next.reward"}) == "next.reward"
    with pytest.raises(KeyError, match=r"DynamicSampling\(reward_key='score'\) reads 'score', which the collected steps do not have"):
        SpreadFilter(DynamicSampling(reward_key="score"), 2).score_name({"next.reward"})
    rewards = torch.tensor([[0.0, 1.0, 5.0], [0.0, 0.0, 7.0]])
    for rows in ([1, 0], [1, 0] * 3):  # one row at a time, or a gather
        lengths = torch.tensor([3, 2] * (len(rows) // 2))
        assert spread.scores(rewards, torch.tensor(rows), lengths) == [7.0, 1.0] * (len(rows) // 2)  # past the end: not
    assert [spread.keep(s) for s in ([1.0, 1.4], [1.0, 1.6])] == [False, True]


@pytest.fixture
def local_ray(monkeypatch):
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")  # a busy shared box must not kill the workers
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_workers_filter_their_own_groups(local_ray):
    """Each worker judges its own groups and bounds its own draws (one group per worker's share of a batch)."""
    with RayTokenCollector(make_env, make_policy, num_workers=2, mode="trajectories", batch_size=8,
                           options=options(max_num_gen_batches=1)) as collector:  # fmt: skip
        assert set(COUNTERS) <= set(collector.metrics)  # the workers' counters, from construction
        it = iter(collector)
        batches, errors = [], []
        while len(batches) < 2 or not errors:
            try:
                batches.append(next(it))
            except DynamicSamplingError as err:  # the same iterator goes on: the worker did not roll back
                errors.append(err)
        for batch in batches:
            check_batch(batch, 2)  # one group from each worker
        assert str(errors[0]).startswith("RayTokenCollector worker") and "dynamic sampling drew" in str(errors[0])
        counts = collector.counts()  # added up over the workers
        check_counts(counts)
        assert counts["draw_bound_reached"] == len(errors) and counts["kept_groups"] >= 4
