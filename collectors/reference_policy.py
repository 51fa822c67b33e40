"""StepwiseReference: a reference model stepped alongside the policy, with its own KV cache per slot."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from tokengym.collectors.kv_cache import SlotKVCache
from tokengym.llm_envs import keys

__all__ = ["StepwiseReference"]


class StepwiseReference(TensorDictModuleBase):
    """Writes ``keys.REF_LOG_PROB``: the reference model's log-prob of the action the policy just chose.

    Run it after the policy on every step (e.g. ``lambda td: ref(policy(td))``); it keeps its own
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
        >>> from tokengym.collectors import TransformersPolicy
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
        self.model, self.env, self.temperature = model, getattr(env, "base_env", env), temperature
        self.cache = SlotKVCache(model, self.env.batch_size[0])

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        active = tensordict.get(keys.ACTIVE)
        self.cache.sync(self.env.tokens, tensordict.get(keys.SEQ_LEN), tensordict.get(keys.TRAJ_ID), active)
        logits = self.cache.decode(tensordict.get(keys.TOKEN), active).float() / self.temperature  # (B, V)
        action = tensordict.get(keys.ACTION)
        ref = logits.log_softmax(-1).gather(-1, action[:, None]).squeeze(-1)
        tensordict.set(keys.REF_LOG_PROB, torch.where(active, ref, torch.zeros_like(ref)))
        return tensordict
