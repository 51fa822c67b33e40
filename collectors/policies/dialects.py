"""What differs per generation engine, and nothing else: the dialect protocols of the wave backends.

Every wave backend (an engine in this process, a fleet of servers) is one core
(:class:`~tokengym.collectors.policies.WaveCore`: request seeds, budgets, versions, collection state, the weight path,
the LoRA choice) and one dialect that speaks to the engine. A dialect turns a wave into the engine's requests and its
answers back into token ids and log-probs, and knows the engine's endpoints, start-up checks, weight reload, cache
reset and abort. vLLM's are :class:`~tokengym.collectors.policies.VLLMServerDialect` and
:class:`~tokengym.collectors.policies.VLLMEngineDialect`, SGLang's server is
:class:`~tokengym.collectors.policies.SGLangServerDialect`; ``docs/guides/backends.md`` ("Writing an engine dialect")
walks through the SGLang one.

:func:`check_dialect` refuses, with a ``TypeError`` naming them, a dialect that lacks a member its protocol requires,
before it reaches an engine.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Generic, Protocol

from tokengym.collectors.policies.sampling import SamplingConfig

__all__ = ["EngineDialect", "FleetDialect", "ServerDialect", "WaveDialect", "check_dialect", "required_members"]


class WaveDialect(Protocol):
    """How one engine's requests and answers look (both kinds of dialect).

    The core calls, per wave: ``wave_fields`` once, ``row`` per prompt, the backend sends the rows, ``reply`` per
    answer. Sampling fields are computed once per policy by ``sampling_fields`` (a policy keeps them as ``_base``).
    """

    name: str
    """The engine's name in messages (``"vLLM"``)."""
    max_stop_strings: int | None
    """The most stop strings a request may carry (``None``: any number); the env cuts each turn at its first stop
    string whatever the engine stopped on, so any subset is safe."""

    def sampling_fields(self, sampling: SamplingConfig) -> dict:
        """The request fields a :class:`~tokengym.collectors.policies.SamplingConfig` maps to, with what makes the
        engine return one processed log-prob per sampled token, ignore its own end id and keep token ids."""

    def wave_fields(self, base: dict, eos_token_ids: Sequence[int], stop_strings: Sequence[str]) -> dict:
        """``base`` (the sampling fields) with the wave's end ids and stop strings (at most ``max_stop_strings``)."""

    def row(self, fields: dict, prompt: list[int], max_tokens: int, seed: int | None) -> Any:
        """One request: ``prompt`` token ids continued by at most ``max_tokens`` tokens sampled with ``seed``."""

    def reply(self, answer: Any) -> tuple[Sequence[int], Sequence[float] | None]:
        """The token ids of one answer and their log-probs (``None`` when the engine gave none)."""

    def finished(self, answer: Any) -> bool:
        """False where the engine stopped the row before its turn ended (aborted: an interrupt, or enough rows
        finished); the row then holds the tokens it has so far, and the next wave continues it."""


class ServerDialect(WaveDialect, Protocol):
    """What an HTTP inference server adds: endpoints, start-up checks, weight reload and its tag, cache reset, abort.

    Async members run on the fleet's event loop; ``fleet`` is the policy's server fleet (``fleet.call(server,
    method, path, body)`` returns the decoded JSON answer; a 4xx answer raises
    :class:`~tokengym.collectors.policies.RequestRejected`).
    """

    generate_path: str
    """The path a generation request is POSTed to (``"/v1/completions"``)."""
    health_path: str
    """The path that answers 200 once the server takes requests (``"/health"``)."""
    reload_hint: str
    """What a server that refuses a weight reload needs (appended to its 4xx answer)."""
    initial_weights: str
    """The tag (:meth:`held_weights`) of a server that loaded no weights since it started: it holds its checkpoint."""

    async def inspect(self, fleet, server, probe_ids: list[int]) -> dict:
        """What ``server`` says about itself: a dict with at least ``url``, ``model``, ``root`` (its model path),
        ``max_model_len``, ``vocab_size`` and ``probe_text`` (``probe_ids`` decoded by the server, ``None`` when it
        has no tokenizer: stop strings are then left to the env). ``ValueError`` when it is not this engine's
        server or cannot be reached."""

    def check(self, answer: dict, env, *, is_unmodified: bool, model: str | None, sampling: SamplingConfig) -> None:
        """``ValueError`` naming the server and the fix where ``answer`` (:meth:`inspect`) does not fit ``env``."""

    def check_fleet(self, answers: list[dict]) -> None:
        """``ValueError`` where the servers of one fleet differ (model, context, vocabulary)."""

    def transport(self, root):
        """The default :class:`~tokengym.collectors.policies._server_weights.WeightTransport` (``root``: where
        weights are written, ``None`` a temporary directory): how a server loads published weights."""

    async def reset_cache(self, fleet, server) -> None:
        """Drop ``server``'s prefix cache (KV computed under the old weights) after new weights."""

    async def held_weights(self, fleet, server) -> str | None:
        """The tag of the weights ``server`` holds: :attr:`initial_weights` until a weight update tagged them
        (:meth:`tag_weights`); ``None`` when the server cannot say. A policy built on servers that an earlier run
        updated reads it to refuse stamping their weights as version 0."""

    async def tag_weights(self, fleet, server, tag: str) -> None:
        """Record ``tag`` on ``server`` as the weights it holds now (called after each reload)."""

    def stream(self, row: Any) -> Any:
        """``row`` asked as a stream (one event per generated step) under a request id of its own (what
        :meth:`abort` names), so a row keeps what it has when it is stopped."""

    def answer(self) -> Any:
        """An answer with no token yet, which :meth:`take` fills (``reply`` and ``finished`` read it as a whole one)."""

    def take(self, answer: Any, chunk: dict) -> None:
        """Fold one streamed event into ``answer``; an error event raises (``RequestRejected`` for a 4xx, else
        ``OSError``: the server failed). An event that says the request was aborted is no end (:meth:`finished`
        stays False)."""

    def received(self, answer: Any) -> int:
        """Tokens ``answer`` holds so far."""

    def generated(self, answer: Any) -> int | None:
        """The tokens the server says it generated for the request whose stream just ended (its usage), then
        forgotten; ``None`` when it said nothing (a stream closed before its end). The fleet counts what it generated
        beyond what was received as discarded."""

    def resume(self, row: Any, answer: Any) -> Any | None:
        """``row`` continued from what ``answer`` received (its server failed mid-stream: the row goes on on another
        server): prompt plus those tokens, the budget less them, the same seed; ``None`` when nothing is left."""

    async def abort(self, fleet, server, requests: Sequence) -> bool:
        """Ask ``server`` to stop ``requests`` (as :meth:`stream` made them); their streams then end with every token
        generated so far, which the fleet reads before it closes them (partial rollouts: a wave stopped by new
        weights, or once enough rows ended). A request the server does not know yet (still on its way) is left
        alone: the fleet asks again for the requests whose streams go on. False when the server cannot abort a
        request by its id: the fleet then closes their connections (what the server generated after the last token
        read is lost)."""


class FleetDialect(ServerDialect, Protocol):
    """What :class:`~tokengym.collectors.policies.ServerPolicy` asks of a server dialect beyond one server's API: how
    the engine says it died, and how its servers take LoRA adapters (a policy built with ``lora=``; servers that take
    none get the merged weights instead).
    """

    adapter_hint: str
    """What a server needs to take LoRA adapters of rank ``{rank}`` (a format string: ``"--enable-lora
    --max-lora-rank {rank} (or more)"``): named where some servers of a fleet take them and others do not, where they
    take none and merged weights go instead, or where they cannot load the adapter."""

    def engine_died(self, message: str) -> bool:
        """Whether a 5xx answer whose message is ``message`` says the server's engine died (the fleet then names the
        server's log, when this process started it)."""

    async def takes_adapters(self, fleet, server) -> bool:
        """Whether ``server`` loads LoRA adapters while it runs (``RequestRejected`` for a 401 goes up)."""

    def adapter_calls(self, handle: str) -> list[tuple[str, dict]]:
        """``(path, json body)`` of the POSTs that load the adapter directory ``handle`` into one server, under its
        directory's name (again in place where the server holds that name already: a revived server)."""

    def name_adapter(self, row: Any, name: str) -> None:
        """Make request ``row`` (:meth:`row`) sample with the adapter loaded under ``name``."""


class EngineDialect(WaveDialect, Protocol):
    """What an engine in this process adds: generation that can stop between two engine steps, weight reload and
    cache reset."""

    def generate(self, rows: list, adapter=None, *, should_stop=None) -> list:
        """The answers to ``rows`` (:meth:`row`), in order, sampled with LoRA ``adapter`` (``None``: the base).

        ``should_stop(finished)`` (``None``: never), called before each engine step with the number of rows finished
        so far: once it returns True the engine stops and every row not finished is aborted and answered with the
        tokens and log-probs it has (:meth:`finished` False). Partial rollouts (an interrupt: weights published
        mid-wave) and over-sampling (enough rows ended) stop waves this way."""

    def reload(self, items: list) -> None:
        """Load ``(name, tensor)`` pairs (transformers names, every tensor of the checkpoint) into the engine."""

    def reset_cache(self) -> None:
        """Drop the engine's prefix cache (KV computed under the old weights)."""


def required_members(protocol: type) -> list[str]:
    """The names a dialect of ``protocol`` must have: its attributes and methods, and its bases'.

    Example:
        >>> required_members(WaveDialect)
        ['finished', 'max_stop_strings', 'name', 'reply', 'row', 'sampling_fields', 'wave_fields']
    """
    names = set()
    for cls in protocol.__mro__:
        if cls in (object, Protocol, Generic):
            continue
        names |= set(vars(cls).get("__annotations__", {}))
        names |= {n for n, v in vars(cls).items() if inspect.isfunction(v)}
    return sorted(n for n in names if not n.startswith("_"))


def check_dialect(dialect, protocol: type) -> None:
    """``TypeError`` naming each member of ``protocol`` that ``dialect`` lacks (or has as a non-method).

    Example:
        >>> class Half:
        ...     name, max_stop_strings = "X", None
        ...     def reply(self, answer): ...
        >>> check_dialect(Half(), WaveDialect)
        Traceback (most recent call last):
        ...
        TypeError: the Half dialect lacks finished, row, sampling_fields, wave_fields of the WaveDialect protocol; ...
    """
    missing = []
    for name in required_members(protocol):
        if not hasattr(dialect, name) or (callable(getattr(protocol, name, None)) and not callable(getattr(dialect, name))):
            missing.append(name)
    if missing:
        raise TypeError(f"the {type(dialect).__name__} dialect lacks {', '.join(missing)} of the {protocol.__name__} "
                        f"protocol; a dialect implements every member of it (see "
                        f"tokengym.collectors.policies.dialects and docs/guides/backends.md)")  # fmt: skip
