"""The keyword arguments an adapter factory passes on to its env: an unknown one fails at the call, by name."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping

from tokengym.llm_envs.adapters._episodes import EpisodeTokenEnv
from tokengym.llm_envs.token_env import TokenEnv

__all__ = ["EPISODE_ENV_OPTIONS", "EPISODE_HINTS", "check_kwargs", "keyword_options"]


def keyword_options(builder: Callable, *, exclude: Collection[str] = ()) -> tuple[str, ...]:
    """The keyword-only arguments of ``builder`` (a class: its ``__init__``), less ``exclude`` (set by the factory).

    Example:
        >>> "batch_size" in keyword_options(TokenEnv), "turns" in keyword_options(TokenEnv, exclude={"turns"})
        (True, False)
    """
    params = inspect.signature(builder.__init__ if isinstance(builder, type) else builder).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in exclude)


def check_kwargs(factory: Callable, given: Mapping, passed_on: Collection[str],
                 hints: Mapping[str, str] | None = None) -> None:  # fmt: skip
    """Raise ``TypeError`` naming the arguments of ``given`` that neither ``factory`` nor its env takes.

    Args:
        factory: the factory called (its own keyword arguments count as accepted).
        given: its ``**env_kwargs``.
        passed_on: the env arguments the factory passes on.
        hints: ``{argument: what to do instead}`` for arguments a user may expect here.
    """
    unknown = [name for name in given if name not in passed_on]
    if not unknown:
        return
    params = inspect.signature(factory).parameters.values()
    own = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    hint = "".join(f"; {name}: {hints[name]}" for name in unknown if hints and name in hints)
    raise TypeError(f"{factory.__name__}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}{hint}. "
                    f"It accepts {', '.join(own)} and the env's {', '.join(passed_on)}")  # fmt: skip


# what a factory of external episodes passes on to EpisodeTokenEnv (a PromptSource of episodes: no shuffle, no
# overlong policy of its own; the turns are the episodes')
_EPISODE_OWN = keyword_options(EpisodeTokenEnv, exclude={"max_turns"})
EPISODE_ENV_OPTIONS = (*_EPISODE_OWN, *keyword_options(TokenEnv, exclude={"turns", "max_turns", "shuffle", "overlong_prompts",
                                                                          *_EPISODE_OWN}))  # fmt: skip
_NO_LIST = ("external episodes are not a list of problems: they are made by their reset seeds, so there is nothing "
            "to replay or split")  # fmt: skip
EPISODE_HINTS = {
    "epochs": f"{_NO_LIST}; num_episodes=N runs N episodes, then the source ends",
    **{name: f"{_NO_LIST}; held-out episodes come from a second env with another seed= (its episodes reset with "
             "other seeds: env.source.episode_seed(g))" for name in ("split", "held_out", "split_seed")},
}  # fmt: skip
