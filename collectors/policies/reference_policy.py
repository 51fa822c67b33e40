"""StepwiseReference: a reference model stepped alongside the policy, with its own KV cache per slot."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from tokengym.collectors.policies.kv_cache import SlotKVCache
from tokengym.collectors.policies.protocol import Weights, load_policy_state, policy_state, sampling_of
from tokengym.collectors.policies.sampling import SamplingConfig
from tokengym.collectors.policies.vision_inputs import check_vision, slot_images
from tokengym.llm_envs import keys

__all__ = ["PolicyWithReference", "StepwiseReference"]


class StepwiseReference(TensorDictModuleBase):
    """Writes ``keys.REF_LOG_PROB``: the reference model's log-prob of the action the policy just chose.

    Compose it with the policy as :class:`PolicyWithReference` (it runs after the policy on every
    step, and the pair is a :class:`~tokengym.collectors.policies.protocol.StepPolicy`); it keeps its own
    per-slot KV cache, so each step costs one incremental forward of the reference model. A
    ``KLRewardTransform()`` without ``ref_model`` inside a ``TransformedEnv`` then shapes every step's
    reward. The cheaper alternative is ``KLRewardTransform(ref_model=...)`` as a collector postproc:
    one teacher-forced forward per collected batch.

    Args:
        model: the reference causal LM (same tokenizer as the policy).
        env: the env (or a TransformedEnv of it) whose token buffer holds the sequences.
        temperature: divides the reference logits (1.0 scores the model's own distribution).

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.collectors.policies import TransformersPolicy
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> env = TokenEnv(["1+1="], tok, batch_size=2, max_new_tokens=4, model_config=model.config)
        >>> policy, ref = TransformersPolicy(model, env, sampling=None), StepwiseReference(model, env)
        >>> td = ref(policy(env.reset()))
        >>> bool(torch.allclose(td["ref_log_prob"], td["action_log_prob"], atol=1e-5))  # same weights
        True
    """

    in_keys = [keys.TOKEN, keys.SEQ_LEN, keys.TRAJ_ID, keys.ACTIVE, keys.ACTION]
    out_keys = [keys.REF_LOG_PROB]

    def __init__(self, model, env, *, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model, self.temperature = model, temperature
        # not a submodule: state_dict(), parameters() and .to() are the model's alone
        object.__setattr__(self, "env", getattr(env, "base_env", env))
        # a vision-language reference prefills each slot with its prompt's images (a text-only one is refused)
        self.images = slot_images(self.env) if check_vision(model, self.env, "dynamic", role="the reference model") else None
        self.cache = SlotKVCache(model, self.env.batch_size[0], images=self.images)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        active = tensordict.get(keys.ACTIVE)
        self.cache.sync(self.env.tokens, tensordict.get(keys.SEQ_LEN), tensordict.get(keys.TRAJ_ID), active)
        logits = self.cache.decode(tensordict.get(keys.TOKEN), active).float() / self.temperature  # (B, V)
        action = tensordict.get(keys.ACTION)  # the policy's, on the host
        ref = logits.log_softmax(-1).gather(-1, action.to(logits.device, non_blocking=True)[:, None]).squeeze(-1)
        ref = ref.to(action.device)  # a CUDA reference: one more device-to-host copy per step
        tensordict.set(keys.REF_LOG_PROB, torch.where(active, ref, torch.zeros_like(ref)))
        return tensordict

    def collection_state(self, *, include_cache: bool = True) -> dict:
        """The reference's KV cache (its weights never change during collection; ``state_dict()`` is the module's)."""
        return {"cache": self.cache.state_dict()} if include_cache else {}

    def load_collection_state(self, state: dict) -> None:
        """Restore :meth:`collection_state` (without a saved cache, live slots are re-prefilled)."""
        self.cache = SlotKVCache(self.model, self.env.batch_size[0], images=self.images)
        if state.get("cache") is not None:
            self.cache.load_state_dict(state["cache"])


class PolicyWithReference:
    """A :class:`~tokengym.collectors.policies.protocol.StepPolicy` that steps ``policy`` and then ``reference``.

    Every step carries ``keys.REF_LOG_PROB`` beside the policy's keys; weight updates, version,
    checkpoints and ``close`` go to the policy (the reference's cache is checkpointed too).

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.collectors import TokenCollector
        >>> from tokengym.collectors.policies import TransformersPolicy
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> env = TokenEnv(["1+1="], tok, batch_size=2, max_new_tokens=3, model_config=model.config)
        >>> policy = PolicyWithReference(TransformersPolicy(model, env), StepwiseReference(tiny_model(tok), env))
        >>> batch = next(iter(TokenCollector(env, policy, mode="steps", batch_size=2)))
        >>> "ref_log_prob" in batch.keys(), policy.update_weights(), policy.version
        (True, 1, 1)
    """

    supports_cache_state = True

    def __init__(self, policy, reference: StepwiseReference) -> None:
        if not callable(policy) or not hasattr(policy, "update_weights"):
            raise TypeError(f"policy must be a stepwise TokenPolicy, got {type(policy).__name__}")
        if not isinstance(reference, StepwiseReference):
            raise TypeError(f"reference must be a StepwiseReference, got {type(reference).__name__}")
        self.policy, self.reference = policy, reference

    def __call__(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.reference(self.policy(tensordict))

    @property
    def version(self) -> int:
        """The policy's version."""
        return self.policy.version

    @property
    def sampling(self) -> SamplingConfig | None:
        """The policy's sampling settings (recorded with every batch), ``None`` if it does not say."""
        return sampling_of(self.policy)

    def update_weights(self, weights: Weights | None = None) -> int:
        """Update the policy's weights (the reference stays as it is)."""
        return self.policy.update_weights(weights)

    def set_seed(self, seed: int) -> None:
        """Reseed the policy's sampling (the reference samples nothing)."""
        if hasattr(self.policy, "set_seed"):
            self.policy.set_seed(seed)

    def collection_state(self, *, include_cache: bool = True) -> dict:
        """The policy's collection state and the reference's KV cache (``include_cache=False``: neither cache)."""
        return {"policy": policy_state(self.policy, include_cache=include_cache),
                "reference": self.reference.collection_state(include_cache=include_cache)}  # fmt: skip

    def load_collection_state(self, state: dict) -> None:
        """Restore :meth:`collection_state`."""
        load_policy_state(self.policy, state["policy"])
        self.reference.load_collection_state(state["reference"])

    def close(self) -> None:
        """Close the policy (the reference model stays the caller's)."""
        self.policy.close()
