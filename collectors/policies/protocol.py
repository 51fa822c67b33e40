"""The policy protocols: everything a collector may call on a policy, and what a backend checks against the env.

A policy generates tokens for the slots of a :class:`~tokengym.llm_envs.TokenEnv`. Every policy implements the
base, :class:`TokenPolicy`: the version stamped on every token, weight updates, the sampling seed, its
collection state (sampling RNG or request counter, version, caches; the weights are the trainer's to save)
and ``close``. On top of it, one generation mode or both:

- :class:`StepPolicy`: ``__call__(td)`` chooses one token for every slot of a step TensorDict;
- :class:`WavePolicy`: ``generate(request)`` continues every slot of a :class:`~tokengym.llm_envs.waves.WaveRequest`
  until its turn ends.

Optional capabilities are class attributes; absent means ``False`` (read them with the functions below):

- ``is_wave_only``: the policy is callable but does not step (an ``nn.Module`` that generates waves);
- ``supports_cache_state``: ``collection_state(include_cache=False)`` leaves out a cache too large to save;
- ``sampling``: the policy's :class:`~tokengym.collectors.policies.SamplingConfig` (an attribute, not a flag): the
  collector records it with every batch so the sequence actors score what was sampled (:func:`sampling_of`);
- ``counts()``: a method returning counters the collector adds to its metrics, every key from construction on
  (``VLLMServerPolicy``: servers up, failovers, weight reloads, requests sent again).

Built-in: :class:`~tokengym.collectors.policies.TransformersPolicy` (steps and waves, cache state),
:class:`~tokengym.collectors.PolicyWithReference` (steps), ``VLLMPolicy`` and ``VLLMServerPolicy`` (waves).
Each checks at construction that it fits its env with :func:`check_fits_env`.

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
    ...     def set_seed(self, seed): pass
    ...     def collection_state(self): return {"version": self.version}
    ...     def load_collection_state(self, state): self.version = state["version"]
    ...     def close(self): pass
    >>> policy = EOSPolicy(tiny_tokenizer().eos_token_id)
    >>> isinstance(policy, StepPolicy), isinstance(policy, WavePolicy), supports_steps(policy)
    (True, False, True)
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase

from tokengym.collectors.policies.lora import adapter_weights, is_lora_model
from tokengym.collectors.policies.sampling import SamplingConfig
from tokengym.llm_envs import TokenEnv
from tokengym.llm_envs.waves import WaveRequest, WaveResult

__all__ = ["FunctionPolicy", "StepPolicy", "TokenPolicy", "WavePolicy", "as_token_policy", "check_fits_env",
           "check_policy", "check_policy_env", "check_policy_sampling", "is_token_policy", "load_policy_state", "policy_state", "probe_ids",
           "sampling_of", "supports_cache_state", "supports_interrupt", "supports_steps", "supports_waves", "weights_of"]  # fmt: skip

Weights = Mapping[str, torch.Tensor] | TensorDictBase | torch.nn.Module


@runtime_checkable
class TokenPolicy(Protocol):
    """The base of every policy: what a collector calls on it besides generating tokens.

    A policy also implements :class:`StepPolicy`, :class:`WavePolicy` or both; optional capabilities
    (``is_wave_only``, ``supports_cache_state``) are class attributes, described in the module docstring.
    """

    version: int
    """Version of the weights; stamped on every token as ``keys.POLICY_VERSION``."""

    def update_weights(self, weights: Weights | None = None) -> int:
        """Load ``weights`` (see ``weights_of``; ``None``: the model was updated in place or its checkpoint
        is reloaded), drop caches computed under the old weights, bump and return :attr:`version`."""

    def set_seed(self, seed: int) -> None:
        """Restart the sampling randomness from ``seed``."""

    def collection_state(self) -> dict:
        """What a collector checkpoints: sampling RNG or request counter, version, caches; never the weights.
        Plain data (tensors, numbers, strings, lists, dicts). A policy with ``supports_cache_state`` takes
        ``include_cache: bool = True`` (keyword-only) and leaves its cache out when it is False."""

    def load_collection_state(self, state: dict) -> None:
        """Restore :meth:`collection_state`."""

    def close(self) -> None:
        """Release engines, caches and workers (the model stays the caller's)."""


@runtime_checkable
class StepPolicy(TokenPolicy, Protocol):
    """A policy that chooses one token per slot per env step (``source="step"``)."""

    def __call__(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Write ``keys.ACTION``, ``keys.ACTION_LOG_PROB`` and ``keys.POLICY_VERSION`` (optionally
        ``keys.RAW_LOG_PROB``) for every slot of the step TensorDict, and return it.

        The collector keeps the tensors written as they are until the batch is built (one stack per key, not a
        copy per step): write new tensors each step (or tensors never written in place again, as a shared
        version tensor), not a buffer refilled in place."""


@runtime_checkable
class WavePolicy(TokenPolicy, Protocol):
    """A policy that generates every live slot's whole turn in one call (``source="wave"``)."""

    def generate(self, request: WaveRequest) -> WaveResult:
        """Continue every prompt of ``request`` until its turn ends (an EOS id, a stop string or its budget);
        the env re-checks termination on what comes back."""


_REQUIRED = ("version", "update_weights", "set_seed", "collection_state", "load_collection_state", "close")


def supports_steps(policy) -> bool:
    """True when ``policy`` chooses one token per slot from a step TensorDict (``__call__``)."""
    return callable(policy) and not getattr(policy, "is_wave_only", False)


def supports_waves(policy) -> bool:
    """True when ``policy`` generates whole waves (``generate(WaveRequest) -> WaveResult``)."""
    return callable(getattr(policy, "generate", None))


def supports_interrupt(policy) -> bool:
    """True when ``policy`` has an ``interrupt`` event (a ``threading.Event``): set, its wave in progress stops early
    and returns its unfinished rows (``WaveResult.finished``); see ``CollectorOptions(partial_rollouts=...)``."""
    return isinstance(getattr(policy, "interrupt", None), threading.Event)


def supports_cache_state(policy) -> bool:
    """True when ``policy.collection_state`` takes ``include_cache`` (its cache may be left out of a checkpoint)."""
    return bool(getattr(policy, "supports_cache_state", False))


def sampling_of(policy) -> SamplingConfig | None:
    """The :class:`~tokengym.collectors.policies.SamplingConfig` ``policy`` samples with (its ``sampling``), or ``None``
    when it does not say (a plain function); a ``TypeError`` when ``sampling`` is something else."""
    sampling = getattr(policy, "sampling", None)
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise TypeError(f"{type(policy).__name__}.sampling must be a SamplingConfig (what the policy samples with, "
                        f"recorded with every batch) or None, got {type(sampling).__name__}")  # fmt: skip
    return sampling


def is_token_policy(policy) -> bool:
    """True when ``policy`` implements :class:`TokenPolicy` and at least one generation mode."""
    return isinstance(policy, TokenPolicy) and (supports_steps(policy) or supports_waves(policy))


def check_policy(policy) -> None:
    """Raise a ``TypeError`` naming what ``policy`` lacks of :class:`TokenPolicy` and a generation mode."""
    missing = [name for name in _REQUIRED if not hasattr(policy, name)]
    if not (supports_steps(policy) or supports_waves(policy)):
        missing.append("__call__ (steps) or generate (waves)")
    if missing:
        raise TypeError(f"{type(policy).__name__} is not a TokenPolicy: it lacks {missing}; "
                        "see tokengym.collectors.policies.protocol.TokenPolicy")  # fmt: skip


def as_token_policy(policy):
    """``policy`` itself when it implements :class:`TokenPolicy`; a plain function becomes a
    :class:`FunctionPolicy`; anything else raises a ``TypeError`` naming what it lacks."""
    if callable(policy) and not hasattr(policy, "update_weights") and not supports_waves(policy):
        return FunctionPolicy(policy)
    check_policy(policy)
    return policy


def policy_state(policy, *, include_cache: bool = True) -> dict:
    """``policy.collection_state()``, with ``include_cache`` where the policy ``supports_cache_state``."""
    if supports_cache_state(policy):
        return policy.collection_state(include_cache=include_cache)
    return policy.collection_state()


def load_policy_state(policy, state: dict) -> None:
    """``policy.load_collection_state(state)``: restore :func:`policy_state`."""
    policy.load_collection_state(state)


def weights_of(policy_or_weights, weights=None, *, missing: str = "no weights were given") -> dict[str, torch.Tensor]:
    """The weights of an update as ``{name: tensor}`` with the names of ``model.state_dict()``: the one place
    a state_dict, a TensorDict of weights (nested keys joined with ``"."``) or a module (its ``state_dict()``; a PEFT
    LoRA model: its adapter's tensors, :func:`~tokengym.collectors.policies.adapter_weights`) becomes weights. With
    ``update_policy_weights_(policy_or_weights, *, weights)``'s two arguments
    ``weights`` wins; ``ValueError(missing)`` when both are ``None``.

    Example:
        >>> from tensordict import TensorDict
        >>> weights_of(TensorDict({"lm_head": {"weight": torch.ones(2)}}, []))
        {'lm_head.weight': tensor([1., 1.])}
        >>> weights_of({"w": 1.0})
        Traceback (most recent call last):
        ...
        TypeError: weights must map names to tensors; not tensors: ['w']
    """
    weights = policy_or_weights if weights is None else weights
    if weights is None:
        raise ValueError(missing)
    if is_lora_model(weights):  # a PEFT LoRA model: its adapter alone (what a LoRA policy loads)
        weights = adapter_weights(weights)
    elif isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    elif isinstance(weights, TensorDictBase):
        weights = weights.flatten_keys(".").items(include_nested=True, leaves_only=True)
    elif not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a state_dict (a mapping name -> tensor), a TensorDict of weights or a "
                        f"module, got {type(weights).__name__}")  # fmt: skip
    weights = dict(weights)
    bad = sorted(k for k, v in weights.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise TypeError(f"weights must map names to tensors; not tensors: {bad[:5]}")
    return weights


def probe_ids(tokenizer, n: int = 2048) -> list[int]:
    """About ``n`` ids spread evenly over ``tokenizer``'s vocabulary (specials included): a backend's tokenizer
    decodes them as the env's does (:func:`check_fits_env`'s ``probe_text``)."""
    size = len(tokenizer)
    return list(range(0, size, max(1, size // n)))


def check_fits_env(env, backend: str, *, vocab_size: int | None, positions: int | None, length_fix: str,
                   sampling: SamplingConfig | None = None, probe_text: str | None = None,
                   tokenizer_fix: str = "save the env's tokenizer with the model", takes_images: bool = False) -> None:  # fmt: skip
    """Raise a ``ValueError`` naming ``backend`` and the fix when it does not fit ``env``; every backend calls it.

    Checked (``None`` skips what a backend cannot tell): the model's ``vocab_size`` covers the env tokenizer
    and stays within the ids the env accepts; ``positions`` (the context: ``max_position_embeddings``,
    ``max_model_len``) holds the env's ``max_length`` (else ``length_fix``, where ``{positions}`` is
    replaced); ``sampling``'s banned ids are in the vocabulary and leave a token to sample; ``probe_text``,
    the backend's decoding of ``probe_ids()`` of the env tokenizer, is the env tokenizer's (stop strings
    are found in decoded text); an env that renders images (a ``processor``) needs a backend that ``takes_images``.

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> env = TokenEnv(["hi"], tiny_tokenizer(), max_new_tokens=8, max_length=64)
        >>> check_fits_env(env, "MyModel", vocab_size=512, positions=32, length_fix="use max_length={positions}")
        Traceback (most recent call last):
        ...
        ValueError: the env holds sequences of up to max_length=64 tokens but MyModel has 32 positions; use max_length=32
    """
    env = getattr(env, "base_env", env)
    if getattr(env, "processor", None) is not None and not takes_images:
        raise ValueError(f"the env's prompts carry images (processor={type(env.processor).__name__}) but {backend} "
                         "does not take images: generate with TransformersPolicy and a vision-language model (tokengym's "
                         "vLLM policies do not pass images yet)")  # fmt: skip
    if vocab_size is not None:
        _check_vocab(env, backend, int(vocab_size), sampling)
    if positions is not None and env.max_length > int(positions):
        raise ValueError(f"the env holds sequences of up to max_length={env.max_length} tokens but {backend} has "
                         f"{int(positions)} positions; {length_fix.format(positions=int(positions))}")  # fmt: skip
    if probe_text is not None and probe_text != env.tokenizer.decode(probe_ids(env.tokenizer)):
        raise ValueError(f"{backend}'s tokenizer decodes ids differently from the env's (stop strings would be "
                         f"found in the wrong places); {tokenizer_fix}")  # fmt: skip


def _check_vocab(env, backend: str, vocab: int, sampling: SamplingConfig | None) -> None:
    if vocab < len(env.tokenizer):
        raise ValueError(f"{backend} has vocab_size {vocab}, smaller than the env tokenizer's {len(env.tokenizer)}: "
                         "the model and the tokenizer do not match")  # fmt: skip
    if vocab > env.vocab_size:
        raise ValueError(f"{backend} can emit ids up to {vocab - 1} but the env accepts [0, {env.vocab_size}); "
                         "build the env with model_config=model.config")  # fmt: skip
    banned = () if sampling is None else sampling.banned_token_ids
    bad = [i for i in banned if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"banned_token_ids {bad} are outside the model's vocabulary [0, {vocab}); drop them")
    if len(set(banned)) >= vocab:
        raise ValueError(f"banned_token_ids bans all {vocab} tokens of the vocabulary: nothing is left to sample")


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
        >>> from tokengym.collectors.policies import TransformersPolicy
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


def check_policy_sampling(policy, env) -> None:
    """Raise a ``ValueError`` when ``env`` declares a sampling temperature (an agent env tells its programs the
    temperature they are sampled at, ``make_agent_env(..., temperature=)``) and ``policy`` samples at another.

    Example:
        >>> from tokengym.collectors.policies import TransformersPolicy
        >>> from tokengym.llm_envs.agents import make_agent_env
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> async def agent(client, task):
        ...     return 0.0
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> env = make_agent_env(agent, ["1+1="], tok, temperature=0.7, max_new_tokens=8, max_length=64,
        ...                      model_config=model.config)
        >>> check_policy_sampling(TransformersPolicy(model, env), env)
        Traceback (most recent call last):
        ...
        ValueError: the env tells its agent programs temperature=0.7 (make_agent_env(..., temperature=0.7)) but TransformersPolicy samples at temperature=1.0: the programs would be told one temperature and get tokens sampled at another; build the policy at the env's, TransformersPolicy(model, env, sampling=SamplingConfig(temperature=0.7)), or build the env with temperature=1.0 (or temperature=None: not checked)
        >>> env.close()
    """
    base = getattr(env, "base_env", env)
    declared, sampling = getattr(base.turns, "temperature", None), sampling_of(policy)
    if declared is None or sampling is None or abs(float(declared) - sampling.temperature) <= 1e-6:
        return
    owner = type(policy).__name__
    raise ValueError(f"the env tells its agent programs temperature={declared} (make_agent_env(..., "
                     f"temperature={declared})) but {owner} samples at temperature={sampling.temperature}: the "
                     "programs would be told one temperature and get tokens sampled at another; build the policy at "
                     f"the env's, {owner}(model, env, sampling=SamplingConfig(temperature={declared})), or build the "
                     f"env with temperature={sampling.temperature} (or temperature=None: not checked)")  # fmt: skip


class FunctionPolicy:
    """A plain function ``td -> td`` as a :class:`StepPolicy` with no weights and no state (version 0, or the
    function's own ``version`` attribute).

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

    def update_weights(self, weights: Weights | None = None) -> int:
        raise TypeError(
            f"{getattr(self.fn, '__name__', self.fn)!r} is a plain function with no weights; "
            "implement TokenPolicy.update_weights on a policy object to take weight updates"
        )

    def set_seed(self, seed: int) -> None:
        """Nothing to seed: a plain function keeps its own randomness."""

    def collection_state(self) -> dict[str, Any]:
        return {}

    def load_collection_state(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass
