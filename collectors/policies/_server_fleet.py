"""A fleet of inference servers behind one client: routing, failover, and HTTP on a private event loop.

:class:`ServerFleet` sends a wave of requests over the live servers (least outstanding requests; a key
such as a trajectory sticks to the server it used before, so its prefix cache is reused). A server that
cannot be reached, times out or answers 5xx is marked down and its requests are sent again elsewhere,
unchanged (same seeds): each request gets exactly one answer. A request whose connection is closed without an
answer is first sent once more to the same server (a connection the server was closing as it was reused is not
a server that is down; one that is gone refuses the next connection and is marked down then). A 4xx answer is
the request's fault and raises at once with the server's message. With no server left, :class:`NoServerError` names each
server and its last failure. A server whose engine died (a 5xx answer the dialect's ``engine_died`` recognizes: vLLM's
names its ``EngineCore``) is described so, with its log file when this process started it (the launchers' registry,
:mod:`._server_logs`). Logs name the engine (``dialect.name``: "vLLM server ...", "SGLang server ...").

Requests are streamed: each row's tokens and log-probs are kept as they arrive (the dialect folds each chunk into
its answer). That is what lets a wave stop early and go on later (partial rollouts, :meth:`ServerFleet.complete`'s
``until``): when the policy's ``interrupt`` is set (new weights published) or enough rows have ended
(``WaveRequest.min_finished``), the fleet asks each server to abort the rows in flight by their request ids (the
dialect's ``abort``) and goes on reading their streams until each ends: a row keeps every token its server generated,
unfinished, and none is generated twice. A request the server took only after that abort (its first chunk comes
after the wave stopped) is aborted at that chunk, and the fleet asks again every ``_ABORT_WAIT_S`` until every
stream ended. What a server says it generated beyond what was received (its usage) is
counted in ``server_discarded_tokens``; a server that cannot abort by id has its connections closed instead (logged
once: what it generated after the last token read is lost). A server that fails mid-stream is another matter: its
rows are sent again elsewhere *from the tokens they received* (prompt and tokens so far, the budget reduced, the same
seed), so nothing it streamed is lost.

What happens is logged under ``tokengym.collectors.policies`` (a server marked down and why: WARNING;
a server back: INFO) and counted in :meth:`ServerFleet.counts` (servers up, failovers, revivals, requests
sent again), which reach the collector's metrics through the policy.

HTTP is ``httpx.AsyncClient`` on an asyncio loop in a daemon thread of its own, so a synchronous caller
(the collector) and one that already runs an event loop (a notebook) call it alike. The client sends the key
(:func:`~tokengym.collectors.policies._server_options.server_key`) as ``Authorization: Bearer <key>`` with every
request; it is held by the client's headers only (httpx shows them as ``[secure]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import httpx

from tokengym.collectors.policies._server_logs import server_log
from tokengym.collectors.policies._server_options import (
    NoServerError,
    RequestRejected,
    ServerOptions,
    WaveStop,
    server_key,
)
from tokengym.collectors.policies._sse import event_lines
from tokengym.collectors.policies.server_guard import KEY_VARIABLE

__all__ = ["Server", "ServerFleet", "describe_answer"]

_log = logging.getLogger(__name__)
_RETRY_PAUSE_S = 1.0  # before a control call without side effects is sent again
_ABORT_WAIT_S = 0.5  # for aborted streams to end before the requests still streaming are aborted again


@dataclasses.dataclass
class Server:
    """What the client knows of one server."""

    url: str
    model: str | None = None
    """The model id it serves (``/v1/models``)."""
    max_model_len: int | None = None
    is_up: bool = True
    version: int = 0
    """Weights version it holds (as far as this client knows)."""
    outstanding: int = 0
    answered: int = 0
    """Generation requests it answered."""
    streamed: int = 0
    """Streamed chunks it sent (generation requests)."""
    last_failure: str | None = None
    down_reason: str | None = None
    """Why it was marked down (``last_failure`` is the latest failed attempt to bring it back)."""
    down_since: float = 0.0
    has_missed_weights: bool = False
    """A weight update went by while it was down (warned once; it reloads when it comes back)."""
    attempts: dict = dataclasses.field(default_factory=dict)
    """Requests in flight on it: each attempt's task and the request it streams (cancelled, and sent elsewhere, when
    it goes down; aborted by their ids when a wave stops)."""
    aborts_by_id: bool = True
    """Whether it aborts a request named by its id (else a stopped wave closes its connections)."""
    has_warned_abort: bool = False


class _Run:
    """One wave in flight: each row's answer so far, how many rows ended, whether it was told to stop."""

    def __init__(self, answers: list, until: WaveStop) -> None:
        self.answers, self.until, self.ended = answers, until, 0
        self.is_stopped = False
        self.stopped = asyncio.Event()
        self.late_aborts: set[asyncio.Task] = set()  # aborts of requests the server took after the wave stopped

    def stop(self) -> None:
        self.is_stopped = True
        self.stopped.set()

    def should_stop(self) -> bool:
        """Checked at every chunk: stop once the interrupt is set or enough rows ended."""
        if not self.is_stopped:
            u = self.until
            if (u.interrupt is not None and u.interrupt.is_set()) or (
                u.min_finished is not None and self.ended >= u.min_finished
            ):
                self.stop()
        return self.is_stopped


def _describe(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:300]


def describe_answer(response: httpx.Response) -> str:
    """The message of an error answer: vLLM's JSON ``error.message``, a short plain text, or what the body is
    (an HTML page is never quoted)."""
    try:
        return str(response.json()["error"]["message"])[:500]
    except (ValueError, KeyError, TypeError):
        pass
    kind = response.headers.get("content-type", "").split(";")[0].strip()
    if kind in ("text/plain", "application/json") or (kind == "" and response.text.isprintable()):
        return response.text[:500] or "(empty body)"
    return f"a {kind or 'non-JSON'} page of {len(response.content)} bytes"


def engine_died(dialect, server_url: str, status: int, message: str) -> str | None:
    """The reason to give for a 5xx answer that says the server's engine died (``dialect.engine_died``), naming its
    log; else ``None``."""
    if not dialect.engine_died(message):
        return None
    log = server_log(server_url)
    where = f"its log {log}" if log is not None else f"the {dialect.name} server's output (its log)"
    return (f"its engine died (HTTP {status}: {message[:160]}); the cause is in {where}; restart the server (the "
            "policy takes it back with the current weights)")


class ServerFleet:
    """Servers at ``urls`` and one HTTP client for all of them.

    Args:
        urls: base URLs (``http://host:port``), one per server.
        dialect: the engine's server dialect (a ``ServerDialect``): where a generation request is POSTed, how it
            is streamed and its chunks read, how a row goes on from its tokens, how requests are aborted.
        options: a :class:`ServerOptions`.

    Attributes:
        client: the ``httpx.AsyncClient`` every call and every stream goes through, on the fleet's own event loop:
            its ``event_hooks`` (coroutines) see each request before it is sent and each answer as it arrives
            (tracing, logging, a request held until an event).
    """

    def __init__(self, urls: Sequence[str], dialect, *, options: ServerOptions | None = None) -> None:
        self.options, self.dialect = options or ServerOptions(), dialect
        self.generate_path = dialect.generate_path
        self.servers = [Server(url.rstrip("/")) for url in urls]
        self.sticky: dict[Hashable, Server] = {}
        self.revive: Callable | None = None  # async (server) -> None: make a returning server current
        self.has_key = server_key(self.options) is not None
        self.counters = {"server_failovers": 0, "server_revivals": 0, "server_reloads": 0, "retried_requests": 0,
                         "failover_kept_tokens": 0, "server_discarded_tokens": 0}  # fmt: skip
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tokengym-server-fleet", daemon=True
        )
        self._thread.start()
        self.client = self.run(self._make_client())

    async def _make_client(self) -> httpx.AsyncClient:
        o = self.options
        timeout = httpx.Timeout(o.control_timeout_s, connect=o.connect_timeout_s)
        # idle connections expire before the server's keep-alive timeout (uvicorn: 5 s), so a request never
        # goes out on a connection the server is closing (a ReadError that would mark a healthy server down)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=2.0)
        key = server_key(o)
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)

    def run(self, coro):
        """Run ``coro`` on the fleet's loop and return its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Close the HTTP client and stop the loop."""
        if self._loop.is_closed():
            return
        self.run(self.client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    # -- control calls --
    async def call(
        self, server: Server, method: str, path: str, payload=None, *, timeout: float | None = None,
        retry: bool = False,
    ):
        """One control call; returns the decoded JSON (or ``None``); raises ``httpx`` errors and
        :class:`RequestRejected` / ``httpx.HTTPStatusError`` for 4xx / 5xx answers. ``retry``: a call without
        side effects is sent once more, after a pause, when its connection fails (a dropped connection is not yet
        a server that is down)."""
        timeout = self.options.control_timeout_s if timeout is None else timeout
        url = server.url + path
        try:
            response = await self.client.request(method, url, json=payload, timeout=timeout)
        except httpx.TransportError as err:
            if not retry:
                raise
            _log.warning("%s %s failed (%s: %s); sending it once more", method, url, type(err).__name__, err)
            await asyncio.sleep(_RETRY_PAUSE_S)
            response = await self.client.request(method, url, json=payload, timeout=timeout)
        _raise_for_status(self.dialect, server, response)
        return response.json() if response.content else None

    async def is_open(self, server: Server, path: str) -> bool:
        """Whether ``server`` answers ``GET path`` with 200 to a request that carries no key."""
        request = self.client.build_request("GET", server.url + path, timeout=self.options.control_timeout_s)
        request.headers.pop("Authorization", None)
        return (await self.client.send(request)).status_code == 200

    def mark_down(self, server: Server, reason: str, *, moving: int = 0) -> None:
        """Take ``server`` out of the rotation; its requests in flight go elsewhere (``moving``: requests whose
        failure marks it down, sent elsewhere by the caller)."""
        if not server.is_up:
            return
        server.is_up, server.last_failure, server.down_reason = False, reason, reason
        server.down_since = time.monotonic()
        self.counters["server_failovers"] += 1
        moved = moving + len(server.attempts)
        live = [s.url for s in self.up()]
        where = f"go to {', '.join(live)}" if live else "wait: no server is left up"
        _log.warning("%s server %s marked down: %s; %d request(s) in flight on it %s (it is tried again after "
                     "%.0f s)", self.dialect.name, server.url, reason, moved, where, self.options.retry_down_after_s)  # fmt: skip
        for attempt in list(server.attempts):
            attempt.cancel()

    def reloaded(self, server: Server, version: int, seconds: float) -> None:
        """Record that ``server`` loaded weights ``version`` (in ``seconds``)."""
        server.version = version
        self.counters["server_reloads"] += 1
        _log.info("%s server %s reloaded weights version %d in %.2f s", self.dialect.name, server.url, version, seconds)

    def missed(self, server: Server, version: int) -> None:
        """Warn (once while it stays down) that ``server`` is down and misses weights ``version``."""
        if server.has_missed_weights:
            return
        server.has_missed_weights = True
        _log.warning("%s server %s is down (%s) and did not get weights version %d; it gets the current weights "
                     "when it answers again (it is tried before a wave, every %.0f s)", self.dialect.name, server.url,
                     _failure(server), version, self.options.retry_down_after_s)  # fmt: skip

    def up(self) -> list[Server]:
        return [s for s in self.servers if s.is_up]

    def counts(self) -> dict[str, int]:
        """``servers_up`` now; failovers (servers marked down), revivals (servers back), weight reloads into a server,
        requests sent more than once (each counted once), the tokens they had received from a server that failed
        (kept: the request went on from them) and the tokens servers said they generated but this client did not
        receive (``server_discarded_tokens``), since the fleet was made."""
        return {"servers_up": len(self.up()), **self.counters}

    def failures(self) -> str:
        return "; ".join(f"{s.url}: {_failure(s)}" for s in self.servers)

    async def revive_down(self, *, force: bool = False) -> None:
        """Try the servers that are down (those down for ``retry_down_after_s``, or all with ``force``)."""
        now, wait = time.monotonic(), self.options.retry_down_after_s
        due = [s for s in self.servers if not s.is_up and (force or now - s.down_since >= wait)]
        if due and self.revive is not None:
            await asyncio.gather(*(self._revive_one(s) for s in due))

    async def _revive_one(self, server: Server) -> None:
        start = time.monotonic()
        try:
            await self.revive(server)
        except (httpx.HTTPError, RequestRejected, OSError) as err:
            server.last_failure, server.down_since = f"still down: {_describe(err)}", time.monotonic()
            _log.debug("%s server %s is still down: %s", self.dialect.name, server.url, _describe(err))
            return
        server.is_up, server.has_missed_weights = True, False
        self.counters["server_revivals"] += 1
        _log.info("%s server %s is back (it was down: %s); it holds weights version %d (brought back in %.2f s) and "
                  "takes requests again", self.dialect.name, server.url, server.down_reason, server.version,
                  time.monotonic() - start)  # fmt: skip

    # -- waves --
    def complete(self, payloads: list[dict], keys: list[Hashable | None], until: WaveStop | None = None) -> list:  # fmt: skip
        """Send every payload to :attr:`generate_path` and return the answers in order (exactly one each).

        Each answer is the dialect's (``dialect.answer()``, filled by the chunks streamed); with ``until``, the wave
        may stop early and the rows still in flight are aborted: each stream is read to its end, so their answers hold
        every token their server generated, and the dialect's ``finished`` says False."""
        return self.run(self._wave(payloads, keys, until or WaveStop()))

    async def _wave(self, payloads: list[dict], keys: list, until: WaveStop) -> list:
        await self.revive_down()
        if not self.up():
            await self.revive_down(force=True)
        self.sticky = {
            k: self.sticky[k] for k in keys if k is not None and k in self.sticky
        }  # this wave's only
        run = _Run([self.dialect.answer() for _ in payloads], until)
        tasks = [asyncio.ensure_future(self._one(i, payloads[i], keys[i], run)) for i in range(len(payloads))]
        rows = asyncio.gather(*tasks)
        stopped = asyncio.ensure_future(run.stopped.wait())
        try:
            await asyncio.wait({rows, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not rows.done():  # told to stop: abort what is in flight; each stream is read to its end
                await self._abort()
            await rows
            await asyncio.gather(*run.late_aborts, return_exceptions=True)
        except BaseException:
            for task in (*tasks, *run.late_aborts):
                task.cancel()
            await asyncio.gather(*tasks, *run.late_aborts, return_exceptions=True)
            raise
        finally:
            stopped.cancel()
        return run.answers

    async def _abort(self) -> None:
        await asyncio.gather(*(self._abort_on(s) for s in self.servers if s.attempts))

    async def _abort_on(self, server: Server) -> None:
        """Abort the requests in flight on ``server`` and wait until their streams end (each holds every token the
        server generated); a request still on its way when the server was asked is aborted once it arrives. A server
        that cannot abort by id, or whose streams do not end within ``control_timeout_s``, has them closed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.control_timeout_s
        pending = dict(server.attempts)
        while pending:
            why = None
            if server.aborts_by_id:
                try:
                    server.aborts_by_id = await self.dialect.abort(self, server, list(pending.values()))
                except (httpx.HTTPError, RequestRejected, OSError) as err:
                    why = f"its abort failed ({_describe(err)})"
            if why is None and not server.aborts_by_id:
                why = "it cannot abort a request by its id"
            if why is None:
                await asyncio.wait(pending, timeout=_ABORT_WAIT_S)
                pending = {a: r for a, r in pending.items() if not a.done()}
                if not pending:
                    return
                if loop.time() < deadline:
                    continue
                why = f"its aborted streams did not end in {self.options.control_timeout_s:.0f} s"
            if not server.has_warned_abort:
                server.has_warned_abort = True
                _log.warning("%s server %s: %s, so the %d request(s) a stopped wave leaves on it are closed: what it "
                             "generated after the last token read is lost (not counted)", self.dialect.name,
                             server.url, why, len(pending))  # fmt: skip
            for attempt in pending:
                attempt.cancel()
            return

    def _pick(self, key) -> Server:
        server = self.sticky.get(key) if key is not None else None
        if server is None or not server.is_up:
            live = self.up()
            if not live:
                raise NoServerError(f"no {self.dialect.name} server left to generate on ({self.failures()}); restart one (the "
                                    "policy takes it back with the current weights) and collect again: the collector "
                                    "can be checkpointed and resumed")  # fmt: skip
            server = min(live, key=lambda s: s.outstanding)
            if key is not None:
                self.sticky[key] = server
        return server

    async def _one(self, i: int, payload: dict, key, run: _Run) -> None:
        """Row ``i`` until it ends or the wave stops. A failed attempt is sent again from what the row received
        (the dialect's ``resume``: prompt and tokens so far, the budget reduced, the same seed)."""
        answer = run.answers[i]
        has_revived, sent, again = False, 0, None
        while not run.is_stopped:
            before = self.dialect.received(answer)
            body = payload if before == 0 else self.dialect.resume(payload, answer)
            if body is None:  # its budget was spent, or it ended, before its server failed
                run.ended += 1
                run.should_stop()
                return
            try:  # a request whose connection was dropped goes to the same server once more
                server = again if again is not None and again.is_up else self._pick(key)
                again = None
            except NoServerError:
                if has_revived:
                    raise
                has_revived = True
                await self.revive_down(force=True)
                continue
            if sent == 1:  # its first attempt failed: sent again (counted once, however many sends it takes)
                self.counters["retried_requests"] += 1
            sent += 1
            streamed = self.dialect.stream(body)
            attempt = asyncio.ensure_future(self._stream(server, streamed, answer, run))
            server.attempts[attempt] = streamed
            server.outstanding += 1
            try:
                await asyncio.wait({attempt})
            except BaseException:
                attempt.cancel()
                raise
            finally:
                server.attempts.pop(attempt, None)
                server.outstanding -= 1
            kept = self.dialect.received(answer)
            generated = self.dialect.generated(answer)  # what the server says it generated in this attempt
            if generated is not None and generated > kept - before:
                self.counters["server_discarded_tokens"] += generated - (kept - before)
            if attempt.cancelled():  # aborted (the wave stopped: keep what it has), or its server went down
                self.counters["failover_kept_tokens"] += 0 if run.is_stopped else kept - before
                continue
            err = attempt.exception()
            if err is not None:
                if isinstance(err, RequestRejected):
                    raise RequestRejected(f"{server.url} rejected {self.generate_path} (wave row {i}) with {err}",
                                          status_code=err.status_code) from err  # fmt: skip
                if not isinstance(err, httpx.HTTPError | OSError):
                    raise err
                self.counters["failover_kept_tokens"] += kept - before
                if isinstance(err, httpx.RemoteProtocolError | httpx.ReadError) and sent == 1:
                    # closed without an answer (a connection the server was closing as it was reused; a reset when
                    # it closed with the request unread): not yet a server that is down; a server that is gone
                    # refuses the next connection
                    again = server
                    continue
                self.mark_down(server, _describe(err), moving=1)
                continue
            response = attempt.result()
            if response is not None:  # an error answer before the stream began
                if response.status_code >= 500:
                    self.mark_down(server, server_failure(self.dialect, server.url, response), moving=1)
                    continue
                _raise_for_status(self.dialect, server, response, row=i)
            if self.dialect.finished(answer):
                server.answered += 1
                return
            if not run.is_stopped:  # the stream ended without its end: a server that failed
                self.mark_down(server, "its stream ended before the request did", moving=1)

    async def _stream(self, server: Server, streamed, answer, run: _Run) -> httpx.Response | None:
        """One attempt: the chunks of ``streamed`` (``dialect.stream(row)``) into ``answer`` until its stream ends (a
        wave told to stop aborts it: read on, its last tokens are kept); an error answer (>= 400) is returned, read."""
        o = self.options
        timeout = httpx.Timeout(o.request_timeout_s, connect=o.connect_timeout_s)
        request = self.client.stream("POST", server.url + self.generate_path, json=streamed, timeout=timeout)
        async with asyncio.timeout(o.request_timeout_s), request as response:
            if response.status_code >= 400:
                await response.aread()
                return response
            has_ended, chunks = False, 0
            async for line in event_lines(response.aiter_bytes()):  # server-sent events: "data: {json}", "data: [DONE]"
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                self.dialect.take(answer, json.loads(data))
                server.streamed += 1
                chunks += 1
                if not has_ended and self.dialect.finished(answer):
                    has_ended = True
                    run.ended += 1
                stopped_before = run.is_stopped
                run.should_stop()  # the wave aborts this request: its stream goes on to its end
                if chunks == 1 and stopped_before and not has_ended and server.aborts_by_id:
                    # the server took this request after the wave stopped: an abort sent before may have missed it
                    task = asyncio.ensure_future(self._abort_late(server, streamed))
                    run.late_aborts.add(task)
        return None

    async def _abort_late(self, server: Server, streamed) -> None:
        """Abort one request at its first chunk (the wave had stopped: ``_abort_on``'s abort may have reached the
        server before the request did, and asks again only every ``_ABORT_WAIT_S``); a failure is left to it."""
        try:
            await self.dialect.abort(self, server, [streamed])
        except (httpx.HTTPError, RequestRejected, OSError):
            pass


def _raise_for_status(dialect, server: Server, response: httpx.Response, *, row: int | None = None) -> None:
    if response.status_code < 400:
        return
    path = response.request.url.path
    if response.status_code == 401:
        if "Authorization" in response.request.headers:
            why = "with this client's key (HTTP 401): it was started with a different key; pass that one"
        else:
            why = "without a key (HTTP 401): it needs the key it was started with; pass it"
        raise RequestRejected(f"{server.url} refused {path} {why} as ServerOptions(api_key=...) "
                              f"(LocalVLLMServer.api_key) or in this process's {KEY_VARIABLE}", status_code=401)  # fmt: skip
    if response.status_code < 500:
        where = "" if row is None else f" (wave row {row})"
        raise RequestRejected(f"{server.url} rejected {path}{where} with HTTP {response.status_code}: "
                              f"{describe_answer(response)}", status_code=response.status_code)  # fmt: skip
    raise httpx.HTTPStatusError(f"{server.url}{path}: {server_failure(dialect, server.url, response)}",
                                request=response.request, response=response)  # fmt: skip


def server_failure(dialect, url: str, response: httpx.Response) -> str:
    """What a 5xx answer of the server at ``url`` says: its engine died (with its log), or the status and message."""
    message = describe_answer(response)
    return engine_died(dialect, url, response.status_code, message) or f"HTTP {response.status_code}: {message}"


def _failure(server: Server) -> str:
    if server.is_up or server.down_reason in (None, server.last_failure):
        return server.last_failure or ("up" if server.is_up else "down")
    return f"{server.down_reason} (then {server.last_failure})"
