"""One Ray rollout worker: an ordinary TokenCollector on its own shard of the prompt stream.

Plain Python (no Ray import): :mod:`tokengym.collectors.ray_collector` makes :class:`CollectorWorker`
an actor and sends ``next_batch`` / ``state_dict`` / ``load_state_dict`` / ``set_seed`` to its
single-thread ``collect`` concurrency group; ``update_policy_weights_`` and ``info`` run on the actor's
default group, another thread, while a batch is being collected.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections.abc import Callable, Mapping

import numpy as np
import torch
from tensordict import TensorDictBase

from tokengym.collectors.core import CollectSpec
from tokengym.collectors.dynamic_sampling import DynamicSamplingError
from tokengym.collectors.policies.protocol import weights_of
from tokengym.collectors.token_collector import TokenCollector
from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import PromptError

__all__ = ["CollectorWorker", "PackedState", "WorkerSpec", "pack_weights", "unpack_state", "unpack_weights", "worker_seeds"]


def worker_seeds(seed: int, num_workers: int) -> list[int]:
    """Independent sampling seeds of ``num_workers`` workers, derived from one collector seed.

    Example:
        >>> worker_seeds(0, 2) == worker_seeds(0, 2), len(set(worker_seeds(0, 4)))
        (True, 4)
    """
    return [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(num_workers)]


def pack_weights(weights) -> dict[str, tuple[np.ndarray, str, tuple[int, ...]]]:
    """Weights (anything :func:`~tokengym.collectors.policies.protocol.weights_of` takes) as uint8 NumPy views:
    Ray moves them without pickling, and a worker reads them straight from the object store (zero-copy, read-only)."""
    out = {}
    for name, value in weights_of(weights).items():
        t = value.detach().cpu().contiguous()
        out[name] = (t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))
    return out


def unpack_weights(packed: Mapping) -> dict[str, torch.Tensor]:
    """Tensors over the arrays of :func:`pack_weights` (read-only memory: loading copies them)."""
    out = {}
    with warnings.catch_warnings():  # object-store memory is read-only; load_state_dict copies it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, (data, dtype, shape) in packed.items():
            out[name] = torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)
    return out


class PackedState:
    """A collector checkpoint whose tensors share one byte buffer: Ray moves it as one array, where the
    plain state (hundreds of small tensors: queued trajectories, caches) costs a pickle call each."""

    def __init__(self, state) -> None:
        tensors: list[torch.Tensor] = []
        self.tree = _strip(state, tensors)
        self.specs = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
        flat = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        self.buffer = (torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8)).numpy()

    def unpack(self):
        """The state, its tensors copied out of the buffer."""
        data = torch.from_numpy(self.buffer.copy())  # the buffer may be read-only object-store memory
        tensors, offset = [], 0
        for dtype, shape in self.specs:
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            n = t.numel() * t.element_size()
            t.reshape(-1).view(torch.uint8).copy_(data[offset : offset + n])
            tensors.append(t)
            offset += n
        return _fill(self.tree, tensors)


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index


def _strip(x, tensors: list):
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return _Slot(len(tensors) - 1)
    if isinstance(x, TensorDictBase):
        return x.consolidate()
    if type(x) is dict:
        return {k: _strip(v, tensors) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_strip(v, tensors) for v in x)
    return x


def _fill(x, tensors: list):
    if isinstance(x, _Slot):
        return tensors[x.index]
    if type(x) is dict:
        return {k: _fill(v, tensors) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_fill(v, tensors) for v in x)
    return x


def unpack_state(state):
    """A plain collector state from a :class:`PackedState` (or a plain one, as is)."""
    return state.unpack() if isinstance(state, PackedState) else state


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What every worker is built from (picklable: it crosses to the worker processes)."""

    env_fn: Callable
    policy_fn: Callable
    collect: CollectSpec
    """The driver's spec with each worker's frames (:meth:`CollectSpec.per_worker`)."""
    source: object
    num_workers: int
    num_threads: int


class CollectorWorker:
    """A TokenCollector over shard ``index`` of the prompt stream, in a Ray actor.

    Collection (and everything touching the collector's state) runs in the single-thread
    ``collect`` group; weight updates arrive on another thread (the default group) and are queued, as a
    trainer thread's update is for a :class:`TokenCollector` iterated elsewhere: the collector applies them at
    its next step boundary and, with partial rollouts (a wave source and a policy with an ``interrupt``), stops
    the wave in progress first; its rows go on under the new weights, every token keeps the version that
    produced it. Trajectory ids are made global: ``local * num_workers + index``.
    """

    def __init__(self, spec: WorkerSpec, index: int, seed: int, env_seed: int | None, weights, version: int,
                 state) -> None:  # fmt: skip
        torch.set_num_threads(spec.num_threads)
        self.index, self.num_workers, self.num_threads = index, spec.num_workers, spec.num_threads
        env = spec.env_fn()
        base = getattr(env, "base_env", env)
        base.source.shard(index, spec.num_workers)
        self.collector, self.error = None, None
        group_size = int(getattr(base.source, "group_size", 1))
        try:
            collect = spec.collect.for_env(slots=base.batch_size[0], group_size=group_size)
            collect = collect.worker_share(index, spec.num_workers, group_size=group_size)
        except ValueError as err:  # reported by info(): the driver raises it as it is
            self.error = err
            return
        policy = spec.policy_fn(env)
        if hasattr(policy, "set_seed"):
            policy.set_seed(seed)
        self.collector = TokenCollector(env, policy, mode=collect.mode, batch_size=collect.batch_size,
                                        total_steps=collect.total_steps, source=spec.source, options=collect.options)  # fmt: skip
        self.iterator = None
        self.lock = threading.Lock()  # an update is queued or applied, never half-way into a batch start
        if env_seed is not None:
            base.set_seed(env_seed)
        if weights is not None:  # a restarted worker: the newest weights, then its checkpoint
            self.collector.update_policy_weights_(unpack_weights(weights))
        if state is not None:
            self.collector.load_state_dict(unpack_state(state))
        self._catch_up(version)
        self.last_state = self.collector.state_dict()

    def _catch_up(self, version: int) -> None:
        """Bring the policy to ``version``: the model already holds the newest weights, so each missed
        update only drops what was computed under older ones (cache, in-flight work per ``in_flight``)."""
        while self.collector.policy.version < version:
            self.collector.update_policy_weights_(None)

    def next_batch(self):
        """``((batch, report), state after it)``, the batch ``None`` once this worker's budget or shard ends.

        The :meth:`report` (steps, counters) comes with every batch. A failing batch (a reward function raising,
        say) rolls the worker back to the state after its last batch and raises with the worker's index in the
        message. A :class:`PromptError` does not: the collector has recorded what it collected and moved past the
        prompt (a rollback would draw it again, and fail again), so the next call goes on from there; nor does a
        :class:`DynamicSamplingError` (the groups drawn are judged and the kept ones queued: a rollback would draw
        the same groups again).
        """
        try:
            with self.lock:
                if self.iterator is None:
                    self.iterator = iter(self.collector)
            batch = next(self.iterator, None)
        except (PromptError, DynamicSamplingError) as err:
            _with_worker(err, self.index, self.num_workers)
            raise
        except Exception as err:
            self.iterator = None
            version = self.collector.policy.version
            self.collector.load_state_dict(self.last_state)
            self._catch_up(version)
            _with_worker(err, self.index, self.num_workers)
            raise
        if batch is None:
            return (None, self.report()), PackedState(self.last_state)
        self.last_state = self.collector.state_dict()
        return (self._globalize(batch).consolidate(), self.report()), PackedState(self.last_state)

    def report(self) -> dict:
        """The collector's env steps and counters, which the driver adds up over the workers."""
        return {"steps": self.collector.steps_done, "counts": self.collector.counts()}

    def _globalize(self, batch: TensorDictBase) -> TensorDictBase:
        n, i = self.num_workers, self.index
        traj = batch.get(keys.TRAJ_ID)
        batch.set(keys.TRAJ_ID, traj * n + i)
        for key in (keys.BRANCH_ID, keys.PARENT_ID):  # trees: the ids of a leaf's ancestors, mapped the same way
            ids = batch.get(key, None)
            if ids is not None:
                batch.set(key, torch.where(ids >= 0, ids * n + i, ids))
        table = batch.get_non_tensor(keys.PROMPTS)
        out = table.subset(table.group_ids())
        for t in table.traj_ids():
            out.add_sequence(t * n + i, table.sequence(t))
        for t in table.own_prompt_trajs():
            out.add_trajectory_prompt(t * n + i, table.trajectory_prompt(t))
        for t in table.image_trajs():
            out.add_trajectory_images(t * n + i, table.trajectory_images(t, -1))
        batch.set_non_tensor(keys.PROMPTS, out)
        return batch

    def update_policy_weights_(self, weights, version: int) -> int:
        """Queue new weights (applied at the collector's next step boundary; a wave in progress is interrupted when
        the collector has partial rollouts on); returns the version they give. Runs while ``next_batch`` runs: the
        collector's iterating thread is the ``collect`` group's, this call another."""
        with self.lock:
            expected = self.collector.update_policy_weights_(None if weights is None else unpack_weights(weights))
        if expected != version:
            raise RuntimeError(f"worker {self.index} would be at policy version {expected} after this update, "
                               f"the driver at {version}")  # fmt: skip
        return expected

    def state_dict(self) -> PackedState:
        return PackedState(self.last_state)

    def load_state_dict(self, state, version: int) -> None:
        self.iterator = None
        self.collector.load_state_dict(unpack_state(state))
        self._catch_up(version)
        self.last_state = self.collector.state_dict()

    def set_seed(self, env_seed: int, seed: int) -> None:
        self.collector.base_env.set_seed(env_seed)
        if hasattr(self.collector.policy, "set_seed"):
            self.collector.policy.set_seed(seed)

    def info(self) -> dict:
        if self.error is not None:
            return {"pid": os.getpid(), "error": self.error, "index": self.index}
        return {"pid": os.getpid(), "version": int(self.collector.policy.version), "index": self.index,
                "report": self.report()}  # fmt: skip

    def shutdown(self) -> None:
        if self.collector is not None:
            self.collector.shutdown()


def _with_worker(err: Exception, index: int, num_workers: int) -> None:
    """Prefix the exception's message with the worker (ids in it are the worker's own); its type and attributes
    (a ``PromptError``'s ``slots``) are kept: it is the same exception."""
    note = (f"RayTokenCollector worker {index}: {err} (trajectory ids in this message are the worker's; "
            f"in its batches they become id * {num_workers} + {index})")  # fmt: skip
    err.args = (note, *err.args[1:])
