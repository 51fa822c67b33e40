"""What a token env does when turns end: ask its turn handler, write the rewards, append the feedback of the
episodes that go on and move those slots to their next turn."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokengym.llm_envs import keys
from tokengym.llm_envs._slots import Slots
from tokengym.llm_envs.errors import RewardFunctionError
from tokengym.llm_envs.turns.protocol import FinishedTurns, Turn, TurnHandler, check_turns
from tokengym.llm_envs.turns.render import ChatRenderer
from tokengym.llm_envs.unroll import TurnEnd

__all__ = ["TurnEnds"]


class TurnEnds:
    """Answers the turns that ended in one step or wave of ``slots``.

    Args:
        slots: the env's slots.
        renderer: renders feedback messages (``None``: a single-turn env, every turn ends its episode).
        max_turns: turns per episode.
        max_length: the slots' capacity (feedback that does not fit ends the episode).
        vocab_size: feedback ids a handler renders itself must lie below it.
        decode: the env's response decoder (rows of ids -> texts).
    """

    def __init__(self, slots: Slots, renderer: ChatRenderer | None, *, max_turns: int, max_length: int,
                 vocab_size: int, decode: Callable[[list[torch.Tensor]], list[str]]) -> None:  # fmt: skip
        self.slots, self.renderer, self.decode = slots, renderer, decode
        self.max_turns, self.max_length, self.vocab_size = max_turns, max_length, vocab_size
        self.metrics = {"turns": 0, "feedback_tokens": 0}

    def answer(self, handler: TurnHandler, ended, limited, new_len, cut) -> TurnEnd:
        """Ask ``handler`` about every ended turn; write the feedback of continuing slots after the model's
        tokens. A turn cut by ``max_turn_tokens`` is answered as any finished turn; an episode ending with it is
        truncated. Raises RewardFunctionError (nothing written then)."""
        reward = torch.zeros(len(self.slots.prompts), 1)
        stopped = limited if cut is None else limited | cut  # a limit ended the turn
        terminated, truncated = ended, stopped & ~ended
        index = (ended | stopped).nonzero().squeeze(-1)
        finished = index.tolist()
        if not finished:
            return TurnEnd(terminated=terminated, truncated=truncated, reward=reward)
        turns = self.finished_turns(finished, limited, new_len, ended)
        rewards, results = check_turns(handler.end_turns(turns), turns, who=handler.name)
        reward.view(-1).index_copy_(0, index, rewards)
        if self.renderer is None:
            return TurnEnd(terminated=terminated, truncated=truncated, reward=reward)
        if results is None:  # rewards alone: every episode ends
            results = [Turn(r) for r in rewards.tolist()]
        split = [i for i, r in enumerate(results) if r.new_trajectory]
        if split:  # parts of episodes that go on in a new trajectory: truncated here (the episode did not end)
            rows = [turns.slots[i] for i in split]
            terminated, truncated = terminated.clone(), truncated.clone()
            terminated[rows], truncated[rows] = False, True
            self.slots.parts += [turns.trajectories[i] for i in split]
        appended = self.feedback(turns, results, new_len, who=handler.name)
        if appended:  # continuing slots: not done, their feedback written after the model's tokens
            terminated, truncated = terminated.clone(), truncated.clone()
            rows = list(appended)
            terminated[rows] = truncated[rows] = False
            self.slots.write_feedback(appended, new_len)
        self.slots.archive(terminated | truncated, new_len)
        return TurnEnd(terminated=terminated, truncated=truncated, reward=reward, appended=appended)

    def finished_turns(self, slots: list[int], limited: torch.Tensor, new_len: torch.Tensor,
                       ended: torch.Tensor) -> FinishedTurns:  # fmt: skip
        """The handler's view of the turns of ``slots`` ending at lengths ``new_len`` (``ended``: on an end id)."""
        s, tokens = self.slots.state, self.slots.tokens
        starts, ends, all_trajs = s[keys.PROMPT_LEN].tolist(), new_len.tolist(), s[keys.TRAJ_ID].tolist()  # three reads
        is_end = ended.tolist()  # and the end flags, once (not indexed per slot)
        trajs = [all_trajs[b] for b in slots]
        if self.renderer is None:
            turns, final = [0] * len(slots), [True] * len(slots)
        else:
            index = torch.tensor(slots)
            turns, is_limited = s[keys.TURN][index].tolist(), limited[index].tolist()
            final = [lim or t + 1 >= self.max_turns for lim, t in zip(is_limited, turns, strict=True)]
        log_probs = self.slots.log_probs
        turn_log_probs = None if log_probs is None else (lambda b: log_probs[b, starts[b] : ends[b]].tolist())
        return FinishedTurns(slots, turns, [self.slots.prompts[b] for b in slots], [tokens[b, starts[b] : ends[b]] for b in slots],
                             final, trajs, decode=self.decode, history=lambda b: tokens[b, : ends[b]],
                             ended=[is_end[b] for b in slots], log_probs=turn_log_probs)  # fmt: skip

    def feedback(self, turns: FinishedTurns, results: list[Turn], new_len: torch.Tensor, *, who: str) -> dict[int, torch.Tensor]:
        """The ids to append per continuing slot: feedback given, the episode not over, and it fits."""
        appended, ends = {}, new_len.tolist()
        for i, (b, result) in enumerate(zip(turns.slots, results, strict=True)):
            if result.is_done or turns.is_final[i]:
                continue
            if isinstance(result.feedback, torch.Tensor):
                ids = self.checked_ids(result.feedback, turns.slots[i], who=who)
            else:
                ids = self.renderer.feedback_ids(turns.response_ids[i], result.messages())
            if ends[b] + len(ids) + 1 <= self.max_length:  # else the feedback does not fit: the episode ends here
                appended[b] = ids
        return appended

    def checked_ids(self, ids: torch.Tensor, slot: int, *, who: str) -> torch.Tensor:
        """Feedback ids a handler rendered itself, checked (int64, 1-D, in the vocabulary) and copied."""
        if ids.dtype != torch.int64 or ids.dim() != 1 or not len(ids):
            raise RewardFunctionError(f"{who} gave feedback ids of dtype {ids.dtype} and shape {tuple(ids.shape)} for "
                                      f"slot {slot}; give a non-empty int64 (n,) tensor")  # fmt: skip
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= self.vocab_size:
            raise RewardFunctionError(f"{who} gave feedback id {lo if lo < 0 else hi} for slot {slot}, outside the "
                                      f"vocabulary [0, {self.vocab_size})")  # fmt: skip
        return ids.clone()

    def continue_turns(self, appended: dict[int, torch.Tensor], new_len: torch.Tensor) -> None:
        """Move continuing slots to their next turn (after the step or wave is committed)."""
        if appended:
            self.metrics["feedback_tokens"] += self.slots.continue_turns(appended, new_len)
            self.metrics["turns"] += len(appended)
