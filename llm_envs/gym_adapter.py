"""Gymnasium adapter: a single-slot :class:`TokenEnv` as a ``gymnasium.Env`` (one step = one token).

Importing this module registers the built-in tasks under the ``tokengym/`` namespace.

Example:
    >>> import gymnasium
    >>> from tokengym.testing import tiny_tokenizer
    >>> env = gymnasium.make("tokengym/Arithmetic-v0", tokenizer=tiny_tokenizer(), max_new_tokens=4)
    >>> obs, info = env.reset(seed=0)
    >>> info["prompt"], sorted(obs)
    ('19+18=', ['prompt_len', 'response_len', 'seq_len', 'token'])
    >>> obs, reward, terminated, truncated, info = env.step(env.unwrapped.tokenizer.eos_token_id)
    >>> terminated, reward, info["response"]
    (True, 0.0, '')
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import gymnasium
import numpy as np
import torch
from gymnasium import spaces

from tokengym.llm_envs import keys
from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.errors import ResetNeeded
from tokengym.llm_envs.tasks import make_arithmetic_env, make_countdown_env, make_reversal_env
from tokengym.llm_envs.token_env import TokenEnv

__all__ = ["GymTokenEnv", "TASK_ENV_IDS", "register_envs"]

TASK_ENV_IDS = {
    "tokengym/Arithmetic-v0": make_arithmetic_env,
    "tokengym/Countdown-v0": make_countdown_env,
    "tokengym/Reversal-v0": make_reversal_env,
}
_OBS_KEYS = (keys.TOKEN, keys.SEQ_LEN, keys.PROMPT_LEN, keys.RESPONSE_LEN)
_NEXT = keys.DONE[0]  # torchrl's root of the next-step entries


class GymTokenEnv(gymnasium.Env):
    """A ``batch_size=1`` :class:`TokenEnv` behind the gymnasium API; the action is a token id.

    Observations are a dict of ints: the last ``token``, ``seq_len``, ``prompt_len`` and
    ``response_len``; the text lives in ``info`` (``prompt`` and ``metadata`` at reset, plus
    ``response`` at the last step). ``reset(seed=s)`` rewinds the prompt source and reseeds its
    shuffle with ``s``, so the same seed gives the same prompts; a reset without a seed takes the next one.

    Args:
        env_factory: ``env_factory(**env_kwargs) -> TokenEnv`` with ``batch_size=1``.
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns prompt + response so far).
        **env_kwargs: forwarded to ``env_factory``.

    Example:
        >>> from tokengym.llm_envs.tasks import make_reversal_env
        >>> from tokengym.testing import tiny_tokenizer
        >>> env = GymTokenEnv(make_reversal_env, tokenizer=tiny_tokenizer(), batch_size=1, n_prompts=4)
        >>> env.action_space
        Discrete(512)
        >>> obs, info = env.reset(seed=0)
        >>> info["prompt"], int(obs["response_len"])
        ('Reverse ynbiqp:', 0)
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 30}  # render_fps: declared for checkers; text ignores it

    def __init__(self, env_factory: Callable[..., TokenEnv], *, render_mode: str | None = None, **env_kwargs) -> None:
        if not callable(env_factory):
            raise TypeError(f"env_factory must be a callable returning a TokenEnv, got {env_factory!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or one of {self.metadata['render_modes']}, got {render_mode!r}")
        env = env_factory(**env_kwargs)
        if not isinstance(env, TokenEnv):
            raise TypeError(f"env_factory must return a TokenEnv, got {type(env).__name__}")
        if tuple(env.batch_size) != (1,):
            raise ValueError(
                f"GymTokenEnv needs a single-slot TokenEnv, got batch_size={tuple(env.batch_size)}; "
                "build it with batch_size=1"
            )
        self.env, self.tokenizer, self.render_mode = env, env.tokenizer, render_mode
        self.action_space = spaces.Discrete(env.vocab_size)
        length = spaces.Discrete(env.max_length + 1)
        self.observation_space = spaces.Dict(
            {
                keys.TOKEN: spaces.Discrete(env.vocab_size),
                keys.SEQ_LEN: length,
                keys.PROMPT_LEN: copy.deepcopy(length),
                keys.RESPONSE_LEN: spaces.Discrete(env.max_new_tokens + 1),
            }
        )
        self._td = None  # the TokenEnv's current observation; None until reset and after an episode ends

    def _obs(self, td) -> dict[str, np.int64]:
        return {k: np.int64(td.get(k)[0].item()) for k in _OBS_KEYS}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        """Start an episode on the next prompt (the first of the ``seed`` order when ``seed`` is given)."""
        super().reset(seed=seed)
        if seed is not None:
            self.env.source.rewind(seed)  # the env's reset below refills the slot (ending an external episode)
        self._td = self.env.reset()
        prompt = self.env.slot_prompt(0)
        if prompt is None:
            self._td = None
            raise ValueError("the prompt source is exhausted; build the env with more prompts or epochs=None")
        return self._obs(self._td), {"prompt": prompt.text, "metadata": copy.deepcopy(prompt.metadata)}

    def step(self, action) -> tuple[dict, float, bool, bool, dict]:
        """Append token ``action``; the reward arrives with the last token of the response."""
        if self._td is None:
            raise ResetNeeded("GymTokenEnv.step() before reset() or after the episode ended; call reset() first")
        action = _token_id(action)
        if not 0 <= action < self.action_space.n:
            raise ValueError(f"action must be a token id in [0, {self.action_space.n}), got {action}")
        prompt = self.env.slot_prompt(0)
        out = self.env.step(self._td.set(keys.ACTION, torch.tensor([action])))
        terminated, truncated = bool(out.get(keys.TERMINATED)[0]), bool(out.get(keys.TRUNCATED)[0])
        info = {}
        if terminated or truncated:
            response = self.tokenizer.decode(self.env.response_ids(0), skip_special_tokens=True)
            info = {"prompt": prompt.text, "response": response, "metadata": copy.deepcopy(prompt.metadata)}
        self._td = None if terminated or truncated else out.get(_NEXT)
        return self._obs(out.get(_NEXT)), float(out.get(keys.REWARD)[0]), terminated, truncated, info

    def render(self) -> str | None:
        """With ``render_mode="ansi"``: the prompt and the response so far."""
        if self.render_mode != "ansi":
            return None
        prompt = self.env.slot_prompt(0)
        if prompt is None:
            return ""
        return prompt.text + self.tokenizer.decode(self.env.response_ids(0), skip_special_tokens=True)


def _token_id(action) -> int:
    """One token id from an int, a numpy integer or a one-element integer array / tensor."""
    if isinstance(action, torch.Tensor | np.ndarray):
        dtype = str(action.dtype)
        if (action.size if isinstance(action, np.ndarray) else action.numel()) != 1:
            raise ValueError(f"action must be one token id, got a {type(action).__name__} of shape {tuple(action.shape)}")
        if "int" not in dtype:
            raise TypeError(f"action must be an integer token id, got a {type(action).__name__} of dtype {dtype}")
        return int(action.reshape(-1)[0].item())
    if isinstance(action, bool | np.bool_) or not isinstance(action, int | np.integer):
        raise TypeError(f"action must be an integer token id, got {type(action).__name__} {action!r:.40}")
    return int(action)


def _make_task(task_id: str, *, render_mode: str | None = None, **env_kwargs) -> GymTokenEnv:
    require_tokenizer(f"gymnasium.make({task_id!r})", env_kwargs.get("tokenizer"))
    env_kwargs = {"batch_size": 1, "shuffle": True, **env_kwargs}
    return GymTokenEnv(TASK_ENV_IDS[task_id], render_mode=render_mode, **env_kwargs)


def register_envs() -> None:
    """Register the built-in tasks (ids in ``TASK_ENV_IDS``) with gymnasium; calling it again is a no-op.

    ``gymnasium.make`` kwargs go to the task's ``make_*_env``: ``tokenizer`` (required), ``n_prompts``,
    ``max_new_tokens``...
    """
    for env_id in TASK_ENV_IDS:
        if env_id not in gymnasium.registry:
            gymnasium.register(
                id=env_id,
                entry_point=_entry_point(env_id),
                disable_env_checker=False,
            )


def _entry_point(env_id: str) -> Callable[..., GymTokenEnv]:
    make = functools.partial(_make_task, env_id)
    make.metadata = GymTokenEnv.metadata  # read by gymnasium.make to validate render_mode
    return make


register_envs()
