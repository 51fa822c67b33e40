"""A token env's step and wave over its slots: validate one token per slot, write it into the buffer, find the turns
that ended and have them answered; a wave's request and unroll with the same termination.

The usual step (no turn can end: no end id and no slot at a limit) is a handful of tensor ops: the actions read to the
host once (a list: the vocabulary check and whether any is an end id, in Python), the lengths moved, one write into the
buffer; the steps left before the nearest limit are counted in Python, so no comparison with the limits is made until
one may be reached.
"""

from __future__ import annotations

from typing import Protocol

import torch
from tensordict import TensorDict, TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs._slots import Slots
from tokengym.llm_envs._stop import StopChecker
from tokengym.llm_envs._turn_ends import TurnEnds
from tokengym.llm_envs.errors import ResetNeeded, RewardFunctionError
from tokengym.llm_envs.turns.protocol import TurnHandler
from tokengym.llm_envs.unroll import WaveSteps, unroll_wave
from tokengym.llm_envs.waves import WaveRequest, WaveResult

__all__ = ["Limits", "StepCore"]


class Limits(Protocol):
    """The length limits a step checks (a token env has them): the trajectory's budget, the context and the turn's
    own limit (or ``None``)."""

    max_new_tokens: int
    max_length: int
    max_turn_tokens: int | None


class StepCore:
    """Steps and waves of ``slots``; ``turn_ends`` answers the turns that end, ``stop`` finds stop strings.

    Args:
        slots: the env's slots.
        turn_ends: what happens when turns end (the env's turn handler is passed per call).
        stop: the stop-string checker.
        eos: the end ids (1-D int64).
        vocab_size: actions must lie in ``[0, vocab_size)``.
    """

    def __init__(self, slots: Slots, turn_ends: TurnEnds, stop: StopChecker, eos: torch.Tensor, vocab_size: int) -> None:
        self.slots, self.turn_ends, self.stop, self.eos, self.vocab_size = slots, turn_ends, stop, eos, vocab_size
        self.batch_size = torch.Size([slots.tokens.shape[0]])
        self.is_end = torch.zeros(vocab_size, dtype=torch.bool)  # per vocabulary id (a step's ended turns: a gather)
        self.is_end[eos] = True
        self.end_ids = frozenset(eos.tolist())  # whether a step's actions hold an end id, asked of their host list

    # -- checks --
    def check_action(self, action) -> torch.Tensor:
        """``action`` when it is one in-vocabulary int64 id per slot; else a TypeError / ValueError naming the fix."""
        shape = tuple(self.batch_size)
        if not isinstance(action, torch.Tensor):
            raise TypeError(f"action must be an int64 tensor of shape {shape}, got {type(action)}")
        if action.dtype != torch.int64:
            raise TypeError(f"action must be int64 token ids, got dtype {action.dtype}; use action.long()")
        if action.shape != self.batch_size:
            raise ValueError(f"action must have shape {shape} (one token per slot), got {tuple(action.shape)}")
        lo, hi = (int(x) for x in torch.aminmax(action))
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"action {bad} is out of the vocabulary [0, {self.vocab_size}); check the policy's vocab")
        return action

    def check_not_done(self, active: torch.Tensor) -> None:
        """A ResetNeeded when an active slot is done (it must be refilled first)."""
        slots = self.slots
        if slots.any_done and bool((slots.done & active).any()):
            done = (slots.done & active).nonzero().squeeze(-1).tolist()
            raise ResetNeeded(f"slots {done} are done; reset them (td['_reset']) or use env.step_and_maybe_reset")

    # -- a step --
    def step(self, tensordict: TensorDictBase, handler: TurnHandler, limits: Limits) -> TensorDictBase:
        """Append ``tensordict``'s action to every active slot; the step's ``("next", ...)`` observation. A reward
        function that raises leaves no trace (the write is undone)."""
        action, active, new_len, resp_len, previous = self._advance(tensordict, limits)
        B, rt = self.batch_size[0], self.slots
        if previous is None:  # the common step: no turn ends, nothing to score
            flags = torch.zeros(3, B, 1, dtype=torch.bool).unbind(0)
            rt.commit(action, active, new_len, resp_len, flags[0].view(B), any_done=False)
            rt.flags, rt.done_slots = flags, []
            return rt.observation(*flags, torch.zeros(B, 1))
        ended = active & self.is_end.index_select(0, action)  # an end id
        if self.stop.is_enabled:
            ended |= self.stop.hits(rt.tokens, action, active & ~ended, rt.state[keys.PROMPT_LEN], new_len)
        hit = active & (new_len >= rt.deadline)  # a budget, the context or the turn limit reached
        limited, cut = self._split_limits(hit, ended, new_len, limits)
        try:
            end = self.turn_ends.answer(handler, ended, limited, new_len, cut)
        except RewardFunctionError:
            rt.flat.index_copy_(0, rt.row_start + rt.state[keys.SEQ_LEN], previous)  # undo the write
            raise
        done = end.terminated | end.truncated
        any_done = bool(done.any())
        rt.commit(action, active, new_len, resp_len, done, any_done=any_done)
        self.turn_ends.continue_turns(end.appended, new_len)
        if self.turn_ends.pending is not None:  # slots that wait, slots woken
            self.turn_ends.settle()
        rt.flags = (done.unsqueeze(-1), end.terminated.unsqueeze(-1), end.truncated.unsqueeze(-1))
        rt.done_slots = done.nonzero().squeeze(-1).tolist() if any_done else []
        return rt.observation(*rt.flags, end.reward)

    def _advance(self, tensordict: TensorDictBase, limits: Limits):
        """Validate the action, write it into the token buffer and tell whether a turn may have ended.

        Returns ``(action, active, new_len, resp_len, previous)``: ``previous`` holds the overwritten buffer cells
        (for a rollback) when a slot's turn may have ended (an end id, a stop string or a limit), and is ``None`` on
        the usual step, where nothing ended (then no end flags are computed at all).
        """
        rt = self.slots
        if not rt.is_reset:
            raise ResetNeeded("TokenEnv was stepped before reset(); call env.reset() first")
        action = tensordict.get(keys.ACTION)
        if not isinstance(action, torch.Tensor) or action.dtype != torch.int64 or action.shape != self.batch_size:
            self.check_action(action)
        ids = action.tolist()  # the step's one read of the actions: a few ids, cheaper in Python than as tensor ops
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            self.check_action(action)
        s = rt.state
        active = s[keys.ACTIVE]
        self.check_not_done(active)
        if rt.deadline is None:
            rt.set_deadlines(limits.max_new_tokens, limits.max_length, limits.max_turn_tokens)
        seq_len = s[keys.SEQ_LEN]
        if rt.all_active:
            new_len, resp_len = seq_len + 1, s[keys.RESPONSE_LEN] + 1
        else:
            new_len, resp_len = seq_len + active, s[keys.RESPONSE_LEN] + active
        # a turn may end where the action is an end id or a slot reaches a limit (none can before `steps_left` runs out)
        may_end = self.stop.is_enabled or not self.end_ids.isdisjoint(ids)
        if not may_end and rt.steps_left <= 1:
            may_end = bool((new_len >= rt.deadline).any())
        pos = rt.row_start + seq_len
        previous = rt.flat.index_select(0, pos) if may_end or not rt.all_active else None
        rt.flat.index_copy_(0, pos, action if rt.all_active else torch.where(active, action, previous))
        if rt.log_probs is not None and (log_prob := tensordict.get(keys.ACTION_LOG_PROB, None)) is not None:
            rt.write_log_probs(pos, log_prob)
        return action, active, new_len, resp_len, previous if may_end else None

    def _split_limits(self, hit: torch.Tensor, ended: torch.Tensor, new_len: torch.Tensor, limits: Limits):
        """``(limited, cut)`` of the slots that reached a limit: the trajectory's budget or the context
        (a truncation unless ``ended``), or only the turn's ``max_turn_tokens`` (where nothing else ended it)."""
        if limits.max_turn_tokens is None:
            return hit, None
        limited = hit & (new_len >= self.slots.budget_deadline)
        return limited, hit & ~limited & ~ended

    # -- a wave --
    def wave_request(self, limits: Limits, eos_token_ids, stop_strings) -> WaveRequest:
        """The live slots' request (see ``TokenEnv.wave_request``)."""
        s = self.slots.state
        self.check_not_done(s[keys.ACTIVE])
        slots = s[keys.ACTIVE].nonzero().squeeze(-1)
        seq_len, resp_len = s[keys.SEQ_LEN][slots], s[keys.RESPONSE_LEN][slots]
        budget = torch.minimum(limits.max_new_tokens - resp_len, limits.max_length - seq_len)
        if limits.max_turn_tokens is not None:
            budget = torch.minimum(budget, limits.max_turn_tokens - (seq_len - s[keys.PROMPT_LEN][slots]))
        if self.slots.closing:  # a woken slot's last turn: one token
            for i, b in enumerate(slots.tolist()):
                if b in self.slots.closing:
                    budget[i] = min(int(budget[i]), self.slots.closing[b] - int(seq_len[i]))
        prompts = [self.slots.tokens[b, : int(n)] for b, n in zip(slots.tolist(), seq_len.tolist(), strict=True)]
        return WaveRequest(slots=slots, prompts=prompts, max_new_tokens=budget,
                           eos_token_ids=tuple(sorted(eos_token_ids)), stop_strings=stop_strings)  # fmt: skip

    def unroll(self, request: WaveRequest, result: WaveResult, handler: TurnHandler, limits: Limits,
               width: int | None, *, cells: bool = False) -> TensorDict | tuple[TensorDict, torch.Tensor]:  # fmt: skip
        """The steps (B, T) of ``result``'s tokens (see ``TokenEnv.unroll``); with ``cells``, its real steps (n,) and
        each slot's step count (see ``TokenEnv.unroll_cells``)."""
        rt = self.slots
        if not rt.is_reset:
            raise ResetNeeded("TokenEnv.unroll before reset(); call env.reset() first")
        wave = WaveSteps.from_result(request, result, self.batch_size[0])
        start = rt.state[keys.SEQ_LEN]
        rules = dict(eos=self.eos, stop=self.stop, max_new_tokens=limits.max_new_tokens,
                     max_length=limits.max_length, max_turn_tokens=limits.max_turn_tokens)  # fmt: skip
        steps = unroll_wave(wave, rt.state, rt.tokens, rules)
        if rt.log_probs is not None:
            rt.write_wave_log_probs(start, steps.new_len, wave.log_probs)
        try:
            end = self.turn_ends.answer(handler, steps.ended, steps.limited, steps.new_len, steps.cut)
        except RewardFunctionError:
            steps.rollback(rt.tokens)
            raise
        done = end.terminated | end.truncated
        rt.copy_on_write()
        rt.commit(steps.last_action, steps.in_wave, steps.new_len, steps.resp_len, done, any_done=bool(done.any()))
        self.turn_ends.continue_turns(end.appended, steps.new_len)
        if self.turn_ends.pending is not None:
            self.turn_ends.settle()
        return steps.to_cells(end, rt.state) if cells else steps.to_tensordict(end, rt.state, width)
