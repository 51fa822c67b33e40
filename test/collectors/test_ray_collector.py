"""RayTokenCollector on one local Ray (started once for this module): sharding, weights, faults, checkpoints."""

import functools
import os
import queue
import sys
import threading
import time

import pytest
import ray  # noqa: E402 - the "ray" extra; `make test` installs it
import torch
from ray import cloudpickle  # noqa: E402

from tokengym.collectors import TokenCollector
from tokengym.collectors.async_collector import AsyncCollector  # noqa: E402
from tokengym.collectors.policies import TransformersPolicy
from tokengym.collectors.ray_collector import RayConfig, RayTokenCollector, cat_batches, worker_seeds  # noqa: E402
from tokengym.errors import PromptError, RewardFunctionError
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules by name

PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(3)]
GROUP = 2


def make_source(epochs=1):
    return PromptSource(PROMPTS, tiny_tokenizer(), group_size=GROUP, shuffle=True, seed=7, epochs=epochs)


def make_env(reward=None, *, epochs=1, batch_size=2):
    return TokenEnv(make_source(epochs), tiny_tokenizer(), reward, batch_size=batch_size, max_new_tokens=4,
                    max_length=32)  # fmt: skip


def make_policy(env, model_seed=0):
    return TransformersPolicy(tiny_model(env.tokenizer, seed=model_seed), env)


def exact_match(responses, prompts, metadata):
    return [float(r.strip() == m["answer"]) for r, m in zip(responses, metadata, strict=True)]


class FlakyReward:
    """Raises the first time (in its process) it scores ``text``; exact match otherwise."""

    def __init__(self, text):
        self.text, self.has_raised = text, False

    def __call__(self, responses, prompts, metadata):
        if self.text in prompts and not self.has_raised:
            self.has_raised = True
            raise RuntimeError("reward service down")
        return exact_match(responses, prompts, metadata)


class CountingReward:
    """Exact match; appends a line to ``folder/<pid>`` per call, so a test sees a worker mid-batch."""

    def __init__(self, folder):
        self.folder = folder

    def __call__(self, responses, prompts, metadata):
        with open(os.path.join(self.folder, str(os.getpid())), "a") as f:
            f.write("x\n")
        return exact_match(responses, prompts, metadata)


pytestmark = pytest.mark.usefixtures("local_ray")  # one local Ray for the module (conftest)


def _rows(batches):
    """(group id, sample id, prompt text, trajectory id) of every trajectory in TRAJECTORIES batches."""
    out = []
    for b in batches:
        table = b.get_non_tensor(keys.PROMPTS)
        for g, s, t in zip(b[keys.GROUP_ID][:, 0].tolist(), b[keys.SAMPLE_ID][:, 0].tolist(),
                           b[keys.TRAJ_ID][:, 0].tolist(), strict=True):  # fmt: skip
            out.append((g, s, table.text(g), t))
    return out


def _check_against_source(batches, num_workers):
    rows = _rows(batches)
    expected = sorted((p.group_id, p.sample_id, p.text) for p in make_source())
    assert sorted(r[:3] for r in rows) == expected  # nothing lost, nothing twice
    assert len({r[3] for r in rows}) == len(rows)  # trajectory ids are globally unique
    assert all(g % num_workers == t % num_workers for g, _, _, t in rows)  # a group comes from one worker


def _globalize(batch, i, n):
    batch.set(keys.TRAJ_ID, batch[keys.TRAJ_ID] * n + i)
    return batch


def _assert_equal(a, b):
    assert a.batch_size == b.batch_size
    for key in a.exclude(keys.PROMPTS).keys(True, True):
        assert torch.equal(a[key], b[key]), key


def test_workers_are_ordinary_collectors_on_shards_and_take_weights():
    """Each round equals two in-process TokenCollectors on shards 0 and 1 with the derived seeds, weight
    update included; the groups are exactly those of the prompt source."""
    new_weights = tiny_model(tiny_tokenizer(), seed=1).state_dict()
    with RayTokenCollector(make_env, make_policy, num_workers=2, mode="trajectories", batch_size=8, seed=3,
                           ray_config=RayConfig(cpus_per_worker=1)) as collector:  # fmt: skip
        got = []
        for i, batch in enumerate(collector):
            got.append(batch)
            if i == 1:
                assert collector.update_policy_weights_(weights=new_weights) == 1
        assert collector.metrics["workers"] == 2 and collector.metrics["restarts"] == 0
        assert repr(collector).startswith("RayTokenCollector(num_workers=2, mode='trajectories', batch_size=8, seed=3")
    local = []
    for i, seed in enumerate(worker_seeds(3, 2)):
        env = make_env()
        env.source.shard(i, 2)
        policy = make_policy(env)
        policy.set_seed(seed)
        rounds = []
        for r, batch in enumerate(TokenCollector(env, policy, mode="trajectories", batch_size=4)):
            rounds.append(_globalize(batch, i, 2))
            if r == 1:
                policy.update_weights(new_weights)
        local.append(rounds)
    expected = [cat_batches([a, b]) for a, b in zip(*local, strict=True)]
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected, strict=True):
        _assert_equal(a, b)
    assert {int(v) for b in got[2:] for v in b[keys.POLICY_VERSION][b[keys.MASK]]} == {1}
    _check_against_source(got, 2)


def test_steps_batches_put_the_workers_slots_side_by_side():
    sink = queue.Queue()
    with RayTokenCollector(functools.partial(make_env, epochs=None), make_policy, num_workers=2, mode="steps",
                           frames_per_batch=12, total_frames=24, sink=sink) as collector:  # fmt: skip
        with pytest.raises(ValueError, match="needs the weights"):
            collector.update_policy_weights_()
        assert list(collector) == [None, None]
        metrics = dict(collector.metrics)
    batches = [sink.get_nowait() for _ in range(2)]
    assert [tuple(b.shape) for b in batches] == [(4, 3), (4, 3)]
    assert metrics["steps"] == 12 and metrics["tokens"] == int(batches[1][keys.MASK].sum())
    assert {"tokens_per_s", "mean_reward", "staleness_max", "policy_version"} <= set(metrics)


def test_a_killed_worker_is_restarted_without_loss_or_duplication(tmp_path):
    """ray.kill on a worker in the middle of a batch: it restarts from its last checkpoint."""
    env_fn = functools.partial(make_env, CountingReward(str(tmp_path)), batch_size=2)
    with RayTokenCollector(env_fn, make_policy, num_workers=2, mode="trajectories", batch_size=12) as collector:
        iterator = iter(collector)
        batches = [next(iterator)]
        victim = collector.worker_pids()[0]
        log = tmp_path / str(victim)
        calls = len(log.read_text().splitlines())
        thread = threading.Thread(target=lambda: batches.append(next(iterator)))
        thread.start()
        deadline = time.monotonic() + 120
        while len(log.read_text().splitlines()) == calls and time.monotonic() < deadline:
            time.sleep(0.005)
        ray.kill(collector.workers[0])  # the worker has scored something of this batch, not all of it
        thread.join()
        batches += list(iterator)
        assert collector.restarts == [1, 0] and collector.metrics["restarts"] == 1
        assert collector.worker_pids()[0] != victim
    _check_against_source(batches, 2)


def test_a_failing_reward_names_worker_prompt_and_slot_and_keeps_other_data():
    env_fn = functools.partial(make_env, FlakyReward("4+1="))
    collector = RayTokenCollector(env_fn, make_policy, num_workers=2, mode="trajectories", batch_size=8)
    batches, errors = [], []
    with collector:
        iterator = iter(collector)
        while True:
            try:
                batch = next(iterator, None)
            except RewardFunctionError as err:
                errors.append(str(err))
                iterator = iter(collector)  # the failed worker was rolled back; carry on
                continue
            if batch is None:
                break
            batches.append(batch)
    assert len(errors) == 1
    assert "RayTokenCollector worker" in errors[0] and "reward service down" in errors[0]
    assert "slots [" in errors[0] and "'4+1='" in errors[0]
    _check_against_source(batches, 2)


def test_checkpoint_resumes_the_same_rounds(tmp_path):
    new_weights = tiny_model(tiny_tokenizer(), seed=2).state_dict()
    env_fn = functools.partial(make_env, epochs=None)
    with RayTokenCollector(env_fn, make_policy, num_workers=2, mode="trajectories", batch_size=6) as collector:
        collector.set_seed(11)
        iterator = iter(collector)
        next(iterator)
        collector.update_policy_weights_(new_weights)
        next(iterator)
        torch.save(collector.state_dict(), tmp_path / "ckpt.pt")
        after = [next(iterator) for _ in range(2)]
        next(iterator)
        collector.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))  # plain data
        resumed = [next(iterator) for _ in range(2)]
    for a, b in zip(after, resumed, strict=True):
        _assert_equal(a, b)
    assert int(after[0][keys.POLICY_VERSION][after[0][keys.MASK]].min()) == 1


@pytest.mark.filterwarnings("ignore::tokengym.errors.TokenGymWarning")  # a batch left short by stale work (timing)
def test_async_over_ray_workers_bounds_staleness():
    weights = [tiny_model(tiny_tokenizer(), seed=s).state_dict() for s in (1, 2)]
    inner = RayTokenCollector(functools.partial(make_env, epochs=None), make_policy, num_workers=2,
                              mode="trajectories", batch_size=6)  # fmt: skip
    seen = []
    with AsyncCollector(inner, max_staleness=1) as collector:
        for i, batch in enumerate(collector):
            mask = batch[keys.MASK]
            seen.append(int(batch[keys.POLICY_VERSION][mask].min()))
            assert seen[-1] >= collector.version - 1
            assert collector.metrics["staleness_max"] <= 1
            time.sleep(0.05)  # "training"
            collector.update_policy_weights_(weights[i % 2])
            if i == 5:
                break
    assert collector.version == 6 and max(seen) >= 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"num_workers": 0}, ValueError, "num_workers must be a positive int, got 0"),
     ({"mode": "episodes"}, ValueError, "mode must be one of"),
     ({"batch_size": 0}, ValueError, r"batch_size / frames_per_batch \(.*\) must be a positive int, got 0"),
     ({"batch_size": 4, "frames_per_batch": 5}, ValueError, "frames_per_batch=5 is not a multiple of num_workers=2"),
     ({"mode": "trajectories", "frames_per_batch": 4}, ValueError, "counts TorchRL frames .* pass batch_size=N"),
     ({"total_steps": 0}, ValueError, "total_steps must be a positive int or -1"),
     ({"mode": "trajectories", "batch_size": 1}, ValueError, "batch_size=1 trajectories is not a multiple of the env's group_size=2"),
     ({"mode": "trajectories", "batch_size": 2}, ValueError, "holds 1 group.* of 2, fewer than the 2 workers"),
     ({"ray_config": {"address": None}}, TypeError, "ray_config must be a RayConfig"),
     ({"sink": 3}, TypeError, "sink must be a ReplayBuffer")],
)  # fmt: skip
def test_bad_arguments_fail_before_ray_starts(kwargs, error, match):
    kwargs = {"num_workers": 2, "batch_size": 4, **kwargs}
    with pytest.raises(error, match=match):
        RayTokenCollector(make_env, make_policy, **kwargs)



def test_trajectory_batches_hold_whole_groups_across_workers():
    """Issue 20 item 1: each worker's share of a batch is whole groups; 10 batches, variable lengths."""
    env_fn = functools.partial(make_env, epochs=None, batch_size=3)
    with RayTokenCollector(env_fn, make_policy, num_workers=2, mode="trajectories", batch_size=6) as collector:
        batches = [b for b, _ in zip(collector, range(10), strict=False)]
    counts: dict[int, list[int]] = {}
    for i, b in enumerate(batches):
        for g in b[keys.GROUP_ID][:, 0].tolist():
            counts.setdefault(g, []).append(i)
    split = [g for g, where in counts.items() if len(where) != GROUP or len(set(where)) != 1]
    lengths = {int(n) for b in batches for n in b[keys.MASK].sum(1)}
    assert len(batches) == 10 and len(lengths) > 1 and split == []


def make_env_with_a_bad_prompt():
    items = [*PROMPTS[:5], {"answer": "0"}, *PROMPTS[5:]]  # item 5 has no prompt field: a PromptError on its worker
    source = PromptSource(items, tiny_tokenizer(), group_size=GROUP, shuffle=True, seed=7, epochs=1)
    return TokenEnv(source, tiny_tokenizer(), exact_match, batch_size=2, max_new_tokens=4, max_length=32)


def test_a_workers_prompt_error_ends_one_next_and_the_same_iterator_goes_on():
    """The driver's iterator ended at the error (a generator); and the worker, rolled back to its last batch,
    drew the bad prompt again: the same PromptError at every later call."""
    with RayTokenCollector(make_env_with_a_bad_prompt, make_policy, num_workers=2, mode="trajectories",
                           batch_size=4) as collector:  # fmt: skip
        it = iter(collector)
        batches = []
        with pytest.raises(PromptError, match="RayTokenCollector worker [01]: .*prompt item 5 is a mapping") as caught:
            while True:
                batches.append(next(it))
        assert caught.value.slots  # the worker's exception itself: its type and attributes, the message prefixed
        batches.append(next(it))  # the same iterator goes on
        batches += list(it)  # with no second error: the worker went on past the prompt
        assert collector.metrics["failed_prompts"] == 1  # counted by the worker, added up by the driver
    rows = _rows(batches)
    assert sorted((text, s) for _, s, text, _ in rows) == sorted((p["prompt"], s) for p in PROMPTS for s in range(GROUP))
    assert len({r[3] for r in rows}) == len(rows)  # nothing twice


@pytest.mark.parametrize(("mode", "batch_size"), [("steps", 3), ("trajectories", 4)])
def test_metrics_have_a_token_collectors_keys_from_the_start(mode, batch_size):
    """Every key is there before the first batch (it was {} until a round succeeded). The workers send their
    counters (failed prompts, weight updates, prompt counts, the recorder's) and the driver adds them up with the
    same metric function; it adds ``workers`` and ``restarts``."""
    env = make_env()
    local = TokenCollector(env, make_policy(env), mode=mode, batch_size=batch_size)
    next(iter(local))
    with RayTokenCollector(make_env, make_policy, num_workers=2, mode=mode, batch_size=batch_size) as collector:
        before = dict(collector.metrics)
        assert before["workers"] == before["tokens"] == before["restarts"] == 0
        assert set(before) == set(local.metrics) | {"workers", "restarts"}
        next(iter(collector))
        assert set(collector.metrics) == set(before) and collector.metrics["workers"] == 2
        collector.update_policy_weights_(tiny_model(tiny_tokenizer(), seed=1).state_dict())
        next(iter(collector))
        assert set(collector.metrics) == set(local.metrics) | {"workers", "restarts"}
        assert collector.metrics["weight_updates"] == 1 and collector.metrics["steps"] > 0


def test_a_failing_postproc_on_the_driver_loses_nothing():
    calls = []

    def flaky(batch):
        calls.append(batch.shape[0])
        if len(calls) == 2:
            raise RuntimeError("postproc down")
        return batch

    with RayTokenCollector(make_env, make_policy, num_workers=2, mode="trajectories", batch_size=8,
                           postproc=flaky) as collector:  # fmt: skip
        it = iter(collector)
        batches = [next(it)]
        with pytest.raises(RuntimeError, match="postproc down"):
            next(it)
        batches += list(it)  # the round whose postproc raised comes first
    assert len(calls) == len(batches) + 1
    _check_against_source(batches, 2)


def test_workers_grow_trees_and_their_ids_stay_consistent():
    """CollectorOptions(tree=...) reaches every worker: whole trees per batch, a leaf's ancestors' ids (BRANCH_ID,
    PARENT_ID) mapped to global ids as its own trajectory id is."""
    from tokengym.collectors import CollectorOptions, SegmentRule

    env_fn = functools.partial(make_env, epochs=None, batch_size=2)
    with RayTokenCollector(env_fn, make_policy, num_workers=2, mode="trajectories", batch_size=4,
                           options=CollectorOptions(tree=SegmentRule(1, 2))) as collector:  # fmt: skip
        batches = [b for b, _ in zip(collector, range(3), strict=False)]
    for b in batches:
        mask, traj, branch, parent = b[keys.MASK], b[keys.TRAJ_ID][:, 0], b[keys.BRANCH_ID], b[keys.PARENT_ID][:, 0]
        groups = b[keys.GROUP_ID][:, 0]
        for g in groups.unique().tolist():
            rows = (groups == g).nonzero().squeeze(-1)
            assert len(rows) == GROUP and (parent[rows] == -1).sum() == 1
            assert set(parent[rows][parent[rows] >= 0].tolist()) <= set(traj[rows].tolist())  # parents are leaves here
            assert set(branch[rows][mask[rows]].tolist()) <= set(traj[rows].tolist())
        assert len(set(traj.tolist())) == len(traj)
    assert collector.metrics["tree_forks"] > 0
