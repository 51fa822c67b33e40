"""A minimal client of OpenEnv's WebSocket session protocol, on the ``websockets`` library (sync API).

One connection to ``ws://host:port/ws`` is one environment session on the server. Client messages:
``{"type": "reset", "data": {...}}``, ``{"type": "step", "data": {<action fields>}}``,
``{"type": "state"}``, ``{"type": "close"}``. Server messages: ``{"type": "observation", "data":
{"observation": {...}, "reward": float | None, "done": bool}}``, ``{"type": "state", "data": {...}}``
or ``{"type": "error", "data": {"message": ..., "code": ...}}``.

A server at its session limit (openenv's ``max_concurrent_envs``) answers a new connection with an error of code
``CAPACITY_REACHED`` (with ``max_sessions``) and closes it: that is a :class:`SessionClosed` naming the limit. A
connection refused or broken is a :class:`ServerGone` (a ``ConnectionError``: the server went away).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from tokengym.llm_envs.adapters._lazy import require

__all__ = ["MalformedMessage", "ServerError", "ServerGone", "Session", "SessionClosed", "StepResult", "check_health",
           "fetch_json", "parse_step", "session_urls"]  # fmt: skip

_EXTRA = "openenv"
_REWARD, _DONE, _OBSERVATION = "reward", "done", "observation"  # protocol fields (not TensorDict keys)
_CAPACITY = "CAPACITY_REACHED"  # openenv's error code for a server at max_concurrent_envs sessions
_NORMAL_CLOSURE = 1000  # a WebSocket closed on purpose (1001, "going away", is a server shutting down)


class MalformedMessage(ValueError):
    """The server sent something that is not a message of the protocol."""


class ServerError(RuntimeError):
    """The server answered with an error message."""


class SessionClosed(ServerError):
    """The server refused a session or closed it; ``max_sessions`` is its session limit when it said it."""

    def __init__(self, message: str, *, max_sessions: int | None = None) -> None:
        super().__init__(message)
        self.max_sessions = max_sessions


class ServerGone(ConnectionError):
    """The server went away: its connection was refused or broke."""


class StepResult(tuple):
    """``(observation dict, reward float, done bool)`` of a reset or a step."""

    __slots__ = ()

    def __new__(cls, observation: dict, reward: float, done: bool):
        return super().__new__(cls, (observation, reward, done))


def session_urls(url: str) -> tuple[str, str]:
    """``(http base, ws url)`` of a server given as ``http://host:port`` or ``ws://host:port/ws``.

    Example:
        >>> session_urls("http://127.0.0.1:8000/")
        ('http://127.0.0.1:8000', 'ws://127.0.0.1:8000/ws')
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a string like 'http://127.0.0.1:8000', got {url!r}")
    parts = urllib.parse.urlsplit(url)
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if parts.scheme not in schemes or not parts.netloc:
        raise ValueError(f"url must look like 'http://host:port' or 'ws://host:port/ws', got {url!r}")
    path = parts.path.rstrip("/")
    base_path = path[: -len("/ws")] if path.endswith("/ws") else path
    http = "https" if schemes[parts.scheme] == "wss" else "http"
    return f"{http}://{parts.netloc}{base_path}", f"{schemes[parts.scheme]}://{parts.netloc}{base_path}/ws"


def check_health(http_url: str, timeout_s: float) -> None:
    """Raise a ``ValueError`` naming the URL and the fix when nothing answers ``GET /health`` at ``http_url``
    (any HTTP answer counts: the session protocol checks the rest)."""
    try:
        with urllib.request.urlopen(f"{http_url}/health", timeout=timeout_s):  # noqa: S310  (http(s): session_urls)
            return
    except urllib.error.HTTPError:
        return  # something answers HTTP there
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ValueError(f"OpenEnv server {http_url} cannot be reached (GET /health: {type(reason).__name__}: "
                         f"{reason}); start it (e.g. uvicorn on openenv's create_app) or fix the URL") from err  # fmt: skip


def fetch_json(url: str, timeout_s: float) -> dict:
    """GET ``url`` and parse its JSON body."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310  (http(s) only: session_urls)
        return json.loads(response.read())


def parse_step(raw, where: str) -> StepResult:
    """The observation, reward and done flag of a server message; a clear error for anything else."""
    try:
        msg = json.loads(raw)
    except (TypeError, ValueError):
        raise MalformedMessage(f"{where} sent a malformed message (not JSON): {raw!r:.120}") from None
    if not isinstance(msg, dict) or "type" not in msg:
        raise MalformedMessage(f"{where} sent a malformed message (no 'type'): {raw!r:.120}")
    data = msg.get("data")
    if msg["type"] == "error":
        raise _error_of(data, where)
    if msg["type"] != _OBSERVATION or not isinstance(data, dict) or not isinstance(data.get(_OBSERVATION), dict):
        raise MalformedMessage(f"{where} sent a malformed message: expected {{'type': 'observation', 'data': "
                               f"{{'observation': {{...}}, 'reward': ..., 'done': ...}}}}, got {raw!r:.120}")  # fmt: skip
    reward = data[_REWARD] if _REWARD in data else None
    done = data[_DONE] if _DONE in data else False
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise MalformedMessage(f"{where} sent a malformed message: reward must be a number or null, got {reward!r}")
    if not isinstance(done, bool):
        raise MalformedMessage(f"{where} sent a malformed message: done must be true or false, got {done!r}")
    return StepResult(data[_OBSERVATION], 0.0 if reward is None else float(reward), done)


def _error_of(data, where: str) -> ServerError:
    """The exception of an error message's ``data``: :class:`SessionClosed` for a server at its session limit."""
    detail = data.get("message", data) if isinstance(data, dict) else data
    if isinstance(data, dict) and data.get("code") == _CAPACITY:
        limit = data.get("max_sessions")
        return SessionClosed(f"{detail!s:.200}", max_sessions=limit if isinstance(limit, int) else None)
    return ServerError(f"{where} answered with an error: {detail!r:.200}")


class Session:
    """One WebSocket session with an OpenEnv server (a connection; not picklable, made where it is used).

    Args:
        ws_url: ``ws://host:port/ws``.
        timeout_s: limit of the connection's opening and of each answer.
    """

    def __init__(self, ws_url: str, *, timeout_s: float) -> None:
        client = require("websockets.sync.client", _EXTRA)
        self.closed_errors = require("websockets.exceptions", _EXTRA).ConnectionClosed
        self.ws_url, self.timeout_s = ws_url, timeout_s
        try:
            self.conn = client.connect(ws_url, open_timeout=timeout_s, close_timeout=1.0, max_size=None)
        except ConnectionError as err:
            raise ServerGone(f"{ws_url} refused the connection ({type(err).__name__}: {err})") from err

    def send(self, kind: str, data: dict | None = None) -> None:
        """Send a client message of ``kind`` (``"reset"``, ``"step"``, ``"state"``, ``"close"``)."""
        msg = {"type": kind} if data is None else {"type": kind, "data": data}
        try:
            self.conn.send(json.dumps(msg))
        except self.closed_errors as err:
            raise self._closed(err) from err

    def receive(self) -> str:
        """The next server message (raises ``TimeoutError`` after ``timeout_s``; :class:`SessionClosed` or
        :class:`ServerGone` when the connection closed)."""
        try:
            return self.conn.recv(timeout=self.timeout_s)
        except self.closed_errors as err:
            raise self._closed(err) from err

    def _closed(self, err) -> Exception:
        """What a closed connection means: the error the server sent before closing (a session limit...), a session
        it closed on purpose, or a server that went away."""
        try:
            last = json.loads(self.conn.recv(timeout=0))  # a message that arrived before the close
        except Exception:  # noqa: BLE001  (none, or not JSON: the close itself says what happened)
            last = None
        if isinstance(last, dict) and last.get("type") == "error":
            return _error_of(last.get("data"), self.ws_url)
        code = getattr(err.rcvd, "code", None)
        if code == _NORMAL_CLOSURE:
            return SessionClosed(f"{self.ws_url} closed the session ({err})")
        return ServerGone(f"{self.ws_url} went away: the connection closed ({err})")

    def close(self) -> None:
        """Say goodbye (best effort) and close the connection."""
        try:
            self.send("close")
        except Exception:  # noqa: BLE001  (a connection that already failed)
            pass
        self.conn.close()
