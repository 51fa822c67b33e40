"""Chat messages as the agent env compares them, and the chat-completion replies it sends.

A request continues an episode when its messages begin with the episode's messages so far, compared as
messages (role, text, tool calls by name and parsed arguments, tool-call id of a tool result), never
re-rendered: the model's own tokens stay in the slot whatever the template would write for them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence

__all__ = ["assistant_message", "chat_reply", "first_difference", "normalized"]


def _text(content) -> str:
    """A message's content as text (OpenAI content parts joined; ``None`` is empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(p.get("text", "") if isinstance(p, Mapping) else str(p) for p in content)
    return str(content)


def _calls(calls) -> tuple:
    out = []
    for call in calls or ():
        fn = call.get("function", call) if isinstance(call, Mapping) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return tuple(out)


def normalized(message: Mapping) -> tuple:
    """What two messages must share to be the same message: role, text, tool calls, tool-call id."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"a chat message must be a mapping with a 'role', got {message!r:.120}")
    return (message["role"], _text(message.get("content")), _calls(message.get("tool_calls")),
            message.get("tool_call_id") if message["role"] == "tool" else None)  # fmt: skip


def first_difference(before: Sequence[Mapping], request: Sequence[Mapping]) -> int | None:
    """Index of the first message of ``before`` that ``request`` does not repeat (``None``: it continues)."""
    for i, message in enumerate(before):
        if i >= len(request) or normalized(request[i]) != normalized(message):
            return i
    return None


def assistant_message(content: str, tool_calls: list[dict]) -> dict:
    """The assistant message of a turn, as the reply carries it and the episode keeps it."""
    message = {"role": "assistant", "content": content or None if tool_calls else content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_reply(model: str, message: dict, finish_reason: str, *, prompt_tokens: int, token_ids: list[int],
               log_probs: list[float] | None, tokens: list[str] | None) -> dict:  # fmt: skip
    """A ``chat.completion`` object: one choice, ``usage``, and the turn's token ids (``choices[0].token_ids``,
    an extension field) with their log-probs as OpenAI ``logprobs`` content when ``log_probs`` is given."""
    choice = {"index": 0, "message": message, "finish_reason": finish_reason, "token_ids": token_ids,
              "logprobs": None}  # fmt: skip
    if log_probs is not None:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                          for t, lp in zip(tokens, log_probs, strict=True)]}  # fmt: skip
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids),
                  "total_tokens": prompt_tokens + len(token_ids)},
    }  # fmt: skip
