"""A key on every path of a server tokengym launches: ``Authorization: Bearer <key>`` or HTTP 401.

vLLM's own ``--api-key`` guards only the paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``. The
development endpoints that weight sync needs (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``,
``/reset_prefix_cache``, ``/server_info``) stay open to anyone who can reach the port, and ``/collective_rpc``
calls any method of the engine's workers (``reload_weights`` from a path of the caller's choosing among them).
:class:`ServerKeyGuard` is a pure ASGI middleware for vLLM's ``--middleware`` flag that answers 401 to every
request without the key, on every path but ``/health`` (what a launcher or a load balancer polls). The server
reads the key from the environment variable ``TOKENGYM_SERVER_KEY`` (an environment variable, not a flag, so
the key is not in the process list) and refuses to start without it::

    TOKENGYM_SERVER_KEY=<key> VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --host 127.0.0.1 --middleware tokengym.collectors.policies.server_guard.ServerKeyGuard ...

:class:`~tokengym.collectors.policies.LocalVLLMServer` starts its servers this way with a random key;
:class:`~tokengym.collectors.policies.VLLMServerPolicy` sends the key (``ServerOptions(api_key=...)`` or the same
environment variable) with every request. This module needs only the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable

__all__ = ["KEY_VARIABLE", "MIDDLEWARE", "OPEN_PATHS", "ServerKeyGuard"]

KEY_VARIABLE = "TOKENGYM_SERVER_KEY"
"""The environment variable that holds the key, in the server's environment (and, optionally, the client's)."""
MIDDLEWARE = "tokengym.collectors.policies.server_guard.ServerKeyGuard"
"""What to pass to vLLM's ``--middleware``."""
OPEN_PATHS = frozenset({"/health"})
"""The only paths answered without the key: liveness, nothing else."""

_REFUSAL = json.dumps({"error": {"message": "this server needs 'Authorization: Bearer <key>' (a key it was "
                                 "started with)", "type": "Unauthorized", "code": 401}}).encode()  # fmt: skip
_REFUSAL_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(_REFUSAL)).encode()),
                    (b"www-authenticate", b"Bearer")]  # fmt: skip


class ServerKeyGuard:
    """ASGI middleware: a request passes only with ``Authorization: Bearer <key>`` (or to a path in
    ``OPEN_PATHS``); any other gets 401 (a WebSocket is closed with code 1008).

    Args:
        app: the ASGI app it guards.
        key: the key; ``None`` (what vLLM's ``--middleware`` gives): ``os.environ["TOKENGYM_SERVER_KEY"]``.

    Raises:
        RuntimeError: no key (the variable is unset or empty): a server started without it does not start.

    The key is compared in constant time (its SHA-256 digests, so not even its length leaks), and the guard
    logs nothing.

    Example:
        >>> import asyncio
        >>> async def app(scope, receive, send):
        ...     await send({"type": "http.response.start", "status": 200, "headers": []})
        ...     await send({"type": "http.response.body", "body": b"ok"})
        >>> def status(guard, path, headers=()):
        ...     sent = []
        ...     async def send(message):
        ...         sent.append(message)
        ...     scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers)}
        ...     asyncio.run(guard(scope, None, send))
        ...     return sent[0]["status"]
        >>> guard = ServerKeyGuard(app, key="s3cret")
        >>> status(guard, "/collective_rpc"), status(guard, "/collective_rpc", [(b"authorization", b"Bearer s3cret")])
        (401, 200)
        >>> status(guard, "/health")
        200
    """

    def __init__(self, app: Callable, *, key: str | None = None) -> None:
        key = os.environ.get(KEY_VARIABLE) if key is None else key
        if not key:
            raise RuntimeError(f"ServerKeyGuard found no key: start the server with the environment variable "
                               f"{KEY_VARIABLE} set to the key its clients send (e.g. python -c 'import secrets; "
                               "print(secrets.token_urlsafe(32))'), or drop the --middleware flag to serve "
                               "every path to anyone who can reach the port")  # fmt: skip
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def __call__(self, scope: dict, receive: Callable, send: Callable) -> Awaitable[None]:
        # returns the app's awaitable (no coroutine frame of its own on the way in: ~1 us a request)
        if scope["type"] not in ("http", "websocket") or self._is_allowed(scope):
            return self.app(scope, receive, send)
        return self._refuse(scope, send)

    def _is_allowed(self, scope: dict) -> bool:
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path in OPEN_PATHS:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                digest = hashlib.sha256(token.strip()).digest()
                return scheme.lower() == b"bearer" and hmac.compare_digest(digest, self._digest)
        return False

    @staticmethod
    async def _refuse(scope: dict, send: Callable) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation (before accept: a 403)
            return
        await send({"type": "http.response.start", "status": 401, "headers": _REFUSAL_HEADERS})
        await send({"type": "http.response.body", "body": _REFUSAL})
