"""External episodes behind a multi-turn token env: one episode (a server session, an env instance) per slot.

A backend runs the episodes: ``start`` opens one and gives its first observation (the prompt),
``step`` answers finished turns (several episodes at once) with a :class:`~tokengym.llm_envs.turns.Turn` each
(reward, the observation as feedback with its role, done), ``end`` releases one. The env's prompt source
(:class:`EpisodeSource`) numbers the episodes and their reset seeds; the env's turn handler (:class:`EpisodeTurns`)
is an ordinary :class:`~tokengym.llm_envs.turns.TurnHandler`: it starts an episode when a slot needs one
(:meth:`~EpisodeTurns.serve`), steps the episodes of the finished turns and ends the episode a slot held when the
slot is refilled. An episode whose backend fails ends there with reward 0 (``Turn.failed``) and its error is raised
at the slot's refill as an :class:`EpisodeError` (through the collector's usual ``PromptError`` path: the step is
recorded, iterating again goes on), counted in ``failed_episodes`` and logged (WARNING, ``tokengym.llm_envs``);
its wording says what failed: an episode that could not start, one that failed, or a server that went away (a
backend's ``ConnectionError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from tokengym.llm_envs.errors import EpisodeError
from tokengym.llm_envs.prompts import Prompt, PromptSource
from tokengym.llm_envs.token_env import TokenEnv
from tokengym.llm_envs.turns.protocol import EnvFacts, FinishedTurns, HeldEpisode, Turn, TurnHandler

__all__ = ["EpisodeBackend", "EpisodeError", "EpisodeSource", "EpisodeTokenEnv", "EpisodeTurns"]

EPISODE = "episode"  # prompt-metadata fields: the episode number, its reset seed and where it runs
SEED = "seed"
WHERE = "where"


def _episode_error(message: str, cause: Exception, *, is_start: bool) -> EpisodeError:
    """An :class:`EpisodeError` whose ``what`` says what failed."""
    if isinstance(cause, ConnectionError):
        what = "episode(s) lost their server: it went away"
    else:
        what = "episode(s) could not start" if is_start else EpisodeError.what
    err = EpisodeError(message, what=what)
    err.__cause__ = cause
    return err


class EpisodeBackend(Protocol):
    """Runs external episodes for :func:`EpisodeTokenEnv`."""

    def start(self, episode: int, seed: int) -> str:
        """Open episode ``episode`` (reset with ``seed``) and return its first observation as text."""

    def step(self, episodes: list[int], actions: list[str]) -> list[Turn | Exception]:
        """One turn of each episode: ``Turn(reward, observation, role=..., done=...)``; a failure is returned
        (not raised) in that episode's place."""

    def end(self, episode: int) -> None:
        """Release the episode (idempotent; unknown ids are ignored)."""

    def end_all(self) -> None:
        """Release every episode."""

    @property
    def live(self) -> list[int]:
        """The episodes running now."""

    def where(self, episode: int | None = None) -> str:
        """Where the episodes run, for error messages (``"server ws://..."``)."""


class EpisodeSource(PromptSource):
    """The draws of external episodes: episode ``g`` is reset with seed ``seed * 100_003 + g``.

    Each draw has ``group_id = index = g`` and metadata ``{"episode": g, "seed": ...}``; its first observation comes
    from the env's turn handler (:meth:`EpisodeTurns.serve`). ``num_episodes=None`` runs forever. Sharding (Ray
    workers) splits the episode numbers ``g % num_shards``.
    """

    def __init__(self, tokenizer, *, num_episodes: int | None = None, seed: int = 0,
                 chat_template_kwargs: dict | None = None) -> None:  # fmt: skip
        super().__init__([None], tokenizer, seed=seed, chat_template_kwargs=chat_template_kwargs)
        if num_episodes is not None and (isinstance(num_episodes, bool) or not isinstance(num_episodes, int)
                                         or num_episodes < 1):  # fmt: skip
            raise ValueError(f"num_episodes must be a positive int or None (endless), got {num_episodes!r}")
        self.num_episodes, self.is_sized, self.next_episode = num_episodes, False, 0
        self.epochs = None if num_episodes is None else 1  # a finite run ends (what evaluate() asks of a source)

    def episode_seed(self, episode: int) -> int:
        """The reset seed of ``episode``."""
        return self.seed * 100_003 + episode

    def next(self) -> Prompt | None:
        """The next episode's draw (``None`` after ``num_episodes``)."""
        while True:
            g = self.next_episode
            if self.num_episodes is not None and g >= self.num_episodes:
                self.is_exhausted = True
                return None
            self.next_episode += 1
            if g % self.num_shards == self.shard_index:
                break
        return Prompt(torch.zeros(1, dtype=torch.int64), "", {EPISODE: g, SEED: self.episode_seed(g)}, g, g, 0)

    def shard(self, index: int, num_shards: int) -> EpisodeSource:
        """Keep only the episodes ``g`` with ``g % num_shards == index`` (before the first draw)."""
        if self.next_episode:
            raise ValueError(f"shard() must come before the first draw; {self.next_episode} episodes were started")
        super().shard(index, num_shards)
        return self

    def rewind(self, seed: int) -> None:
        """Start over from the first draw of the ``seed`` order: the next episode is episode 0, reset with the
        seeds of ``seed``. The episodes still running are the env's: its next refill of a slot ends the episode the
        slot held (reset the env after a rewind)."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"rewind needs an int seed, got {seed!r}")
        self.seed, self.next_episode, self.is_exhausted = seed, 0, False

    def state_dict(self) -> dict:
        """The episode counter (live sessions cannot be saved: a restored slot's episode ends with an error)."""
        return {"next_episode": self.next_episode}

    def load_state_dict(self, state) -> None:
        """Restore the counter from :meth:`state_dict`."""
        self.next_episode, self.is_exhausted = int(state["next_episode"]), False


class EpisodeTurns(TurnHandler):
    """The turn handler of external episodes: serves each episode's first observation and steps the finished turns'
    episodes with the response text.

    The backend's :class:`Turn` is the answer (its observation is the next message unless the episode is done).
    A failed start or step fails that episode alone (:meth:`Turn.failed`). A slot's episode ends when the slot is
    refilled or the env closes; a restarted slot's episode is reset again.

    Args:
        backend: runs the episodes.
        action_fn: maps a turn's response text to the action text (default: the text itself).
        system_prompt: a system message before each first observation.
    """

    def __init__(self, backend: EpisodeBackend, *, action_fn: Callable[[str], str] | None = None,
                 system_prompt: str | None = None) -> None:  # fmt: skip
        if action_fn is not None and not callable(action_fn):
            raise TypeError(f"action_fn must be callable(text) -> action text, got {action_fn!r}")
        self.backend, self.action_fn, self.system_prompt = backend, action_fn, system_prompt
        self.broken: dict[int, EpisodeError] = {}  # episodes that could not restart: failed at their next turn

    def bind(self, facts: EnvFacts) -> None:
        if facts.group_size != 1:
            raise ValueError(f"group_size must be 1 for external episodes (each slot runs its own episode), got "
                             f"{facts.group_size!r}; give each episode its own seed instead")  # fmt: skip
        super().bind(facts)

    def describe(self) -> str:
        return self.backend.where()

    def serve(self, draw: Prompt, episode: int):
        """Start the draw's episode on the backend; its first observation (chat messages under a chat template) and
        where it runs (metadata ``"where"``)."""
        g, seed = int(draw.metadata[EPISODE]), int(draw.metadata[SEED])
        try:
            text = self.backend.start(g, seed)
        except Exception as err:
            self.backend.end(g)
            raise _episode_error(f"episode {g} could not start on {self.backend.where(g)}: {type(err).__name__}: "
                                 f"{err}; the slot takes the next episode at the next refill", err, is_start=True) from err  # fmt: skip
        return {"prompt": self.as_prompt(text), WHERE: self.backend.where(g)}

    def as_prompt(self, observation: str):
        """The prompt item of a first observation: chat messages when the tokenizer has a chat template."""
        if getattr(self.facts.tokenizer, "chat_template", None) is None:
            return f"{self.system_prompt}\n{observation}" if self.system_prompt else observation
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": observation}]

    def end_turns(self, turns: FinishedTurns) -> list[Turn]:
        episodes = [int(m[EPISODE]) for m in turns.metadata]
        actions = [self.action_fn(r) if self.action_fn else r for r in turns.responses]
        answers = self.backend.step(episodes, actions)
        out = []
        for g, turn, final, answer in zip(episodes, turns.turns, turns.is_final, answers, strict=True):
            if g in self.broken:
                self.backend.end(g)
                out.append(Turn.failed(self.broken.pop(g)))
            elif isinstance(answer, Exception):
                self.backend.end(g)
                out.append(Turn.failed(_episode_error(
                    f"episode {g} failed at turn {turn} on {self.backend.where(g)}: {type(answer).__name__}: "
                    f"{answer}; it ended there with reward 0, the other episodes go on", answer, is_start=False)))  # fmt: skip
            elif answer.is_done or final:
                self.backend.end(g)
                out.append(answer if answer.is_done else dataclasses.replace(answer, done=True))
            else:
                out.append(answer)
        return out

    def release(self, held: list[HeldEpisode]) -> None:
        for h in held:
            self.backend.end(int(h.prompt.metadata[EPISODE]))

    def refilled(self, held: list[HeldEpisode]) -> None:
        kept = {int(h.prompt.metadata[EPISODE]) for h in held}
        for g in set(self.backend.live) - kept:  # started, but no slot holds it: release it
            self.backend.end(g)

    def restart(self, dropped: list[HeldEpisode], restarted: list[HeldEpisode]) -> None:
        for h in restarted:
            g = int(h.prompt.metadata[EPISODE])
            self.backend.end(g)
            try:
                self.backend.start(g, int(h.prompt.metadata[SEED]))
            except Exception as err:  # the episode's next turn fails it
                self.broken[g] = _episode_error(f"episode {g} could not restart on {self.backend.where(g)}: "
                                                f"{type(err).__name__}: {err}", err, is_start=True)  # fmt: skip

    def close(self) -> None:
        self.backend.end_all()


def EpisodeTokenEnv(backend: EpisodeBackend, tokenizer, *, max_turns: int = 4, num_episodes: int | None = None,  # noqa: N802
                    system_prompt: str | None = None, action_fn: Callable[[str], str] | None = None,
                    seed: int = 0, **kwargs) -> TokenEnv:  # fmt: skip
    """``TokenEnv(EpisodeSource(...), tokenizer, turns=EpisodeTurns(backend, ...))``: one external episode per slot.

    A function returning a :class:`~tokengym.llm_envs.TokenEnv` (a subclass before this release); see the module
    docstring. The backend is ``env.turns.backend``.

    Args:
        backend: runs the episodes.
        tokenizer: as for :class:`~tokengym.llm_envs.TokenEnv`.
        max_turns: turns per episode (the env ends an episode after it even if the backend goes on).
        num_episodes: episodes to run (``None``: endless).
        system_prompt: a system message before the first observation.
        action_fn: maps a turn's response text to the action text (default: the text itself).
        seed: the episodes' reset seeds (``seed * 100_003 + episode``).
        **kwargs: the other :class:`~tokengym.llm_envs.TokenEnv` arguments (``group_size`` must be 1: every slot
            is its own episode).
    """
    source = EpisodeSource(tokenizer, num_episodes=num_episodes, seed=seed)
    turns = EpisodeTurns(backend, action_fn=action_fn, system_prompt=system_prompt)
    if kwargs.get("group_size", 1) != 1:
        raise ValueError(f"group_size must be 1 for external episodes (each slot runs its own episode), got "
                         f"{kwargs['group_size']!r}; give each episode its own seed instead")  # fmt: skip
    kwargs.pop("group_size", None)
    return TokenEnv(source, tokenizer, turns=turns, max_turns=max_turns, **kwargs)
