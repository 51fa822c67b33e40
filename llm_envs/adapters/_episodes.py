"""External episodes behind a multi-turn token env: one episode (a server session, an env instance) per slot.

A backend runs the episodes: ``start`` opens one and gives its first observation (the prompt),
``step`` answers finished turns (several episodes at once) with a :class:`~tokengym.llm_envs.turns.Turn` each
(reward, the observation as feedback with its role, done), ``end`` releases one. The env's prompt source
(:class:`EpisodeSource`) starts an episode whenever a slot needs a prompt; the env's turn handler
(:class:`EpisodeTurns`) steps the episodes of the finished turns and ends the episode a slot held when the
slot is refilled. An episode whose backend fails ends there with reward 0 and its error is raised at the
slot's refill as an :class:`EpisodeError` (through the collector's usual ``PromptError`` path: the step is
recorded, iterating again goes on). Each failure is logged (WARNING, ``tokengym.llm_envs.adapters``) when it
happens, and its wording says what failed: an episode that could not start, one that failed, or a server that
went away (a backend's ``ConnectionError``).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Protocol

from tokengym.llm_envs.errors import PromptError
from tokengym.llm_envs.prompts import Prompt, PromptSource
from tokengym.llm_envs.token_env import TokenEnv
from tokengym.llm_envs.turns.protocol import FinishedTurns, Turn, TurnHandler

__all__ = ["EpisodeBackend", "EpisodeError", "EpisodeSource", "EpisodeTokenEnv", "EpisodeTurns"]

EPISODE = "episode"  # prompt-metadata fields: the episode id, its reset seed and where it runs
SEED = "seed"
WHERE = "where"

_log = logging.getLogger(__name__)


class EpisodeError(PromptError):
    """An external episode failed (its session, server or env instance); only that episode ended."""

    what = "episode(s) failed and ended with reward 0"

    def __init__(self, message: str, *, what: str | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        if what is not None:
            self.what = what


def _episode_error(message: str, cause: Exception, *, is_start: bool) -> EpisodeError:
    """An :class:`EpisodeError` whose ``what`` says what failed (logged as it happens)."""
    if isinstance(cause, ConnectionError):
        what = "episode(s) lost their server: it went away"
    else:
        what = "episode(s) could not start" if is_start else EpisodeError.what
    _log.warning("%s", message)
    return EpisodeError(message, what=what)


class EpisodeBackend(Protocol):
    """Runs external episodes for an :class:`EpisodeTokenEnv`."""

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
    """A prompt source whose prompts are the first observations of newly started episodes.

    Episode ``g`` is reset with seed ``seed * 100_003 + g``; its prompt has ``group_id = index = g``
    and metadata ``{"episode": g, "seed": ..., "where": ...}``. ``num_episodes=None`` runs forever.
    Sharding (Ray workers) splits the episode ids ``g % num_shards``.
    """

    def __init__(self, backend: EpisodeBackend, tokenizer, *, num_episodes: int | None = None, seed: int = 0,
                 system_prompt: str | None = None, chat_template_kwargs: dict | None = None) -> None:  # fmt: skip
        super().__init__([None], tokenizer, seed=seed, chat_template_kwargs=chat_template_kwargs)
        if num_episodes is not None and (isinstance(num_episodes, bool) or not isinstance(num_episodes, int)
                                         or num_episodes < 1):  # fmt: skip
            raise ValueError(f"num_episodes must be a positive int or None (endless), got {num_episodes!r}")
        self.backend, self.num_episodes, self.system_prompt = backend, num_episodes, system_prompt
        self.is_sized = False
        self.failures: collections.deque[EpisodeError] = collections.deque()
        self.next_episode = 0

    def episode_seed(self, episode: int) -> int:
        """The reset seed of ``episode``."""
        return self.seed * 100_003 + episode

    def next(self) -> Prompt | None:
        """The next episode's prompt; first raises the errors of episodes that failed since the last call."""
        if self.failures:
            raise self.failures.popleft()
        while True:
            g = self.next_episode
            if self.num_episodes is not None and g >= self.num_episodes:
                self.is_exhausted = True
                return None
            self.next_episode += 1
            if g % self.num_shards == self.shard_index:
                break
        seed = self.episode_seed(g)
        try:
            text = self.backend.start(g, seed)
        except Exception as err:
            self.backend.end(g)
            raise _episode_error(f"episode {g} could not start on {self.backend.where(g)}: {type(err).__name__}: "
                                 f"{err}; the slot takes the next episode at the next refill", err, is_start=True) from err  # fmt: skip
        ids, text, meta = self.encode({"prompt": self.as_prompt(text), EPISODE: g, SEED: seed,
                                       WHERE: self.backend.where(g)}, g)  # fmt: skip
        return Prompt(ids, text, meta, g, g, 0)

    def as_prompt(self, observation: str):
        """The prompt item of a first observation: chat messages when the tokenizer has a chat template."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            return f"{self.system_prompt}\n{observation}" if self.system_prompt else observation
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": observation}]

    def shard(self, index: int, num_shards: int) -> EpisodeSource:
        """Keep only the episodes ``g`` with ``g % num_shards == index`` (before the first draw)."""
        if self.next_episode:
            raise ValueError(f"shard() must come before the first draw; {self.next_episode} episodes were started")
        super().shard(index, num_shards)
        return self

    def rewind(self, seed: int) -> None:
        """Start over from the first draw of the ``seed`` order: the next episode is episode 0, reset with the
        seeds of ``seed``; failures not yet raised are dropped. The episodes still running are the env's: its
        next refill of a slot ends the episode the slot held (reset the env after a rewind)."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"rewind needs an int seed, got {seed!r}")
        self.seed, self.next_episode, self.is_exhausted = seed, 0, False
        self.failures.clear()

    def state_dict(self) -> dict:
        """The episode counter (live sessions cannot be saved: a restored slot's episode ends with an error)."""
        return {"next_episode": self.next_episode}

    def load_state_dict(self, state) -> None:
        """Restore the counter from :meth:`state_dict`."""
        self.next_episode, self.is_exhausted = int(state["next_episode"]), False
        self.failures.clear()


class EpisodeTurns(TurnHandler):
    """The turn handler of an :class:`EpisodeTokenEnv`: steps each finished turn's episode with the response text.

    The backend's :class:`Turn` is the answer (its observation is the next message unless the episode is
    done). A failed step ends the episode with reward 0 and queues an :class:`EpisodeError`. A slot's
    episode ends when the slot is refilled or the env closes; a restarted slot's episode is reset again.
    """

    def __init__(self, source: EpisodeSource, *, max_turns: int, action_fn: Callable[[str], str] | None = None) -> None:
        if action_fn is not None and not callable(action_fn):
            raise TypeError(f"action_fn must be callable(text) -> action text, got {action_fn!r}")
        self.source, self.backend, self.max_turns, self.action_fn = source, source.backend, max_turns, action_fn

    def describe(self) -> str:
        return self.backend.where()

    def end_turns(self, turns: FinishedTurns) -> list[Turn]:
        episodes = [int(m[EPISODE]) for m in turns.metadata]
        actions = [self.action_fn(r) if self.action_fn else r for r in turns.responses]
        answers = self.backend.step(episodes, actions)
        out = []
        for g, turn, final, answer in zip(episodes, turns.turns, turns.is_final, answers, strict=True):
            if isinstance(answer, Exception):
                self.backend.end(g)
                self.source.failures.append(_episode_error(
                    f"episode {g} failed at turn {turn} on {self.backend.where(g)}: {type(answer).__name__}: "
                    f"{answer}; it ended there with reward 0, the other episodes go on", answer, is_start=False))  # fmt: skip
                out.append(Turn(0.0))
                continue
            if answer.is_done or final or turn + 1 >= self.max_turns:
                self.backend.end(g)
            out.append(answer)
        return out

    def release(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:
            self.backend.end(int(prompt.metadata[EPISODE]))

    def refilled(self, held: list[Prompt]) -> None:
        # an episode whose prompt the env rejected (too long, say) holds no slot: release it
        kept = {int(p.metadata[EPISODE]) for p in held}
        for g in set(self.backend.live) - kept:
            self.backend.end(g)

    def restart(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:
            g = int(prompt.metadata[EPISODE])
            self.backend.end(g)
            try:
                self.backend.start(g, int(prompt.metadata[SEED]))
            except Exception as err:  # the episode's next turn finds no session and ends with an error
                self.source.failures.append(_episode_error(f"episode {g} could not restart on {self.backend.where(g)}: "
                                                           f"{type(err).__name__}: {err}", err, is_start=True))  # fmt: skip

    def close(self) -> None:
        self.backend.end_all()


class EpisodeTokenEnv(TokenEnv):
    """``TokenEnv(EpisodeSource(backend), tokenizer, turns=EpisodeTurns(...))``: one external episode per slot.

    See the module docstring.

    Args:
        backend: runs the episodes.
        tokenizer: as for :class:`~tokengym.llm_envs.token_env.TokenEnv`.
        max_turns: turns per episode (the env ends an episode after it even if the backend goes on).
        num_episodes: episodes to run (``None``: endless).
        system_prompt: a system message before the first observation.
        action_fn: maps a turn's response text to the action text (default: the text itself).
        **kwargs: the other :class:`TokenEnv` arguments (``group_size`` must be 1: every slot is its own episode).
    """

    def __init__(self, backend: EpisodeBackend, tokenizer, *, max_turns: int = 4, num_episodes: int | None = None,
                 system_prompt: str | None = None, action_fn: Callable[[str], str] | None = None, **kwargs) -> None:  # fmt: skip
        if kwargs.get("group_size", 1) != 1:
            raise ValueError(f"group_size must be 1 for external episodes (each slot runs its own episode), "
                             f"got {kwargs['group_size']!r}; give each episode its own seed instead")  # fmt: skip
        kwargs.pop("group_size", None)
        source = EpisodeSource(backend, tokenizer, num_episodes=num_episodes, seed=kwargs.pop("seed", 0),
                               system_prompt=system_prompt)  # fmt: skip
        turns = EpisodeTurns(source, max_turns=max_turns, action_fn=action_fn)
        super().__init__(source, tokenizer, turns=turns, max_turns=max_turns, **kwargs)
        self.backend = backend
