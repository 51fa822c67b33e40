"""Agent programs on one event loop in a background thread: one episode per run, talking to the env through
:class:`~tokengym.llm_envs.agents.chat_app.ChatApp`.

The loop thread runs the programs and the endpoint; the env's thread (the collector's) reads each episode's
moves (:meth:`Episode.next_move`: a chat call, the program's return value, its error) and answers the calls
(:meth:`Episode.answer`). B episodes wait on tools, timers or other services at once; only an episode whose
turn has ended is waited for, and only until its program's next move.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import queue
import secrets
import threading
import time
from collections.abc import Callable

from tokengym.llm_envs.agents.chat_app import ChatApp, RequestRefused, check_request
from tokengym.llm_envs.agents.messages import first_difference, normalized

__all__ = ["AgentRunner", "AgentTimeout", "Episode"]


async def _drain() -> None:
    """Cancel the loop's other tasks (programs still running) and let them finish."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class AgentTimeout(TimeoutError):
    """An agent program ran past its time limit (its episode ended there)."""


class Episode:
    """One run of the agent program: its conversation so far and the chat call waiting for its answer.

    Attributes:
        id: the episode id (the prompt metadata's ``"episode"``).
        task: the task object the program was given.
        messages: the conversation so far, as the requests and replies wrote it.
        tools: the tools of the first request (a later request with other tools is refused).
    """

    def __init__(self, runner: AgentRunner, episode_id: int, task, task_index: int) -> None:
        self.runner, self.id, self.task, self.task_index = runner, episode_id, task, task_index
        self.key = secrets.token_urlsafe(18)
        self.moves: queue.SimpleQueue = queue.SimpleQueue()
        self.messages: list[dict] = []
        self.tools = None
        self.wants_log_probs = False  # the waiting call asked for logprobs
        self.reply: asyncio.Future | None = None
        self.waited = 0.0  # seconds the program's calls waited for the model (not its own time)
        self.closed = False
        self.handle = None  # the program's concurrent.futures.Future

    # -- loop thread --
    async def chat(self, body: dict) -> dict:
        """Answer one chat call of the program (runs on the loop): a move for the env, then its answer."""
        if self.closed:
            raise RequestRefused(f"episode {self.id} has ended; the env answers no more calls of it", status=409,
                                 code="episode_ended")  # fmt: skip
        if self.reply is not None:
            raise RequestRefused(f"episode {self.id} made a chat call while its previous call is unanswered: one "
                                 "call at a time per episode (await each call before the next)", status=409,
                                 code="call_in_flight")  # fmt: skip
        runner = self.runner
        check_request(body, temperature=runner.temperature, max_turn_tokens=runner.max_turn_tokens,
                      stop_strings=runner.stop_strings)  # fmt: skip
        try:
            for m in body["messages"]:
                normalized(m)
        except ValueError as err:
            raise RequestRefused(str(err)) from None
        if self.messages:
            if json.dumps(body.get("tools"), sort_keys=True) != json.dumps(self.tools, sort_keys=True):
                raise RequestRefused(f"episode {self.id} changed its tools after the first call; the tools are in "
                                     "the episode's first tokens: keep them for the whole episode")  # fmt: skip
            at = first_difference(self.messages, body["messages"])
            if at is not None and runner.on_rewrite == "error":
                runner.counts["history_rewrites"] += 1
                theirs = body["messages"][at] if at < len(body["messages"]) else None
                raise RequestRefused(
                    f"episode {self.id} rewrote its history: message {at} ({self.messages[at]['role']}: "
                    f"{str(self.messages[at].get('content'))[:60]!r}) is not what the request has there "
                    f"({'nothing' if theirs is None else repr(str(theirs.get('content'))[:60])}); a call must repeat "
                    "the conversation so far (the assistant messages as the env returned them) and add to it",
                    code="history_rewritten")  # fmt: skip
        self.reply = asyncio.get_running_loop().create_future()
        self.moves.put(("call", body))
        asked = time.monotonic()
        try:
            return await self.reply
        finally:
            self.reply = None
            self.waited += time.monotonic() - asked

    def own_time(self, started: float) -> float:
        """Seconds the program has run since ``started``, less the time its calls waited for the model."""
        return time.monotonic() - started - self.waited

    # -- env thread --
    def next_move(self) -> tuple[str, object]:
        """The program's next move: ``("call", request)``, ``("return", value)`` or ``("error", exception)``."""
        return self.moves.get()

    def answer(self, reply: dict | RequestRefused) -> None:
        """Answer the waiting chat call with ``reply`` (or refuse it)."""
        future = self.reply

        def resolve():
            if future is not None and not future.done():
                future.set_exception(reply) if isinstance(reply, Exception) else future.set_result(reply)

        self.runner.loop.call_soon_threadsafe(resolve)


class AgentRunner:
    """Runs ``agent(client, task)`` programs, one per episode, on a background event loop.

    Args:
        agent: ``async def agent(client, task) -> reward`` (an ``openai.AsyncOpenAI`` client), or a plain function
            (an ``openai.OpenAI`` client, run in a worker thread; needs ``transport="http"``).
        transport: ``"asgi"`` (in-process, no port) or ``"http"`` (127.0.0.1, a bearer key per episode).
        time_limit: seconds of an episode program's own time (``None``: no limit): its wall time less the time its
            chat calls wait for the model, whose pace is the batch's, not the program's.
        model: the model name the endpoint reports.
        temperature, max_turn_tokens, stop_strings: the env's settings requests are checked against.
        on_rewrite: ``"error"``: a call that does not continue its episode is refused.
    """

    def __init__(self, agent: Callable, *, transport: str = "asgi", time_limit: float | None = None,
                 model: str = "tokengym-policy", temperature: float | None = None, max_turn_tokens: int | None = None,
                 stop_strings: tuple[str, ...] = (), on_rewrite: str = "error") -> None:  # fmt: skip
        if not callable(agent):
            raise TypeError(f"agent must be a function agent(client, task) -> reward, got {agent!r:.80}")
        if transport not in ("asgi", "http"):
            raise ValueError(f"transport must be 'asgi' (in-process) or 'http' (127.0.0.1), got {transport!r}")
        call = agent if inspect.isroutine(agent) or inspect.isclass(agent) else type(agent).__call__
        self.is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(call)
        if not self.is_async and transport != "http":
            raise ValueError(f"agent {getattr(agent, '__name__', agent)!r} is a plain function (sync openai client): "
                             "it needs transport='http' (the in-process transport serves only the async client)")  # fmt: skip
        if time_limit is not None and not (isinstance(time_limit, int | float) and time_limit > 0):
            raise ValueError(f"time_limit must be a positive number of seconds or None, got {time_limit!r}")
        self.agent, self.transport, self.time_limit, self.model = agent, transport, time_limit, model
        self.temperature, self.max_turn_tokens, self.stop_strings = temperature, max_turn_tokens, tuple(stop_strings)
        self.on_rewrite = on_rewrite
        self.episodes: dict[int, Episode] = {}
        self.counts = {"history_rewrites": 0, "history_splits": 0}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.base_url: str | None = None
        self._http = None

    def __getstate__(self) -> dict:  # a Ray worker starts its own loop
        return {**self.__dict__, "episodes": {}, "loop": None, "thread": None, "base_url": None, "_http": None,
                "app": None}  # fmt: skip

    @property
    def name(self) -> str:
        return getattr(self.agent, "__qualname__", None) or type(self.agent).__name__

    def _started(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, name="tokengym-agents", daemon=True)
            self.thread.start()
            self.app = ChatApp(self._chat_of, self.model)
            if self.transport == "http":
                self.base_url = asyncio.run_coroutine_threadsafe(self.app.serve(self.loop), self.loop).result(30)
            else:
                self.base_url = "http://tokengym.agent-env/v1"
        return self.loop

    def _chat_of(self, key: str):
        return next((ep.chat for ep in list(self.episodes.values()) if secrets.compare_digest(ep.key, key)), None)

    def start(self, episode_id: int, task, task_index: int) -> Episode:
        """Start the program on ``task`` as episode ``episode_id`` (an earlier run of that id is ended)."""
        loop = self._started()
        self.end(episode_id)
        ep = Episode(self, episode_id, task, task_index)
        self.episodes[episode_id] = ep
        ep.handle = asyncio.run_coroutine_threadsafe(self._run(ep), loop)
        return ep

    def end(self, episode_id: int) -> None:
        """End an episode: its program is cancelled if still running, its calls are refused from now on."""
        ep = self.episodes.pop(episode_id, None)
        if ep is not None and ep.handle is not None and not ep.handle.done():
            ep.handle.cancel()

    def end_all(self) -> None:
        for episode_id in list(self.episodes):
            self.end(episode_id)

    def _client(self, ep: Episode):
        import httpx
        import openai

        timeout = httpx.Timeout(None, connect=10.0)  # a reply waits for the model: the time limit is the program's own
        if self.transport == "asgi":
            if self._http is None:
                self._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), timeout=timeout)
            return openai.AsyncOpenAI(api_key=ep.key, base_url=self.base_url, http_client=self._http, max_retries=0)
        cls = openai.AsyncOpenAI if self.is_async else openai.OpenAI
        return cls(api_key=ep.key, base_url=self.base_url, max_retries=0, timeout=timeout)

    async def _run(self, ep: Episode) -> None:
        client, started = self._client(ep), time.monotonic()
        try:
            if self.is_async:
                work = self.agent(client, ep.task)
            else:
                work = asyncio.get_running_loop().run_in_executor(None, self.agent, client, ep.task)
            value = await (work if self.time_limit is None else self._within_limit(ep, work, started))
            ep.moves.put(("return", value))
        except asyncio.CancelledError:
            ep.moves.put(("error", RuntimeError("the env ended the episode")))
            raise
        except BaseException as err:  # noqa: BLE001 (the program's error ends its episode, reported by the env)
            ep.moves.put(("error", err))
        finally:
            ep.closed = True
            if ep.reply is not None and not ep.reply.done():
                ep.reply.set_exception(RequestRefused(f"episode {ep.id} ended", status=409, code="episode_ended"))
            if self.transport == "http" or not self.is_async:
                close = client.close()
                if inspect.isawaitable(close):
                    await close

    async def _within_limit(self, ep: Episode, work, started: float):
        """``await work``, cancelled with an :class:`AgentTimeout` once the program's own time passes the limit."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                waiting = ep.reply
                if waiting is not None:  # the model's turn: the program's clock stands still
                    await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
                else:
                    left = self.time_limit - ep.own_time(started)
                    if left <= 0:
                        break
                    await asyncio.wait({task}, timeout=left)
                if task.done():
                    return task.result()
        except asyncio.CancelledError:
            task.cancel()
            raise
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise AgentTimeout(f"ran past its time limit of {self.time_limit} s (its own time: the time its calls "
                           "waited for the model is not counted)")

    def close(self) -> None:
        """End every episode and stop the loop (and the HTTP endpoint)."""
        if self.loop is None:
            return
        self.end_all()
        if self.transport == "http":
            asyncio.run_coroutine_threadsafe(self.app.shutdown(), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(_drain(), self.loop).result(30)
        if self._http is not None:
            asyncio.run_coroutine_threadsafe(self._http.aclose(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.loop = self.thread = self._http = None
