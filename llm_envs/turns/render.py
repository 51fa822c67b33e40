"""What the env writes after a finished turn: the template's turn close, the feedback messages, the generation prompt."""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

__all__ = ["ChatRenderer"]

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


class ChatRenderer:
    """Renders feedback messages as the tokenizer's chat template writes them after an assistant turn.

    Rendered ids are cached by message contents (bounded, least recently used out): a task's feedback
    texts repeat, and rendering one costs a chat template call and an encode.

    Args:
        tokenizer: the env's tokenizer.
        max_cached: rendered messages kept.
    """

    def __init__(self, tokenizer, *, max_cached: int = 1024) -> None:
        self.tokenizer, self.max_cached = tokenizer, max_cached
        self._frame = _chat_frame(tokenizer)
        close = tokenizer(self._frame[1], add_special_tokens=False)["input_ids"] if self._frame else []
        self.close_ids = torch.tensor(close, dtype=torch.int64)  # the template's close of an assistant turn
        self._close = close
        self._cache: dict[tuple, torch.Tensor] = {}

    @property
    def end_of_turn_id(self) -> int | None:
        """The template's end-of-turn token when it is a special token (it then ends a turn), else ``None``."""
        first = self._close[:1]
        return first[0] if first and first[0] in _special_ids(self.tokenizer) else None

    def render(self, messages: Sequence[dict]) -> torch.Tensor:
        """Ids of ``messages`` plus the generation prompt after an assistant turn (a cached tensor: do not write)."""
        key = tuple((m["role"], m["content"]) if len(m) == 2 and isinstance(m["content"], str)
                    else json.dumps(dict(m), sort_keys=True, default=str) for m in messages)  # fmt: skip
        ids = self._cache.pop(key, None)
        if ids is None:
            ids = self._render(messages)
            if len(self._cache) >= self.max_cached:
                self._cache.pop(next(iter(self._cache)))  # the least recently used
        self._cache[key] = ids
        return ids

    def _render(self, messages: Sequence[dict]) -> torch.Tensor:
        tok = self.tokenizer
        messages = [dict(m) for m in messages]
        if self._frame is not None:
            before = self._frame[0]
            text = tok.apply_chat_template([*_PROBE, *messages], tokenize=False, add_generation_prompt=True)
            if not text.startswith(before):
                roles = [m["role"] for m in messages]
                raise ValueError(f"the chat template rewrites earlier turns when {roles} messages follow, so the "
                                 "feedback tokens cannot be appended; use a template that renders turns in order")  # fmt: skip
            text = text[len(before) :]
        elif getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "".join(f"\n{m['content']}\n" for m in messages)
        return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)

    def feedback_ids(self, turn_ids: torch.Tensor, messages: Sequence[dict]) -> torch.Tensor:
        """What follows a finished turn ``turn_ids``: the rest of the template's turn close (:attr:`close_ids`
        less what the turn already ends with), then :meth:`render`'s ids (a new tensor)."""
        close = self._close
        ended = turn_ids[-len(close) :].tolist() if close else []  # only the turn's tail can overlap the close
        k = next((k for k in range(min(len(close), len(ended)), 0, -1) if ended[-k:] == close[:k]), 0)
        rendered = self.render(messages)
        return torch.cat([self.close_ids[k:], rendered]) if k < len(close) else rendered.clone()
