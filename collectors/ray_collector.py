"""RayTokenCollector: N Ray actors, each an ordinary TokenCollector on its own shard of the prompts."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch
from tensordict import TensorDictBase

from tokengym.collectors._metrics import sum_counts
from tokengym.collectors._ray_worker import (
    CollectorWorker,
    PackedState,
    WorkerSpec,
    pack_weights,
    unpack_state,
    worker_seeds,
)
from tokengym.collectors.core import CollectMode, CollectorBase, CollectorOptions, CollectSpec
from tokengym.llm_envs import PromptTable, keys

__all__ = ["RayConfig", "RayTokenCollector", "cat_batches", "worker_seeds"]

_COLLECT = {"concurrency_group": "collect"}


def _ray():
    try:
        import ray
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("RayTokenCollector needs Ray: pip install 'tokengym[ray]'") from err
    return ray


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """Where the workers run and how they recover."""

    address: str | None = None
    """A Ray cluster to join (``"auto"``, ``"ray://host:10001"``); ``None`` starts a local Ray in this
    process (``ray.init``), shut down with the collector. A Ray already initialized in this process (the
    usual ``ray.init(address=...)`` of the driver) is reused whatever the address, and left running."""
    num_cpus: int | None = None
    """CPUs of the embedded local Ray; default ``num_workers * cpus_per_worker``."""
    cpus_per_worker: int = 1
    """Ray CPUs reserved per worker actor; also its torch threads."""
    max_restarts: int = 3
    """Restarts per worker after it dies (``ray.kill``, a crash, a lost node); one more death raises."""
    actor_options: dict = dataclasses.field(default_factory=dict)
    """Extra ``.options(...)`` of every worker actor (``num_gpus``, ``resources``, ``runtime_env``)."""
    init_options: dict = dataclasses.field(default_factory=dict)
    """Extra ``ray.init(...)`` arguments when this collector starts or joins Ray (``log_to_driver=True`` to
    see the workers' output, ``object_store_memory``, ``runtime_env``)."""


class RayTokenCollector(CollectorBase):
    """Collects with ``num_workers`` Ray actors, each a :class:`TokenCollector` built on the worker.

    Every worker builds its env with ``env_fn()`` (all alike: the same prompts in the same order) and
    takes shard ``i`` of the prompt stream (:meth:`PromptSource.shard`): each group (all samples of a
    prompt) is produced by exactly one worker and keeps the group id of the unsharded stream.
    Trajectory ids are made global (``local * num_workers + i``). Each worker's sampling seed is
    derived from ``seed``. Iterating yields batches like a ``TokenCollector`` whose env has the
    workers' slots side by side: ``STEPS`` batches are ``(num_workers * B, T)`` (TorchRL's
    ``frames_per_batch`` = ``num_workers * B * T``); a ``TRAJECTORIES`` batch holds ``batch_size``
    trajectories of whole groups, the groups split over the workers (at least one group each).
    Batches are consolidated before they cross Ray.

    Weights published while the workers collect reach each of them at once (the actor takes the update on
    another thread than the batch's) and are applied at the worker's next step boundary; with a wave source
    and partial rollouts (``CollectorOptions.partial_rollouts``, on by default) every worker's wave in
    progress stops there and its rows go on under the new weights, each token stamped with the version that
    produced it (``interrupted_sequences`` counts them, over the workers).

    A worker that dies is restarted from the state after its last delivered batch (with the newest
    weights), so no trajectory is lost or duplicated. A worker whose batch raises (a reward function,
    say) is rolled back to that state (after a ``PromptError`` it goes on past the prompt instead); the
    error names the worker, and the other workers' results of the round are kept for the next call,
    which the same iterator answers.

    Validation, delivery (postproc, metrics, sink) and TorchRL's conventions are the collector core's
    (:class:`~tokengym.collectors.core.CollectorBase`), as for a ``TokenCollector``; the metrics have a
    ``TokenCollector``'s keys (the workers' counters added up) and ``workers`` (in the last batch) and
    ``restarts``.

    Args:
        env_fn: picklable ``() -> TokenEnv`` (or a ``TransformedEnv`` of one), called on each worker.
        policy_fn: picklable ``(env) -> policy`` (a :class:`~tokengym.collectors.policies.TokenPolicy`).
        num_workers: Ray actors.
        mode/batch_size/total_steps: as for :class:`TokenCollector`; ``total_steps`` counts each
            worker's env steps. ``frames_per_batch`` / ``total_frames`` count TorchRL frames (one env
            step of one slot) over all workers.
        seed: collector seed; worker ``i`` samples with ``worker_seeds(seed, num_workers)[i]``.
        postproc: applied on the driver to every combined batch (a KL transform, say).
        sink: a ``ReplayBuffer`` (``extend``) or a queue (``put``) on the driver; iteration yields ``None``.
        source/options: passed to every worker's ``TokenCollector``.
        ray_config: a :class:`RayConfig`.

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.collectors.policies import TransformersPolicy
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> def env_fn():
        ...     return TokenEnv(["1+1=", "2+3=", "3+4="], tiny_tokenizer(), batch_size=2, max_new_tokens=3,
        ...                     max_length=16, group_size=2)
        >>> def policy_fn(env):
        ...     return TransformersPolicy(tiny_model(env.tokenizer), env)
        >>> with RayTokenCollector(env_fn, policy_fn, num_workers=2, mode="trajectories", batch_size=4,
        ...                        total_steps=6) as collector:
        ...     batch = next(iter(collector))
        >>> batch.shape[0], collector.metrics["workers"]
        (4, 2)
    """

    needs_weights_because = "the workers hold their own copies of the model"

    def __init__(self, env_fn: Callable, policy_fn: Callable, *, num_workers: int = 2,
                 mode: CollectMode | str = CollectMode.STEPS, batch_size: int | None = None, total_steps: int = -1,
                 seed: int = 0, postproc: Callable | None = None, sink=None, source=None,
                 options: CollectorOptions | None = None, ray_config: RayConfig | None = None,
                 frames_per_batch: int | None = None, total_frames: int | None = None) -> None:  # fmt: skip
        _check_args(env_fn, policy_fn, num_workers, seed, ray_config)
        spec = CollectSpec.from_args(mode, batch_size=batch_size, total_steps=total_steps, options=options,
                                     frames_per_batch=frames_per_batch, total_frames=total_frames)  # fmt: skip
        super().__init__(spec, postproc=postproc, sink=sink)
        self.num_workers, self.seed = num_workers, seed
        self.config = ray_config or RayConfig()
        self._worker_spec = WorkerSpec(env_fn, policy_fn, spec.per_worker(num_workers), source, num_workers,
                                       self.config.cpus_per_worker)  # fmt: skip
        self._lock = threading.RLock()
        self._is_ray_owner, self._actor_cls = False, None
        self.restarts = [0] * num_workers
        self.version, self.weight_updates, self._weights_ref, self._env_seed = 0, 0, None, None
        self._start_ray()
        self.workers: list = []
        try:
            self.workers = [self._new_worker(i, None) for i in range(num_workers)]
            infos = _ray().get([w.info.remote() for w in self.workers])
            for info in infos:
                if info.get("error") is not None:
                    raise info["error"]  # a configuration error, the same on every worker
            self.version = int(infos[0]["version"])
        except Exception:
            self.shutdown()
            raise
        self._reports = [info["report"] for info in infos]  # each worker's steps and counters, as last sent
        self._round_workers = 0  # workers in the last batch
        self._committed = [w.state_dict.options(**_COLLECT).remote() for w in self.workers]
        self._latest = list(self._committed)  # state after the last batch received (restart point)
        self._pending: dict[int, tuple] = {}  # worker -> (result ref, state ref) in flight
        self._held: dict[int, tuple] = {}  # worker -> (batch, state ref) of this round, until delivered
        self._finished: set[int] = set()

    # -- Ray lifecycle --
    def _start_ray(self) -> None:
        ray = _ray()
        if ray.is_initialized():
            return  # the user's Ray (a local one, or the cluster they joined with ray.init(address=...)): theirs
        num_cpus = None
        if self.config.address is None:
            num_cpus = self.config.num_cpus or self.num_workers * self.config.cpus_per_worker
        options = {"address": self.config.address, "num_cpus": num_cpus, "include_dashboard": False,
                   "log_to_driver": False, "configure_logging": False, **self.config.init_options}  # fmt: skip
        ray.init(**options)
        self._is_ray_owner = True

    def _new_worker(self, i: int, state_ref):
        ray = _ray()
        if self._actor_cls is None:
            self._actor_cls = ray.remote(concurrency_groups={"collect": 1})(CollectorWorker)
        options = {"num_cpus": self.config.cpus_per_worker, "max_restarts": 0, **self.config.actor_options}
        seed = worker_seeds(self.seed, self.num_workers)[i]
        return self._actor_cls.options(**options).remote(self._worker_spec, i, seed, self._env_seed, self._weights_ref,
                                                         self.version, state_ref)  # fmt: skip

    def describe(self) -> dict[str, object]:
        return {"num_workers": self.num_workers, "mode": repr(self.mode.value), "batch_size": self.batch_size,
                "seed": self.seed, "address": repr(self.config.address), "version": self.version,
                "restarts": sum(self.restarts)}  # fmt: skip

    def shutdown(self) -> None:
        """Stop the workers; shut down the embedded Ray (or leave the cluster) if this collector started it."""
        ray = _ray()
        for w in getattr(self, "workers", []):
            try:
                ray.get(w.shutdown.options(**_COLLECT).remote(), timeout=10)
            except Exception:  # a dead or stuck worker is killed below
                pass
            ray.kill(w)
        self.workers = []
        self._pending, self._held = {}, {}
        if self._is_ray_owner and ray.is_initialized():
            ray.shutdown()
        self._is_ray_owner = False

    # -- collecting --
    def collect_batch(self) -> TensorDictBase | None:
        """One round: a batch from every worker still collecting, combined; ``None`` when all are done. The
        workers' parts are held (and their states not committed) until the batch is delivered; an error of one
        worker ends the call, and the next one goes on with the other workers' results of the round."""
        if not self.workers:
            raise RuntimeError("this RayTokenCollector was shut down; build a new one")
        while True:
            for i in range(self.num_workers):
                if i not in self._finished and i not in self._held and i not in self._pending:
                    self._submit(i)
            if not self._pending:
                break
            self._receive_one()
        self._round_workers = len(self._held)
        if not self._held:
            return None
        return cat_batches([self._held[i][0] for i in sorted(self._held)])

    def commit_batch(self) -> None:
        """The round was delivered: a restarted worker resumes after it, and so does a checkpoint."""
        for i, (_, state_ref) in self._held.items():
            self._committed[i] = state_ref
        self._held = {}

    def _submit(self, i: int) -> None:
        result, state = self.workers[i].next_batch.options(num_returns=2, **_COLLECT).remote()
        self._pending[i] = (result, state)

    def _receive_one(self) -> None:
        ray = _ray()
        by_ref = {refs[0]: i for i, refs in self._pending.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=1)
        i = by_ref[ready[0]]
        result_ref, state_ref = self._pending.pop(i)
        try:
            result = ray.get(result_ref)
        except ray.exceptions.RayActorError as err:
            self._restart(i, err)
            return
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(err.cause, Exception) else err
            _consume(state_ref)  # the same error: read, or Ray prints it as unhandled when the ref goes
            self._reports[i] = ray.get(self.workers[i].info.remote())["report"]  # its counts of the failure
            raise cause from err  # the worker already rolled back; the other workers' results stay held
        batch, self._reports[i] = result
        self._latest[i] = state_ref
        if batch is None:  # this worker is done: nothing to deliver
            self._finished.add(i)
            self._committed[i] = state_ref
        else:
            self._held[i] = (batch, state_ref)

    def _restart(self, i: int, err: Exception) -> None:
        """Replace dead worker ``i`` with a new actor resuming from the state after its last batch."""
        ray = _ray()
        with self._lock:
            self.restarts[i] += 1
            if self.restarts[i] > self.config.max_restarts:
                raise RuntimeError(f"RayTokenCollector worker {i} died {self.restarts[i]} times "
                                   f"(max_restarts={self.config.max_restarts}); last: {err}") from err  # fmt: skip
            try:
                ray.kill(self.workers[i])
            except Exception:  # already gone
                pass
            self.workers[i] = self._new_worker(i, self._latest[i])

    @property
    def steps_done(self) -> int:
        """Env steps of all workers (each of ``B`` tokens, a worker's slots)."""
        return sum(int(r["steps"]) for r in self._reports)

    def counts(self) -> dict[str, int]:
        """The workers' counters added up, with the workers of the last batch, restarts and weight updates."""
        return {**sum_counts(r["counts"] for r in self._reports), "workers": self._round_workers,
                "restarts": sum(self.restarts), "weight_updates": self.weight_updates}  # fmt: skip

    # -- weights --
    def push_weights(self, weights) -> int:
        """Put the weights into the object store once; every worker loads them (at its next step boundary when it
        is collecting, its wave in progress interrupted with partial rollouts) and the version bumps everywhere.
        Returns once every worker has queued them."""
        ray = _ray()
        ref = ray.put(pack_weights(weights))
        with self._lock:
            self.version += 1
            self.weight_updates += 1
            self._weights_ref, version = ref, self.version
            calls = [w.update_policy_weights_.remote(ref, version) for w in self.workers]
        for call in calls:
            try:
                ray.get(call)
            except ray.exceptions.RayActorError:  # dead: its restart loads the newest weights
                pass
        return version

    # -- TorchRL collector conventions --
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the prompt order (the same on every worker) and each worker's sampling (derived); call it
        before collecting. Returns ``seed``."""
        ray = _ray()
        self.seed, self._env_seed = seed, seed
        seeds = worker_seeds(seed, self.num_workers)
        ray.get([w.set_seed.options(**_COLLECT).remote(seed, s) for w, s in zip(self.workers, seeds, strict=True)])
        self._committed = [w.state_dict.options(**_COLLECT).remote() for w in self.workers]
        self._latest = list(self._committed)
        return seed

    def state_dict(self) -> dict:
        """Every worker's state after the last batch yielded, the policy version and which workers are done.
        Plain data like a ``TokenCollector``'s state (``torch.load(..., weights_only=True)`` reads it back);
        the weights are the trainer's to save."""
        ray = _ray()
        return {"workers": [unpack_state(s) for s in ray.get(list(self._committed))], "version": self.version,
                "finished": sorted(self._finished), "num_workers": self.num_workers, "seed": self.seed,
                "env_seed": self._env_seed, "weight_updates": self.weight_updates}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`: the rounds that follow are those the saved run would have yielded."""
        ray = _ray()
        if state["num_workers"] != self.num_workers:
            raise ValueError(f"this checkpoint has {state['num_workers']} workers, this collector {self.num_workers}; "
                             "the prompt shards differ, build the collector with the same num_workers")  # fmt: skip
        self._pending, self._held, self.undelivered = {}, {}, None  # dropped: the workers replay them
        self.version, self.seed, self._env_seed = int(state["version"]), state["seed"], state["env_seed"]
        self.weight_updates = int(state.get("weight_updates", self.version))
        self._finished = set(state["finished"])
        ray.get([w.load_state_dict.options(**_COLLECT).remote(s, self.version)
                 for w, s in zip(self.workers, state["workers"], strict=True)])  # fmt: skip
        self._committed = [ray.put(PackedState(s)) for s in state["workers"]]
        self._latest = list(self._committed)
        self._reports = [info["report"] for info in ray.get([w.info.remote() for w in self.workers])]

    def worker_pids(self) -> list[int]:
        """Process ids of the worker actors."""
        ray = _ray()
        return [int(info["pid"]) for info in ray.get([w.info.remote() for w in self.workers])]


def cat_batches(batches: list[TensorDictBase]) -> TensorDictBase:
    """Stack batches along the first dim (slots or trajectories), right-padding time to the widest.

    Padding is zeros (``keys.MASK`` False); the prompt tables are merged.

    Example:
        >>> from tokengym.testing import make_trajectory_batch
        >>> out = cat_batches([make_trajectory_batch([2, 1]), make_trajectory_batch([3], seed=1)])
        >>> out.shape, out["collector", "mask"].sum(1).tolist()
        (torch.Size([3, 3]), [2, 1, 3])
    """
    from tensordict import pad

    if len(batches) == 1:
        return batches[0]
    tables = [b.get_non_tensor(keys.PROMPTS) for b in batches]
    plain = [b.exclude(keys.PROMPTS) for b in batches]
    if plain[0].batch_dims == 2:
        width = max(b.shape[1] for b in plain)
        plain = [b if b.shape[1] == width else pad(b, [0, 0, 0, width - b.shape[1]]) for b in plain]
    out = torch.cat(plain, 0)
    table = PromptTable()
    for t in tables:
        table.merge(t)
    out.set_non_tensor(keys.PROMPTS, table)
    return out


def _consume(ref) -> None:
    """Read a result that holds the task's error (already raised from its other result)."""
    ray = _ray()
    try:
        ray.get(ref)
    except ray.exceptions.RayTaskError:
        pass


def _check_args(env_fn, policy_fn, num_workers, seed, ray_config) -> None:
    """What only a RayTokenCollector takes; the rest is checked by the collector core."""
    for name, fn in (("env_fn", env_fn), ("policy_fn", policy_fn)):
        if not callable(fn):
            raise TypeError(f"{name} must be a picklable callable building the {name[:-3]} on a worker, got {fn!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers <= 0:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if ray_config is not None and not isinstance(ray_config, RayConfig):
        raise TypeError(f"ray_config must be a RayConfig, got {type(ray_config).__name__}")
