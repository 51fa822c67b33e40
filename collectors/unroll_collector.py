"""UnrollCollector: one ``model.generate`` call per wave of B prompts, then the token-level steps built at once."""

from __future__ import annotations

import torch

from tokengym.collectors.token_collector import CollectMode, TokenCollector
from tokengym.llm_envs import keys
from tokengym.llm_envs.unroll import unroll_wave

__all__ = ["UnrollCollector"]


class UnrollCollector(TokenCollector):
    """A :class:`TokenCollector` that generates whole waves with ``model.generate`` (generate-then-unroll).

    All B slots start together and the next wave starts when every slot has finished (slots that
    finish early idle: their steps have ``keys.MASK`` False). Sampling uses the policy's sampler and
    generator, so a wave equals, token for token, what stepping yields for the same prompts.
    This is also the seam for faster generation backends. Takes the arguments of
    :class:`TokenCollector`; the policy must be a :class:`~tokengym.collectors.TransformersPolicy`.
    """

    def __init__(self, env, policy, **kwargs) -> None:
        super().__init__(env, policy, **kwargs)
        if not self._is_fast:
            raise TypeError("UnrollCollector needs a bare TokenEnv (env transforms run per step); use TokenCollector")
        if not hasattr(policy, "generate_wave"):
            raise TypeError(f"UnrollCollector needs a policy with generate_wave, got {type(policy).__name__}")
        self._pending: dict | None = None
        self._is_first_wave = True

    def _wave(self) -> dict:
        env = self.base_env
        if not self._is_first_wave:
            self._obs = env.reset()
            self._remember_prompts(range(env.batch_size[0]))
        self._is_first_wave = False
        s = env._rt.state
        p_len = s[keys.PROMPT_LEN]
        width = int(p_len.max())
        cols = torch.arange(width)[None, :]
        shift = (width - p_len)[:, None]  # left padding of each row
        src = (cols - shift).clamp(min=0)
        mask = cols >= shift
        prompts = torch.where(mask, env.tokens.gather(1, src), env.tokenizer.pad_token_id)
        actions, logp, raw = self.policy.generate_wave(prompts, mask.long(), env.max_new_tokens)
        td = unroll_wave(env, actions)
        T = td.shape[1]
        td.set(keys.ACTION_LOG_PROB, logp[:, :T])
        td.set(keys.POLICY_VERSION, torch.full_like(td.get(keys.ACTION), self.policy.version))
        if getattr(self.policy, "return_raw_log_prob", False):
            td.set(keys.RAW_LOG_PROB, raw[:, :T])
        return self._step_keys.flat(td, td.get(keys.NEXT))

    def _collect_some(self) -> None:
        if self.mode is CollectMode.TRAJECTORIES:
            wave = self._wave()
            self.steps_done += next(iter(wave.values())).shape[1]
            self._rec.write_rows(wave)
            return
        if self._pending is None:
            self._pending = self._wave()
        k = min(self._rec.free, next(iter(self._pending.values())).shape[1])
        self._rec.write({name: v[:, :k] for name, v in self._pending.items()})
        rest = {name: v[:, k:] for name, v in self._pending.items()}
        self._pending = rest if next(iter(rest.values())).shape[1] else None
        self.steps_done += k
