"""TokenPolicy: the complete set of what a collector may call on a policy.

A policy generates tokens for the slots of a :class:`~tokengym.llm_envs.TokenEnv`, either one step at a
time (``__call__`` on the step TensorDict) or a whole wave at a time (``generate`` on a
:class:`~tokengym.llm_envs.waves.WaveRequest`), or both. Everything else a collector needs is here:
the version stamped on every token, a weight update, a checkpoint of the policy's collection state
(RNG, cache, version; the weights are the trainer's to save) and ``close``. Built-in implementations:
:class:`~tokengym.collectors.TransformersPolicy` (both modes), :class:`~tokengym.collectors.PolicyWithReference`
(a policy composed with a stepwise reference) and ``VLLMPolicy`` (waves).

Example:
    A scripted policy that always answers with EOS works with every collector:

    >>> import torch
    >>> from tokengym.llm_envs import TokenEnv, keys
    >>> from tokengym.testing import tiny_tokenizer
    >>> class EOSPolicy:
    ...     version = 0
    ...     def __init__(self, eos): self.eos = eos
    ...     def __call__(self, td):
    ...         n = td.batch_size[0]
    ...         td.set(keys.ACTION, torch.full((n,), self.eos)); td.set(keys.ACTION_LOG_PROB, torch.zeros(n))
    ...         return td.set(keys.POLICY_VERSION, torch.full((n,), self.version))
    ...     def update_weights(self, weights=None): self.version += 1; return self.version
    ...     def state_dict(self): return {"version": self.version}
    ...     def load_state_dict(self, state): self.version = state["version"]
    ...     def close(self): pass
    >>> tok = tiny_tokenizer()
    >>> policy = EOSPolicy(tok.eos_token_id)
    >>> is_token_policy(policy), supports_steps(policy), supports_waves(policy)
    (True, True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import TokenEnv

__all__ = ["FunctionPolicy", "weights_of", "TokenPolicy", "as_token_policy", "check_policy", "check_policy_env",
           "is_token_policy", "supports_steps", "supports_waves"]

Weights = Mapping[str, Any] | TensorDictBase


@runtime_checkable
class TokenPolicy(Protocol):
    """What a collector calls on a policy, and nothing else.

    A policy implements ``__call__(td) -> td`` (stepwise: writes ``keys.ACTION``,
    ``keys.ACTION_LOG_PROB``, ``keys.POLICY_VERSION`` and optionally ``keys.RAW_LOG_PROB`` for every
    slot), ``generate(request: WaveRequest) -> WaveResult`` (one call continues every slot of the
    request until its turn ends; the env re-checks termination on what comes back), or both. A
    wave-only policy sets ``is_wave_only = True``. The rest is required.
    """

    version: int
    """Version of the weights; stamped on every token as ``keys.POLICY_VERSION``."""

    def update_weights(self, weights: Weights | None = None) -> int:
        """Load ``weights`` (a state_dict or a TensorDict of weights; ``None``: the model was updated in
        place), drop caches computed under the old weights, bump and return :attr:`version`."""

    def state_dict(self) -> dict:
        """Collection state to checkpoint (sampling RNG, version, caches); not the model weights."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    def close(self) -> None:
        """Release engines, caches and workers."""


def supports_steps(policy) -> bool:
    """True when ``policy`` chooses one token per slot from a step TensorDict (``__call__``)."""
    return callable(policy) and not getattr(policy, "is_wave_only", False)


def supports_waves(policy) -> bool:
    """True when ``policy`` generates whole waves (``generate(WaveRequest) -> WaveResult``)."""
    return callable(getattr(policy, "generate", None))


def is_token_policy(policy) -> bool:
    """True when ``policy`` implements :class:`TokenPolicy` and at least one generation mode."""
    return isinstance(policy, TokenPolicy) and (supports_steps(policy) or supports_waves(policy))


def check_policy(policy) -> None:
    """Raise a ``TypeError`` naming what ``policy`` lacks of :class:`TokenPolicy`."""
    required = ("version", "update_weights", "state_dict", "load_state_dict", "close")
    missing = [name for name in required if not hasattr(policy, name)]
    if not (supports_steps(policy) or supports_waves(policy)):
        missing.append("__call__ (steps) or generate (waves)")
    if missing:
        raise TypeError(
            f"{type(policy).__name__} is not a TokenPolicy: it lacks {missing}; "
            "see tokengym.collectors.policies.protocol.TokenPolicy"
        )



def _bound_envs(policy, depth: int = 0):
    """``(owner, env)`` of every TokenEnv ``policy`` is bound to: its ``env``, and those of the parts a
    composed policy exposes as ``policy`` / ``reference`` (e.g. ``PolicyWithReference``)."""
    env = getattr(policy, "env", None)
    base = getattr(env, "base_env", env)
    if isinstance(base, TokenEnv):
        yield type(policy).__name__, base
    if depth < 3:
        for part in ("policy", "reference"):
            inner = getattr(policy, part, None)
            if inner is not None and inner is not policy:
                yield from _bound_envs(inner, depth + 1)


def check_policy_env(policy, env) -> None:
    """Raise a ``ValueError`` when a stepping ``policy`` (or a part of it) was built on another env than ``env``.

    A policy that steps reads its env's token buffer (KV-cache prefills), so one built on another env
    would continue other sequences; with another batch size it fails deep inside torch. (A wave
    reaches the policy as a request, so a wave source may share one policy between envs.)

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.collectors import TransformersPolicy
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> env4, env8 = (TokenEnv(["1+1="], tok, batch_size=b, model_config=model.config) for b in (4, 8))
        >>> check_policy_env(TransformersPolicy(model, env4), env8)
        Traceback (most recent call last):
        ...
        ValueError: TransformersPolicy was built on another env (batch_size 4) than the collector's (batch_size 8); build it on the env you collect from, e.g. TransformersPolicy(model, env)
    """
    base = getattr(env, "base_env", env)
    for owner, bound in _bound_envs(policy):
        if bound is not base:
            raise ValueError(
                f"{owner} was built on another env (batch_size {bound.batch_size[0]}) than the collector's "
                f"(batch_size {base.batch_size[0]}); build it on the env you collect from, e.g. {owner}(model, env)"
            )


class FunctionPolicy:
    """A plain function ``td -> td`` as a stepwise :class:`TokenPolicy` with no weights (version 0).

    Handy for scripted and random policies in tests; it cannot take weight updates.
    """

    def __init__(self, fn) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable on the step TensorDict, got {fn!r}")
        self.fn = fn

    def __call__(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.fn(tensordict)

    @property
    def version(self) -> int:
        """The function's own ``version`` attribute, if it has one, else 0."""
        return int(getattr(self.fn, "version", 0))

    def update_weights(self, weights=None) -> int:
        raise TypeError(
            f"{getattr(self.fn, '__name__', self.fn)!r} is a plain function with no weights; "
            "implement TokenPolicy.update_weights on a policy object to take weight updates"
        )

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


def as_token_policy(policy):
    """``policy`` itself when it implements :class:`TokenPolicy`; a plain function becomes a
    :class:`FunctionPolicy`; anything else raises a ``TypeError`` naming what it lacks."""
    if callable(policy) and not hasattr(policy, "update_weights") and not supports_waves(policy):
        return FunctionPolicy(policy)
    check_policy(policy)
    return policy


def weights_of(policy_or_weights, weights, *, missing: str) -> Weights:
    """The weights of an ``update_policy_weights_(policy_or_weights=None, *, weights=None)`` call: a
    state_dict, a TensorDict of weights, or a module's ``state_dict()``; ``ValueError(missing)`` when none."""
    weights = policy_or_weights if weights is None else weights
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    if weights is None:
        raise ValueError(missing)
    return weights
