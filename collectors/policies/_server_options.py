"""Options and errors of :class:`~tokengym.collectors.policies.ServerPolicy` (importable without an HTTP client)."""

from __future__ import annotations

import dataclasses
import os
import threading

from tokengym.collectors.policies.server_guard import KEY_VARIABLE

__all__ = ["NoServerError", "RequestRejected", "ServerOptions", "WaveStop", "server_key"]


class NoServerError(RuntimeError):
    """No server of the fleet can take requests; the message names each and its last failure."""


class RequestRejected(ValueError):
    """A server answered 4xx: the request itself is wrong (the message is the server's), or, with
    ``status_code`` 401, it lacks the server's key."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Options of :class:`~tokengym.collectors.policies.ServerPolicy` (and ``VLLMServerPolicy``): timeouts, failover,
    where weights go."""

    request_timeout_s: float = 600.0
    """Longest wait for one generation request; a server that takes longer is marked down."""
    connect_timeout_s: float = 5.0
    """Longest wait for a connection (a dead host fails fast)."""
    control_timeout_s: float = 120.0
    """Longest wait for a control call (health, models, weight reload, cache reset)."""
    retry_down_after_s: float = 5.0
    """A server marked down is tried again (health, then the current weights) after this long."""
    weights_dir: str | None = None
    """Where weights are written for the servers to load (they must see it) and where the fleet records the
    version it holds. Several processes sharing servers (Ray workers) pass the same fresh directory; ``None``:
    a temporary directory of this policy's own."""
    transport: object | None = None
    """A :class:`~tokengym.collectors.policies._server_weights.WeightTransport`; ``None``: safetensors files
    in ``weights_dir`` that each server loads as its dialect says (vLLM: ``/collective_rpc``, SGLang:
    ``/update_weights_from_disk``; servers on this host or a shared filesystem)."""
    checkpoint_dir: str | None = None
    """A local copy of the served model directory (its config and safetensors names and shapes check the
    weights you push); ``None``: the servers' model path, when it is a directory here."""
    model: str | None = None
    """The model id every server must serve (``/v1/models``); ``None``: any, but the same on all."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """The key sent as ``Authorization: Bearer <key>`` with every request: the one the servers were started
    with (``LocalVLLMServer.api_key``; ``TOKENGYM_SERVER_KEY`` of a server behind
    :class:`~tokengym.collectors.policies.server_guard.ServerKeyGuard`; vLLM's ``--api-key``). ``None``: this
    process's ``TOKENGYM_SERVER_KEY`` if set, else no key. Not in ``repr``, logs or checkpoints (it does travel
    with the options when they are pickled, e.g. to Ray workers)."""

    def __post_init__(self) -> None:
        key = self.api_key
        if key is not None and not (isinstance(key, str) and key.strip() == key != "" and key.isprintable()):
            # the key itself is never echoed
            raise ValueError(f"api_key must be a non-empty printable string without spaces at its ends (the key the "
                             f"servers were started with), got a {type(key).__name__} that is not")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WaveStop:
    """When a fleet's wave may stop before every row ended its turn (partial rollouts, over-sampling); the rows in
    flight then keep the tokens they received, unfinished."""

    interrupt: threading.Event | None = None
    """Set (by another thread: new weights published), the wave stops; checked at every chunk received, so the wave
    stops at the first chunk after it is set (a row then holds at least that chunk: a wave never comes back
    empty)."""
    min_finished: int | None = None
    """The wave stops once this many rows have ended (``WaveRequest.min_finished``)."""


def server_key(options: ServerOptions) -> str | None:
    """The key a client with ``options`` sends: ``options.api_key``, else ``$TOKENGYM_SERVER_KEY``, else ``None``.

    Example:
        >>> options = ServerOptions(api_key="k3y")
        >>> server_key(options), "k3y" in repr(options)
        ('k3y', False)
    """
    return options.api_key or os.environ.get(KEY_VARIABLE) or None
