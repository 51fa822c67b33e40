"""The collector core: what :class:`~tokengym.collectors.TokenCollector`, :class:`~tokengym.collectors.RayTokenCollector`
and :class:`~tokengym.collectors.AsyncCollector` share, written once.

:class:`CollectSpec` checks the configuration (mode, batch size, budget, TorchRL frames, :class:`CollectorOptions`)
and does the frame accounting of one collector and of Ray workers; :class:`CollectorBase` delivers every batch
(postproc, metrics, logger, sink: a batch leaves its collector only once delivered), gives
``update_policy_weights_`` its one meaning and keeps TorchRL's conventions (iteration with :class:`BatchIterator`,
``set_seed``, ``shutdown`` and the context manager, ``state_dict``, the repr).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable
from enum import StrEnum
from typing import ClassVar

from tensordict import TensorDictBase

from tokengym.collectors._metrics import collector_metrics
from tokengym.collectors.branching import check_rule
from tokengym.collectors.dynamic_sampling import DynamicSampling
from tokengym.collectors.iteration import BatchIterator
from tokengym.collectors.sinks import check_sink, write_to_sink

__all__ = ["CollectMode", "CollectSpec", "CollectorBase", "CollectorOptions", "InFlight"]


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
        dynamic_sampling: a :class:`~tokengym.collectors.DynamicSampling` (DAPO, verl's ``filter_groups``): in
            ``TRAJECTORIES`` mode, batches of whole groups whose rewards spread, sampled until full.
        partial_rollouts: with ``source="wave"`` and a policy that can be interrupted (``TransformersPolicy``,
            ``VLLMPolicy``, ``VLLMServerPolicy``),
            weights published from another thread (``AsyncCollector``) interrupt the wave in progress: the tokens
            generated so far are kept with their version and each sequence goes on under the new weights in the
            next wave (then ``in_flight`` applies). False: the update waits for the wave's end.
        over_sampling: with ``source="wave"`` in ``TRAJECTORIES`` mode (slime's over-sampling, APRIL): a wave stops as
            soon as enough of its rows ended to fill the batch; the others go on in the next wave (long tails carried
            over, into the next batch) instead of holding the finished slots idle until the longest row ends. Needs a
            policy that honours ``WaveRequest.min_finished`` (``TransformersPolicy``, ``VLLMPolicy``).
        tree: a branching rule (:class:`~tokengym.collectors.SegmentRule`, ``EntropyRule``, ``TurnRule``, or
            your own): each group is sampled as a tree whose ``group_size`` leaves fork from one another at the
            tokens the rule picks (``mode="trajectories"``, ``source="step"`` or ``"wave"`` without
            ``over_sampling``, a bare ``TokenEnv`` with ``group_size >= 2``); each leaf's row holds its whole
            sequence, with ``keys.BRANCH_ID``,
            ``keys.PARENT_ID`` and ``keys.FORK_INDEX`` (see the guide ``docs/guides/trees.md``).
    """

    def __init__(self, *, is_last_step_only: bool = False, is_fixed_width: bool = True, is_whole_groups: bool = True,
                 in_flight: InFlight | str = InFlight.CONTINUE, use_progress_bar: bool = False,
                 dynamic_sampling: DynamicSampling | None = None, partial_rollouts: bool = True,
                 over_sampling: bool = False, tree=None) -> None:  # fmt: skip
        for name, value in (("partial_rollouts", partial_rollouts), ("over_sampling", over_sampling)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self.partial_rollouts, self.over_sampling = partial_rollouts, over_sampling
        self.is_last_step_only, self.is_fixed_width = is_last_step_only, is_fixed_width
        self.is_whole_groups = is_whole_groups
        try:
            self.in_flight = InFlight(in_flight)
        except ValueError:
            raise ValueError(f"in_flight must be one of {[m.value for m in InFlight]}, got {in_flight!r}") from None
        self.use_progress_bar = use_progress_bar
        if dynamic_sampling is not None and not isinstance(dynamic_sampling, DynamicSampling):
            raise TypeError(f"dynamic_sampling must be a DynamicSampling or None, got {type(dynamic_sampling).__name__}")
        self.dynamic_sampling = dynamic_sampling
        if tree is not None:
            check_rule(tree)
        self.tree = tree


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class CollectSpec:
    """A collector's checked configuration: what a batch holds and how long collection runs.

    :meth:`from_args` checks what needs no env (at construction, before anything starts); :meth:`for_env`
    turns TorchRL frames into env steps once the env's slots are known and checks whole groups. A frame is
    one env step of one slot (one token position): ``frames_per_batch=40`` with 4 slots gives (4, 10)
    ``STEPS`` batches; ``frames_per_batch`` does not apply to ``TRAJECTORIES`` batches (their size is a
    number of trajectories). Ray's combined batch has every worker's slots: :meth:`per_worker` and
    :meth:`worker_share` give each worker its part.

    Example:
        >>> spec = CollectSpec.from_args("steps", frames_per_batch=40, total_frames=100).for_env(slots=4, group_size=1)
        >>> spec.batch_size, spec.total_steps  # (4, 10) batches, 25 env steps (100 frames, rounded up)
        (10, 25)
    """

    mode: CollectMode
    batch_size: int | None
    """Env steps per batch (``STEPS``) or trajectories per batch (``TRAJECTORIES``); ``None`` while
    ``frames_per_batch`` stands for it (until :meth:`for_env`)."""
    total_steps: int = -1
    """Env steps (each ``B`` tokens) before collection stops; -1 runs until the prompts are exhausted."""
    frames_per_batch: int | None = None
    """TorchRL's batch size (``STEPS`` only); turned into ``batch_size`` by :meth:`for_env`."""
    total_frames: int | None = None
    """TorchRL's budget; turned into ``total_steps`` by :meth:`for_env` (rounded up to whole env steps)."""
    options: CollectorOptions = dataclasses.field(default_factory=CollectorOptions)

    @classmethod
    def from_args(cls, mode: CollectMode | str, *, batch_size: int | None = None, total_steps: int = -1,
                  frames_per_batch: int | None = None, total_frames: int | None = None,
                  options: CollectorOptions | None = None) -> CollectSpec:  # fmt: skip
        """The spec of a collector's arguments; ``ValueError`` / ``TypeError`` naming the value and the fix."""
        try:
            mode = CollectMode(mode)
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in CollectMode]}, got {mode!r}") from None
        options = CollectorOptions() if options is None else options
        if not isinstance(options, CollectorOptions):
            raise TypeError(f"options must be a CollectorOptions, got {type(options).__name__}")
        for name, value in (("frames_per_batch", frames_per_batch), ("total_frames", total_frames)):
            if value is not None and (not _is_int(value) or value <= 0):
                raise ValueError(f"{name} must be a positive int (TorchRL frames: env steps of one slot), got {value!r}")
        if frames_per_batch is not None and mode is not CollectMode.STEPS:
            raise ValueError(f"frames_per_batch={frames_per_batch} counts TorchRL frames (tokens of one slot), which "
                             "size STEPS batches only; a TRAJECTORIES batch holds a number of trajectories: pass "
                             "batch_size=N (a multiple of group_size)")  # fmt: skip
        if batch_size is None and frames_per_batch is None:
            raise ValueError("pass batch_size (env steps per batch in STEPS mode, trajectories per batch in "
                             "TRAJECTORIES mode) or, in STEPS mode, TorchRL's frames_per_batch")  # fmt: skip
        if batch_size is not None and (not _is_int(batch_size) or batch_size <= 0):
            what = "steps_per_batch (env steps)" if mode is CollectMode.STEPS else "trajectories per batch"
            raise ValueError(f"batch_size / frames_per_batch ({what}) must be a positive int, got {batch_size!r}")
        if not _is_int(total_steps) or (total_steps <= 0 and total_steps != -1):
            raise ValueError(f"total_steps must be a positive int or -1 (endless), got {total_steps!r}")
        if options.is_last_step_only and mode is not CollectMode.TRAJECTORIES:
            raise ValueError("is_last_step_only=True needs mode='trajectories' (a step batch has no 'last step')")
        if options.in_flight is InFlight.DROP and mode is not CollectMode.TRAJECTORIES:
            raise ValueError("in_flight='drop' needs mode='trajectories' (steps already yielded cannot be dropped)")
        if options.dynamic_sampling is not None and (mode is not CollectMode.TRAJECTORIES or not options.is_whole_groups):
            why = f"mode={mode.value!r}" if mode is not CollectMode.TRAJECTORIES else "is_whole_groups=False"
            raise ValueError(f"dynamic_sampling keeps or drops whole groups of finished trajectories, so it needs "
                             f"mode='trajectories' with whole groups, got {why}; use ZeroStdGroupFilter(mode='mask') "
                             "on STEPS batches instead")  # fmt: skip
        return cls(mode, batch_size, total_steps, frames_per_batch, total_frames, options)

    def for_env(self, *, slots: int, group_size: int) -> CollectSpec:
        """This spec on an env of ``slots`` slots and prompts of ``group_size`` samples: frames turned into env
        steps (``frames_per_batch = slots * batch_size``, ``total_frames = slots * total_steps``), and a
        ``TRAJECTORIES`` batch checked to hold whole groups."""
        batch_size, total_steps = self.batch_size, self.total_steps
        if self.frames_per_batch is not None:
            if self.frames_per_batch % slots:
                raise ValueError(f"frames_per_batch={self.frames_per_batch} is not a multiple of the env's {slots} slots: "
                                 f"a STEPS batch (B, T) holds B * T frames; pass frames_per_batch={slots} * T")  # fmt: skip
            steps = self.frames_per_batch // slots
            if batch_size is not None and batch_size != steps:
                raise ValueError(f"batch_size={batch_size!r} and frames_per_batch={self.frames_per_batch} ({slots} slots "
                                 f"x {steps} steps) disagree; pass one of them")  # fmt: skip
            batch_size = steps
        if self.total_frames is not None:
            steps = -(-self.total_frames // slots)
            if total_steps != -1 and total_steps != steps:
                raise ValueError(f"total_steps={total_steps!r} and total_frames={self.total_frames} ({slots} slots x "
                                 f"{steps} steps) disagree; pass one of them")  # fmt: skip
            total_steps = steps
        group = self.group_of(group_size)
        if self.options.dynamic_sampling is not None and group_size < 2:
            raise ValueError(f"dynamic_sampling needs group_size >= 2 (it keeps groups whose samples' rewards spread), "
                             f"got group_size={group_size}; pass group_size=G to the env or its PromptSource")  # fmt: skip
        if batch_size % group:
            raise ValueError(f"batch_size={batch_size} trajectories is not a multiple of the env's group_size={group}: "
                             f"a TRAJECTORIES batch holds whole groups; pass batch_size={max(1, batch_size // group) * group}, "
                             "or options=CollectorOptions(is_whole_groups=False) to let groups span batches")  # fmt: skip
        return dataclasses.replace(self, batch_size=batch_size, total_steps=total_steps, frames_per_batch=None,
                                   total_frames=None)  # fmt: skip

    def group_of(self, group_size: int) -> int:
        """The samples a batch keeps together: ``group_size`` for ``TRAJECTORIES`` batches of whole groups, else 1."""
        is_whole = self.mode is CollectMode.TRAJECTORIES and self.options.is_whole_groups
        return group_size if is_whole else 1

    def per_worker(self, num_workers: int) -> CollectSpec:
        """The frames of each of ``num_workers`` workers whose slots are side by side in the combined batch: a
        ``STEPS`` batch is ``(num_workers * B, T)``, so each worker collects ``frames_per_batch / num_workers``;
        ``total_frames`` is shared the same way (rounded up)."""
        frames, total = self.frames_per_batch, self.total_frames
        if frames is not None:
            if frames % num_workers:
                raise ValueError(f"frames_per_batch={frames} is not a multiple of num_workers={num_workers}: a "
                                 "STEPS batch is (num_workers * B, T), num_workers * B * T frames")  # fmt: skip
            frames //= num_workers
        if total is not None:
            total = -(-total // num_workers)
        return dataclasses.replace(self, frames_per_batch=frames, total_frames=total)

    def worker_share(self, index: int, num_workers: int, *, group_size: int) -> CollectSpec:
        """Worker ``index``'s part of a ``TRAJECTORIES`` batch (a spec :meth:`for_env` gave): its groups are split over
        the workers, ``groups // num_workers`` each and one more for the first ``groups % num_workers``."""
        if self.mode is not CollectMode.TRAJECTORIES:
            return self  # each worker's STEPS batch has its own slots: the combined batch puts them side by side
        group = self.group_of(group_size)
        groups = self.batch_size // group
        if groups < num_workers:
            raise ValueError(f"batch_size={self.batch_size} holds {groups} group(s) of {group}, fewer than the "
                             f"{num_workers} workers: give at least one group per worker "
                             f"(batch_size >= {num_workers * group})")  # fmt: skip
        share = (groups // num_workers + (index < groups % num_workers)) * group
        return dataclasses.replace(self, batch_size=share)


class CollectorBase(abc.ABC):
    """The core of every collector: delivery of its batches, weight updates and TorchRL's conventions.

    A collector makes batches (:meth:`collect_batch`) and the core delivers each: ``postproc``, then
    ``metrics`` (:meth:`batch_metrics`), the logger and the sink, then :meth:`commit_batch`. A batch leaves its
    collector only at the commit: when the postproc, the logger or the sink raises, the exception ends that
    ``next()`` and the next one delivers the same batch again (a postprocessed batch is kept, not postprocessed
    twice); a checkpoint taken meanwhile still holds it.

    Besides the abstract methods, a collector has ``version`` (the policy version it collects with now) and
    ``steps_done`` (env steps collected so far, each ``B`` tokens), read by the default :meth:`batch_metrics`.

    Args:
        spec: the checked configuration.
        postproc: a callable applied to every batch (a KL transform, say); if it has ``metrics()``, they join
            the batch metrics.
        sink: a TorchRL ``ReplayBuffer`` (``extend``) or a queue (``put``): batches go there and iteration
            yields ``None``.
        logger: a TorchRL logger; every batch's metrics are logged at the collector's step count.
    """

    needs_weights_because: ClassVar[str] = ""
    """Why ``update_policy_weights_`` needs the weights; empty where ``None`` (trained in place) is allowed."""

    def __init__(self, spec: CollectSpec, *, postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
                 sink=None, logger=None) -> None:  # fmt: skip
        if postproc is not None and not callable(postproc):
            raise TypeError(f"postproc must be callable on a TensorDict, got {postproc!r}")
        check_sink(sink)
        self.spec, self.postproc, self.sink, self.logger = spec, postproc, sink, logger
        self.undelivered: TensorDictBase | None = None
        """A postprocessed batch whose delivery raised: the next :meth:`next_batch` delivers it (``None``: none)."""
        self._metrics: dict[str, float] | None = None

    # -- the spec --
    @property
    def mode(self) -> CollectMode:
        return self.spec.mode

    @property
    def options(self) -> CollectorOptions:
        return self.spec.options

    @property
    def batch_size(self) -> int | None:
        return self.spec.batch_size

    @property
    def total_steps(self) -> int:
        return self.spec.total_steps

    # -- what a collector implements --
    @abc.abstractmethod
    def collect_batch(self) -> TensorDictBase | None:
        """The next batch, left in the collector until :meth:`commit_batch` (a second call before it gives the
        same batch); ``None`` when collection has ended."""

    @abc.abstractmethod
    def commit_batch(self) -> None:
        """Drop the batch :meth:`collect_batch` gave: it was delivered."""

    @abc.abstractmethod
    def counts(self) -> dict[str, int | float]:
        """The counters the metrics report (cumulative: failed prompts, dropped tokens, weight updates...)."""

    @abc.abstractmethod
    def push_weights(self, weights) -> int:
        """Send an update to the policy (``weights`` as :meth:`update_policy_weights_` got them; ``None``: the
        model was trained in place); returns the version the policy has (or will have) after it."""

    @abc.abstractmethod
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the prompt order and the policy's sampling (TorchRL's signature); returns ``seed``."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Everything needed to resume between batches, as plain data (``torch.load(..., weights_only=True)``
        reads it back); the weights are the trainer's to save."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`: the batches that follow are those the saved run would have yielded."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release what the collector holds (engines, workers, threads); calling it twice is fine."""

    @abc.abstractmethod
    def describe(self) -> dict[str, object]:
        """The fields of the repr, in order, each shown with ``str()`` (``repr()`` it for quotes)."""

    # -- delivery --
    def __iter__(self) -> BatchIterator:
        """An iterator of batches; an error of one batch ends that ``next()`` only, and the next one goes on."""
        return BatchIterator(self.next_batch, has_sink=self.sink is not None)

    def next_batch(self) -> TensorDictBase | None:
        """The next batch, delivered (postprocessed, measured, logged, in the sink); ``None`` when collection ends."""
        if self.undelivered is None:
            start = time.perf_counter()
            batch = self.collect_batch()
            if batch is None:
                return None
            if self.postproc is not None:
                batch = self.postproc(batch)
            self._metrics = self.batch_metrics(batch, time.perf_counter() - start)
            self.undelivered = batch
        batch = self.undelivered
        if self.logger is not None:
            for name, value in self.metrics.items():
                self.logger.log_scalar(name, float(value), step=self.steps_done)
        if self.sink is not None:
            write_to_sink(self.sink, batch)
        self.undelivered = None
        self.commit_batch()
        return batch

    @property
    def metrics(self) -> dict[str, float]:
        """The last batch's metrics (rewards, lengths, staleness, tokens/s, counters); before the first batch the
        same keys, zeros and NaN where no value exists yet (a logger sees the same columns throughout)."""
        return self._metrics if self._metrics is not None else self.batch_metrics(None, 0.0)

    def batch_metrics(self, batch: TensorDictBase | None, elapsed: float) -> dict[str, float]:
        """The metrics of ``batch`` (collected in ``elapsed`` seconds) with :meth:`counts`; ``None``: before a batch."""
        return collector_metrics(batch, elapsed, self.version, self.steps_done, counts=(self.counts(),),
                                 is_last_step_only=self.options.is_last_step_only, postproc=self.postproc)  # fmt: skip

    # -- weights --
    def update_policy_weights_(self, policy_or_weights=None, *, weights=None) -> int:
        """Load new weights into the policy and bump its version (TorchRL's signature).

        ``weights`` (or the positional argument) is a state_dict, a TensorDict of weights or the trained module
        (its ``state_dict()``); ``None`` means the policy's own model was trained in place (a collector whose
        policy holds its own copy, in workers or behind a thread, needs the weights). Collection goes on: the
        update reaches the policy at its next step boundary. Returns the version the policy has (or will
        have) after the update.
        """
        weights = policy_or_weights if weights is None else weights
        if weights is None and self.needs_weights_because:
            raise ValueError(f"{type(self).__name__}.update_policy_weights_ needs the weights (a state_dict, a "
                             f"TensorDict or the trained module): {self.needs_weights_because}")  # fmt: skip
        return self.push_weights(weights)

    # -- TorchRL's conventions --
    def __enter__(self) -> CollectorBase:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in self.describe().items())
        return f"{type(self).__name__}({fields})"
