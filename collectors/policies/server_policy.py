"""ServerPolicy: whole waves generated on a fleet of running inference servers, token ids in and out, any engine.

The wave policy of :class:`~tokengym.collectors.policies.vllm_policy.VLLMPolicy`, on a fleet of servers instead of an
engine in this process: the same per-request seeds, termination (the env's EOS ids as the request's stop ids with the
engine's own end id ignored, the env's stop strings, budgets clamped here) and log-prob semantics (``action_log_prob``
is the log-prob under the distribution sampled from; ``raw_log_prob`` only where the sampling leaves the model's
distribution unmodified).

The wave, its seeds, versions, state and weight path are the core every wave backend shares (:mod:`._wave_core`);
routing, failover and weight sync are the fleet's (:mod:`._server_fleet`, :mod:`._server_weights`); what is an
engine's own (request and answer fields, endpoints, start-up checks, weight reload, cache reset, abort, LoRA adapters,
how its engine dies) is its dialect (a :class:`~tokengym.collectors.policies.dialects.FleetDialect`: vLLM's
:class:`~._vllm_dialect.VLLMServerDialect`, SGLang's :class:`~.sglang_dialect.SGLangServerDialect`).
:class:`~tokengym.collectors.policies.VLLMServerPolicy` is this policy with vLLM's dialect.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
import urllib.parse
from pathlib import Path

from tokengym.collectors.policies._checkpoints import checkpoint_shapes, read_checkpoint, tied_outputs
from tokengym.collectors.policies._lora_servers import ServerAdapters
from tokengym.collectors.policies._lora_sync import check_not_adapter, tensor_bytes
from tokengym.collectors.policies._server_options import (
    NoServerError,
    RequestRejected,
    ServerOptions,
    WaveStop,
)
from tokengym.collectors.policies._server_weights import FleetLock, WeightTransport, load_call
from tokengym.collectors.policies._wave_core import WaveCore, full_items
from tokengym.collectors.policies.dialects import FleetDialect, ServerDialect, check_dialect
from tokengym.collectors.policies.protocol import probe_ids, weights_of
from tokengym.collectors.policies.sampling import SamplingConfig
from tokengym.llm_envs.waves import WaveRequest

__all__ = ["ServerPolicy"]

_log = logging.getLogger(__name__)


def _http(owner: str):
    """httpx and the fleet built on it (installed with vLLM; imported when a policy is built)."""
    try:
        import httpx

        from tokengym.collectors.policies._server_fleet import ServerFleet
    except ImportError as err:
        raise ImportError(f"{owner} needs httpx: pip install httpx (it comes with vllm) ({err})") from err
    return httpx, ServerFleet


class ServerPolicy(WaveCore):
    """Generates every live slot's turn of a :class:`~tokengym.llm_envs.TokenEnv` on running inference servers.

    A :class:`~tokengym.collectors.policies.protocol.WavePolicy` (``TokenCollector(..., source="wave")``); the servers
    speak ``dialect``'s API (:class:`~tokengym.collectors.policies.VLLMServerPolicy` is this policy with vLLM's).
    One generation request per slot, spread over the live servers (least outstanding requests; a
    multi-turn trajectory stays on its server so its prefix cache is reused). A server that dies, times
    out or answers 5xx is marked down and its requests go to another server with the same seeds: the wave
    completes with one answer per slot. A 4xx answer raises at once with the server's message. A server
    marked down is tried again after ``options.retry_down_after_s`` and used only once it holds the current
    weights. With no server left, :class:`NoServerError` names each server and its last failure; the wave's
    request counter is not advanced, so a checkpoint taken then resumes exactly.

    Partial rollouts: requests are streamed, so when weights are published from another thread during a wave (the
    collector sets :attr:`interrupt`) or enough rows have ended (``WaveRequest.min_finished``, over-sampling), the
    requests in flight are aborted by their ids and each stream is read to its end: each row comes back unfinished
    with every token its server generated, stamped with the wave's version; the next wave continues it (under the new
    weights). A server that fails mid-stream is not an abort: its rows go on on another server from the tokens they
    received (budget reduced, same seed).

    Version 0 is the servers' checkpoint. Each weight update tags the weights every server holds (the engine's weight
    version: vLLM's and SGLang's servers keep one); a policy built on servers that another run updated (tagged weights,
    and no record of them in ``options.weights_dir``) reloads their model directory before its first wave and logs a WARNING: to go on with
    those weights instead, build it with that run's ``weights_dir``. With a shared ``weights_dir`` that records a
    version, a server holding other weights is marked down and gets that version before it takes requests.

    Args:
        urls: base URL of each server (``"http://host:8000"``), or one URL.
        env: the env whose slots it continues (vocabulary, context limit and tokenizer are checked
            against every server at construction).
        dialect: the servers' engine (a :class:`~tokengym.collectors.policies.dialects.FleetDialect`:
            :class:`~tokengym.collectors.policies.VLLMServerDialect`,
            :class:`~tokengym.collectors.policies.SGLangServerDialect`); a subclass may set it as a class attribute
            instead (``VLLMServerPolicy`` does).
        sampling: a :class:`~tokengym.collectors.policies.SamplingConfig`.
        seed: seed of the per-request sampling seeds.
        options: a :class:`ServerOptions` (timeouts, the weights directory and transport, the model, the key).
        lora: the PEFT LoRA model being trained (or its ``peft.LoraConfig``) when the servers serve its base: updates
            send the adapter alone, loaded on every server under a new name that requests then name (servers that
            take adapters: the dialect's ``adapter_hint`` says how to start them), else the merged weights
            (``weight_sync`` says which).

    Every request carries the servers' key (``ServerOptions.api_key``, else ``$TOKENGYM_SERVER_KEY``) as
    ``Authorization: Bearer <key>``; the key is never logged, shown or saved with the collection state.

    Raises:
        TypeError: ``dialect`` lacks a member of its protocol (named), or none is given.
        ValueError: a server cannot be reached, refuses the policy's key or its lack of one (HTTP 401: pass the
            key it was started with), serves another model, has a smaller context or another
            vocabulary or tokenizer than the env, or would report log-probs that are not those of the
            distribution sampled from (the dialect's checks say how to start it); a URL ends with
            ``/v1`` (pass the server's base URL); an HTTP server is not the dialect's engine; a server's engine died
            (its log is named when this process started it, ``LocalVLLMServer`` or another launcher that registers
            its log). :class:`~tokengym.collectors.policies.VLLMServerPolicy` says what vLLM's checks add.

    Logs under ``tokengym.collectors.policies``: a server marked down and why, and each failover (WARNING); a weight
    update that a down server missed (WARNING, once); a server back, and each weight reload into a server (INFO).
    Its :meth:`counts` (servers up, failovers, revivals, reloads, requests sent again) join the collector's metrics.

    Example (not run here: two SGLang servers on GPU hosts)::

        policy = ServerPolicy(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], env, dialect=SGLangServerDialect(),
                              options=ServerOptions(weights_dir="/shared/weights/run-17", api_key=key))
        collector = TokenCollector(env, policy, mode="trajectories", batch_size=64, source="wave")
        for batch in collector:
            ...  # train
            collector.update_policy_weights_(model.state_dict())  # written once, reloaded into every server
    """

    dialect = None
    """What is the engine's own: request and answer fields, endpoints, start-up checks, weight reload, cache reset,
    abort, LoRA adapters (a ``FleetDialect``; see "Writing an engine dialect" in the backends guide)."""

    def __init__(self, urls, env, *, dialect=None, sampling: SamplingConfig | None = None, seed: int = 0,
                 options: ServerOptions | None = None, lora=None) -> None:  # fmt: skip
        if dialect is not None:
            self.dialect = dialect
        if self.dialect is None:
            raise TypeError(f"{type(self).__name__} needs the servers' dialect: pass dialect=VLLMServerDialect() or "
                            "SGLangServerDialect() (or use VLLMServerPolicy)")  # fmt: skip
        check_dialect(self.dialect, ServerDialect)
        check_dialect(self.dialect, FleetDialect)
        self.budget_where = f"the {self.dialect.name} server"
        urls = [urls] if isinstance(urls, str) else list(urls)
        bad = [u for u in urls if not isinstance(u, str) or not u.startswith(("http://", "https://"))]
        if not urls or bad:
            raise ValueError(f"urls must be one or more server URLs like 'http://host:8000', got {urls!r}")
        for url in urls:
            _check_base_url(url, self.dialect.generate_path, type(self).__name__)
        super().__init__(env, sampling, seed)
        if options is not None and not isinstance(options, ServerOptions):
            raise TypeError(f"options must be a ServerOptions, got {type(options).__name__}")
        self.options = options or ServerOptions()
        if self.options.transport is not None and not isinstance(self.options.transport, WeightTransport):
            raise TypeError(f"options.transport must implement WeightTransport (publish, load_calls, close), got "
                            f"{type(self.options.transport).__name__}")  # fmt: skip
        self.lock_dir = self.options.weights_dir or tempfile.mkdtemp(prefix="tokengym-fleet-")
        Path(self.lock_dir).mkdir(parents=True, exist_ok=True)
        self.transport = self.options.transport or self.dialect.transport(self.options.weights_dir)
        self.fleet_lock = FleetLock(self.lock_dir)
        self._httpx, fleet_class = _http(type(self).__name__)
        self.fleet = fleet_class(urls, self.dialect, options=self.options)
        self.fleet.revive = self._revive
        try:
            self._check_servers()
            self._check_weights()
            self.adapters = None if lora is None else ServerAdapters(lora, self)
        except BaseException:
            self.close()
            raise
        if self.adapters is not None and self.adapters.transport is not None:  # servers that take LoRA adapters
            self.transport.close()
            self.transport = self.adapters.transport
        self.weight_sync = "full" if self.adapters is None else self.adapters.sync
        """What an update sends: ``"full"`` weights, the LoRA ``"adapter"``, or the ``"merged"`` weights."""
        self.last_update_bytes = 0
        """Bytes of the tensors the last :meth:`update_weights` published."""
        self._base = self.dialect.sampling_fields(self.sampling)

    def _check_servers(self) -> None:
        async def inspect_all():
            ids = probe_ids(self.env.tokenizer)
            return await asyncio.gather(*(self.dialect.inspect(self.fleet, s, ids) for s in self.fleet.servers))

        self.answers = self.fleet.run(inspect_all())
        for answer in self.answers:
            self.dialect.check(answer, self.env, is_unmodified=self.is_unmodified, model=self.options.model,
                               sampling=self.sampling)  # fmt: skip
        self.dialect.check_fleet(self.answers)
        for server, answer in zip(self.fleet.servers, self.answers, strict=True):
            server.model, server.max_model_len = answer["model"], answer["max_model_len"]
        self.max_model_len = int(self.answers[0]["max_model_len"] or self.env.max_length)
        self.can_stop_strings = all(a["probe_text"] is not None for a in self.answers)
        local = self.options.checkpoint_dir or self.answers[0]["root"]
        self.checkpoint_dir = local if local and Path(local, "config.json").is_file() else None

    def weights_tag(self, version: int) -> str:
        """The tag an update to ``version`` gives the servers' weights: the version and this fleet's weights
        directory (``options.weights_dir``, else the policy's own temporary one), so another run's are told apart.

        Example (not run here: a policy needs running servers)::

            policy.weights_tag(3)   # 'tokengym v3 /shared/weights/run-17'
        """
        return f"tokengym v{version} {Path(self.lock_dir).resolve()}"

    def _check_weights(self) -> None:
        """Make version 0 (or the version a shared ``weights_dir`` records) what the servers hold: servers whose
        tagged weights an earlier run loaded have their model directory reloaded (WARNING: the fix for a resumed run
        is its ``weights_dir``); with a record, a server holding other weights is marked down (revived with them)."""

        async def held():
            return await asyncio.gather(*(self.dialect.held_weights(self.fleet, s) for s in self.fleet.servers))

        with self.fleet_lock.exclusive() as (version, handle):
            tags = self.fleet.run(held())
            initial = self.dialect.initial_weights
            if handle is not None:  # this fleet's weights directory records what the servers hold
                expected = {self.weights_tag(version)} | ({initial} if version == 0 else set())  # v0: a LoRA adapter
                for server, tag in zip(self.fleet.servers, tags, strict=True):
                    if tag is not None and tag not in expected:
                        self.fleet.mark_down(server, f"it holds weights tagged {tag!r}, not version {version} of "
                                                     f"{self.lock_dir} (it reloads them before it takes requests)")  # fmt: skip
                return
            stale = [(s, t) for s, t in zip(self.fleet.servers, tags, strict=True) if t is not None and t != initial]
            if not stale:
                return
            urls, held = ", ".join(s.url for s, _ in stale), "; ".join(sorted({repr(t) for _, t in stale}))
            resume = ("to go on with those weights instead (a resumed run), build the policy with that run's "
                      "ServerOptions(weights_dir=...) and load the collector's checkpoint")  # fmt: skip
            if self.checkpoint_dir is None:
                raise ValueError(f"{self.dialect.name} server(s) {urls} hold weights an earlier run loaded ({held}), "
                                 f"not their checkpoint, and a new {type(self).__name__} starts at version 0 (the "
                                 "checkpoint); restart them, pass ServerOptions(checkpoint_dir=<a local copy of the "
                                 f"served model directory>) so that the policy reloads it into them, or {resume}")  # fmt: skip
            _log.warning("%s server(s) %s hold weights an earlier run loaded (%s), not their checkpoint; a new "
                         "%s starts at version 0, so it loads their checkpoint (%s) into them now; %s",
                         self.dialect.name, urls, held, type(self).__name__, self.checkpoint_dir, resume)  # fmt: skip
            handle = self.transport.publish(self._checkpoint_items(), 0)
            self.fleet.run(self._reload_checkpoints([s for s, _ in stale], handle))

    async def _reload_checkpoints(self, servers: list, handle: str) -> None:
        async def reload(server) -> None:
            start = time.monotonic()
            await self._load_one(server, handle, self.dialect.initial_weights)
            self.fleet.reloaded(server, 0, time.monotonic() - start)

        await asyncio.gather(*(reload(server) for server in servers))

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.fleet.servers]

    def counts(self) -> dict[str, int]:
        """The fleet's counters, which a collector adds to its metrics: ``servers_up`` (taking requests now),
        ``server_failovers`` (servers marked down, their requests sent elsewhere), ``server_revivals`` (servers
        back), ``server_reloads`` (weights loaded into one server, updates and revivals), ``retried_requests``
        (requests sent again after their server failed or dropped the connection, each counted once however many
        sends it took), ``failover_kept_tokens`` and ``server_discarded_tokens`` (tokens a server said it generated
        that this client never received)."""
        return self.fleet.counts() if self.fleet is not None else dict(self._closed_counts)

    # -- generation --
    def send_wave(self, request: WaveRequest, rows: list) -> tuple[list, int]:
        with self.wave_lock, self.fleet_lock.shared() as (fleet_version, handle):
            if self.adapters is not None:  # name the adapter the servers hold
                self.adapters.name_requests(rows, handle)
            # streamed: an interrupt (new weights published) or enough rows ended stops the wave, and the rows in
            # flight keep what they received (unfinished: the next wave continues them under the new weights)
            until = WaveStop(self.interrupt, request.min_finished)
            answers = self.fleet.complete(rows, self._sticky_keys(request), until)
        # stamped with the version the servers hold (a process sharing them may have loaded newer weights; it
        # waited for this wave: no token of it was sampled under weights loaded during it)
        return answers, max(self.version, fleet_version)

    def _sticky_keys(self, request: WaveRequest) -> list:
        """One key per trajectory: (slot, group, sample) of the prompt the slot works on."""
        prompt_of = getattr(self.env, "slot_prompt", None)
        if prompt_of is None:
            return [None] * len(request)
        keys = []
        for slot in request.slots.tolist():
            p = prompt_of(slot)
            keys.append(None if p is None else (slot, p.group_id, p.sample_id))
        return keys

    def check_open(self) -> None:
        if self.fleet is None:
            raise RuntimeError(f"this {type(self).__name__} is closed; build a new one")

    # -- weights --
    def push_weights(self, weights, version: int) -> None:
        items = None if weights is None and self.adapters is None else self._weight_items(weights)
        self.last_update_bytes = 0 if items is None else tensor_bytes(items)
        with self.fleet_lock.exclusive() as (fleet_version, _):
            if fleet_version < version:  # else a process sharing these servers loaded this version already
                handle = self.transport.publish(items if items is not None else self._checkpoint_items(), version)
                self.fleet.run(self._load_all(handle, version))
                self.fleet_lock.write(version, handle)

    def _checkpoint_items(self) -> list:
        """The tensors of the servers' model directory, read here (a tied output layer sent as its embedding: a server
        reloading the directory itself keeps the output layer it had)."""
        if self.checkpoint_dir is None:
            raise ValueError(f"update_weights(None) reloads the servers' model directory, but "
                             f"{self.answers[0]['root']!r} is not a directory here; pass the weights")  # fmt: skip
        return self._full_items(read_checkpoint(self.checkpoint_dir))

    def _weight_items(self, weights) -> list:
        if self.adapters is not None:  # a LoRA policy: its adapter, or the merged weights for servers without LoRA
            weights = self.adapters.weights(weights)
            if self.adapters.transport is not None:
                return list(weights.items())
        if self.checkpoint_dir is None:
            check_not_adapter(weights_of(weights), f"the {type(self).__name__}")
            raise ValueError(f"the servers' model path {self.answers[0]['root']!r} is not a directory here, so "
                             "the weights' names, shapes and tied layers cannot be checked; pass "
                             "ServerOptions(checkpoint_dir=<a local copy of the served model directory>)")  # fmt: skip
        return self._full_items(weights)

    def _full_items(self, weights) -> list:
        if not hasattr(self, "_shapes"):
            from transformers import AutoConfig

            self._shapes = checkpoint_shapes(self.checkpoint_dir)
            self._tied = tied_outputs(AutoConfig.from_pretrained(self.checkpoint_dir))
        return full_items(weights, shapes=self._shapes, tied=self._tied, owner=f"the {type(self).__name__}")

    async def _load_one(self, server, handle: str, tag: str | None) -> None:
        """Load ``handle`` into ``server``, reset its prefix cache, tag its weights ``tag`` (``None``: an adapter,
        the base weights unchanged)."""
        for path, body in self.transport.load_calls(handle):
            await load_call(self.fleet, server, path, body)
        await self.dialect.reset_cache(self.fleet, server)
        if tag is not None:
            await self.dialect.tag_weights(self.fleet, server, tag)

    def _tag(self, version: int) -> str | None:
        """The tag of ``version``'s weights; ``None`` where an update loads a LoRA adapter (the base is unchanged)."""
        return self.weights_tag(version) if self.adapters is None or self.adapters.transport is None else None

    async def _load_all(self, handle: str, version: int) -> None:
        async def load(server):
            start = time.monotonic()
            try:
                await self._load_one(server, handle, self._tag(version))
            except RequestRejected as err:
                if err.status_code == 401:  # says itself which key to pass
                    raise
                raise ValueError(f"{err}; {self.dialect.reload_hint}") from err
            except (self._httpx.HTTPError, OSError) as err:
                self.fleet.mark_down(server, f"weight reload failed: {type(err).__name__}: {err}"[:300])
                return
            self.fleet.reloaded(server, version, time.monotonic() - start)

        await asyncio.gather(*(load(s) for s in self.fleet.up()))
        for server in self.fleet.servers:
            if not server.is_up:
                self.fleet.missed(server, version)
        if not self.fleet.up():
            raise NoServerError(
                f"no {self.dialect.name} server took the weights of version {version} ({self.fleet.failures()})"
            )

    async def _revive(self, server) -> None:
        """A server marked down answers again: give it the current weights before it takes requests."""
        await self.fleet.call(server, "GET", self.dialect.health_path, timeout=self.options.connect_timeout_s)
        version, handle = self.fleet_lock.read()
        start = time.monotonic()
        if handle is not None:
            await self._load_one(server, handle, self._tag(version))
            self.fleet.reloaded(server, version, time.monotonic() - start)
        server.version = version

    def close(self) -> None:
        """Close the HTTP client and remove this policy's own weight files (the servers keep running)."""
        fleet, self.fleet = getattr(self, "fleet", None), None
        if fleet is not None:
            self._closed_counts = fleet.counts()
            fleet.close()
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()
        if self.options.weights_dir is None and getattr(self, "lock_dir", None):
            shutil.rmtree(self.lock_dir, ignore_errors=True)


def _check_base_url(url: str, generate_path: str, owner: str) -> None:
    """A server's base URL: the policy adds ``generate_path`` (``/v1/completions``) and the control paths itself."""
    path = urllib.parse.urlsplit(url).path.rstrip("/")
    if path.endswith("/v1"):
        base = url.rstrip("/")[: -len("/v1")]
        raise ValueError(f"server URL {url!r} ends with /v1, but {owner} takes the server's base URL (it "
                         f"adds {generate_path}, /health and its control paths itself); pass {base!r}")  # fmt: skip
