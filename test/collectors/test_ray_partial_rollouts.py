"""Partial rollouts on Ray workers: weights the trainer publishes (``AsyncCollector`` -> ``RayTokenCollector``) interrupt
every worker's wave in progress; each row goes on under the new weights from the tokens it has, each token stamped
with (and scored under) the version that produced it, nothing discarded.

The interruption is deterministic across processes: each worker's policy holds its wave at its k-th interrupt check
(after k - 1 decode steps) and tells the trainer thread through a Ray queue; once every worker is held there the
trainer publishes, and the update, arriving on the worker's other concurrency group, releases the wave.
"""

import functools
import itertools
import sys
import threading

import pytest
import ray  # noqa: E402 - the "ray" extra; `make test` installs it
import torch
from collector_helpers import assert_log_probs_under_their_versions as under_their_versions
from ray import cloudpickle  # noqa: E402
from ray.util.queue import Queue  # noqa: E402

from tokengym.collectors import TokenCollector
from tokengym.collectors.async_collector import AsyncCollector  # noqa: E402
from tokengym.collectors.policies import TransformersPolicy
from tokengym.collectors.ray_collector import RayTokenCollector, cat_batches, worker_seeds  # noqa: E402
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.testing import PublishAfter, tiny_model, tiny_tokenizer  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules by name

PROMPTS = [f"{a}+{b}=" for a in range(4) for b in range(3)]
GROUP, K, WORKERS = 2, 5, 2  # K: the interrupt check at which a wave is held (after K - 1 decode steps)


def make_env():
    source = PromptSource(PROMPTS, tiny_tokenizer(), group_size=GROUP, shuffle=True, seed=7, epochs=1)
    return TokenEnv(source, tiny_tokenizer(), batch_size=4, max_new_tokens=12, max_length=32)


class HeldAt(threading.Event):
    """A worker policy's ``interrupt`` that holds the wave at its ``k``-th checks until an update arrives.

    At each check in ``ks`` it puts the worker's index into ``ready`` (a Ray queue the test's trainer reads) and waits
    for the event to be set: the worker's collector sets it when the trainer's weights reach the worker (on the
    actor's other concurrency group). The wave then stops after ``k - 1`` decode steps in all, as with
    ``PublishAfter(k)`` in one process; an update that arrives before the first held check is seen there, not
    earlier."""

    def __init__(self, ks: tuple[int, ...], ready, index: int) -> None:
        super().__init__()
        self.ks, self.ready, self.index, self.checks = ks, ready, index, 0

    def is_set(self) -> bool:
        self.checks += 1
        if self.checks < self.ks[0]:
            return False
        if self.checks in self.ks:
            self.ready.put(self.index)
            if not self.wait(timeout=120):
                raise TimeoutError(f"worker {self.index}: no weight update reached the held wave")
        return super().is_set()


def make_held_policy(env, *, ready, ks=(K,)):
    """Worker ``i`` (its shard of the prompts tells which) with a :class:`HeldAt` interrupt."""
    policy = TransformersPolicy(tiny_model(env.tokenizer, seed=0), env)
    policy.interrupt = HeldAt(ks, ready, env.source.shard_index)
    return policy


def trainer_thread(fn):
    """Run ``fn`` in a thread of its own, as a trainer publishes from its own thread; the returned function joins it
    and gives what ``fn`` returned (or raises what it raised)."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as err:  # raised again by join()
            out.append(err)

    thread = threading.Thread(target=run, name="test-trainer")
    thread.start()

    def join():
        thread.join()
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    return join


def trainer(collector, ready, weights):
    """Once every worker's wave is held, publish ``weights``; joined, the workers it saw held."""

    def publish():
        seen = sorted(ready.get(timeout=120) for _ in range(WORKERS))
        collector.update_policy_weights_(weights)
        return seen

    return trainer_thread(publish)


pytestmark = pytest.mark.usefixtures("local_ray")  # one local Ray for the module (conftest)


@pytest.fixture
def ready():
    """The queue through which held workers tell the trainer (a Ray actor, killed after the test)."""
    queue = Queue()
    yield queue
    queue.shutdown(force=True)


@pytest.fixture
def published():
    tok = tiny_tokenizer()
    return {0: tiny_model(tok, seed=0), 1: tiny_model(tok, seed=1)}


def assert_log_probs_under_their_versions(batch, published):
    under_their_versions(batch, published, make_env())


def assert_whole_groups(batch):
    groups = batch[keys.GROUP_ID][:, 0]
    assert all(int((groups == g).sum()) == GROUP for g in groups.unique())


def group_samples(batches):
    """(group id, sample id) of every trajectory in TRAJECTORIES batches."""
    return [
        (int(g), int(s))
        for b in batches
        for g, s in zip(b[keys.GROUP_ID][:, 0], b[keys.SAMPLE_ID][:, 0], strict=True)
    ]


def spanning_rows(batch):
    spans = (batch[keys.VERSION_START][:, 0] < batch[keys.VERSION_END][:, 0]) & batch[keys.MASK][:, 0]
    return spans.nonzero().squeeze(-1)


def test_a_publish_interrupts_every_workers_wave_and_the_rows_go_on_under_the_new_weights(published, ready):
    inner = RayTokenCollector(make_env, functools.partial(make_held_policy, ready=ready), num_workers=WORKERS,
                              mode="trajectories", batch_size=8, source="wave")  # fmt: skip
    with AsyncCollector(inner, max_staleness=1) as collector:
        join = trainer(collector, ready, published[1].state_dict())
        batch = next(iter(collector))
        # every worker's first wave was held, then released by the update
        assert join() == list(range(WORKERS))
        metrics = dict(collector.metrics)
    assert metrics["interrupted_sequences"] >= WORKERS and metrics["dropped_tokens"] == 0
    assert metrics["update_wait_s"] > 0  # from each worker's publish to its wave's stop, added up
    assert collector.version == 1 and metrics["weight_updates"] == 1
    assert metrics["version_spanning_fraction"] > 0
    rows = spanning_rows(batch)
    assert {int(t) % WORKERS for t in batch[keys.TRAJ_ID][rows, 0]} == set(range(WORKERS))  # on every worker
    mask, version = batch[keys.MASK], batch[keys.POLICY_VERSION]
    for row in rows.tolist():
        v = version[row][mask[row]]
        assert bool((v[1:] >= v[:-1]).all())  # no old-version token after the update landed
        assert int((v == 0).sum()) == K - 1  # held after K - 1 decode steps: those tokens kept, not redone
    assert_log_probs_under_their_versions(batch, published)
    assert_whole_groups(batch)
    last = mask.sum(1) - 1  # every trajectory ended as the env ends it, none cut by the interruption
    assert bool(batch[keys.NEXT][keys.DONE[1]].squeeze(-1)[torch.arange(len(last)), last].all())


def local_rounds(index, new_weights, mode, batch_size):
    """What worker ``index`` yields: an in-process TokenCollector on its shard, its wave interrupted at the same check."""
    env = make_env()
    env.source.shard(index, WORKERS)
    policy = TransformersPolicy(tiny_model(env.tokenizer, seed=0), env)
    policy.set_seed(worker_seeds(0, WORKERS)[index])
    policy.interrupt = PublishAfter(K, lambda: collector.update_policy_weights_(new_weights))
    collector = TokenCollector(env, policy, mode=mode, batch_size=batch_size, source="wave")
    out = []
    for batch in collector:
        batch.set(keys.TRAJ_ID, batch[keys.TRAJ_ID] * WORKERS + index)
        out.append(batch)
    return out, collector.metrics["interrupted_sequences"]


@pytest.mark.parametrize(("mode", "batch_size"), [("trajectories", 8), ("steps", 6)])
def test_ray_partial_rollouts_equal_in_process_ones_on_the_shards(published, ready, mode, batch_size):
    """Every round equals two in-process collectors whose waves are interrupted at the same check; over the whole
    prompt source each trajectory comes once, in whole groups, each token scored under its version."""
    new_weights = published[1].state_dict()
    inner = RayTokenCollector(make_env, functools.partial(make_held_policy, ready=ready), num_workers=WORKERS,
                              mode=mode, batch_size=batch_size, source="wave")  # fmt: skip
    with AsyncCollector(inner, max_staleness=1) as collector:
        join = trainer(collector, ready, new_weights)
        got = list(collector)
        assert join() == list(range(WORKERS))
        interrupted, dropped = collector.metrics["interrupted_sequences"], collector.metrics["dropped_tokens"]
    per_worker = batch_size // WORKERS if mode == "trajectories" else batch_size
    local = [local_rounds(i, new_weights, mode, per_worker) for i in range(WORKERS)]
    # a worker whose shard ended sits the last rounds out
    rounds = itertools.zip_longest(*(r for r, _ in local))
    expected = [cat_batches([b for b in parts if b is not None]) for parts in rounds]
    assert len(got) == len(expected) > 1
    for a, b in zip(got, expected, strict=True):
        assert a.batch_size == b.batch_size
        for key in a.exclude(keys.PROMPTS).keys(True, True):
            assert torch.equal(a[key], b[key]), key
    assert interrupted == sum(n for _, n in local) > 0 and dropped == 0
    if mode == "steps":  # per slot, versions never go back; both versions were sampled
        versions = torch.cat([b[keys.POLICY_VERSION][b[keys.ACTIVE]] for b in got])
        assert set(versions.tolist()) == {0, 1}
        for b in got:
            for row in range(b.shape[0]):
                v = b[keys.POLICY_VERSION][row][b[keys.ACTIVE][row]]
                assert bool((v[1:] >= v[:-1]).all())
        return
    rows = group_samples(got)
    assert sorted(rows) == sorted((g, s) for g in range(len(PROMPTS)) for s in range(GROUP))  # each once
    for b in got:
        assert_whole_groups(b)
        assert_log_probs_under_their_versions(b, published)


def test_a_worker_killed_while_its_wave_is_held_loses_nothing(published, ready):
    """Worker 0 dies with its wave held mid-way, nothing of the round delivered: it restarts from its last batch and
    generates those rows again, held at the same check; one publish then releases both workers. No trajectory is
    lost or doubled, every token scores under its version."""
    collector = RayTokenCollector(make_env, functools.partial(make_held_policy, ready=ready), num_workers=WORKERS,
                                  mode="trajectories", batch_size=8, source="wave")  # fmt: skip

    def kill_then_publish():
        seen = sorted(ready.get(timeout=120) for _ in range(WORKERS))
        ray.kill(collector.workers[0])  # its wave held mid-way, nothing of this round delivered
        seen.append(ready.get(timeout=120))  # the new worker 0 holds its wave at its K-th check too
        collector.update_policy_weights_(published[1].state_dict())
        return seen

    with collector:
        join = trainer_thread(kill_then_publish)
        got = list(collector)
        assert join() == [0, 1, 0] and collector.restarts == [1, 0]
        assert collector.metrics["dropped_tokens"] == 0 and collector.metrics["interrupted_sequences"] > 0
    assert sorted(group_samples(got)) == sorted((g, s) for g in range(len(PROMPTS)) for s in range(GROUP))
    for b in got:
        assert_whole_groups(b)
        assert_log_probs_under_their_versions(b, published)
    first = got[0]
    for row in spanning_rows(first).tolist():  # each worker's first wave: K - 1 tokens under the old weights
        assert int((first[keys.POLICY_VERSION][row][first[keys.MASK][row]] == 0).sum()) == K - 1


def test_a_second_update_at_the_next_waves_start_keeps_every_token(published, ready):
    """Two publishes in a row: the first stops the wave after K - 1 decode steps, the second lands as the next wave
    starts (it generates nothing); the rows go on under the newest weights."""
    policy_fn = functools.partial(make_held_policy, ready=ready, ks=(K, K + 1))
    inner = RayTokenCollector(make_env, policy_fn, num_workers=WORKERS, mode="trajectories", batch_size=8,
                              source="wave")  # fmt: skip
    published = {**published, 2: published[1]}

    def publish_twice():
        for _ in range(2):
            assert sorted(ready.get(timeout=120) for _ in range(WORKERS)) == list(range(WORKERS))
            collector.update_policy_weights_(published[1].state_dict())
        return True

    with AsyncCollector(inner, max_staleness=2) as collector:
        join = trainer_thread(publish_twice)
        batch = next(iter(collector))
        assert join() is True and collector.version == 2
        assert collector.metrics["dropped_tokens"] == 0 and collector.metrics["interrupted_sequences"] > 0
    assert_whole_groups(batch)
    assert_log_probs_under_their_versions(batch, published)
    rows = spanning_rows(batch)
    assert len(rows) > 0 and set(batch[keys.POLICY_VERSION][rows][batch[keys.MASK][rows]].tolist()) == {0, 2}


def test_a_worker_restarted_behind_the_newest_weights_takes_the_next_update(published):
    """Worker 0 dies after an update its last batch did not see: the new actor loads the newest weights and the
    state after that batch, and catches up with the driver's version; the next update (AsyncCollector publishes one
    every batch) gives the driver and every worker the same version."""
    weights = published[1].state_dict()
    with RayTokenCollector(make_env, make_policy_plain, num_workers=WORKERS, mode="trajectories", batch_size=8,
                           source="wave") as collector:  # fmt: skip
        iterator = iter(collector)
        next(iterator)
        assert collector.update_policy_weights_(weights) == 1
        ray.kill(collector.workers[0])
        next(iterator)
        assert collector.restarts == [1, 0]
        assert collector.update_policy_weights_(weights) == 2
        batch = next(iterator)
    assert int(batch[keys.POLICY_VERSION][batch[keys.MASK]].min()) == 2


def make_policy_plain(env):
    return TransformersPolicy(tiny_model(env.tokenizer, seed=0), env)
