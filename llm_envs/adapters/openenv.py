"""OpenEnv environment services as multi-turn token envs: one WebSocket session per slot.

``pip install 'tokengym[openenv]'`` (the client runs on ``websockets``; no ``openenv`` package is
needed to talk to a server). Each slot's episode is a session on the server: the reset observation is
the prompt, each finished turn is sent as a step action (the response text in the action's string
field, found from the server's ``/schema`` or given as ``action_field``), and the step's reward, done
flag and observation become the turn's reward and the next user message. ``B`` slots are ``B``
concurrent sessions; a turn's steps go out together and their answers are awaited together.

The server must answer ``GET /health`` when the env is built. A session that fails (connection lost, server
gone, timeout, error or malformed message) ends only its episode, with reward 0; the error, naming the episode
and the server, is raised at the slot's refill as an :class:`~tokengym.llm_envs.adapters.EpisodeError` (a
``PromptError``: the collector has recorded the step, iterating again goes on). A server that refuses or closes
a new session at reset usually limits concurrent sessions (openenv's ``max_concurrent_envs``, below the env's
``batch_size``): the error says so, with the limit when the server tells it.

Example (against a running server)::

    env = make_openenv_env("http://127.0.0.1:8000", tokenizer, batch_size=8, max_turns=4)
    collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=8)
"""

from __future__ import annotations

import json
from collections.abc import Callable

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.adapters._episodes import EpisodeTokenEnv
from tokengym.llm_envs.adapters._kwargs import EPISODE_ENV_OPTIONS, EPISODE_HINTS, check_kwargs
from tokengym.llm_envs.adapters._ws import (
    Session,
    SessionClosed,
    check_health,
    fetch_json,
    parse_step,
    session_urls,
)
from tokengym.llm_envs.token_env import TokenEnv
from tokengym.llm_envs.turns.protocol import Turn

__all__ = ["OpenEnvBackend", "make_openenv_env", "render_observation"]

_ACTION = "action"  # the /schema field of the action's JSON schema (not a TensorDict key)
_TEXT_FIELDS = ("prompt", "text", "message", "content", "observation", "feedback")


def render_observation(observation: dict) -> str:
    """Text of an observation: its ``prompt``/``text``/``message``/... field, its only string field, or its JSON.

    Example:
        >>> render_observation({"text": "hello", "step": 2}), render_observation({"board": [1, 2]})
        ('hello', '{"board": [1, 2]}')
    """
    strings = {k: v for k, v in observation.items() if isinstance(v, str)}
    for name in _TEXT_FIELDS:
        if strings.get(name):
            return strings[name]
    if len(strings) == 1:
        return next(iter(strings.values()))
    return json.dumps(observation, sort_keys=True, default=str)


class OpenEnvBackend:
    """Episodes as sessions on one OpenEnv server (see the module docstring).

    Args:
        url: ``http://host:port`` (or ``ws://host:port/ws``).
        action_field: the action's field that takes the response text; found from ``/schema`` when
            ``None`` (the action's only string field, else its only required one).
        timeout_s: limit of a connection, a reset and a step.
        render: ``render(observation dict) -> str`` (default ``render_observation``).
    """

    def __init__(self, url: str, *, action_field: str | None = None, timeout_s: float = 30.0,
                 render: Callable[[dict], str] | None = None) -> None:  # fmt: skip
        self.http_url, self.ws_url = session_urls(url)
        if action_field is not None and (not isinstance(action_field, str) or not action_field):
            raise TypeError(f"action_field must be a non-empty string or None (found from /schema), got {action_field!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if render is not None and not callable(render):
            raise TypeError(f"render must be callable(observation dict) -> str, got {render!r}")
        self.action_field, self.timeout_s, self.render = action_field, float(timeout_s), render or render_observation
        self._sessions: dict[int, Session] = {}
        check_health(self.http_url, self.timeout_s)  # a wrong URL fails here, not at the first batch

    def __getstate__(self) -> dict:  # connections stay in the process that opened them
        return {**self.__dict__, "_sessions": {}}

    @property
    def live(self) -> list[int]:
        """The episodes running now."""
        return list(self._sessions)

    def where(self, episode: int | None = None) -> str:
        return f"OpenEnv server {self.ws_url}"

    def find_action_field(self) -> str:
        """The action field, from the server's ``/schema`` (cached)."""
        if self.action_field is None:
            schema = fetch_json(f"{self.http_url}/schema", self.timeout_s)
            action = schema[_ACTION] if isinstance(schema, dict) and isinstance(schema.get(_ACTION), dict) else {}
            props = action.get("properties", {})
            strings = [k for k, v in props.items() if k != "metadata" and isinstance(v, dict) and v.get("type") == "string"]
            required = [k for k in strings if k in action.get("required", ())]
            picks = strings if len(strings) == 1 else required
            if len(picks) != 1:
                raise ValueError(f"cannot tell which action field of {self.where()} takes the text: string fields "
                                 f"{strings} (required {required}); pass action_field= one of them")  # fmt: skip
            self.action_field = picks[0]
        return self.action_field

    def start(self, episode: int, seed: int) -> str:
        self.find_action_field()  # a server whose schema does not fit fails before any session opens
        self.end(episode)
        held = len(self._sessions)
        try:
            session = Session(self.ws_url, timeout_s=self.timeout_s)
            self._sessions[episode] = session
            session.send("reset", {"seed": seed})
            obs, _, _ = parse_step(session.receive(), f"{self.where()} (episode {episode}, reset)")
        except SessionClosed as err:
            raise SessionClosed(_session_limit(err, held), max_sessions=err.max_sessions) from err
        return self.render(obs)

    def step(self, episodes: list[int], actions: list[str]) -> list[Turn | Exception]:
        field = self.find_action_field()
        out: list[Turn | Exception | None] = [None] * len(episodes)
        for i, (g, text) in enumerate(zip(episodes, actions, strict=True)):  # all steps go out first...
            session = self._sessions.get(g)
            if session is None:
                out[i] = KeyError(f"episode {g} has no live session (it ended, or the env was restored from a checkpoint)")
                continue
            try:
                session.send("step", {field: text})
            except Exception as err:  # noqa: BLE001  (this episode ends; the others go on)
                out[i] = err
        for i, g in enumerate(episodes):  # ...then the answers are awaited: the server runs them concurrently
            if out[i] is not None:
                continue
            try:
                obs, reward, done = parse_step(self._sessions[g].receive(), f"{self.where()} (episode {g})")
                out[i] = Turn(reward, self.render(obs), done=bool(done))
            except Exception as err:  # noqa: BLE001
                out[i] = err
        return out

    def end(self, episode: int) -> None:
        session = self._sessions.pop(episode, None)
        if session is not None:
            try:
                session.close()
            except Exception:  # noqa: BLE001  (already broken: nothing left to release)
                pass

    def end_all(self) -> None:
        for g in list(self._sessions):
            self.end(g)


def _session_limit(err: SessionClosed, held: int) -> str:
    """The message of a session refused or closed at reset: the server's session limit is the likely cause."""
    n = err.max_sessions
    limit = (f"it allows {n} concurrent sessions (openenv's max_concurrent_envs)" if n else
             "it may limit concurrent sessions (openenv's max_concurrent_envs)")  # fmt: skip
    fix = f"or build the env with batch_size <= {n}" if n else "or lower the env's batch_size"
    return (f"the server refused a new session at reset ({err}): {limit}, and the env opens one session per slot "
            f"({held} open now); start the server with max_concurrent_envs >= the env's batch_size {fix}")


def make_openenv_env(url: str, tokenizer, *, max_turns: int = 4, action_field: str | None = None,
                     timeout_s: float = 30.0, **env_kwargs) -> TokenEnv:  # fmt: skip
    """A multi-turn token env whose slots are sessions on the OpenEnv server at ``url``.

    Args:
        url: the server, ``http://host:port``.
        tokenizer: the tokenizer of the model you train (its chat template renders the turns).
        max_turns: turns per episode (the server may end it sooner with ``done``).
        action_field: the action field for the response text (default: found from ``/schema``).
        timeout_s: limit of a connection, a reset and a step.
        **env_kwargs: :class:`~tokengym.llm_envs.adapters.EpisodeTokenEnv` arguments (``batch_size``,
            ``max_new_tokens``, ``max_length``, ``num_episodes``, ``system_prompt``, ``seed``, ``render``...).

    Raises:
        ValueError: nothing answers at ``url`` (``GET /health``), or another argument is bad.
        TypeError: an argument the env does not take (named, with the accepted ones), before any connection.
    """
    require_tokenizer("make_openenv_env", tokenizer)
    check_kwargs(make_openenv_env, env_kwargs, (*EPISODE_ENV_OPTIONS, "render"), EPISODE_HINTS)
    render = env_kwargs.pop("render", None)
    backend = OpenEnvBackend(url, action_field=action_field, timeout_s=timeout_s, render=render)
    return EpisodeTokenEnv(backend, tokenizer, max_turns=max_turns, **env_kwargs)
