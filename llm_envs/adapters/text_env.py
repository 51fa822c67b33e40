"""Gym-style text environments as multi-turn token envs: one env instance per slot, built by a factory.

A text env is any object with ``reset(seed=...) -> (observation, info)`` and
``step(text) -> (observation, reward, terminated, truncated, info)`` (GEM, TextArena through
:class:`~tokengym.llm_envs.adapters.textarena.TextArenaEnv`, your own). The first observation is the
prompt; each finished turn's text is the action; the step's reward is the turn's reward and its
observation the next user message, until ``terminated`` or ``truncated``. Instances are reused: at
most ``batch_size`` exist at a time.

Example:
    >>> from tokengym.testing import tiny_tokenizer
    >>> class Echo:  # a two-turn text env
    ...     def reset(self, seed=None):
    ...         self.n = 0
    ...         return "say hi", {}
    ...     def step(self, text):
    ...         self.n += 1
    ...         return "again", float(self.n), self.n == 2, False, {}
    >>> env = make_text_env(Echo, tiny_tokenizer(), batch_size=1, max_turns=4, max_new_tokens=8, max_length=64)
    >>> td = env.reset(); eos = torch.tensor([env.tokenizer.eos_token_id])
    >>> out = env.step(td.set("action", eos))["next"]
    >>> out["reward"].item(), out["done"].item(), out["turn"].item()
    (1.0, False, 1)
"""

from __future__ import annotations

from collections.abc import Callable

import torch  # noqa: F401  (the example uses it)

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.adapters._episodes import EpisodeTokenEnv
from tokengym.llm_envs.adapters._kwargs import EPISODE_ENV_OPTIONS, EPISODE_HINTS, check_kwargs
from tokengym.llm_envs.token_env import TokenEnv
from tokengym.llm_envs.turns.protocol import Turn

__all__ = ["TextEnvBackend", "make_text_env"]


class TextEnvBackend:
    """Runs episodes on text env instances made by ``factory()`` (reused after an episode ends).

    Args:
        factory: ``factory() -> text env``; picklable (a class, a ``functools.partial``) for Ray workers.
        render: ``render(observation) -> str`` (default ``str``).
        name: shown in error messages (default: the factory's name).
    """

    def __init__(self, factory: Callable, *, render: Callable | None = None, name: str | None = None) -> None:
        if not callable(factory):
            raise TypeError(f"factory must be callable() -> a text env with reset/step, got {factory!r}")
        if render is not None and not callable(render):
            raise TypeError(f"render must be callable(observation) -> str, got {render!r}")
        self.factory, self.render = factory, render or str
        self.name = name or getattr(factory, "__name__", None) or repr(factory)
        self._live: dict[int, object] = {}
        self._free: list = []

    def __getstate__(self) -> dict:  # instances stay where they were made
        return {**self.__dict__, "_live": {}, "_free": []}

    @property
    def live(self) -> list[int]:
        """The episodes running now."""
        return list(self._live)

    def where(self, episode: int | None = None) -> str:
        return f"text env {self.name}"

    def _make(self):
        env = self.factory()
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(f"factory {self.name} made {type(env).__name__}, which has no {method}(); a text env "
                                "needs reset(seed=...) -> (obs, info) and step(text) -> (obs, reward, terminated, "
                                "truncated, info)")  # fmt: skip
        return env

    def start(self, episode: int, seed: int) -> str:
        env = self._free.pop() if self._free else self._make()
        self._live[episode] = env
        out = env.reset(seed=seed)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{self.name}.reset(seed=...) must return (observation, info), got {out!r:.80}")
        return self.render(out[0])

    def step(self, episodes: list[int], actions: list[str]) -> list[Turn | Exception]:
        out: list[Turn | Exception] = []
        for g, text in zip(episodes, actions, strict=True):
            env = self._live.get(g)
            if env is None:
                out.append(KeyError(f"episode {g} has no live env instance (it ended or the env was restored "
                                    "from a checkpoint)"))  # fmt: skip
                continue
            try:
                result = env.step(text)
                if not (isinstance(result, tuple) and len(result) == 5):
                    raise TypeError(f"step(text) must return (observation, reward, terminated, truncated, info), "
                                    f"got {result!r:.80}")  # fmt: skip
                obs, reward, terminated, truncated, info = result
                role = info.get("role", "user") if isinstance(info, dict) else "user"  # e.g. "tool" for a tool result
                out.append(Turn(float(reward), self.render(obs), role=role, done=bool(terminated) or bool(truncated)))
            except Exception as err:  # noqa: BLE001  (the episode ends with this error; the others go on)
                out.append(err)
        return out

    def end(self, episode: int) -> None:
        env = self._live.pop(episode, None)
        if env is not None:
            self._free.append(env)

    def end_all(self) -> None:
        for g in list(self._live):
            self.end(g)


def make_text_env(factory: Callable, tokenizer, *, max_turns: int = 8, render: Callable | None = None,
                  name: str | None = None, **env_kwargs) -> TokenEnv:  # fmt: skip
    """A multi-turn token env over gym-style text envs, one instance per slot.

    Args:
        factory: ``factory() -> text env`` (picklable for Ray workers).
        tokenizer: the tokenizer of the model you train (its chat template renders the turns).
        max_turns: turns per episode (the env may end it sooner).
        render: ``render(observation) -> str`` (default ``str``).
        name: the env's name in error messages.
        **env_kwargs: :class:`~tokengym.llm_envs.adapters._episodes.EpisodeTokenEnv` arguments
            (``batch_size``, ``max_new_tokens``, ``max_length``, ``num_episodes``, ``system_prompt``, ``seed``...).

    Raises:
        TypeError: an argument the env does not take (named, with the accepted ones); ``epochs=`` and a held-out
            ``split=`` among them: episodes are made by their seeds (``num_episodes=N`` ends the source).
    """
    require_tokenizer("make_text_env", tokenizer)
    check_kwargs(make_text_env, env_kwargs, EPISODE_ENV_OPTIONS, EPISODE_HINTS)
    return EpisodeTokenEnv(TextEnvBackend(factory, render=render, name=name), tokenizer, max_turns=max_turns,
                           **env_kwargs)  # fmt: skip
