"""The core of every wave backend: one wave, one weight update and one collection state, whatever the engine.

:class:`WaveCore` is what :class:`~tokengym.collectors.policies.VLLMPolicy` (an engine in this process) and
:class:`~tokengym.collectors.policies.ServerPolicy` (a fleet of servers of any engine) share; a backend adds its dialect
(``tokengym.collectors.policies.dialects``: what differs per engine) and the two hooks that reach its engine. What an
update sends is decided once for every backend (:func:`weight_sync_of`, :func:`update_tensors`, :func:`full_items`): the full weights, a LoRA
adapter (engines that take adapters), or the base checkpoint with the adapter merged (engines that do not).

Partial rollouts (a wave interrupted by new weights) have one place to go: a wave is one ``send_wave`` under
``wave_lock``; it stops early when :meth:`WaveCore.should_stop` says so (``interrupt`` set, or enough rows ended:
over-sampling), the engine's unfinished requests are aborted with the tokens they have, and the result marks those rows
unfinished (``WaveResult.finished``): the env continues them in the next wave.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from tokengym.collectors.policies._checkpoints import read_checkpoint, weight_items
from tokengym.collectors.policies._lora_sync import check_not_adapter
from tokengym.collectors.policies._wave_requests import (
    check_budgets,
    check_greedy,
    empty_result,
    is_unmodified,
    wave_result,
)
from tokengym.collectors.policies._wave_state import RequestSeeds
from tokengym.collectors.policies.protocol import weights_of
from tokengym.collectors.policies.sampling import SamplingConfig
from tokengym.llm_envs.waves import WaveRequest, WaveResult

__all__ = ["WaveCore", "full_items", "update_tensors", "weight_sync_of"]


def weight_sync_of(lora, takes_adapters: bool) -> str:
    """What an update sends: ``"full"`` weights (no LoRA), the ``"adapter"`` (an engine that takes adapters) or the
    ``"merged"`` weights (one that does not).

    Example:
        >>> weight_sync_of(None, False), weight_sync_of(object(), True), weight_sync_of(object(), False)
        ('full', 'adapter', 'merged')
    """
    return "full" if lora is None else "adapter" if takes_adapters else "merged"


def update_tensors(weights, *, spec, sync: str, checkpoint_dir) -> Mapping | None:
    """The tensors an update sends, before their names are checked: the adapter's (``sync`` ``"adapter"``), the base
    checkpoint in ``checkpoint_dir`` with the adapter merged (``"merged"``), or ``weights`` as given (``"full"``;
    ``None``: the engine's own checkpoint). ``spec``: the policy's ``AdapterSpec`` (``None`` without LoRA)."""
    if sync == "full":
        return weights
    tensors = spec.tensors(weights)
    return tensors if sync == "adapter" else spec.merge(read_checkpoint(checkpoint_dir), tensors)


def full_items(weights, *, shapes, tied: dict, owner: str) -> list:
    """``(name, tensor)`` pairs of full weights for the engine, every checkpoint tensor present with its shape (a tied
    output layer missing is sent as its embedding); ``ValueError`` for LoRA tensors sent to ``owner``, which has no
    adapter."""
    check_not_adapter(weights_of(weights), owner)
    return weight_items(weights, shapes, tied)


class WaveCore:
    """The part every wave backend shares: sampling checks, per-request seeds, the budget check of a wave, its rows
    built by the backend's dialect, the answers read back into a :class:`~tokengym.llm_envs.waves.WaveResult`, the
    version a weight update bumps (restored when the update fails), and the collection state.

    A backend (a subclass) sets ``dialect``, ``_base`` (``dialect.sampling_fields(sampling)``), ``max_model_len`` and
    ``can_stop_strings`` before its first wave, and defines the hooks :meth:`check_open`, :meth:`send_wave` and
    :meth:`push_weights`, which only :meth:`generate` and :meth:`update_weights` call.

    Args:
        env: the env whose slots it continues.
        sampling: a :class:`~tokengym.collectors.policies.SamplingConfig`.
        seed: seed of the per-request sampling seeds.
    """

    is_wave_only = True
    budget_where = "the engine"
    """Names the engine in a budget error."""

    def __init__(self, env, sampling: SamplingConfig | None = None, seed: int = 0) -> None:
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        self.seeds, self.version = RequestSeeds(seed), 0
        self.env = getattr(env, "base_env", env)
        self.sampling = sampling or SamplingConfig()
        check_greedy(self.sampling)
        self.is_unmodified = is_unmodified(self.sampling)
        self.wave_lock = threading.Lock()
        """Held by a wave and by a weight update: they never overlap in this process."""
        self.interrupt = threading.Event()
        """Set (by a collector, when weights are published during a wave: partial rollouts), the wave in progress stops
        early: the dialect stops the engine's requests and the rows keep the tokens they have (unfinished rows)."""

    # -- generation --
    def generate(self, request: WaveRequest) -> WaveResult:
        """Continue every prompt of ``request`` until its turn ends (EOS id, stop string or its budget)."""
        if not isinstance(request, WaveRequest):
            raise TypeError(f"generate takes a WaveRequest (TokenEnv.wave_request()), got {type(request).__name__}")
        self.check_open()
        n = len(request)
        if n == 0:
            return empty_result(self.is_unmodified, self.version)
        budgets = check_budgets(request, self.max_model_len, where=self.budget_where)
        seeds = self.seeds.next(n, greedy=self.sampling.greedy)
        stops = request.stop_strings if self.can_stop_strings else ()
        fields = self.dialect.wave_fields(self._base, request.eos_token_ids, stops)
        rows = [self.dialect.row(fields, p.tolist(), m, s) for p, m, s in zip(request.prompts, budgets, seeds, strict=True)]
        answers, version = self.send_wave(request, rows)
        self.seeds.advance(n)  # only once the wave is complete: a failed wave is sent again with the same seeds
        replies = [self.dialect.reply(a) for a in answers]
        return wave_result([r[0] for r in replies], [r[1] for r in replies], is_unmodified=self.is_unmodified,
                           version=version, finished=[self.dialect.finished(a) for a in answers])  # fmt: skip

    def should_stop(self, request: WaveRequest) -> Callable[[int], bool]:
        """Whether the wave of ``request`` stops now, given how many of its rows have finished: ``interrupt`` is set
        (weights published during the wave), or ``request.min_finished`` rows ended (over-sampling). An engine checks
        it between its steps (its first check before the first step), then aborts the rows not finished.

        Example:
            >>> import torch
            >>> core = WaveCore(env=None)
            >>> request = WaveRequest(torch.arange(3), [torch.ones(2, dtype=torch.int64)] * 3, torch.full((3,), 4), (0,),
            ...                       min_finished=2)
            >>> stop = core.should_stop(request)
            >>> stop(1), stop(2)
            (False, True)
            >>> core.interrupt.set(); stop(0)
            True
        """
        k, interrupt = request.min_finished, self.interrupt
        if k is None or k >= len(request):  # every row runs to its end unless interrupted
            return lambda finished: interrupt.is_set()
        return lambda finished: interrupt.is_set() or finished >= k

    def check_open(self) -> None:
        """Hook: ``RuntimeError`` once the backend is closed."""
        raise NotImplementedError

    def send_wave(self, request: WaveRequest, rows: list) -> tuple[list, int]:
        """Hook: the engine's answers to ``rows`` (one each, in order) and the version they were sampled under."""
        raise NotImplementedError

    # -- weights --
    def update_weights(self, weights=None) -> int:
        """Load the trainer's weights into the engine (every server of a fleet), reset its prefix cache, bump the
        version.

        Args:
            weights: a ``transformers`` state_dict or a TensorDict of weights (transformers names, all of them; a
                tied output layer missing from it is sent as its embedding); ``None`` reloads the engine's checkpoint
                directory (after the trainer saved to it). A LoRA policy takes the PEFT model (or its adapter's
                tensors): a new adapter version, no cache reset (a new adapter name), or the merged weights for an
                engine without LoRA.

        The new version is visible while the weights load (no wave runs meanwhile); if loading fails, the version is
        unchanged. A fleet marks servers that fail to load down (they get the weights when they come back); if none
        takes them, :class:`~tokengym.errors.NoServerError` is raised.
        """
        self.check_open()
        with self.wave_lock:
            old = self.version
            # visible at once: a collector computing the version a queued update will give reads it while it loads
            self.version = new = old + 1
            try:
                self.push_weights(weights, new)
            except BaseException:
                self.version = old
                raise
        return self.version

    def push_weights(self, weights, version: int) -> None:
        """Hook: load ``weights`` (as :meth:`update_weights` takes them) as ``version`` (``wave_lock`` is held)."""
        raise NotImplementedError

    # -- state --
    def set_seed(self, seed: int) -> None:
        """Restart the per-request seeds from ``seed``."""
        self.seeds.reseed(seed)

    def collection_state(self) -> dict:
        """Seed, request counter and version (prefix caches are caches: they are not saved)."""
        return self.seeds.collection_state(version=self.version)

    def load_collection_state(self, state: dict) -> None:
        """Restore :meth:`collection_state`."""
        self.version = self.seeds.load_collection_state(state)
