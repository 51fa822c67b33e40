"""The OpenAI-compatible endpoint agent programs talk to: a small ASGI app (``/v1/chat/completions``,
``/v1/models``), in-process behind ``httpx.ASGITransport`` or served on 127.0.0.1 by uvicorn.

Each episode has its own bearer key: the key says which episode a request belongs to (and keeps other
local processes out of the HTTP endpoint).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable, Mapping

__all__ = ["ChatApp", "RequestRefused", "check_request"]


class RequestRefused(Exception):
    """A chat request the env cannot answer: sent back to the agent as an OpenAI error (HTTP ``status``)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code


_IGNORED = {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "user", "metadata", "store",
            "logprobs", "top_logprobs", "seed", "stream_options", "extra_body"}  # fmt: skip


def check_request(body: Mapping, *, temperature: float | None, max_turn_tokens: int | None,
                  stop_strings: tuple[str, ...]) -> None:  # fmt: skip
    """Refuse what the env cannot honour: ``n > 1``, streaming, a temperature or top-p other than the
    collector's, ``max_tokens`` below the env's per-turn limit, stop strings the env does not use."""
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestRefused("messages must be a non-empty list of chat messages")
    if body.get("n", 1) not in (1, None):
        raise RequestRefused(f"n={body['n']} is not supported: each chat call is one turn of one episode; run the "
                             "episode group_size times instead (make_agent_env(..., group_size=...))")  # fmt: skip
    if body.get("stream"):
        raise RequestRefused("stream=True is not supported by the tokengym agent env; call without streaming")
    t = body.get("temperature")
    if t is not None and temperature is not None and abs(float(t) - temperature) > 1e-6:
        raise RequestRefused(f"temperature={t} conflicts with the collector's sampling temperature {temperature}: the "
                             "policy samples every turn; drop the argument or build the env with that temperature")  # fmt: skip
    if body.get("top_p") not in (None, 1, 1.0):
        raise RequestRefused(f"top_p={body['top_p']} is not supported: the policy's sampling settings apply")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and max_turn_tokens is not None and int(limit) < max_turn_tokens:
        raise RequestRefused(f"max_tokens={limit} is below the env's per-turn limit max_turn_tokens={max_turn_tokens}; "
                             "build the env with max_turn_tokens equal to the agent's max_tokens")  # fmt: skip
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    unknown = [s for s in stop if s not in stop_strings]
    if unknown:
        raise RequestRefused(f"stop={unknown} are not the env's stop strings {list(stop_strings)}; build the env with "
                             "stop_strings=... to end turns there")  # fmt: skip
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise RequestRefused(f"tool_choice={tool_choice!r} is not supported: the model decides ('auto')")


class ChatApp:
    """ASGI app answering chat completions for the episodes ``episode_of(key)`` finds by bearer key.

    Args:
        episode_of: bearer key -> the episode's ``chat(body) -> reply dict`` coroutine function, or ``None``.
        model: the model name ``/v1/models`` lists.
    """

    def __init__(self, episode_of: Callable[[str], Callable[[dict], Awaitable[dict]] | None], model: str) -> None:
        self.episode_of, self.model = episode_of, model
        self.server = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        status, payload = await self._route(scope, body)
        data = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": data})

    async def _route(self, scope, body: bytes) -> tuple[int, dict]:
        path, method = scope["path"].rstrip("/"), scope["method"]
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode()
        chat = self.episode_of(auth[7:]) if auth.startswith("Bearer ") else None
        try:
            if chat is None:
                raise RequestRefused("no episode has this API key: use the client the agent env gave the agent "
                                     "(or an episode that already ended)", status=401, code="invalid_api_key")  # fmt: skip
            if method == "GET" and path.endswith("/models"):
                return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "tokengym"}]}
            if method != "POST" or not path.endswith("/chat/completions"):
                raise RequestRefused(f"{method} {path} is not served: the agent env answers POST /v1/chat/completions",
                                     status=404, code="not_found")  # fmt: skip
            try:
                request = json.loads(body)
            except json.JSONDecodeError as err:
                raise RequestRefused(f"the request body is not JSON: {err}") from None
            return 200, await chat(request)
        except RequestRefused as err:
            return err.status, {"error": {"message": str(err), "type": "invalid_request_error", "code": err.code}}

    async def serve(self, loop: asyncio.AbstractEventLoop) -> str:
        """Serve on a free port of 127.0.0.1 (uvicorn, on ``loop``); returns the base URL (``.../v1``)."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(self, log_level="warning", lifespan="off", access_log=False)
        self.server, self.socket = uvicorn.Server(config), sock
        self.serving = loop.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            await asyncio.sleep(0.005)
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

    async def shutdown(self) -> None:
        """Stop serving and close the listening socket (the port is free when this returns)."""
        if self.server is not None:
            self.server.should_exit = True
            try:
                await asyncio.wait_for(self.serving, 5)
            except (TimeoutError, asyncio.CancelledError):
                self.serving.cancel()
            self.socket.close()
            self.server = None
