"""TokenCollector: drives a policy through a TokenEnv and yields fixed-step batches or finished trajectories."""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable

import torch
from tensordict import TensorDictBase

from tokengym.collectors._checkpoint import collector_state, load_collector_state
from tokengym.collectors._metrics import policy_counts
from tokengym.collectors.core import (
    CollectMode,
    CollectorBase,
    CollectorOptions,
    CollectSpec,
    InFlight,
)
from tokengym.collectors.iteration import BatchIterator
from tokengym.collectors.policies.protocol import (
    as_token_policy,
    check_policy_env,
    check_policy_sampling,
    sampling_of,
    supports_interrupt,
)
from tokengym.collectors.recorders import Recorder, StepRecorder, TrajectoryRecorder, check_recorder
from tokengym.collectors.sources import Source, SourceKind, check_source, make_source
from tokengym.collectors.tree_sampler import TreeSampler
from tokengym.collectors.tree_source import TreeSource
from tokengym.llm_envs import PromptTable, TokenEnv, keys

__all__ = ["TokenCollector"]

_OPTIONS = tuple(inspect.signature(CollectorOptions).parameters)  # named in the error for a loose option


class TokenCollector(CollectorBase):
    """Collects token-level rollouts from ``env`` with ``policy``.

    A step source advances the env (``source="step"``: one token per slot per step; ``"wave"``: the
    policy generates every live slot's turn at once and the env unrolls it; both give the same
    steps), a recorder turns steps into batches (:class:`CollectMode`). TorchRL's names count frames
    as TorchRL does, a frame being one env step of one slot (one token position): ``frames_per_batch=40``
    with 4 slots gives (4, 10) ``STEPS`` batches, ``total_frames`` stops after that many slot steps.
    ``frames_per_batch`` does not apply to ``TRAJECTORIES`` batches (their size is a number of
    trajectories: ``batch_size``). ``metrics`` holds the last batch's metrics (rewards, lengths,
    staleness, tokens/s, counters); before the first batch it has the same keys, zeros and NaN where
    no value exists yet. Validation, delivery (postproc, metrics, logger, sink: a batch leaves the
    collector only once delivered) and TorchRL's conventions are the collector core's
    (:class:`~tokengym.collectors.core.CollectorBase`).

    Args:
        env: a :class:`~tokengym.llm_envs.TokenEnv` (or a ``TransformedEnv`` of one).
        policy: a :class:`~tokengym.collectors.policies.TokenPolicy`, e.g. :class:`~tokengym.collectors.policies.TransformersPolicy`.
        mode: a :class:`CollectMode` or its string.
        batch_size: env steps per batch (``STEPS``) or trajectories per batch (``TRAJECTORIES``; a
            multiple of the env's ``group_size``: a batch holds whole groups).
        total_steps: stop after this many env steps (each is ``B`` tokens); -1 runs until the
            prompt source is exhausted (forever for a repeating source).
        source: a :class:`~tokengym.collectors.sources.SourceKind` or its string; ``None`` steps
            when the policy can, else generates waves; or a source of your own on the same env and policy (an object
            following :class:`~tokengym.collectors.sources.Source`, checked here).
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
        >>> from tokengym.collectors.policies import TransformersPolicy
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
        source: SourceKind | str | Source | None = None,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        sink=None,
        logger=None,
        options: CollectorOptions | None = None,
        frames_per_batch: int | None = None,
        total_frames: int | None = None,
        **unexpected,
    ) -> None:
        if unexpected:
            _refuse(unexpected)
        base = getattr(env, "base_env", env)
        if not isinstance(base, TokenEnv):
            raise TypeError(f"env must be a TokenEnv or a TransformedEnv of one, got {type(base).__name__}")
        spec = CollectSpec.from_args(mode, batch_size=batch_size, total_steps=total_steps, options=options,
                                     frames_per_batch=frames_per_batch, total_frames=total_frames)  # fmt: skip
        self.group_size = int(getattr(base.source, "group_size", 1))
        super().__init__(spec.for_env(slots=base.batch_size[0], group_size=self.group_size), postproc=postproc,
                         sink=sink, logger=logger)  # fmt: skip
        if base.turns.may_split and spec.mode is CollectMode.STEPS:
            raise ValueError(f"{type(base.turns).__name__} may split an episode into several trajectories, whose parts "
                             "get the episode's reward when it ends: collect with mode='trajectories'")  # fmt: skip
        policy = as_token_policy(policy)
        self.env, self.base_env, self.policy = env, base, policy
        # waves come as wide as fixed-width batches: no padding copy
        width = base.max_new_tokens if self.mode is CollectMode.TRAJECTORIES and self.options.is_fixed_width else None
        self.source: Source = make_source(source, env, policy, width=width)
        if self.options.tree is not None:
            self.source = self._tree_source(base, policy, self.source)
        check_source(self.source)
        if self.source.kind == "step":  # a stepping policy reads its env's tokens: another env fails here
            check_policy_env(policy, env)
        check_policy_sampling(policy, env)  # an agent env tells its programs the temperature they get
        self.steps_done, self.is_started = 0, False
        self.prompts = PromptTable(pad_token_id=base.tokenizer.pad_token_id, sampling=sampling_of(policy))  # layouts pad with it, actors score with it
        self.pending: dict | None = None  # steps of a wave that did not fit into the last batch
        self._lock = threading.Lock()
        self._queued_weights: list = []  # weight updates asked for while collecting (another thread)
        self._published_at: list[float] = []  # when each queued update was published (perf_counter)
        self._asked_version = policy.version  # the version the last update asked for will give
        self._collect_thread: int | None = None  # the thread iterating this collector
        self.num_threads = torch.get_num_threads()
        self.counters = {"dropped_tokens": 0, "weight_updates": 0, "failed_prompts": 0, "interrupted_sequences": 0,
                         "update_wait_s": 0.0}
        # partial rollouts: an update from another thread interrupts the wave in progress
        self._interrupts = (self.options.partial_rollouts and self.source.kind == SourceKind.WAVE
                            and supports_interrupt(policy))  # fmt: skip
        if self.options.over_sampling and (self.source.kind != SourceKind.WAVE or self.mode is not CollectMode.TRAJECTORIES):
            raise ValueError(f"CollectorOptions(over_sampling=True) stops waves early to fill TRAJECTORIES batches: "
                             f"collect with mode='trajectories' and source='wave' (got mode={self.mode.value!r}, "
                             f"source={self.source.kind.value!r}), or leave over_sampling off")  # fmt: skip
        self._wave_cells = False  # waves as their real steps, once trajectories went on across waves
        self.recorder: Recorder = self.new_recorder()
        check_recorder(self.recorder)

    def _tree_source(self, base, policy, source) -> TreeSource:
        """Sample each group as a tree (``options.tree``): checks, then the source wrapped in a tree source (stepping:
        forks after each step, the KV cache rows copied; waves: each wave paused at the rule's next forks, forks
        after it)."""
        where = "CollectorOptions(tree=...) grows trees of whole groups"
        if self.mode is not CollectMode.TRAJECTORIES:
            raise ValueError(f"{where}: collect with mode='trajectories' (got mode={self.mode.value!r})")
        is_wave = source.kind == SourceKind.WAVE
        if not is_wave and not source.is_bare:
            raise ValueError(f"{where} in a bare TokenEnv: env transforms run per step and cannot be forked; apply "
                             "them to the batches (postproc) instead")  # fmt: skip
        if is_wave and self.options.over_sampling:
            raise ValueError(f"{where}; over_sampling stops waves early for long tails, trees pause them at their "
                             "forks: leave over_sampling off with tree=...")  # fmt: skip
        B = base.batch_size[0]
        if self.group_size < 2 or B < self.group_size:
            raise ValueError(f"{where}: build the env with group_size >= 2 (the leaves of a tree) and batch_size >= "
                             f"group_size (a tree holds group_size slots); got group_size={self.group_size}, "
                             f"batch_size={B}")  # fmt: skip
        if base.turns.may_split:
            raise ValueError(f"{where}: {type(base.turns).__name__} may split an episode into several trajectories, "
                             "which a tree cannot follow")  # fmt: skip
        if self.options.in_flight is InFlight.DROP:
            raise ValueError(f"{where}: in_flight='drop' restarts the branches in flight from their prompt, out of "
                             "their trees; keep in_flight='continue' (each token keeps the version that sampled it)")  # fmt: skip
        return TreeSource(source, TreeSampler(self.options.tree, base, None if is_wave else policy, self.group_size))

    @property
    def version(self) -> int:
        """The policy's version: the weights it samples with now."""
        return self.policy.version

    def new_recorder(self) -> Recorder:
        if self.mode is CollectMode.STEPS:
            return StepRecorder(self.batch_size)
        return TrajectoryRecorder(self.batch_size, self.base_env.max_new_tokens, group_size=self.spec.group_of(self.group_size),
                                  is_fixed_width=self.options.is_fixed_width,
                                  dynamic_sampling=self.options.dynamic_sampling,
                                  is_tree=self.options.tree is not None)  # fmt: skip

    def _drop_orphans(self) -> None:
        """Drop waiting groups that can no longer complete (a sample's prompt failed to load): no slot and
        no sample still to come from the prompt source holds them."""
        waiting = self.recorder.waiting_groups()
        if not waiting:
            return
        live = {p.group_id for b in range(self.base_env.batch_size[0]) if (p := self.base_env.slot_prompt(b))}
        drawing = self.base_env.source.group_in_progress
        if drawing is not None:
            live.add(drawing)  # the group being drawn still has samples to give
        self.recorder.drop_groups([g for g in waiting if g not in live])

    # -- collecting --
    def _remember_prompts(self, slots) -> None:
        table = self.prompts
        for b in slots:
            prompt = self.base_env.slot_prompt(b)
            if prompt is None:
                continue
            if prompt.group_id not in table:
                table.add(prompt.group_id, prompt.ids, text=prompt.text, metadata=prompt.metadata, images=prompt.images)
            elif prompt.ids is not table.ids(prompt.group_id) and not torch.equal(prompt.ids, table.ids(prompt.group_id)):
                table.add_trajectory_prompt(self.base_env.slot_trajectory(b), prompt.ids)  # a split episode's part

    def _count_failed(self, error: Exception | None) -> None:
        if error is not None:
            self.counters["failed_prompts"] += len(getattr(error, "slots", ()) or ())

    def _advance(self) -> None:
        """Advance the source once and record what it produced."""
        if self._queued_weights:
            self._apply_queued_weights()
        # over-sampling: the rows still needed to fill the batch; the wave may stop once they ended
        need = max(1, self.batch_size - self.recorder.num_ready) if self.options.over_sampling else None
        step = self.source.advance(min_finished=need, cells=self._wave_cells)
        if step.refilled:
            self._remember_prompts(step.refilled)
        for traj, ids in self.base_env.pop_finished_sequences().items():
            self.prompts.add_sequence(traj, ids)
        for traj, images in self.base_env.pop_finished_images().items():
            self.prompts.add_trajectory_images(traj, images)
        parts = self.base_env.pop_parts()
        if parts:
            self.recorder.hold_parts(parts)
        self.counters["interrupted_sequences"] += step.interrupted
        if step.chunk:
            self.steps_done += step.steps
            self.pending = self.recorder.write(step.chunk)
            # a batch copies waves' steps anyway: once trajectories go on across waves, they come without padding
            self._wave_cells = self._wave_cells or self.recorder.continues_turns
        error = step.error
        self._count_failed(error)
        if self.counters["failed_prompts"]:
            self._drop_orphans()
        if error is not None:
            raise error  # recorded first: iterate again to go on with the next prompts

    def _has_budget(self) -> bool:
        return self.total_steps == -1 or self.steps_done < self.total_steps

    def collect_batch(self) -> TensorDictBase | None:
        """Step until a batch is full (it stays in the recorder until :meth:`commit_batch`); ``None`` when the
        budget or the prompt source runs out. With dynamic sampling, a ``DynamicSamplingError`` once the draw
        bound is reached first (the kept groups stay queued: the next call goes on)."""
        # OpenMP's thread count is per thread: a collector iterated in another thread keeps its builder's
        torch.set_num_threads(self.num_threads)
        if not self.is_started:
            slots, error = self.source.start()
            self._remember_prompts(slots)
            self.is_started = True
            self._count_failed(error)
            if error is not None:
                raise error
        if self.pending is not None:
            self.pending = self.recorder.write(self.pending)
        while not self.recorder.is_full:
            if not self._has_budget() or self.base_env.is_exhausted:
                batch = self.recorder.peek(partial=True)
                return None if batch is None else self._shape(batch)
            if self.mode is CollectMode.TRAJECTORIES:
                self.recorder.check_draws()
            self._advance()
        return self._shape(self.recorder.peek())

    def _shape(self, batch: TensorDictBase) -> TensorDictBase:
        """The batch as it is yielded: its prompt table, and only each trajectory's last step if asked."""
        mask, traj = batch.get(keys.MASK), batch.get(keys.TRAJ_ID)
        first = mask.clone()  # each trajectory's first step in each row: a few ids, not every step's
        first[:, 1:] &= traj[:, 1:] != traj[:, :-1]
        groups = batch.get(keys.GROUP_ID)[first].unique()
        batch.set_non_tensor(keys.PROMPTS, self.prompts.subset(groups, traj[first].unique()))
        if self.options.is_last_step_only:
            last = batch.get(keys.MASK).sum(1) - 1
            batch = batch[torch.arange(batch.shape[0]), last]
        return batch

    def commit_batch(self) -> None:
        """Drop the delivered batch from the recorder, and the prompts no live slot or queued trajectory holds."""
        self.recorder.commit()
        held = [(b, p) for b in range(self.base_env.batch_size[0]) if (p := self.base_env.slot_prompt(b))]
        live = [p.group_id for _, p in held]
        trajectories = self.recorder.queued_trajectories() + [self.base_env.slot_trajectory(b) for b, _ in held]
        live += self.recorder.queued_groups()
        # the trajectories still in slots keep their own prompts (a split episode's later part) for their batch
        self.prompts = self.prompts.subset(torch.tensor(live, dtype=torch.int64), trajectories)

    def counts(self) -> dict[str, int]:
        """Failed prompts, dropped tokens, weight updates, the env's prompt counts (over-long prompts skipped or
        truncated) and turn metrics (its turn handler's counters: reward errors, tool calls...) and, in
        ``TRAJECTORIES`` mode, the groups dropped and trajectories waiting (with dynamic sampling, its counts: groups
        drawn, kept, dropped for zero spread...), and the policy's own counters (a server fleet's: servers up,
        failovers, reloads, requests sent again)."""
        return {**self.counters, **self.base_env.prompt_counts, **self.base_env.turn_metrics, **policy_counts(self.policy),
                **self.source.counts(), **self.recorder.counts()}  # fmt: skip

    # -- iteration --
    def __iter__(self) -> BatchIterator:
        self._collect_thread = threading.get_ident()  # claimed at iter(), before the first batch starts
        bar = self._progress_bar()
        return BatchIterator(self.next_batch, has_sink=self.sink is not None, on_end=functools.partial(self._end, bar),
                             on_batch=None if bar is None else functools.partial(self._show_progress, bar))  # fmt: skip

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
    def push_weights(self, weights) -> int:
        """Queue the update; applied now, or at the next step boundary when another thread is iterating.
        Trajectories in flight continue or restart per ``options.in_flight``."""
        if weights is self.policy:  # TorchRL's habit: the collector's own policy, its model trained in place
            weights = None
        with self._lock:
            self._queued_weights.append(weights)
            self._published_at.append(time.perf_counter())
            if self._interrupts and self._collect_thread not in (None, threading.get_ident()):
                self.policy.interrupt.set()  # the wave in progress stops; its rows go on under these weights
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
            published, self._published_at = self._published_at, []
            if self._interrupts:
                self.policy.interrupt.clear()
        for weights in queued:
            self.policy.update_weights(weights)
            self.counters["weight_updates"] += 1
        applied = time.perf_counter()  # generation under the new weights starts now
        self.counters["update_wait_s"] += sum(applied - t for t in published)
        if queued and self.options.in_flight is InFlight.DROP and self.is_started:
            self._drop_in_flight()

    def _drop_in_flight(self) -> None:
        finished = self.source.finished_slots()  # their trajectories are recorded: nothing in flight there
        resp = [(b, int(self.base_env.history(b).numel()) - int(p.ids.numel()))
                for b in range(self.base_env.batch_size[0])
                if b not in finished and (p := self.base_env.slot_prompt(b)) is not None]  # fmt: skip
        slots = [b for b, n in resp if n > 0]
        if slots:
            self.counters["dropped_tokens"] += sum(n for _, n in resp if n > 0)
            self.source.restart(slots)

    # -- TorchRL collector conventions --
    def describe(self) -> dict[str, object]:
        source = SourceKind(self.source.kind).value
        return {"mode": repr(self.mode.value), "batch_size": self.batch_size, "total_steps": self.total_steps,
                "source": repr(source), "policy": f"{type(self.policy).__name__}(version={self.policy.version})",
                "env": repr(self.env), "steps_done": self.steps_done}  # fmt: skip

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the prompt order (env) and the policy's sampling; returns the seed."""
        self.base_env.set_seed(seed, static_seed=static_seed)
        if hasattr(self.policy, "set_seed"):
            self.policy.set_seed(seed)
        return seed

    def shutdown(self) -> None:
        """Release the policy's resources (engines, caches)."""
        self.policy.close()

    def state_dict(self, *, include_cache: bool = True) -> dict:
        """Everything needed to resume between batches, as tensors, numbers, strings, lists and dicts
        (``torch.load(..., weights_only=True)`` reads it back). ``include_cache=False`` leaves the
        policy's KV cache out (re-prefilled on resume; log-probs may then differ in the last bits)."""
        return collector_state(self, include_cache=include_cache)

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Restore :meth:`state_dict`; the next batch is the one the saved run would have yielded.

        A ``ValueError`` when the checkpoint was taken on other prompts (its fingerprint of the prompt source
        differs from this env's); ``strict=False`` resumes its cursor over this env's prompts anyway."""
        load_collector_state(self, state, strict=strict)
        with self._lock:  # the loaded policy's version, and the updates still queued, give the next one's
            self._asked_version = self.policy.version + len(self._queued_weights)
        self.undelivered = None  # a batch whose delivery failed is in the restored recorder, or was delivered


def _refuse(unexpected: dict) -> None:
    """The ``TypeError`` for keyword arguments TokenCollector does not take; a collector option names the fix."""
    other = sorted(set(unexpected) - set(_OPTIONS))
    if other:
        raise TypeError(f"TokenCollector got unexpected arguments {other}; see its docstring")
    fix = ", ".join(f"{name}=..." for name in unexpected)
    raise TypeError(f"TokenCollector got collector options as keyword arguments ({', '.join(unexpected)}): pass "
                    f"options=CollectorOptions({fix})")  # fmt: skip
