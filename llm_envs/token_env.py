"""TokenEnv: a TorchRL env where one step is one generated token, for ``B`` parallel slots."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import EnvBase

from tokengym.llm_envs import keys
from tokengym.llm_envs._stop import StopChecker
from tokengym.llm_envs.errors import ResetNeeded, RewardFunctionError
from tokengym.llm_envs.prompts import Prompt, PromptSource

__all__ = ["TokenEnv", "RewardFn"]

RewardFn = Callable[[list[str], list[str], list[dict]], "Sequence[float] | torch.Tensor"]
_STATE = (keys.TOKEN, keys.SEQ_LEN, keys.PROMPT_LEN, keys.RESPONSE_LEN, keys.TRAJ_ID, keys.GROUP_ID,
          keys.SAMPLE_ID, keys.TURN, keys.ACTIVE)  # fmt: skip


def _context_limit(tokenizer, model_config) -> int:
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if limit is None:
        limit = getattr(tokenizer, "model_max_length", 4096)
    return int(min(limit, 1 << 16))


class TokenEnv(EnvBase):
    """Token-level LLM environment: each step appends one token per slot; finished slots are refilled.

    The observation is O(1) in sequence length (the last token, lengths and ids); the sequence
    itself is written once into a preallocated ``(B, max_length)`` buffer, :attr:`tokens`, which a
    KV-cached policy reads only when it prefills a new slot. Reward comes from ``reward_fn`` at a
    trajectory's last step, called once per step for all slots that finished in it.

    Args:
        prompts: a list of strings, chat message lists, token-id lists or mappings with a ``prompt``
            field (other fields become metadata), any iterable of those, a ``datasets.Dataset``, or a
            :class:`~tokengym.llm_envs.prompts.PromptSource`.
        tokenizer: a transformers tokenizer with ``pad_token_id`` and ``eos_token_id``.
        reward_fn: ``fn(responses, prompts, metadata) -> floats`` (one per finished slot), or ``None``.
        batch_size: number of parallel slots ``B``.
        max_new_tokens: response budget per trajectory (``truncated`` when reached).
        group_size: samples per prompt; they share ``group_id``.
        max_length: capacity of a sequence (prompt + response), e.g. the model's context limit;
            defaults to ``model_config``'s limit or the tokenizer's.
        stop_strings: strings that end a response (``terminated``).
        eos_token_ids: token ids that end a response; defaults to the tokenizer's and the model's
            generation config eos ids.
        model_config: a transformers config, used for the context limit.
        seed: seed of the prompt order (with ``shuffle``).
        shuffle: shuffle a sized prompt source every epoch.

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> tok = tiny_tokenizer()
        >>> env = TokenEnv(["1+1=", "2+2="], tok, batch_size=2, max_new_tokens=3, max_length=32)
        >>> td = env.reset()
        >>> td = env.step(td.set("action", torch.tensor([tok.eos_token_id, 40])))
        >>> td["next", "done"].squeeze(-1).tolist(), td["next", "terminated"].squeeze(-1).tolist()
        ([True, False], [True, False])
    """

    def __init__(
        self,
        prompts: Iterable | PromptSource,
        tokenizer,
        reward_fn: RewardFn | None = None,
        *,
        batch_size: int = 8,
        max_new_tokens: int = 64,
        group_size: int = 1,
        max_length: int | None = None,
        stop_strings: Sequence[str] = (),
        eos_token_ids: Sequence[int] | None = None,
        model_config=None,
        seed: int = 0,
        shuffle: bool = False,
    ) -> None:
        _check_int("batch_size", batch_size)
        _check_int("max_new_tokens", max_new_tokens)
        _check_tokenizer(tokenizer)
        if reward_fn is not None and not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable(responses, prompts, metadata), got {reward_fn!r}")
        super().__init__(batch_size=torch.Size([batch_size]))
        if isinstance(prompts, PromptSource):
            self.source = prompts
        else:
            self.source = PromptSource(prompts, tokenizer, group_size=group_size, shuffle=shuffle, seed=seed)
        self.tokenizer, self.reward_fn, self.max_new_tokens = tokenizer, reward_fn, max_new_tokens
        self.max_length = max_length if max_length is not None else _context_limit(tokenizer, model_config)
        _check_int("max_length", self.max_length)
        self.vocab_size = len(tokenizer)
        if model_config is not None and getattr(model_config, "vocab_size", None):
            self.vocab_size = max(self.vocab_size, int(model_config.vocab_size))
        self.eos_token_ids = _eos_ids(tokenizer, model_config, eos_token_ids, self.vocab_size)
        self._stop = StopChecker(tokenizer, stop_strings, self.vocab_size)
        self._make_specs()
        self._alloc()

    # -- setup --
    def _make_specs(self) -> None:
        specs = keys.make_spec(self.batch_size[0], self.vocab_size, self.max_length)
        self.observation_spec = specs["observation"]
        self.action_spec = specs["action"]
        self.reward_spec = specs["reward"]
        self.full_done_spec = specs["done"]

    def _alloc(self) -> None:
        B = self.batch_size[0]
        self.tokens = torch.zeros(B, self.max_length, dtype=torch.int64)  # (B, L) the sequences, written once
        # plain attributes of a plain object: nn.Module.__setattr__ costs microseconds per step
        self._rt = _Runtime()
        self._rt.state = {k: torch.zeros(B, dtype=torch.bool if k == keys.ACTIVE else torch.int64) for k in _STATE}
        self._rt.done = torch.zeros(B, dtype=torch.bool)
        self._prompts: list[Prompt | None] = [None] * B
        self._arange = torch.arange(B)
        self._eos = torch.tensor(sorted(self.eos_token_ids), dtype=torch.int64)

    def _set_seed(self, seed: int | None) -> None:
        if seed is not None:
            self.source.seed = seed

    # -- public helpers --
    def slot_prompt(self, slot: int) -> Prompt | None:
        """The prompt the slot is working on (``None`` once the source is exhausted)."""
        return self._prompts[slot]

    def response_ids(self, slot: int) -> torch.Tensor:
        """Token ids generated so far in ``slot``'s trajectory (a view into :attr:`tokens`)."""
        s = self._rt.state
        return self.tokens[slot, int(s[keys.PROMPT_LEN][slot]) : int(s[keys.SEQ_LEN][slot])]

    @property
    def is_exhausted(self) -> bool:
        """True once the prompt source is empty and no slot holds a live trajectory."""
        return self.source.is_exhausted and not bool(self._rt.state[keys.ACTIVE].any())

    def state_dict(self) -> dict:
        """Everything needed to resume: prompt cursor, slot contents, counters."""
        return {
            "source": self.source.state_dict(),
            "tokens": self.tokens.clone(),
            "state": {k: v.clone() for k, v in self._rt.state.items()},
            "done": self._rt.done.clone(),
            "is_reset": self._rt.is_reset,
            "next_traj": self._rt.next_traj,
            "prompts": list(self._prompts),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`."""
        self.source.load_state_dict(state["source"])
        self.tokens.copy_(state["tokens"])
        for k, v in state["state"].items():
            self._rt.state[k].copy_(v)
        self._rt.done.copy_(state["done"])
        self._rt.is_reset, self._rt.next_traj = state["is_reset"], state["next_traj"]
        self._prompts = list(state["prompts"])

    # -- reset --
    def _fill_slot(self, b: int) -> None:
        prompt = self.source.next()
        s = self._rt.state
        self._prompts[b] = prompt
        s[keys.RESPONSE_LEN][b] = 0
        s[keys.TURN][b] = 0
        if prompt is None:  # source exhausted: the slot idles, holding an empty sequence
            s[keys.ACTIVE][b] = False
            s[keys.SEQ_LEN][b] = s[keys.PROMPT_LEN][b] = 0  # a stale seq_len may equal max_length
            return
        n = prompt.ids.numel()
        if n >= self.max_length:
            self._prompts[b], s[keys.ACTIVE][b] = None, False
            raise ValueError(
                f"prompt {prompt.index} has {n} tokens but max_length is {self.max_length} (prompt + response); "
                "shorten the prompt or raise max_length"
            )
        self.tokens[b, :n] = prompt.ids
        s[keys.TOKEN][b] = prompt.ids[-1]
        s[keys.SEQ_LEN][b] = n
        s[keys.PROMPT_LEN][b] = n
        s[keys.TRAJ_ID][b] = self._rt.next_traj
        s[keys.GROUP_ID][b] = prompt.group_id
        s[keys.SAMPLE_ID][b] = prompt.sample_id
        s[keys.ACTIVE][b] = True
        self._rt.next_traj += 1

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        if tensordict is not None and "_reset" in tensordict.keys():
            slots = tensordict.get("_reset").reshape(-1).nonzero().squeeze(-1).tolist()
        else:
            slots = range(self.batch_size[0])
        # copy-on-write: tensors handed out by earlier steps are never mutated
        self._rt.state = {k: v.clone() for k, v in self._rt.state.items()}
        self._rt.done = self._rt.done.clone()
        for b in slots:
            self._rt.done[b] = False
            self._fill_slot(b)
        self._rt.is_reset = True
        zeros = torch.zeros(self.batch_size[0], 1, dtype=torch.bool)
        return self._observation(self._rt.done.unsqueeze(-1).clone(), zeros, zeros.clone())

    def _observation(self, done, terminated, truncated, reward=None) -> TensorDictBase:
        out = dict(self._rt.state)  # shared: the state is replaced, never written in place, after a step
        out.update(done=done, terminated=terminated, truncated=truncated)
        if reward is not None:
            out["reward"] = reward
        return TensorDict._new_unsafe(out, batch_size=self.batch_size)

    # -- step --
    def _check_action(self, action) -> torch.Tensor:
        if not isinstance(action, torch.Tensor):
            raise TypeError(f"action must be an int64 tensor of shape {tuple(self.batch_size)}, got {type(action)}")
        if action.dtype != torch.int64:
            raise TypeError(f"action must be int64 token ids, got dtype {action.dtype}; use action.long()")
        if action.shape != self.batch_size:
            raise ValueError(f"action must have shape {tuple(self.batch_size)} (one token per slot), got {tuple(action.shape)}")
        lo, hi = int(action.min()), int(action.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"action {bad} is out of the vocabulary [0, {self.vocab_size}); check the policy's vocab")
        return action

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        action, active, previous, new_len, resp_len, ended, limited = self._advance(tensordict)
        terminated, truncated = ended, limited & ~ended
        done = terminated | truncated
        reward = torch.zeros(self.batch_size[0], 1)
        if bool(done.any()):
            try:
                self._score(done.nonzero().squeeze(-1), new_len, reward)
            except RewardFunctionError:
                self._rollback(previous)
                raise
        self._commit(action, active, new_len, resp_len, done)
        return self._observation(done.unsqueeze(-1), terminated.unsqueeze(-1), truncated.unsqueeze(-1), reward)

    def _advance(self, tensordict: TensorDictBase):
        """Validate the action, write it into :attr:`tokens` and find the slots whose turn ended.

        Returns ``(action, active, previous, new_len, resp_len, ended, limited)``: ``ended`` marks an
        EOS / stop string, ``limited`` a budget or context limit (a truncation unless ``ended``).
        """
        if not self._rt.is_reset:
            raise ResetNeeded("TokenEnv was stepped before reset(); call env.reset() first")
        action = self._check_action(tensordict.get(keys.ACTION))
        s = self._rt.state
        active = s[keys.ACTIVE]
        if bool((self._rt.done & active).any()):
            slots = (self._rt.done & active).nonzero().squeeze(-1).tolist()
            raise ResetNeeded(f"slots {slots} are done; reset them (td['_reset']) or use env.step_and_maybe_reset")
        seq_len = s[keys.SEQ_LEN]
        previous = self.tokens[self._arange, seq_len]
        self.tokens[self._arange, seq_len] = torch.where(active, action, previous)
        new_len, resp_len = seq_len + active, s[keys.RESPONSE_LEN] + active
        ended = active & torch.isin(action, self._eos)
        if self._stop.is_enabled:
            ended |= self._stop.hits(self.tokens, action, active & ~ended, s[keys.PROMPT_LEN], new_len)
        limited = active & ((resp_len >= self.max_new_tokens) | (new_len >= self.max_length))
        return action, active, previous, new_len, resp_len, ended, limited

    def _rollback(self, previous: torch.Tensor) -> None:
        """Undo :meth:`_advance`'s write: a failed step leaves no trace."""
        self.tokens[self._arange, self._rt.state[keys.SEQ_LEN]] = previous

    def _commit(self, action, active, new_len, resp_len, done) -> None:
        """Make the step the env's state (only after every user callback succeeded)."""
        s = self._rt.state
        s[keys.TOKEN] = torch.where(active, action, s[keys.TOKEN])
        s[keys.SEQ_LEN], s[keys.RESPONSE_LEN] = new_len, resp_len
        self._rt.done = done

    def _score(self, slots: torch.Tensor, new_len: torch.Tensor, reward: torch.Tensor) -> None:
        if self.reward_fn is None:
            return
        slots = slots.tolist()
        p_len = self._rt.state[keys.PROMPT_LEN]
        responses = self.tokenizer.batch_decode(
            [self.tokens[b, int(p_len[b]) : int(new_len[b])] for b in slots], skip_special_tokens=True
        )
        prompts = [self._prompts[b] for b in slots]
        try:
            values = self.reward_fn(responses, [p.text for p in prompts], [p.metadata for p in prompts])
        except Exception as err:
            first = prompts[0]
            raise RewardFunctionError(
                f"reward_fn raised {type(err).__name__}: {err} while scoring slots {slots} "
                f"(first: prompt {first.index} {first.text[:60]!r}, trajectory {int(self._rt.state[keys.TRAJ_ID][slots[0]])}); "
                "the env state is unchanged, fix the reward function and step again"
            ) from err
        reward[slots, 0] = _check_rewards(values, slots, prompts)


class _Runtime:
    """Mutable per-step state of a TokenEnv (kept off the nn.Module)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.done = torch.zeros(0, dtype=torch.bool)
        self.is_reset = False
        self.next_traj = 0


def _check_rewards(values, slots: list[int], prompts: list[Prompt]) -> torch.Tensor:
    n, first = len(slots), f"slots {slots} (first: prompt {prompts[0].index} {prompts[0].text[:60]!r})"
    try:
        out = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as err:
        raise RewardFunctionError(f"reward_fn must return {n} numbers for {first}, got {values!r:.80} ({err})") from err
    if out.numel() != n:
        raise RewardFunctionError(
            f"reward_fn returned {out.numel()} values for {n} finished responses in {first}; "
            "return one float per response"
        )
    if not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).nonzero()[0])
        raise RewardFunctionError(
            f"reward_fn returned {out[bad].item()} for slot {slots[bad]}, prompt {prompts[bad].index} "
            f"{prompts[bad].text[:60]!r}; rewards must be finite"
        )
    return out


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_tokenizer(tokenizer) -> None:
    for attr in ("pad_token_id", "eos_token_id"):
        if getattr(tokenizer, attr, None) is None:
            raise ValueError(
                f"the tokenizer has no {attr}; set it first, e.g. tokenizer.pad_token = tokenizer.eos_token"
                if attr == "pad_token_id"
                else "the tokenizer has no eos_token_id; set tokenizer.eos_token or pass eos_token_ids"
            )


def _eos_ids(tokenizer, model_config, explicit, vocab_size: int) -> set[int]:
    if explicit is not None:
        ids = {int(i) for i in explicit}
    else:
        ids = {int(tokenizer.eos_token_id)}
        gen_eos = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
        gen_eos = gen_eos if gen_eos is not None else getattr(model_config, "eos_token_id", None)
        if gen_eos is not None:
            ids |= {int(i) for i in (gen_eos if isinstance(gen_eos, list | tuple) else [gen_eos])}
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"eos token ids {bad} are outside the vocabulary [0, {vocab_size})")
    return ids
