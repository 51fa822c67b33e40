"""Partial rollouts: a weight update published mid-wave interrupts it; every sequence goes on under the new weights
from the tokens it already has, each token stamped with (and scored under) the version that produced it."""

import copy

import pytest
import torch
from collector_helpers import PublishTwice, assert_log_probs_under_their_versions, perturbed

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.waves import WaveResult
from tokengym.testing import PublishAfter, tiny_model

PROMPTS = [f"{a}+{b}=" for a in range(5) for b in range(4)]


def run(tokenizer, *, partial: bool, k: int = 5, mode: str = "trajectories", in_flight: str = "continue"):
    model = tiny_model(tokenizer, seed=0)
    new = perturbed(model, 1)
    env = TokenEnv(PROMPTS, tokenizer, batch_size=4, max_new_tokens=12, max_length=32, group_size=2)
    policy = TransformersPolicy(copy.deepcopy(model), env, seed=1)
    policy.interrupt = PublishAfter(k, lambda: collector.update_policy_weights_(new.state_dict()))
    collector = TokenCollector(env, policy, mode=mode, batch_size=8 if mode == "trajectories" else 16, source="wave",
                               options=CollectorOptions(partial_rollouts=partial, in_flight=in_flight))  # fmt: skip
    batch = next(iter(collector))
    return batch, collector, env, {0: model, 1: new}


def test_an_update_mid_wave_keeps_the_prefix_and_continues_under_the_new_version(tokenizer):
    batch, collector, env, published = run(tokenizer, partial=True, k=5)
    metrics = collector.metrics
    assert metrics["interrupted_sequences"] > 0 and metrics["dropped_tokens"] == 0
    mask, version = batch[keys.MASK], batch[keys.POLICY_VERSION]
    spans = (batch[keys.VERSION_START][:, 0] < batch[keys.VERSION_END][:, 0]) & mask[:, 0]
    assert bool(spans.any())  # trajectories with old-version tokens then new-version ones
    for row in spans.nonzero().squeeze(-1).tolist():
        v = version[row][mask[row]]
        assert bool((v[1:] >= v[:-1]).all())  # no old-version token after the update landed
        assert int((v == 0).sum()) == 4  # the wave was stopped after 4 decode steps: those tokens kept, not redone
    assert_log_probs_under_their_versions(batch, published, env)
    # every trajectory ended as the env ends them (an end id or its budget), none cut by the interruption
    last = mask.sum(1) - 1
    ended = batch[keys.NEXT][keys.DONE[1]].squeeze(-1)[torch.arange(len(last)), last]
    assert bool(ended.all())
    collector.shutdown()


def test_without_partial_rollouts_the_update_waits_for_the_wave(tokenizer):
    batch, collector, env, published = run(tokenizer, partial=False, k=5)
    assert collector.metrics["interrupted_sequences"] == 0
    mask = batch[keys.MASK]
    first_wave = batch[keys.POLICY_VERSION][mask]
    assert int(first_wave.min()) == 0  # the first wave finished under the old weights
    spans = (batch[keys.VERSION_START][:, 0] < batch[keys.VERSION_END][:, 0]) & mask[:, 0]
    assert not bool(spans.any())  # single-turn waves: one version per trajectory
    assert_log_probs_under_their_versions(batch, published, env)
    collector.shutdown()


@pytest.mark.parametrize("partial", [True, False])
def test_in_flight_drop_restarts_only_what_was_in_flight(tokenizer, partial):
    """With in_flight='drop' an interrupted wave's rows start over (their tokens counted as dropped); an update at a
    wave's end finds the single-turn trajectories finished and recorded: nothing is dropped or restarted."""
    batch, collector, env, published = run(tokenizer, partial=partial, k=5, in_flight="drop")
    dropped = collector.metrics["dropped_tokens"]
    assert (dropped > 0) if partial else (dropped == 0)
    mask = batch[keys.MASK]
    assert not bool(((batch[keys.VERSION_START][:, 0] < batch[keys.VERSION_END][:, 0]) & mask[:, 0]).any())
    assert_log_probs_under_their_versions(batch, published, env)
    collector.shutdown()


def test_steps_mode_keeps_every_token_of_an_interrupted_wave(tokenizer):
    batch, collector, env, _ = run(tokenizer, partial=True, k=3, mode="steps")
    assert collector.metrics["interrupted_sequences"] > 0
    version, active = batch[keys.POLICY_VERSION], batch[keys.ACTIVE]
    for row in range(batch.shape[0]):  # per slot: versions never go back
        v = version[row][active[row]]
        assert bool((v[1:] >= v[:-1]).all())
    collector.shutdown()


def unroll_by_hand(tokenizer, result_for):
    env = TokenEnv(["1+1=", "2+2="], tokenizer, batch_size=2, max_new_tokens=8, max_length=32)
    env.reset()
    request = env.wave_request()
    return env, request, env.unroll(request, result_for(request))


def test_an_unfinished_row_stays_open_and_the_next_wave_continues_it(tokenizer):
    eos = tokenizer.eos_token_id
    ids = torch.tensor([[5, 6, 7], [8, eos, 0]])

    def result_for(request):
        return WaveResult(actions=ids, lengths=torch.tensor([3, 2]), log_probs=torch.zeros(2, 3), version=2,
                          finished=torch.tensor([False, True]), versions=torch.tensor([[1, 1, 2], [2, 2, 2]]))  # fmt: skip

    env, request, steps = unroll_by_hand(tokenizer, result_for)
    done = steps[keys.NEXT][keys.DONE[1]].squeeze(-1)
    assert not bool(done[0].any()) and bool(done[1, 1])  # the interrupted row: no end, no reward
    assert steps[keys.POLICY_VERSION][0].tolist() == [1, 1, 2] and steps[keys.POLICY_VERSION][1, :2].tolist() == [2, 2]
    assert float(steps[keys.NEXT][keys.REWARD[1]][0].abs().sum()) == 0.0
    env.refill([1])  # the finished slot takes a new prompt; slot 0 goes on from its tokens
    after = env.wave_request()
    assert after.slots.tolist() == [0, 1]
    assert after.prompts[0][-3:].tolist() == [5, 6, 7] and len(after.prompts[0]) == len(request.prompts[0]) + 3
    assert int(after.max_new_tokens[0]) == 8 - 3


def test_an_interrupted_row_that_produced_nothing_is_left_as_it_was(tokenizer):
    def result_for(request):
        return WaveResult(actions=torch.zeros(2, 0, dtype=torch.int64), lengths=torch.zeros(2, dtype=torch.int64),
                          log_probs=torch.zeros(2, 0), finished=torch.zeros(2, dtype=torch.bool))  # fmt: skip

    env, request, steps = unroll_by_hand(tokenizer, result_for)
    assert not bool(steps[keys.ACTIVE].any())
    again = env.wave_request()
    assert [p.tolist() for p in again.prompts] == [p.tolist() for p in request.prompts]


@pytest.mark.parametrize("bad, match", [
    (dict(lengths=torch.tensor([0, 1]), finished=None), r"lengths must lie in \[1, 2\] \(0 allowed only where finished is False\)"),
    (dict(lengths=torch.tensor([1, 1]), finished=torch.tensor([0, 1])), r"finished must be a bool tensor \(2,\)"),
    (dict(lengths=torch.tensor([1, 1]), versions=torch.zeros(2, 2)), r"versions must be int64 \(2, 2\)"),
])  # fmt: skip
def test_a_malformed_wave_result_is_named(tokenizer, bad, match):
    def result_for(request):
        return WaveResult(actions=torch.ones(2, 2, dtype=torch.int64), log_probs=torch.zeros(2, 2), **bad)

    with pytest.raises(ValueError, match=match):
        unroll_by_hand(tokenizer, result_for)


def test_over_sampling_yields_whole_groups_and_carries_the_long_tails(tokenizer):
    """A wave stops once enough rows ended to fill the batch; the long rows go on in the next wave, nothing is lost
    or repeated, and each token's log-prob is the policy's."""
    model = tiny_model(tokenizer, seed=0)
    env = TokenEnv(PROMPTS, tokenizer, lambda r, p, m: [float(len(x)) for x in r], batch_size=8, max_new_tokens=24,
                   max_length=40, group_size=2, eos_token_ids=list(range(1, 512, 23)))  # lengths spread  # fmt: skip
    policy = TransformersPolicy(model, env, seed=3)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave",
                               options=CollectorOptions(over_sampling=True))  # fmt: skip
    seen: set[int] = set()
    for i, batch in enumerate(collector):
        assert batch.shape[0] == 4
        groups = batch[keys.GROUP_ID][:, 0]
        assert all(int((groups == g).sum()) == 2 for g in groups.unique())  # whole groups
        trajs = set(batch[keys.TRAJ_ID][:, 0].tolist())
        assert not trajs & seen and len(trajs) == 4  # each trajectory once
        seen |= trajs
        assert_log_probs_under_their_versions(batch, {0: model}, env)
        last = batch[keys.MASK].sum(1) - 1  # each ended as the env ends it, none cut by an early stop
        assert bool(batch[keys.NEXT][keys.DONE[1]].squeeze(-1)[torch.arange(4), last].all())
        if i == 5:
            break
    assert collector.metrics["interrupted_sequences"] > 0  # long tails were carried over


@pytest.mark.parametrize("mode, source", [("steps", "wave"), ("trajectories", "step")])
def test_over_sampling_needs_trajectory_waves(tokenizer, mode, source):
    model = tiny_model(tokenizer, seed=0)
    env = TokenEnv(PROMPTS, tokenizer, batch_size=4, max_new_tokens=8, max_length=32, group_size=2)
    with pytest.raises(ValueError, match=r"over_sampling=True\) stops waves early.*mode='trajectories' and source='wave'"):
        TokenCollector(env, TransformersPolicy(model, env), mode=mode, batch_size=4, source=source,
                       options=CollectorOptions(over_sampling=True))  # fmt: skip


def test_a_checkpoint_with_unfinished_rows_resumes_exactly(tokenizer):
    """Over-sampling leaves rows unfinished at a batch boundary: a checkpoint taken there holds their tokens so far, and
    a collector built anew and loaded from it yields what the first one yields next, continuing those rows."""

    def make():
        model = tiny_model(tokenizer, seed=0)
        env = TokenEnv(PROMPTS, tokenizer, lambda r, p, m: [float(len(x)) for x in r], batch_size=8, max_new_tokens=24,
                       max_length=40, group_size=2, eos_token_ids=list(range(1, 512, 23)))  # fmt: skip
        return TokenCollector(env, TransformersPolicy(model, env, seed=3), mode="trajectories", batch_size=4,
                              source="wave", options=CollectorOptions(over_sampling=True))  # fmt: skip

    first = make()
    batches = iter(first)
    next(batches)
    env = first.base_env
    open_rows = {env.slot_trajectory(b): env.response_ids(b).numel() for b in range(8)
                 if env.slot_prompt(b) is not None and env.response_ids(b).numel() > 0}  # fmt: skip
    state = first.state_dict()
    expected = [next(batches) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(3), resumed, strict=False)]
    for a, b in zip(expected, got, strict=True):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        assert all(torch.equal(a[k], b[k]) for k in a.keys(True, True))
    continued = [(row, t) for a in expected for row, t in enumerate(a[keys.TRAJ_ID][:, 0].tolist()) if t in open_rows
                 and int(a[keys.MASK][row].sum()) > open_rows[t]]  # fmt: skip
    assert continued  # rows in flight at the checkpoint went on from their tokens


def test_a_second_update_as_the_next_wave_starts_keeps_every_token(tokenizer):
    """The first update stops the wave; the second lands at the next wave's first check, so that wave generates
    nothing: it records nothing, and the rows go on under the newest weights."""
    model = tiny_model(tokenizer, seed=0)
    new = perturbed(model, 1)
    env = TokenEnv(PROMPTS, tokenizer, batch_size=4, max_new_tokens=12, max_length=32, group_size=2)
    policy = TransformersPolicy(copy.deepcopy(model), env, seed=1)
    policy.interrupt = PublishTwice(5, lambda: collector.update_policy_weights_(new.state_dict()))
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source="wave")
    batch = next(iter(collector))
    assert policy.version == 2 and collector.metrics["dropped_tokens"] == 0
    assert_log_probs_under_their_versions(batch, {0: model, 1: new, 2: new}, env)
    assert set(batch[keys.POLICY_VERSION][batch[keys.MASK]].tolist()) == {0, 2}
