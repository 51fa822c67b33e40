"""Options and errors of :class:`~tokengym.collectors.VLLMServerPolicy` (importable without an HTTP client)."""

from __future__ import annotations

import dataclasses

__all__ = ["NoServerError", "RequestRejected", "ServerOptions"]


class NoServerError(RuntimeError):
    """No server of the fleet can take requests; the message names each and its last failure."""


class RequestRejected(ValueError):
    """A server answered 4xx: the request itself is wrong (the message is the server's)."""


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Options of :class:`~tokengym.collectors.VLLMServerPolicy`: timeouts, failover, where weights go."""

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
    in ``weights_dir`` reloaded through ``/collective_rpc`` (servers on this host or a shared filesystem)."""
    checkpoint_dir: str | None = None
    """A local copy of the served model directory (its config and safetensors names and shapes check the
    weights you push); ``None``: the servers' model path, when it is a directory here."""
    model: str | None = None
    """The model id every server must serve (``/v1/models``); ``None``: any, but the same on all."""
