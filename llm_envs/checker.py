"""Conformance checker: a short random rollout compared, step by step, against the data contract.

In the spirit of Gymnasium's ``utils/env_checker.py::check_env`` and dm_env's ``specs``: first TorchRL's
own :func:`~torchrl.envs.utils.check_env_specs`, then a rollout through ``step_and_maybe_reset`` whose
every step is checked against :mod:`tokengym.llm_envs.keys`.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torchrl.envs import EnvBase
from torchrl.envs.utils import check_env_specs

from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import ContractError

__all__ = ["check_env"]

_FAIL = "check_env: {check} failed at step {step}, slot {slot}: {detail}"
_ID_KEYS = (keys.PROMPT_LEN, keys.TRAJ_ID, keys.GROUP_ID, keys.SAMPLE_ID)  # fixed within a trajectory
_EOS_RATE = 0.1  # share of actions replaced by an EOS id, so random rollouts also terminate


def _fail(check: str, step: int, slot, detail: str) -> ContractError:
    return ContractError(_FAIL.format(check=check, step=step, slot=slot, detail=detail))


def check_env(env: EnvBase, *, steps: int = 48, seed: int = 0) -> None:
    """Check that ``env`` honours its specs and the data contract of :mod:`tokengym.llm_envs.keys`.

    Runs :func:`torchrl.envs.utils.check_env_specs`, then resets ``env`` and takes ``steps`` steps
    with random in-vocabulary actions (some replaced by EOS ids) through ``env.step_and_maybe_reset``,
    checking every step: observation keys, dtypes and shapes; ``done == terminated | truncated``
    and never both; reward only where done; ``seq_len`` growing by one per active slot while
    ``prompt_len`` / ``traj_id`` / ``group_id`` / ``sample_id`` stay fixed; ``response_len`` within
    ``max_new_tokens``; a fresh trajectory (new ``traj_id``, ``response_len == 0``) after done; and
    the env's ``tokens`` buffer holding prompt + actions. The env's state (prompt cursor included)
    advances; the global torch RNG does not.

    Args:
        env: a token env (``batch_size == (B,)``), e.g. a :class:`~tokengym.llm_envs.TokenEnv`.
        steps: number of checked steps.
        seed: seed of the random actions.

    Raises:
        ContractError: naming the failed check, the step, the slot and the values seen.

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.testing import tiny_tokenizer
        >>> env = TokenEnv(["1+1=", "2+2="], tiny_tokenizer(), batch_size=2, max_new_tokens=4, max_length=32)
        >>> check_env(env, steps=8)
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if len(env.batch_size) != 1:
        raise ContractError(f"check_env: a token env has batch_size (B,), got {tuple(env.batch_size)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            check_env_specs(env)
        except AssertionError as err:
            raise ContractError(f"check_env: check_env_specs failed: {err}") from err
    _Rollout(env, seed).run(steps)


class _Rollout:
    """The checked rollout; keeps the shadow copy of every slot's sequence."""

    def __init__(self, env: EnvBase, seed: int) -> None:
        self.env, self.B = env, env.batch_size[0]
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = int(env.action_spec.space.n)
        self.eos = sorted(getattr(env, "eos_token_ids", ()) or ())
        self.max_new = getattr(env, "max_new_tokens", None)
        self.max_length = getattr(env, "max_length", None)
        self.has_buffer = isinstance(getattr(env, "tokens", None), torch.Tensor)  # (B, L) buffer
        self.seen: set[int] = set()
        self.shadow: list[list[int] | None] = [None] * self.B  # prompt + actions, per slot

    def run(self, steps: int) -> None:
        td = self.env.reset()
        self.check_obs(td, -1, "reset")
        self.start(td, torch.ones(self.B, dtype=torch.bool), -1)
        for t in range(steps):
            td.set(keys.ACTION, self.actions())
            before = td.clone()
            out, td = self.env.step_and_maybe_reset(td)
            nxt = out.get(keys.NEXT)
            self.check_obs(nxt, t, "next")
            self.check_outcome(before, nxt, t)
            self.check_transition(before, nxt, t)
            done = nxt.get(keys.DONE[1]).reshape(-1)
            self.check_obs(td, t, "after reset")
            self.check_buffer(nxt, ~done, t)
            self.start(td, done, t)

    def actions(self) -> torch.Tensor:
        action = torch.randint(0, self.vocab, (self.B,), generator=self.gen)
        if self.eos:
            use_eos = torch.rand(self.B, generator=self.gen) < _EOS_RATE
            eos = torch.tensor(self.eos)[torch.randint(0, len(self.eos), (self.B,), generator=self.gen)]
            action = torch.where(use_eos, eos, action)
        return action

    # -- checks --
    def check_obs(self, td: TensorDictBase, step: int, where: str) -> None:
        spec = self.env.observation_spec
        for key in keys.OBSERVATION_KEYS:
            if key not in td.keys():
                raise _fail(
                    "observation keys", step, "all", f"{where} lacks {key!r}, has {sorted(td.keys())}"
                )
            value = td.get(key)
            dtype = torch.bool if key == keys.ACTIVE else torch.int64
            if value.dtype != dtype or value.shape != (self.B,):
                raise _fail(
                    f"{key} dtype/shape",
                    step,
                    "all",
                    f"{where} expected {dtype} ({self.B},), got {value.dtype} {tuple(value.shape)}",
                )
            if key in spec.keys() and not spec[key].is_in(value):
                raise _fail(
                    f"{key} in spec", step, "all", f"{where} value {value.tolist()} outside {spec[key]}"
                )

    def check_outcome(self, before: TensorDictBase, nxt: TensorDictBase, step: int) -> None:
        flags = {}
        for name in keys.DONE_KEYS:
            value = nxt.get(name, None)
            if value is None or value.dtype != torch.bool or value.shape != (self.B, 1):
                got = None if value is None else (value.dtype, tuple(value.shape))
                raise _fail(f"{name} dtype/shape", step, "all", f"expected bool ({self.B}, 1), got {got}")
            flags[name] = value.reshape(-1)
        reward = nxt.get(keys.REWARD[1], None)
        if reward is None or reward.dtype != torch.float32 or reward.shape != (self.B, 1):
            got = None if reward is None else (reward.dtype, tuple(reward.shape))
            raise _fail("reward dtype/shape", step, "all", f"expected float32 ({self.B}, 1), got {got}")
        done, term, trunc = flags[keys.DONE_NAME], flags[keys.TERMINATED_NAME], flags[keys.TRUNCATED_NAME]
        active = before.get(keys.ACTIVE)
        self._each(
            "done == terminated | truncated",
            step,
            done != (term | trunc),
            lambda b: f"done={bool(done[b])} terminated={bool(term[b])} truncated={bool(trunc[b])}",
        )
        self._each("terminated and truncated never both", step, term & trunc, lambda b: "both are True")
        turn_ended = nxt.get(keys.TURN) != before.get(keys.TURN)  # multi-turn: a per-turn reward
        self._each(
            "reward only where done or a turn ends",
            step,
            (reward.reshape(-1) != 0) & ~done & ~turn_ended,
            lambda b: f"reward {float(reward[b, 0])} but done=False and the turn did not end",
        )
        self._each(
            "inactive slots never finish", step, done & ~active, lambda b: "done=True but active=False"
        )

    def check_transition(self, before: TensorDictBase, nxt: TensorDictBase, step: int) -> None:
        active = before.get(keys.ACTIVE)
        action = before.get(keys.ACTION)
        new_turn = nxt.get(keys.TURN) != before.get(keys.TURN)  # env-inserted turns may add tokens
        grow = nxt.get(keys.SEQ_LEN) - before.get(keys.SEQ_LEN)
        want = active.long()
        self._each(
            "seq_len grows by 1 per active slot",
            step,
            (grow != want) & ~(new_turn & (grow >= 1)),
            lambda b: (
                f"seq_len {int(before[keys.SEQ_LEN][b])} -> {int(nxt[keys.SEQ_LEN][b])}, active={bool(active[b])}"
            ),
        )
        rgrow = nxt.get(keys.RESPONSE_LEN) - before.get(keys.RESPONSE_LEN)
        self._each(
            "response_len grows by 1 per active slot",
            step,
            (rgrow != want) & ~new_turn,
            lambda b: f"response_len {int(before[keys.RESPONSE_LEN][b])} -> {int(nxt[keys.RESPONSE_LEN][b])}",
        )
        self._each(
            "token is the action",
            step,
            active & ~new_turn & (nxt.get(keys.TOKEN) != action),
            lambda b: f"action {int(action[b])}, next token {int(nxt[keys.TOKEN][b])}",
        )
        for key in _ID_KEYS:
            changed = nxt.get(key) != before.get(key)
            if key == keys.PROMPT_LEN:
                changed &= ~new_turn
            self._each(
                f"{key} fixed within a trajectory",
                step,
                changed,
                lambda b, k=key: f"{k} {int(before[k][b])} -> {int(nxt[k][b])}",
            )
        self._each(
            "active stays fixed within a trajectory",
            step,
            nxt.get(keys.ACTIVE) != active,
            lambda b: f"active {bool(active[b])} -> {bool(nxt[keys.ACTIVE][b])}",
        )
        if self.max_new is not None:
            resp = nxt.get(keys.RESPONSE_LEN)
            self._each(
                "response_len <= max_new_tokens",
                step,
                resp > self.max_new,
                lambda b: f"response_len {int(resp[b])} > max_new_tokens {self.max_new}",
            )
        if self.max_length is not None:
            seq = nxt.get(keys.SEQ_LEN)
            self._each(
                "seq_len <= max_length",
                step,
                seq > self.max_length,
                lambda b: f"seq_len {int(seq[b])} > max_length {self.max_length}",
            )
        for b in active.nonzero().squeeze(-1).tolist():
            if self.shadow[b] is not None:
                self.shadow[b].append(int(action[b]))
                if bool(new_turn[b]) and self.has_buffer:  # env-inserted feedback follows the model's token
                    n = int(nxt.get(keys.SEQ_LEN)[b])
                    self.shadow[b].extend(self.env.tokens[b, len(self.shadow[b]) : n].tolist())

    def check_buffer(self, td: TensorDictBase, slots: torch.Tensor, step: int) -> None:
        """Slots still in their trajectory: the buffer holds exactly the shadow prompt + actions."""
        if not self.has_buffer:
            return
        active = td.get(keys.ACTIVE)
        for b in (slots & active).nonzero().squeeze(-1).tolist():
            if self.shadow[b] is None:
                continue
            n = int(td.get(keys.SEQ_LEN)[b])
            got = self.env.tokens[b, :n].tolist()
            if got != self.shadow[b]:
                at = next((i for i, (x, y) in enumerate(zip(got, self.shadow[b], strict=False)) if x != y), n)
                raise _fail(
                    "tokens buffer holds prompt + actions",
                    step,
                    b,
                    f"position {at}: buffer {got[at : at + 4]}, expected {self.shadow[b][at : at + 4]}, seq_len {n}",
                )

    def start(self, td: TensorDictBase, slots: torch.Tensor, step: int) -> None:
        """Slots that begin a new trajectory: fresh ids, zero response, the prompt in the buffer."""
        active = td.get(keys.ACTIVE)
        for b in slots.nonzero().squeeze(-1).tolist():
            self.shadow[b] = None
            if not bool(active[b]):
                continue
            traj, resp = int(td.get(keys.TRAJ_ID)[b]), int(td.get(keys.RESPONSE_LEN)[b])
            if traj in self.seen:
                raise _fail("traj ids unique per new trajectory", step, b, f"traj_id {traj} was used before")
            self.seen.add(traj)
            if resp != 0:
                raise _fail("a new trajectory starts empty", step, b, f"response_len {resp} after reset")
            seq, prompt = int(td.get(keys.SEQ_LEN)[b]), int(td.get(keys.PROMPT_LEN)[b])
            if not 0 < prompt <= seq:
                raise _fail("a new trajectory has a prompt", step, b, f"prompt_len {prompt}, seq_len {seq}")
            if self.has_buffer:
                self.shadow[b] = self.env.tokens[b, :seq].tolist()
                if self.shadow[b][-1] != int(td.get(keys.TOKEN)[b]):
                    raise _fail(
                        "token is the last prompt token",
                        step,
                        b,
                        f"token {int(td.get(keys.TOKEN)[b])}, buffer ends with {self.shadow[b][-1]}",
                    )

    @staticmethod
    def _each(check: str, step: int, bad: torch.Tensor, detail) -> None:
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise _fail(check, step, b, detail(b))
