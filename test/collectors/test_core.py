"""The collector core (collectors/core.py): the checked configuration, and delivery that loses nothing.

A batch leaves its collector only once it was delivered: a postproc, a logger or a sink that raises ends that
``next()``, and the next one delivers the same batch (popped from the recorder before, it was lost).
"""

import queue

import pytest
import torch

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors._ray_worker import _with_worker
from tokengym.collectors.core import CollectSpec
from tokengym.errors import PromptError
from tokengym.llm_envs import keys


class FailOnce:
    """Raises at its ``n``-th call, passes everything else through; counts its calls."""

    def __init__(self, n: int, fn=lambda *args: args[0] if args else None) -> None:
        self.n, self.fn, self.calls = n, fn, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("flaky")
        return self.fn(*args)


class FlakyQueue(queue.Queue):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.fail = FailOnce(n)

    def put(self, item, *args, **kwargs):
        self.fail()
        super().put(item, *args, **kwargs)


class FlakyLogger:
    def __init__(self, n: int) -> None:
        self.fail, self.rows = FailOnce(n), []

    def log_scalar(self, name, value, step):
        if name == "tokens":
            self.fail()
        self.rows.append((name, step))


def _collector(make_env, make_policy, mode, **kwargs):
    env = make_env(batch_size=3, max_new_tokens=5, eos_token_ids=[1, 5, 9, 13], shuffle=True, seed=1)
    return TokenCollector(env, make_policy(env), mode=mode, batch_size=4, total_steps=24, **kwargs)


def _drain(it):
    """Every batch of ``it``, going on after each error; returns (batches, errors)."""
    batches, errors = [], 0
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return batches, errors
        except RuntimeError:
            errors += 1
            continue
        batches.append(batch)


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        for key in b.exclude(keys.PROMPTS).keys(True, True):
            assert torch.equal(a.get(key), b.get(key)), key


def _seen(batch):
    return batch.set("seen", torch.ones(batch.shape))


@pytest.mark.parametrize("mode", ["steps", "trajectories"])
@pytest.mark.parametrize("where", ["postproc", "logger", "sink"])
def test_a_failing_delivery_loses_nothing(make_env, make_policy, mode, where):
    expected = list(_collector(make_env, make_policy, mode))
    postproc = FailOnce(2 if where == "postproc" else 0, _seen)
    sink = FlakyQueue(2) if where == "sink" else None
    logger = FlakyLogger(2) if where == "logger" else None
    collector = _collector(make_env, make_policy, mode, postproc=postproc, sink=sink, logger=logger)
    got, errors = _drain(iter(collector))
    if sink is not None:
        assert got == [None] * len(expected)
        got = [sink.get_nowait() for _ in range(sink.qsize())]
    assert errors == 1
    _assert_same(got, expected)  # the batch whose delivery raised came with the next next(), once
    assert postproc.calls == len(expected) + (where == "postproc")  # a postprocessed batch is not postprocessed again
    assert collector.undelivered is None


def test_a_checkpoint_after_a_failed_delivery_keeps_the_batch(make_env, make_policy):
    """STEPS batches: the recorder keeps the undelivered batch, and its checkpoint holds it."""
    expected = list(_collector(make_env, make_policy, "steps"))
    failing = _collector(make_env, make_policy, "steps", postproc=FailOnce(2))
    it = iter(failing)
    first = next(it)
    with pytest.raises(RuntimeError, match="flaky"):
        next(it)
    state = failing.state_dict()
    resumed = _collector(make_env, make_policy, "steps")
    resumed.load_state_dict(state)
    _assert_same([first, *resumed], expected)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"mode": "frames"}, ValueError, r"mode must be one of \['steps', 'trajectories'\], got 'frames'"),
     ({"options": {"is_whole_groups": False}}, TypeError, "options must be a CollectorOptions, got dict"),
     ({"batch_size": None}, ValueError, "pass batch_size .* or, in STEPS mode, TorchRL's frames_per_batch"),
     ({"mode": "trajectories", "batch_size": 0}, ValueError, r"\(trajectories per batch\) must be a positive int, got 0"),
     ({"total_steps": -2}, ValueError, r"total_steps must be a positive int or -1 \(endless\), got -2"),
     ({"total_frames": -1}, ValueError, "total_frames must be a positive int"),
     ({"frames_per_batch": True}, ValueError, "frames_per_batch must be a positive int"),
     ({"options": CollectorOptions(in_flight="drop")}, ValueError, "in_flight='drop' needs mode='trajectories'")],
)  # fmt: skip
def test_spec_errors_name_the_value_and_the_fix(kwargs, error, match):
    kwargs = {"mode": "steps", "batch_size": 4, **kwargs}
    with pytest.raises(error, match=match):
        CollectSpec.from_args(kwargs.pop("mode"), **kwargs)


def test_spec_frames_of_one_collector_and_of_ray_workers():
    spec = CollectSpec.from_args("steps", frames_per_batch=24, total_frames=50)
    assert spec.batch_size is None
    one = spec.for_env(slots=4, group_size=2)
    assert (one.batch_size, one.total_steps, one.frames_per_batch) == (6, 13, None)  # 50 frames: 13 steps of 4
    worker = spec.per_worker(2).for_env(slots=3, group_size=2)  # (2 * 3, 4) batches, 25 frames per worker
    assert (worker.batch_size, worker.total_steps) == (4, 9)
    with pytest.raises(ValueError, match="frames_per_batch=24 is not a multiple of num_workers=5"):
        spec.per_worker(5)
    trajs = CollectSpec.from_args("trajectories", batch_size=10).for_env(slots=4, group_size=2)
    assert [trajs.worker_share(i, 3, group_size=2).batch_size for i in range(3)] == [4, 4, 2]  # 5 groups over 3
    with pytest.raises(ValueError, match=r"batch_size=10 holds 5 group\(s\) of 2, fewer than the 6 workers"):
        trajs.worker_share(0, 6, group_size=2)
    with pytest.raises(ValueError, match="batch_size=3 trajectories is not a multiple of the env's group_size=2"):
        CollectSpec.from_args("trajectories", batch_size=3).for_env(slots=4, group_size=2)
    loose = CollectSpec.from_args("trajectories", batch_size=3, options=CollectorOptions(is_whole_groups=False))
    assert loose.for_env(slots=4, group_size=2).batch_size == 3


def test_a_workers_error_keeps_its_type_and_attributes():
    """Ray's worker prefix rebuilt the exception from its message: a PromptError lost its slots."""
    err = PromptError("prompt 3 is too long", slots=[1, 2])
    _with_worker(err, 1, 2)
    assert type(err) is PromptError and err.slots == [1, 2]
    assert str(err).startswith("RayTokenCollector worker 1: prompt 3 is too long (trajectory ids")


def test_update_policy_weights_has_one_meaning(make_env, tokenizer, model):
    """The trained module (or its state_dict, or weights=) is loaded; nothing or the collector's own policy: trained
    in place. A module given to a TokenCollector was ignored (a version bump with the old weights)."""
    import copy

    from tokengym.collectors.policies import TransformersPolicy
    from tokengym.testing import tiny_model

    env = make_env(batch_size=2)
    policy = TransformersPolicy(copy.deepcopy(model), env)
    collector = TokenCollector(env, policy, mode="steps", batch_size=2)
    trained = tiny_model(tokenizer, seed=5)
    assert collector.update_policy_weights_(trained) == 1
    assert all(torch.equal(a, b) for a, b in zip(policy.model.state_dict().values(), trained.state_dict().values(),
                                                   strict=True))  # fmt: skip
    assert collector.update_policy_weights_(weights=model.state_dict()) == 2
    assert torch.equal(policy.model.lm_head.weight, model.lm_head.weight)
    assert collector.update_policy_weights_(policy) == collector.update_policy_weights_() - 1 == 3
    assert torch.equal(policy.model.lm_head.weight, model.lm_head.weight) and collector.metrics["weight_updates"] == 4
