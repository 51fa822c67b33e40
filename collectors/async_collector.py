"""AsyncCollector: collection keeps running while the trainer trains, with a bound on policy staleness."""

from __future__ import annotations

import collections
import threading
import time
import warnings

import torch
from tensordict import TensorDictBase

from tokengym.collectors.core import CollectMode, CollectorBase
from tokengym.collectors.policies.protocol import weights_of
from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import TokenGymWarning

__all__ = ["AsyncCollector"]

STALE_TOKENS = ("drop", "mask")  # AsyncCollector(stale_tokens=...)
_OWN_COPY_FIX = ("give the policy its own copy of the model, TransformersPolicy(copy.deepcopy(model), env), and publish "
                 "the trained model's weights after each step: collector.update_policy_weights_(model.state_dict()) "
                 "(in train(): weights=model.state_dict)")  # fmt: skip
_SHORT_BATCH = (
    "AsyncCollector(stale_tokens='drop') kept {kept} of a batch's {asked} trajectories: {groups} group(s) "
    "({tokens} tokens) held tokens sampled more than max_staleness={k} updates ago (trajectories in flight across "
    "weight updates) and were dropped whole, so batches come out smaller than asked whenever the trainer publishes "
    "while trajectories are in flight. To keep batches full, use stale_tokens='mask' (stale tokens stay in the batch "
    "with loss weight 0: train with WeightedLoss(loss)) or a larger max_staleness; metrics['dropped_tokens'] counts "
    "what is dropped. Shown once per collector."
)


class AsyncCollector(CollectorBase):
    """Runs ``collector`` in a background thread so that generation overlaps training.

    The trainer loop is unchanged: take a batch, train, publish the new weights with
    :meth:`update_policy_weights_`. The weights reach the collector at its next env-step boundary
    (a :class:`TokenCollector` in this process, or every worker of a :class:`RayTokenCollector`); with a
    wave source and partial rollouts (``CollectorOptions.partial_rollouts``) the wave in progress stops
    there, its tokens kept with their versions. Trajectories in flight then continue or restart, per the
    collector's ``in_flight`` option.

    Staleness: the version of a token is the policy version it was sampled under; ``current`` is the
    number of updates published. No token a yielded batch trains on is older than ``current - max_staleness``:
    with ``stale_tokens="drop"`` the batch holds no older token; with ``"mask"`` older tokens stay in the batch
    with loss weight 0 (and may be any number of updates old: how many depends on how often the trainer publishes
    while a trajectory is in flight). Two rules keep it so:

    1. **Wait.** Batch ``j`` (counting from 0) is started only once the trainer has asked for batch
       ``j - max_staleness``, so the collector runs at most ``max_staleness`` batches ahead. A trainer
       that publishes once per batch then never sees a token generated more than ``max_staleness``
       updates ago, except in trajectories still in flight across an update (``in_flight="continue"``);
       ``max_staleness=0`` is synchronous collection.
    2. **Drop or mask.** Work that is older anyway is taken out of training when the batch is handed out.
       With ``stale_tokens="drop"`` (default): a whole trajectory (``TRAJECTORIES``; with its whole group, so
       batches keep holding whole groups) that was in flight across more updates, or, in ``STEPS`` mode, the
       stale steps (masked out). It is counted in ``metrics["dropped_tokens"]`` (with the tokens the collector
       itself dropped under ``in_flight="drop"``), so a ``TRAJECTORIES`` batch may hold fewer trajectories
       than asked for whenever trajectories were in flight across more than ``max_staleness`` updates: with
       ``max_staleness=1``, batches of 8 came out as 6 in two of three runs publishing once per batch after a 0.1 s
       step, and as 4 (or 2) publishing three times per batch (the backends guide has the table). A
       :class:`~tokengym.errors.TokenGymWarning` says so once, the first time a batch comes out short. With ``stale_tokens="mask"`` nothing is dropped: each
       token older than the bound gets ``keys.LOSS_WEIGHT`` 0 (multiplying a weight already there), so
       :class:`~tokengym.transforms.WeightedLoss` leaves it out of the gradient while its trajectory, its reward
       and its group stay in the batch (AReaL's ``max_token_version_gap``, slime's off-policy mask in partial
       rollouts); counted in ``metrics["masked_stale_tokens"]``. Train such batches with ``WeightedLoss(loss)``
       (:func:`~tokengym.training.train` refuses a plain loss on a batch that carries loss weights).
       ``in_flight="drop"`` restarts in-flight trajectories at every update, so nothing reaches the hand-out
       stale.

    ``metrics`` adds ``staleness_mean`` / ``staleness_max`` (every token yielded, against ``current``: with
    ``"mask"``, the tokens of weight 0 too), ``staleness_max_weighted`` (the tokens with a nonzero loss weight,
    those that train: at most ``max_staleness`` in both modes), ``dropped_tokens`` and ``masked_stale_tokens``
    (cumulative), ``version_spanning_fraction`` (the batch's trajectories whose tokens come from more than one
    version), ``collector_wait_s`` (the collector idle at the bound) and ``trainer_wait_s`` (the trainer waiting
    for the batch) to the collector's metrics.

    A batch that raises in the collector (a ``PromptError``, a reward function) raises from the trainer's
    ``next()`` in its place; collection goes on and the next ``next()`` gives the next batch. The wrapped
    collector postprocesses, measures and delivers its own batches; this one reads only its public surface
    (:class:`~tokengym.collectors.core.CollectorBase`).

    Args:
        collector: a :class:`TokenCollector` (its policy must hold its own copy of the model: training
            must not write into weights that are generating; :meth:`update_policy_weights_` refuses the policy's
            own tensors) or a :class:`RayTokenCollector`.
        max_staleness: the bound ``k >= 0``.
        stale_tokens: ``"drop"`` (whole trajectories and their groups; stale steps in ``STEPS`` mode) or
            ``"mask"`` (a loss weight of 0 on each token older than the bound; nothing dropped).

    Example:
        >>> import copy
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.collectors import TokenCollector
        >>> from tokengym.collectors.policies import TransformersPolicy
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> env = TokenEnv(["1+1=", "2+3="], tok, batch_size=2, max_new_tokens=4, model_config=model.config)
        >>> policy = TransformersPolicy(copy.deepcopy(model), env)  # the collector's own copy
        >>> inner = TokenCollector(env, policy, mode="trajectories", batch_size=2, total_steps=40)
        >>> with AsyncCollector(inner, max_staleness=1, stale_tokens="mask") as collector:  # train with WeightedLoss
        ...     for batch in collector:
        ...         version = collector.update_policy_weights_(model.state_dict())  # after a train step
        ...         assert batch.shape[0] == 2 and collector.metrics["staleness_max_weighted"] <= 1
        >>> version > 0
        True
    """

    needs_weights_because = "the collector's policy holds its own copy of the model"

    def __init__(self, collector: CollectorBase, *, max_staleness: int = 1, stale_tokens: str = "drop") -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0 (0: synchronous), got {max_staleness!r}")
        if stale_tokens not in STALE_TOKENS:
            raise ValueError(f"stale_tokens must be one of {STALE_TOKENS} (drop whole trajectories, or give stale "
                             f"tokens loss weight 0), got {stale_tokens!r}")  # fmt: skip
        self.stale_tokens = stale_tokens
        if not isinstance(collector, CollectorBase) or isinstance(collector, AsyncCollector):
            raise TypeError(f"collector must be a TokenCollector or a RayTokenCollector, got {type(collector).__name__}")
        super().__init__(collector.spec)  # no postproc, sink or logger: the collector has its own
        self.collector, self.max_staleness = collector, max_staleness
        self.version = collector.version
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (batch, collector metrics) collected ahead
        self._requested = self._started = 0
        self._thread: threading.Thread | None = None
        self._is_done = self._is_stopping = self._is_paused = self._is_busy = False
        self._error: BaseException | None = None
        self._inner: dict = {}  # the collector's metrics of the batch being handed out
        self.counters = {"dropped_tokens": 0, "dropped_stale_groups": 0, "masked_stale_tokens": 0,
                         "collector_wait_s": 0.0, "trainer_wait_s": 0.0}  # fmt: skip
        self._warned_short = False  # the TokenGymWarning of a TRAJECTORIES batch handed out short, once

    @property
    def steps_done(self) -> int:
        return self.collector.steps_done

    # -- the background thread --
    def _produce(self) -> None:
        # OpenMP's thread count is per thread: give this one the process's setting (a new thread would run
        # one OpenMP thread per core, many times slower for small models on busy cores)
        torch.set_num_threads(torch.get_num_threads())
        try:
            iterator = iter(self.collector)
            while True:
                with self._cond:
                    waited = time.perf_counter()
                    self._cond.wait_for(lambda: self._is_stopping or (
                        not self._is_paused and self._started < self._requested + self.max_staleness))
                    self.counters["collector_wait_s"] += time.perf_counter() - waited
                    if self._is_stopping:
                        return
                    self._started, self._is_busy = self._started + 1, True
                try:
                    batch = next(iterator, None)
                    item = None if batch is None else (batch, dict(self.collector.metrics))
                except Exception as err:  # one batch failed (a prompt, a reward function): the collector goes on
                    item = (None, err)  # queued in the batch's place: the trainer meets it where it happened
                with self._cond:
                    if item is None:
                        self._is_done = True
                    else:
                        self._queue.append(item)
                    self._is_busy = False
                    self._cond.notify_all()
                if item is None:
                    return
        except BaseException as err:  # surfaced to the trainer by the next next_batch()
            with self._cond:
                self._error, self._is_busy = err, False
                self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="tokengym-async-collector", daemon=True)
            self._thread.start()

    # -- the trainer side --
    def collect_batch(self) -> TensorDictBase | None:
        """The next batch collected ahead (staleness-checked against the current version); ``None`` when
        collection ends. Raises what the collector raised for this batch. A batch left with no step once its stale
        work is dropped is not handed out (its tokens are counted in ``dropped_tokens``): the next one is."""
        while True:
            batch = self._next_checked()
            if batch is None or bool(batch.get(keys.MASK).any()):
                return batch

    def _next_checked(self) -> TensorDictBase | None:
        self._start()
        start = time.perf_counter()
        with self._cond:
            self._requested += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._queue or self._is_done or self._error is not None)
            if not self._queue and self._error is not None:
                error, self._error = self._error, None
                raise error
            if not self._queue:
                return None
            batch, inner = self._queue.popleft()
        self.counters["trainer_wait_s"] += time.perf_counter() - start
        if batch is None:
            raise inner  # the collector failed this batch and went on: the next call gives the next one
        batch, dropped = self._drop_stale(batch)
        self.counters["dropped_tokens"] += dropped
        self._inner = inner
        return batch

    def commit_batch(self) -> None:
        """Nothing to drop: the batch left the queue when it was collected (its delivery has no step that can
        fail here: the wrapped collector postprocessed and delivered it)."""

    def counts(self) -> dict[str, int | float]:
        """Tokens dropped as stale (with the collector's own), groups dropped, and the waits on either side."""
        return dict(self.counters)

    def _drop_stale(self, batch: TensorDictBase) -> tuple[TensorDictBase, int]:
        """Remove what is older than ``version - max_staleness``; returns the batch and the tokens dropped."""
        mask = batch.get(keys.MASK)
        version = batch.get(keys.POLICY_VERSION)
        stale = mask & (version < self.version - self.max_staleness)
        n = int(stale.sum())
        if n == 0:
            return batch, 0
        if self.stale_tokens == "mask":  # keep everything; the loss leaves the stale tokens out
            keep = (~stale).to(torch.float32)
            old = batch.get(keys.LOSS_WEIGHT, None)
            batch.set(keys.LOSS_WEIGHT, keep if old is None else old.reshape(keep.shape) * keep)
            self.counters["masked_stale_tokens"] += n
            return batch, 0
        if batch.batch_dims == 1 or self.mode is CollectMode.TRAJECTORIES:  # whole trajectories go
            keep = ~stale.reshape(batch.shape[0], -1).any(-1)
            if self.options.is_whole_groups:
                group = batch.get(keys.GROUP_ID).reshape(batch.shape[0], -1)[:, 0]
                gone = group[~keep].unique()
                keep &= ~torch.isin(group, gone)  # with whole groups: a stale sample takes its group along
                self.counters["dropped_stale_groups"] += len(gone)
            dropped = int(mask.reshape(batch.shape[0], -1)[~keep].sum())
            if not self._warned_short and not bool(keep.all()):
                self._warned_short = True
                groups = int(batch.get(keys.GROUP_ID).reshape(batch.shape[0], -1)[~keep, 0].unique().numel())
                warnings.warn(_SHORT_BATCH.format(kept=int(keep.sum()), asked=batch.shape[0], groups=groups,
                                                  tokens=dropped, k=self.max_staleness),
                              TokenGymWarning, stacklevel=4)  # fmt: skip
            out = batch.exclude(keys.PROMPTS)[keep]
            out.set_non_tensor(keys.PROMPTS, batch.get_non_tensor(keys.PROMPTS))
            return out, dropped
        batch.set(keys.MASK, mask & ~stale)  # STEPS: a slot row holds several trajectories; mask the stale steps
        return batch, n

    def batch_metrics(self, batch: TensorDictBase | None, elapsed: float) -> dict[str, float]:
        """The collector's metrics of ``batch`` (as it measured them) with the staleness against the current version
        and this collector's counters; ``batch=None`` gives those before the first batch (the same keys)."""
        inner = self.collector.metrics if batch is None else self._inner
        mask = None if batch is None else batch.get(keys.MASK)
        lag = torch.zeros(0) if batch is None else (self.version - batch.get(keys.POLICY_VERSION)[mask]).float()
        weight = None if batch is None else batch.get(keys.LOSS_WEIGHT, None)
        trained = lag if weight is None else lag[weight.reshape(mask.shape)[mask] != 0]  # the tokens that train
        out = dict(inner)
        out.update(self.counts())
        out.update(policy_version=self.version, tokens=0 if mask is None else int(mask.sum()),
                   staleness_mean=float(lag.mean()) if lag.numel() else 0.0,
                   staleness_max=float(lag.max()) if lag.numel() else 0.0,
                   staleness_max_weighted=float(trained.max()) if trained.numel() else 0.0,
                   dropped_tokens=self.counters["dropped_tokens"] + int(inner.get("dropped_tokens", 0)),
                   version_spanning_fraction=_spanning_fraction(batch))  # fmt: skip
        return out

    def push_weights(self, weights) -> int:
        """Copy the weights now (training may go on at once) and hand them to the collector; collection goes on
        and switches at its next step boundary."""
        weights = weights_of(weights)
        _check_not_generating(weights, self.collector)
        copied = {name: value.detach().clone() for name, value in weights.items()}
        version = self.collector.update_policy_weights_(copied)
        with self._cond:
            self.version = version
        return version

    def describe(self) -> dict[str, object]:
        return {"max_staleness": self.max_staleness, "stale_tokens": self.stale_tokens, "version": self.version, "queued": len(self._queue),
                "collector": repr(self.collector)}  # fmt: skip

    # -- lifecycle and checkpoints --
    def shutdown(self) -> None:
        """Stop the background thread (after the batch in progress) and shut the collector down."""
        with self._cond:
            self._is_stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.collector.shutdown()

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the collector (before iterating); returns ``seed``."""
        self._check_not_started("set_seed")
        return self.collector.set_seed(seed, static_seed)

    def state_dict(self) -> dict:
        """The collector's state, the batches it collected ahead (handed out first on resume), the version and
        the counters. Collection pauses at the end of the batch in progress while the state is taken."""
        with self._cond:
            self._is_paused = True
            try:
                self._cond.wait_for(lambda: not self._is_busy)
                queued = [dict(b=b, metrics=m) for b, m in self._queue if b is not None]  # errors are not data
                return {"collector": self.collector.state_dict(), "queued": queued,
                        "version": self.version, "counters": dict(self.counters)}  # fmt: skip
            finally:
                self._is_paused = False
                self._cond.notify_all()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (before iterating)."""
        self._check_not_started("load_state_dict")
        self.collector.load_state_dict(state["collector"])
        self._queue = collections.deque((q["b"], q["metrics"]) for q in state["queued"])
        self._started, self._requested = len(self._queue), 0
        self.version = int(state["version"])
        self.counters.update(state["counters"])

    def _check_not_started(self, name: str) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{name} must come before iterating an AsyncCollector; build a new one")


def _generating_model(collector) -> torch.nn.Module | None:
    """The model the collector's policy generates with where its public surface shows it (``collector.policy.model``,
    through wrappers that hold a ``policy``); None elsewhere (Ray workers, a vLLM engine)."""
    policy = getattr(collector, "policy", None)
    for _ in range(4):
        model = getattr(policy, "model", None)
        if isinstance(model, torch.nn.Module):
            return model
        policy = getattr(policy, "policy", None)
    return None


def _storages(tensors) -> set[tuple[torch.device, int]]:
    """Where the tensors' data lives (device, storage address); a view shares its base's."""
    return {(t.device, t.untyped_storage().data_ptr()) for t in tensors if t.device.type != "meta" and t.numel()}


def _check_not_generating(weights: dict[str, torch.Tensor], collector) -> None:
    """Refuse weights that are the very tensors the policy generates with: the policy is built on the trained model,
    so training writes into weights that are sampling, under a version that names none of them."""
    model = _generating_model(collector)
    if model is None:
        return
    own = _storages(model.parameters())
    shared = [name for name, value in weights.items() if isinstance(value, torch.Tensor) and _storages([value]) & own]
    if shared:
        raise ValueError(
            f"AsyncCollector.update_policy_weights_ got weights that are the tensors its policy's "
            f"{type(model).__name__} generates with ({len(shared)} of {len(weights)}, e.g. {shared[0]!r}): the policy "
            "is built on the trained model, so each optimizer step writes into weights that are sampling in the "
            "background and the tokens' log-probs match no published version. Instead "
            + _OWN_COPY_FIX
        )


def _spanning_fraction(batch: TensorDictBase | None) -> float:
    """The fraction of the batch's trajectories whose tokens come from more than one policy version."""
    if batch is None or batch.numel() == 0:
        return 0.0
    mask, version, traj = batch.get(keys.MASK).reshape(-1), batch.get(keys.POLICY_VERSION).reshape(-1), batch.get(keys.TRAJ_ID).reshape(-1)
    traj, version = traj[mask], version[mask]
    if traj.numel() == 0:
        return 0.0
    ids, index = traj.unique(return_inverse=True)
    low = torch.full((len(ids),), torch.iinfo(torch.int64).max).scatter_reduce(0, index, version, "amin")
    high = torch.full((len(ids),), torch.iinfo(torch.int64).min).scatter_reduce(0, index, version, "amax")
    return float((low < high).float().mean())
