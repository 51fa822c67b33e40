"""TokenCollector: drives a policy through a TokenEnv and yields fixed-step batches or finished trajectories."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from enum import StrEnum

import torch
from tensordict import TensorDictBase

from tokengym.collectors._checkpoint import collector_state, load_collector_state
from tokengym.collectors._metrics import collector_metrics
from tokengym.collectors.policies.protocol import as_token_policy, check_policy_env
from tokengym.collectors.recorders import Step, StepRecorder, TrajectoryRecorder
from tokengym.collectors.sinks import write_to_sink
from tokengym.collectors.sources import SourceKind, make_source
from tokengym.llm_envs import PromptTable, TokenEnv, keys

__all__ = ["BatchIterator", "CollectMode", "InFlight", "TokenCollector"]


class CollectMode(StrEnum):
    """What one yielded batch holds.

    ``STEPS``: ``batch_size`` env steps of every slot, shape (B, T) (TorchRL's ``frames_per_batch``
    = B * T); a trajectory may span batches and keeps its id. ``TRAJECTORIES``: ``batch_size``
    finished trajectories of whole groups, shape (N, T), right-padded to ``max_new_tokens``
    (``keys.MASK`` marks real steps).
    """

    STEPS = "steps"
    TRAJECTORIES = "trajectories"


class InFlight(StrEnum):
    """What a weight update does to trajectories in flight. ``CONTINUE``: they go on under the new
    weights (the cache is re-prefilled; each token keeps the version it was sampled under).
    ``DROP``: they start over from their prompt under the new weights (TRAJECTORIES mode)."""

    CONTINUE = "continue"
    DROP = "drop"


class TokenCollector:
    """Collects token-level rollouts from ``env`` with ``policy``.

    A step source advances the env (``source="step"``: one token per slot per step; ``"wave"``: the
    policy generates every live slot's turn at once and the env unrolls it; both give the same
    steps), a recorder turns steps into batches (:class:`CollectMode`). TorchRL's names count frames
    as TorchRL does, a frame being one env step of one slot (one token position): ``frames_per_batch=40``
    with 4 slots gives (4, 10) ``STEPS`` batches, ``total_frames`` stops after that many slot steps.
    ``frames_per_batch`` does not apply to ``TRAJECTORIES`` batches (their size is a number of
    trajectories: ``batch_size``). ``metrics`` holds the last batch's metrics (rewards, lengths,
    staleness, tokens/s, counters); before the first batch it has the same keys, zeros and NaN where
    no value exists yet.

    Args:
        env: a :class:`~tokengym.llm_envs.TokenEnv` (or a ``TransformedEnv`` of one).
        policy: a :class:`~tokengym.collectors.TokenPolicy`, e.g. :class:`~tokengym.collectors.TransformersPolicy`.
        mode: a :class:`CollectMode` or its string.
        batch_size: env steps per batch (``STEPS``) or trajectories per batch (``TRAJECTORIES``; a
            multiple of the env's ``group_size``: a batch holds whole groups).
        total_steps: stop after this many env steps (each is ``B`` tokens); -1 runs until the
            prompt source is exhausted (forever for a repeating source).
        source: a :class:`~tokengym.collectors.sources.SourceKind` or its string; ``None`` steps
            when the policy can, else generates waves.
        postproc: a callable applied to every batch (e.g. a KL transform); if it has ``metrics()``,
            they join the batch metrics.
        sink: a TorchRL ``ReplayBuffer`` (``extend``) or a queue (``put``): batches go there and
            iteration yields ``None``.
        logger: a TorchRL logger (``torchrl.record.loggers``: CSV, TensorBoard, W&B...); every batch's
            metrics are logged at the collector's step count.
        options: a :class:`CollectorOptions` (rarely needed: last-step-only batches, fixed width,
            whole groups, in-flight policy on weight updates, progress bar).
        frames_per_batch: TorchRL's batch size in ``STEPS`` mode: ``B * batch_size`` (a multiple of ``B``).
        total_frames: TorchRL's budget: ``B * total_steps`` (rounded up to whole env steps).

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.collectors import TransformersPolicy
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> env = TokenEnv(["1+1=", "2+3="], tok, batch_size=2, max_new_tokens=4, model_config=model.config)
        >>> collector = TokenCollector(env, TransformersPolicy(model, env), mode="steps", batch_size=3, total_steps=6)
        >>> [tuple(batch.shape) for batch in collector]
        [(2, 3), (2, 3)]
    """

    def __init__(
        self,
        env,
        policy,
        *,
        mode: CollectMode | str = CollectMode.STEPS,
        batch_size: int | None = None,
        total_steps: int = -1,
        source: SourceKind | str | None = None,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        sink=None,
        logger=None,
        options: CollectorOptions | None = None,
        frames_per_batch: int | None = None,
        total_frames: int | None = None,
        **legacy,
    ) -> None:
        self.mode = _check_mode(mode)
        self.options = _options(options, legacy)
        base = getattr(env, "base_env", env)
        if not isinstance(base, TokenEnv):
            raise TypeError(f"env must be a TokenEnv or a TransformedEnv of one, got {type(base).__name__}")
        batch_size, total_steps = frames_to_steps(self.mode, base.batch_size[0], batch_size, total_steps,
                                                  frames_per_batch, total_frames)  # fmt: skip
        _check_args(self.mode, batch_size, total_steps, self.options, sink, postproc)
        self.group_size = int(getattr(base.source, "group_size", 1))
        if self.mode is CollectMode.TRAJECTORIES and self.options.is_whole_groups and batch_size % self.group_size:
            raise ValueError(f"batch_size={batch_size} trajectories is not a multiple of the env's group_size="
                             f"{self.group_size}: a TRAJECTORIES batch holds whole groups; pass batch_size="
                             f"{max(1, batch_size // self.group_size) * self.group_size}, or "
                             "options=CollectorOptions(is_whole_groups=False) to let groups span batches")  # fmt: skip
        policy = as_token_policy(policy)
        self.env, self.base_env, self.policy = env, base, policy
        self.batch_size, self.total_steps, self.postproc, self.sink = batch_size, total_steps, postproc, sink
        self.logger = logger
        self.source = make_source(source, env, policy)
        if self.mode is CollectMode.TRAJECTORIES and self.options.is_fixed_width and hasattr(self.source, "width"):
            self.source.width = base.max_new_tokens  # waves come as wide as the batches: no padding copy
        if self.source.kind == "step":  # a stepping policy reads its env's tokens: another env fails here
            check_policy_env(policy, env)
        self.steps_done, self.is_started = 0, False
        self.prompts = PromptTable(pad_token_id=base.tokenizer.pad_token_id)  # the layouts pad with it
        self.pending: dict | None = None  # steps of a wave that did not fit into the last batch
        self._lock = threading.Lock()
        self._queued_weights: list = []  # weight updates asked for while collecting (another thread)
        self._asked_version = policy.version  # the version the last update asked for will give
        self._collect_thread: int | None = None  # the thread iterating this collector
        self.num_threads = torch.get_num_threads()
        self.counters = {"dropped_tokens": 0, "weight_updates": 0, "failed_prompts": 0}
        self.recorder = self.new_recorder()
        self.metrics = self._metrics(None)  # every key from the start: a logger sees the same columns throughout

    def new_recorder(self) -> StepRecorder | TrajectoryRecorder:
        if self.mode is CollectMode.STEPS:
            return StepRecorder(self.batch_size)
        group_size = self.group_size if self.options.is_whole_groups else 1
        return TrajectoryRecorder(self.batch_size, self.base_env.max_new_tokens, group_size=group_size,
                                  is_fixed_width=self.options.is_fixed_width)  # fmt: skip

    def _drop_orphans(self) -> None:
        """Drop waiting groups that can no longer complete (a sample's prompt failed to load): no slot and
        no sample still to come from the prompt source holds them."""
        if not isinstance(self.recorder, TrajectoryRecorder) or not self.recorder.waiting:
            return
        live = {p.group_id for b in range(self.base_env.batch_size[0]) if (p := self.base_env.slot_prompt(b))}
        cursor = self.base_env.source.state_dict()
        if cursor.get("sample", self.group_size) < self.group_size:
            live.add(cursor["group"] - 1)  # the group being drawn still has samples to give
        self.recorder.drop_groups([g for g in self.recorder.waiting if g not in live])

    # -- collecting --
    def _remember_prompts(self, slots) -> None:
        for b in slots:
            prompt = self.base_env.slot_prompt(b)
            if prompt is not None:
                self.prompts.add(prompt.group_id, prompt.ids, text=prompt.text, metadata=prompt.metadata)

    def _advance(self) -> None:
        """Advance the source once and record what it produced."""
        if self._queued_weights:
            self._apply_queued_weights()
        chunk, refilled, error = self.source.advance()
        if refilled:
            self._remember_prompts(refilled)
        for traj, ids in self.base_env.pop_finished_sequences().items():
            self.prompts.add_sequence(traj, ids)
        if chunk:
            self.steps_done += 1 if isinstance(chunk, Step) else getattr(self.source, "last_steps", 0) or next(iter(chunk.values())).shape[1]
            self.pending = self.recorder.write(chunk)
        if error is not None:
            self.counters["failed_prompts"] += len(getattr(error, "slots", ()) or ())
        if self.counters["failed_prompts"]:
            self._drop_orphans()
        if error is not None:
            raise error  # recorded first: iterate again to go on with the next prompts

    def _has_budget(self) -> bool:
        return self.total_steps == -1 or self.steps_done < self.total_steps

    def _next_batch(self) -> TensorDictBase | None:
        """Step until a batch is full; ``None`` when the budget or the prompt source runs out."""
        if not self.is_started:
            slots, error = self.source.start()
            self._remember_prompts(slots)
            self.is_started = True
            if error is not None:
                self.counters["failed_prompts"] += len(getattr(error, "slots", ()) or ())
                raise error
        start, steps0 = time.perf_counter(), self.steps_done
        if self.pending is not None:
            self.pending = self.recorder.write(self.pending)
        while not self.recorder.is_full:
            if not self._has_budget() or self.base_env.is_exhausted:
                batch = self.recorder.flush()
                return None if batch is None else self._finish(batch, start, steps0)
            self._advance()
        return self._finish(self.recorder.pop(), start, steps0)

    def _finish(self, batch: TensorDictBase, start: float, steps0: int) -> TensorDictBase:
        self._add_prompts(batch)
        if self.options.is_last_step_only:
            last = batch.get(keys.MASK).sum(1) - 1
            batch = batch[torch.arange(batch.shape[0]), last]
        if self.postproc is not None:
            batch = self.postproc(batch)
        self.metrics = self._metrics(batch, time.perf_counter() - start)
        if self.logger is not None:
            for name, value in self.metrics.items():
                self.logger.log_scalar(name, float(value), step=self.steps_done)
        return batch

    def _metrics(self, batch: TensorDictBase | None, elapsed: float = 0.0) -> dict[str, float]:
        """The metrics of ``batch``; ``None`` gives those before the first batch (the same keys)."""
        counts = [self.counters, self.base_env.prompt_counts]  # prompt counts: over-long prompts skipped / truncated
        if isinstance(self.recorder, TrajectoryRecorder):
            counts += [self.recorder.counters, {"waiting_trajectories": self.recorder.num_waiting}]
        return collector_metrics(batch, elapsed, self.policy.version, self.steps_done, counts=tuple(counts),
                                 is_last_step_only=self.options.is_last_step_only, postproc=self.postproc)  # fmt: skip

    def _add_prompts(self, batch: TensorDictBase) -> None:
        mask, traj = batch.get(keys.MASK), batch.get(keys.TRAJ_ID)
        first = mask.clone()  # each trajectory's first step in each row: a few ids, not every step's
        first[:, 1:] &= traj[:, 1:] != traj[:, :-1]
        groups = batch.get(keys.GROUP_ID)[first].unique()
        trajs = traj[first].unique()
        batch.set_non_tensor(keys.PROMPTS, self.prompts.subset(groups, trajs))
        # keep only prompts still referenced by live slots or queued trajectories (bounded memory)
        live = [p.group_id for b in range(self.base_env.batch_size[0]) if (p := self.base_env.slot_prompt(b))]
        if isinstance(self.recorder, TrajectoryRecorder):
            live += self.recorder.queued_groups()
        self.prompts = self.prompts.subset(torch.tensor(live, dtype=torch.int64), self.recorder.queued_trajectories())

    # -- iteration --
    def __iter__(self) -> BatchIterator:
        self._collect_thread = threading.get_ident()  # claimed at iter(), before the first batch starts
        bar = self._progress_bar()
        return BatchIterator(self._next_in_thread, sink=self.sink, on_end=functools.partial(self._end, bar),
                             on_batch=None if bar is None else functools.partial(self._show_progress, bar))  # fmt: skip

    def _next_in_thread(self) -> TensorDictBase | None:
        # OpenMP's thread count is per thread: a collector iterated in another thread keeps its builder's
        torch.set_num_threads(self.num_threads)
        return self._next_batch()

    def _show_progress(self, bar) -> None:
        bar.update(self.metrics["tokens"])
        bar.set_postfix(reward=f"{self.metrics['mean_reward']:.3f}", tok_s=f"{self.metrics['tokens_per_s']:.0f}")

    def _end(self, bar) -> None:
        self._collect_thread = None
        if bar is not None:
            bar.close()

    def _progress_bar(self):
        if not self.options.use_progress_bar:
            return None
        import sys

        from tqdm.auto import tqdm

        total = None if self.total_steps == -1 else self.total_steps * self.base_env.batch_size[0]
        return tqdm(total=total, unit="tok", desc="collecting", file=sys.stderr, disable=not sys.stderr.isatty())

    # -- weights --
    def update_policy_weights_(self, policy_or_weights=None, *, weights=None) -> int:
        """Load new weights into the policy and bump its version (TorchRL's signature).

        ``weights`` (or the positional argument) is a state_dict or a TensorDict of weights; ``None``
        means the model was updated in place. Called from another thread while this collector
        iterates (asynchronous collection), the update is applied at the next step boundary;
        otherwise at once. Trajectories in flight continue or restart per ``options.in_flight``.
        Returns the version the policy has (or will have) after the update.
        """
        if weights is None and policy_or_weights is not None and not callable(policy_or_weights):
            weights = policy_or_weights
        with self._lock:
            self._queued_weights.append(weights)
            # counted from the last version asked for, not from the queue: an update being applied has left
            # the queue before the policy's version moves
            self._asked_version = max(self._asked_version, self.policy.version) + 1
            expected = self._asked_version
        if self._collect_thread is None or threading.get_ident() == self._collect_thread:
            self._apply_queued_weights()
        return expected

    def _apply_queued_weights(self) -> None:
        with self._lock:
            queued, self._queued_weights = self._queued_weights, []
        for weights in queued:
            self.policy.update_weights(weights)
            self.counters["weight_updates"] += 1
        if queued and self.options.in_flight is InFlight.DROP and self.is_started:
            self._drop_in_flight()

    def _drop_in_flight(self) -> None:
        resp = [(b, int(self.base_env.history(b).numel()) - int(p.ids.numel()))
                for b in range(self.base_env.batch_size[0]) if (p := self.base_env.slot_prompt(b)) is not None]  # fmt: skip
        slots = [b for b, n in resp if n > 0]
        if slots:
            self.counters["dropped_tokens"] += sum(n for _, n in resp if n > 0)
            self.source.restart(slots)

    def __repr__(self) -> str:
        source = getattr(self.source, "kind", None)
        return (f"{type(self).__name__}(mode={self.mode.value!r}, batch_size={self.batch_size}, "
                f"total_steps={self.total_steps}, source={getattr(source, 'value', type(self.source).__name__)!r}, "
                f"policy={type(self.policy).__name__}(version={self.policy.version}), env={self.env!r}, "
                f"steps_done={self.steps_done})")  # fmt: skip

    # -- TorchRL collector conventions --
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the prompt order (env) and the policy's sampling; returns the seed."""
        self.base_env.set_seed(seed, static_seed=static_seed)
        if hasattr(self.policy, "set_seed"):
            self.policy.set_seed(seed)
        return seed

    def shutdown(self) -> None:
        """Release the policy's resources (engines, caches)."""
        self.policy.close()

    def __enter__(self) -> TokenCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- checkpoints --
    def state_dict(self, *, include_cache: bool = True) -> dict:
        """Everything needed to resume between batches, as tensors, numbers, strings, lists and dicts
        (``torch.load(..., weights_only=True)`` reads it back). ``include_cache=False`` leaves the
        policy's KV cache out (re-prefilled on resume; log-probs may then differ in the last bits)."""
        return collector_state(self, include_cache=include_cache)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the next batch is the one the saved run would have yielded."""
        load_collector_state(self, state)


class BatchIterator:
    """The iterator of a collector: each ``next()`` is one call of ``next_batch``.

    Not a generator: a generator ends at its first exception, so a :class:`~tokengym.llm_envs.PromptError`
    (or a reward function's error) caught around ``next(it)`` would leave ``it`` exhausted. Here an exception
    ends that one call; the next ``next(it)`` goes on from what the collector had recorded. ``next_batch``
    returning ``None`` ends the iteration (budget or prompts exhausted). With a ``sink`` the batch is
    written there and ``next()`` gives ``None``.

    Args:
        next_batch: the collector's next batch, or ``None`` when it is done.
        sink: a ``ReplayBuffer`` (``extend``) or a queue (``put``), or ``None``.
        on_batch: called after each batch (a progress bar, say).
        on_end: called once when ``next_batch`` gives ``None``.

    Example:
        >>> batches = iter([1, 2])
        >>> it = BatchIterator(lambda: next(batches, None))
        >>> list(it), next(it, "done")
        ([1, 2], 'done')
    """

    def __init__(self, next_batch: Callable[[], TensorDictBase | None], *, sink=None,
                 on_batch: Callable[[], None] | None = None, on_end: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.next_batch, self.sink, self.on_batch, self.on_end = next_batch, sink, on_batch, on_end
        self.is_done = False

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> TensorDictBase | None:
        if self.is_done:
            raise StopIteration
        batch = self.next_batch()  # an exception ends this call only: the collector keeps what it recorded
        if batch is None:
            self.is_done = True
            if self.on_end is not None:
                self.on_end()
            raise StopIteration
        if self.on_batch is not None:
            self.on_batch()
        if self.sink is None:
            return batch
        write_to_sink(self.sink, batch)
        return None


class CollectorOptions:
    """Rarely needed collector options.

    Args:
        is_last_step_only: in ``TRAJECTORIES`` mode, keep only each trajectory's last step (N,).
        is_fixed_width: in ``TRAJECTORIES`` mode, pad every batch to ``max_new_tokens`` steps (the
            default), so batches stack in a TorchRL ``ReplayBuffer`` with ``LazyTensorStorage``;
            False trims each batch to its longest trajectory (use a ``ListStorage`` then).
        is_whole_groups: in ``TRAJECTORIES`` mode, a batch holds whole groups (all ``group_size``
            samples of a prompt; the default): finished samples wait for the rest of their group.
            False releases every trajectory as it finishes (groups may span batches).
        in_flight: an :class:`InFlight` (or its string): trajectories in flight at a weight update.
        use_progress_bar: a tqdm bar of collected tokens on stderr (only when stderr is a terminal).
    """

    def __init__(self, *, is_last_step_only: bool = False, is_fixed_width: bool = True, is_whole_groups: bool = True,
                 in_flight: InFlight | str = InFlight.CONTINUE, use_progress_bar: bool = False) -> None:  # fmt: skip
        self.is_last_step_only, self.is_fixed_width = is_last_step_only, is_fixed_width
        self.is_whole_groups = is_whole_groups
        try:
            self.in_flight = InFlight(in_flight)
        except ValueError:
            raise ValueError(f"in_flight must be one of {[m.value for m in InFlight]}, got {in_flight!r}") from None
        self.use_progress_bar = use_progress_bar


def _options(options: CollectorOptions | None, legacy: dict) -> CollectorOptions:
    known = {"is_last_step_only", "is_fixed_width", "is_whole_groups", "in_flight", "use_progress_bar"}
    unknown = set(legacy) - known
    if unknown:
        raise TypeError(f"TokenCollector got unexpected arguments {sorted(unknown)}; see its docstring")
    if options is not None and legacy:
        raise TypeError(f"pass {sorted(legacy)} inside options=CollectorOptions(...), not both")
    if options is not None and not isinstance(options, CollectorOptions):
        raise TypeError(f"options must be a CollectorOptions, got {type(options).__name__}")
    return options or CollectorOptions(**legacy)


def frames_to_steps(mode, slots: int, batch_size, total_steps, frames_per_batch, total_frames) -> tuple:
    """``(batch_size, total_steps)`` from tokengym's and TorchRL's names; a TorchRL frame is one env step of
    one slot, so ``frames_per_batch = slots * batch_size`` (``STEPS`` only) and ``total_frames = slots * total_steps``.

    Example:
        >>> frames_to_steps(CollectMode.STEPS, 4, None, -1, 40, 100)  # (4, 10) batches, 25 env steps
        (10, 25)
    """
    for name, value in (("frames_per_batch", frames_per_batch), ("total_frames", total_frames)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive int (TorchRL frames: env steps of one slot), got {value!r}")
    if frames_per_batch is not None:
        if mode is not CollectMode.STEPS:
            raise ValueError(f"frames_per_batch={frames_per_batch} counts TorchRL frames (tokens of one slot), which "
                             "size STEPS batches only; a TRAJECTORIES batch holds a number of trajectories: pass "
                             "batch_size=N (a multiple of group_size)")  # fmt: skip
        if frames_per_batch % slots:
            raise ValueError(f"frames_per_batch={frames_per_batch} is not a multiple of the env's {slots} slots: a "
                             f"STEPS batch (B, T) holds B * T frames; pass frames_per_batch={slots} * T")  # fmt: skip
        steps = frames_per_batch // slots
        if batch_size is not None and batch_size != steps:
            raise ValueError(f"batch_size={batch_size!r} and frames_per_batch={frames_per_batch} ({slots} slots x "
                             f"{steps} steps) disagree; pass one of them")  # fmt: skip
        batch_size = steps
    if total_frames is not None:
        steps = -(-total_frames // slots)
        if total_steps not in (-1, None) and total_steps != steps:
            raise ValueError(f"total_steps={total_steps!r} and total_frames={total_frames} ({slots} slots x {steps} "
                             "steps) disagree; pass one of them")  # fmt: skip
        total_steps = steps
    return batch_size, -1 if total_steps is None else total_steps


def _check_args(mode, batch_size, total_steps, options, sink, postproc) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        what = "steps_per_batch (env steps)" if mode is CollectMode.STEPS else "trajectories per batch"
        raise ValueError(f"batch_size / frames_per_batch ({what}) must be a positive int, got {batch_size!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or (total_steps <= 0 and total_steps != -1):
        raise ValueError(f"total_steps must be a positive int or -1 (endless), got {total_steps!r}")
    if options.is_last_step_only and mode is not CollectMode.TRAJECTORIES:
        raise ValueError("is_last_step_only=True needs mode='trajectories' (a step batch has no 'last step')")
    if options.in_flight is InFlight.DROP and mode is not CollectMode.TRAJECTORIES:
        raise ValueError("in_flight='drop' needs mode='trajectories' (steps already yielded cannot be dropped)")
    if sink is not None and not (hasattr(sink, "extend") or hasattr(sink, "put")):
        raise TypeError(f"sink must be a ReplayBuffer (extend) or a queue (put), got {type(sink).__name__}")
    if postproc is not None and not callable(postproc):
        raise TypeError(f"postproc must be callable on a TensorDict, got {postproc!r}")


def _check_mode(mode) -> CollectMode:
    try:
        return CollectMode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of {[m.value for m in CollectMode]}, got {mode!r}") from None
