"""A minimal client of OpenEnv's WebSocket session protocol, on the ``websockets`` library (sync API).

One connection to ``ws://host:port/ws`` is one environment session on the server. Client messages:
``{"type": "reset", "data": {...}}``, ``{"type": "step", "data": {<action fields>}}``,
``{"type": "state"}``, ``{"type": "close"}``. Server messages: ``{"type": "observation", "data":
{"observation": {...}, "reward": float | None, "done": bool}}``, ``{"type": "state", "data": {...}}``
or ``{"type": "error", "data": {"message": ..., "code": ...}}``.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

from tokengym.llm_envs.adapters._lazy import require

__all__ = ["MalformedMessage", "ServerError", "Session", "StepResult", "fetch_json", "parse_step", "session_urls"]

_EXTRA = "openenv"
_REWARD, _DONE, _OBSERVATION = "reward", "done", "observation"  # protocol fields (not TensorDict keys)


class MalformedMessage(ValueError):
    """The server sent something that is not a message of the protocol."""


class ServerError(RuntimeError):
    """The server answered with an error message."""


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
        detail = data.get("message", data) if isinstance(data, dict) else data
        raise ServerError(f"{where} answered with an error: {detail!r:.200}")
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


class Session:
    """One WebSocket session with an OpenEnv server (a connection; not picklable, made where it is used).

    Args:
        ws_url: ``ws://host:port/ws``.
        timeout_s: limit of the connection's opening and of each answer.
    """

    def __init__(self, ws_url: str, *, timeout_s: float) -> None:
        client = require("websockets.sync.client", _EXTRA)
        self.timeout_s = timeout_s
        self.conn = client.connect(ws_url, open_timeout=timeout_s, close_timeout=1.0, max_size=None)

    def send(self, kind: str, data: dict | None = None) -> None:
        """Send a client message of ``kind`` (``"reset"``, ``"step"``, ``"state"``, ``"close"``)."""
        msg = {"type": kind} if data is None else {"type": kind, "data": data}
        self.conn.send(json.dumps(msg))

    def receive(self) -> str:
        """The next server message (raises ``TimeoutError`` after ``timeout_s``)."""
        return self.conn.recv(timeout=self.timeout_s)

    def close(self) -> None:
        """Say goodbye (best effort) and close the connection."""
        try:
            self.send("close")
        except Exception:  # noqa: BLE001  (a connection that already failed)
            pass
        self.conn.close()
