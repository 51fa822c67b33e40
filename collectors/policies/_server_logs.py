"""Where the output of a server this process started goes: a registry every launcher writes into, the fleet reads.

A launcher (:class:`~tokengym.collectors.policies.LocalVLLMServer`, or a test server of another engine's API) calls
:func:`register` when it starts a server and :func:`forget` when it stops it; :func:`server_log` tells the fleet which
file to name when that server's engine dies. Servers this process did not start have no entry.

Example:
    >>> from pathlib import Path
    >>> register("http://127.0.0.1:8000/", Path("/tmp/server.log"))
    >>> server_log("http://127.0.0.1:8000")
    PosixPath('/tmp/server.log')
    >>> forget("http://127.0.0.1:8000", Path("/tmp/server.log")); server_log("http://127.0.0.1:8000") is None
    True
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["forget", "register", "server_log"]

_RUNNING: dict[str, Path] = {}  # url -> log of the servers this process started and has not stopped


def register(url: str, log: Path) -> None:
    """Record that the server at ``url`` (started by this process) writes its output to ``log``."""
    _RUNNING[url.rstrip("/")] = Path(log)


def forget(url: str, log: Path | None) -> None:
    """Drop the entry of the server at ``url`` if it still names ``log`` (a server restarted on the same URL since
    keeps its own)."""
    url = url.rstrip("/")
    if log is not None and _RUNNING.get(url) == Path(log):
        del _RUNNING[url]


def server_log(url: str) -> Path | None:
    """The log file of the server at ``url`` if this process started it and has not stopped it; ``None`` otherwise."""
    return _RUNNING.get(url.rstrip("/"))
