"""MultiTurnTokenEnv: token-level env whose episodes span several turns, with env feedback appended in the slot."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import RewardFunctionError
from tokengym.llm_envs.token_env import TokenEnv
from tokengym.llm_envs.unroll import TurnEnd

__all__ = ["MultiTurnTokenEnv", "Turn", "TurnFn"]


@dataclasses.dataclass(frozen=True)
class Turn:
    """What the environment answers to one finished turn.

    Attributes:
        reward: reward of this turn, given at its last token.
        feedback: text appended as the next message (``None`` ends the episode).
        role: chat role of the feedback message (``"user"``, or ``"tool"`` for a tool result).
    """

    reward: float
    feedback: str | None = None
    role: str = "user"


TurnFn = Callable[[list[str], list[str], list[dict], list[int]], Sequence[Turn]]

_MARK = "tokengym-assistant-turn"
_PROBE = ({"role": "user", "content": "tokengym-user-turn"}, {"role": "assistant", "content": _MARK})


def _special_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens, added role markers included."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {int(i) for i, t in added.items() if getattr(t, "special", False)}


def _chat_frame(tokenizer) -> tuple[str, str] | None:
    """``(text of a probe conversation ending with an assistant turn, the text the template closes that turn
    with)``, or ``None`` without a template (or one that does not show an assistant turn's content as is)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template(list(_PROBE), tokenize=False)
    at = text.rfind(_MARK)
    return None if at < 0 else (text, text[at + len(_MARK) :])


class MultiTurnTokenEnv(TokenEnv):
    """A :class:`TokenEnv` where a turn ends on EOS / end-of-turn / stop string and the env may answer.

    When a slot's turn ends, ``turn_fn(responses, prompts, metadata, turns)`` scores it (the text of
    this turn only) and returns a :class:`Turn` per slot. Unless the episode is over (no feedback,
    ``max_turns`` reached, or the feedback no longer fits), the env writes after the model's tokens,
    in the same slot, what the tokenizer's chat template writes there for the same conversation
    (:meth:`feedback_ids`): the rest of the assistant turn's close (``<|im_end|>\n`` for Qwen, of
    which the model wrote ``<|im_end|>``), the feedback message and the generation prompt. So a
    conversation's tokens equal ``tokenizer.apply_chat_template(conversation)``'s when each turn
    ends with the template's end-of-turn token (added to the turn-ending ids unless
    ``eos_token_ids`` is given) or a stop string. No step is emitted for the env's tokens, ``turn``
    increases, ``prompt_len`` moves to the start of the new turn and ``seq_len`` jumps, so a
    KV-cached policy prefills just the appended tokens. Token ids the model produced are kept as
    they were. ``max_new_tokens`` counts the episode's generated tokens (all turns) and ``max_turn_tokens``
    each turn's: a turn cut by the turn limit is answered as any finished turn (the episode goes on), the
    episode budget and the context limit truncate the episode (its last turn is still scored).

    Args:
        prompts: as for :class:`TokenEnv`.
        tokenizer: as for :class:`TokenEnv`.
        turn_fn: scores turns and gives feedback.
        max_turns: turns per episode (>= 1).
        **kwargs: the other :class:`TokenEnv` arguments (``reward_fn`` is not used: ``turn_fn`` rewards).

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> tok = tiny_tokenizer()
        >>> fn = lambda r, p, m, t: [Turn(0.0, "try again") if ti == 0 else Turn(1.0) for ti in t]
        >>> env = MultiTurnTokenEnv(["1+1="], tok, fn, max_turns=2, batch_size=1, max_length=64)
        >>> td = env.reset(); eos = torch.tensor([tok.eos_token_id])
        >>> out = env.step(td.set("action", eos))["next"]
        >>> out["turn"].tolist(), out["done"].item(), int(out["seq_len"]) > int(td["seq_len"]) + 1
        ([1], False, True)
    """

    def __init__(self, prompts, tokenizer, turn_fn: TurnFn, *, max_turns: int = 2, **kwargs) -> None:
        if not callable(turn_fn):
            raise TypeError(f"turn_fn must be callable(responses, prompts, metadata, turns), got {turn_fn!r}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        if kwargs.get("reward_fn") is not None:
            raise ValueError("MultiTurnTokenEnv rewards through turn_fn; pass reward_fn=None")
        super().__init__(prompts, tokenizer, **kwargs)
        self._frame = _chat_frame(tokenizer)
        self.turn_close_ids = torch.tensor(tokenizer(self._frame[1], add_special_tokens=False)["input_ids"] if self._frame
                                           else [], dtype=torch.int64)  # fmt: skip
        end_of_turn = self.turn_close_ids[:1].tolist()
        if kwargs.get("eos_token_ids") is None and end_of_turn and end_of_turn[0] in _special_ids(tokenizer):
            self.eos_token_ids = self.eos_token_ids | set(end_of_turn)  # the template's end of turn ends a turn
            self._eos = torch.tensor(sorted(self.eos_token_ids), dtype=torch.int64)
        self.turn_fn, self.max_turns = turn_fn, max_turns
        self.turn_metrics = {"turns": 0, "feedback_tokens": 0}
        # full token sequences (prompt, turns, feedback) of finished multi-turn episodes, by trajectory
        # id, until a collector takes them (bounded: the oldest go first)
        self._finished: dict[int, torch.Tensor] = {}
        self.max_finished_sequences = 4096
        # rendered feedback ids by (feedback, role), most recently used last (bounded): a task's feedback
        # texts repeat, and rendering one costs a chat template call and an encode
        self._rendered: dict[tuple[str, str], torch.Tensor] = {}
        self.max_rendered = 1024
        self._close = self.turn_close_ids.tolist()

    def config(self) -> dict:
        """The env's configuration as ``repr`` shows it (see :meth:`TokenEnv.config`), with the turn settings."""
        out = super().config()
        del out["reward_fn"]
        turn_fn = self.turn_fn
        return {**out, "turn_fn": getattr(turn_fn, "__name__", type(turn_fn).__name__), "max_turns": self.max_turns}

    def render(self, feedback: str, role: str) -> torch.Tensor:
        """Token ids of a feedback message plus the generation prompt, as the chat template writes them
        after an assistant turn (no default system prompt repeated); ``"\n{feedback}\n"`` without a template.

        Example:
            >>> from tokengym.testing import tiny_tokenizer
            >>> tok = tiny_tokenizer()
            >>> env = MultiTurnTokenEnv(["1+1="], tok, lambda *a: [], batch_size=1, max_length=64)
            >>> tok.decode(env.render("again", "user"))
            '<|user|>again<|end|><|assistant|>'
        """
        return self._rendered_ids(feedback, role).clone()

    def _rendered_ids(self, feedback: str, role: str) -> torch.Tensor:
        """:meth:`render`'s ids from the cache (not to be written to), rendered on a miss."""
        key = (feedback, role)
        ids = self._rendered.pop(key, None)
        if ids is None:
            ids = self._render(feedback, role)
            if len(self._rendered) >= self.max_rendered:
                self._rendered.pop(next(iter(self._rendered)))  # the least recently used
        self._rendered[key] = ids
        return ids

    def _render(self, feedback: str, role: str) -> torch.Tensor:
        tok = self.tokenizer
        if self._frame is not None:
            before = self._frame[0]
            text = tok.apply_chat_template([*_PROBE, {"role": role, "content": feedback}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
            if not text.startswith(before):
                raise ValueError(f"the chat template rewrites earlier turns when a {role!r} message follows, so the "
                                 "feedback tokens cannot be appended; use a template that renders turns in order")  # fmt: skip
            text = text[len(before) :]
        elif getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": role, "content": feedback}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
        else:
            text = f"\n{feedback}\n"
        return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)

    def feedback_ids(self, turn_ids: torch.Tensor, feedback: str, role: str) -> torch.Tensor:
        """What the env writes after a finished turn ``turn_ids``: the rest of the template's turn close
        (:attr:`turn_close_ids` less what the turn already ends with), then :meth:`render`'s tokens.

        Example:
            >>> from tokengym.testing import tiny_tokenizer
            >>> tok = tiny_tokenizer()
            >>> env = MultiTurnTokenEnv(["1+1="], tok, lambda *a: [], batch_size=1, max_length=64)
            >>> end = tok.convert_tokens_to_ids("<|end|>")
            >>> tok.decode(env.feedback_ids(torch.tensor([40, end]), "again", "user"))
            '<|user|>again<|end|><|assistant|>'
            >>> tok.decode(env.feedback_ids(torch.tensor([40]), "again", "user"))  # ended by a stop string
            '<|end|><|user|>again<|end|><|assistant|>'
        """
        close = self._close
        ended = turn_ids[-len(close) :].tolist() if close else []  # only the turn's tail can overlap the close
        k = next((k for k in range(min(len(close), len(ended)), 0, -1) if ended[-k:] == close[:k]), 0)
        rendered = self._rendered_ids(feedback, role)
        return torch.cat([self.turn_close_ids[k:], rendered]) if k < len(close) else rendered.clone()

    def pop_finished_sequences(self) -> dict[int, torch.Tensor]:
        """Full token ids (prompt, turns, feedback) of the episodes finished since the last call, by trajectory id."""
        out, self._finished = self._finished, {}
        return out

    def _end_turns(self, ended: torch.Tensor, limited: torch.Tensor, new_len: torch.Tensor, cut: torch.Tensor) -> TurnEnd:
        """Score every ended turn, write the feedback of continuing slots after the model's tokens.

        A turn cut by ``max_turn_tokens`` is answered as any finished turn; if the episode ends with it, the
        episode is truncated."""
        reward = torch.zeros(self.batch_size[0], 1)
        appended = self._answer_turns(ended | limited | cut, limited, new_len, reward)
        terminated = ended.clone()
        truncated = (limited | cut) & ~ended
        if appended:  # continuing slots: write the feedback after the model's tokens
            terminated[list(appended)] = False
            truncated[list(appended)] = False
            ends = new_len.tolist()
            for b, ids in appended.items():
                self._tokens[b, ends[b] : ends[b] + len(ids)] = ids
        self._archive(terminated | truncated, new_len)
        return TurnEnd(terminated=terminated, truncated=truncated, reward=reward, appended=appended)

    def _answer_turns(self, finished, limited, new_len, reward) -> dict[int, torch.Tensor]:
        slots = finished.nonzero().squeeze(-1).tolist()
        s = self._rt.state
        starts, ends, all_turns = s[keys.PROMPT_LEN].tolist(), new_len.tolist(), s[keys.TURN].tolist()  # one read each
        is_limited = limited.tolist()
        responses = self.decode_responses([self._tokens[b, starts[b] : ends[b]] for b in slots])
        prompts = [self._prompts[b] for b in slots]
        turns = [all_turns[b] for b in slots]
        try:
            outcomes = list(self.turn_fn(responses, [p.text for p in prompts], [p.metadata for p in prompts], turns))
        except Exception as err:
            raise RewardFunctionError(
                f"turn_fn raised {type(err).__name__}: {err} for slots {slots} (first: prompt "
                f"{prompts[0].index} {prompts[0].text[:60]!r}); the env state is unchanged"
            ) from err
        if len(outcomes) != len(slots) or not all(isinstance(o, Turn) for o in outcomes):
            raise RewardFunctionError(
                f"turn_fn must return one Turn per finished slot ({len(slots)} for slots {slots}), got {outcomes!r:.120}"
            )
        appended = {}
        for b, turn_index, outcome in zip(slots, turns, outcomes, strict=True):
            value = float(outcome.reward)
            if value != value or value in (float("inf"), float("-inf")):
                raise RewardFunctionError(f"turn_fn gave reward {value} for slot {b}; rewards must be finite")
            reward[b, 0] = value
            if outcome.feedback is None or is_limited[b] or turn_index + 1 >= self.max_turns:
                continue
            ids = self.feedback_ids(self._tokens[b, starts[b] : ends[b]], outcome.feedback, outcome.role)
            if ends[b] + len(ids) + 1 > self.max_length:
                continue  # the feedback does not fit: the episode ends here
            appended[b] = ids
        return appended

    def _archive(self, done: torch.Tensor, new_len: torch.Tensor) -> None:
        slots = done.nonzero().squeeze(-1)
        if not len(slots):
            return
        trajs, ends = self._rt.state[keys.TRAJ_ID][slots].tolist(), new_len[slots].tolist()
        rows = self._tokens[slots, : max(ends)]  # one gather (a copy), then views of it
        for i, (traj, end) in enumerate(zip(trajs, ends, strict=True)):
            if len(self._finished) >= self.max_finished_sequences:
                self._finished.pop(next(iter(self._finished)))
            self._finished[traj] = rows[i, :end]

    def _continue_turns(self, appended: dict[int, torch.Tensor], new_len: torch.Tensor) -> None:
        if not appended:
            return
        s = self._rt.state
        s[keys.SEQ_LEN], s[keys.TOKEN] = s[keys.SEQ_LEN].clone(), s[keys.TOKEN].clone()
        s[keys.PROMPT_LEN], s[keys.TURN] = s[keys.PROMPT_LEN].clone(), s[keys.TURN].clone()
        slots = torch.tensor(list(appended), dtype=torch.int64)
        sizes = torch.tensor([len(ids) for ids in appended.values()], dtype=torch.int64)
        end = new_len[slots] + sizes
        s[keys.SEQ_LEN][slots] = end
        s[keys.PROMPT_LEN][slots] = end
        s[keys.TOKEN][slots] = torch.stack([ids[-1] for ids in appended.values()])
        s[keys.TURN][slots] += 1
        self.turn_metrics["feedback_tokens"] += int(sizes.sum())
        self.turn_metrics["turns"] += len(appended)
