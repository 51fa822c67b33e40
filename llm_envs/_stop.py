"""Stop-string detection that decodes only the tail of responses whose newest token could complete one."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class StopChecker:
    """Finds slots whose response now contains a stop string.

    A stop string that appears after appending token ``t`` overlaps ``t``'s text, so ``t``'s text
    holds one of its characters: a per-vocabulary table of such tokens skips decoding for every
    other token, keeping the common step free of Python work.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str], vocab_size: int) -> None:
        if stop_strings is None:
            stop_strings = ()
        elif isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        bad = [s for s in stop_strings if not isinstance(s, str) or not s]
        if bad:
            raise ValueError(f"stop_strings must be non-empty strings, got {bad!r}")
        self.stop_strings = tuple(stop_strings)
        self.is_enabled = bool(self.stop_strings)
        self.tokenizer = tokenizer
        if not self.is_enabled:
            return
        chars = set("".join(self.stop_strings))
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        table = torch.ones(vocab_size, dtype=torch.bool)  # unknown ids: check (conservative)
        for i, piece in enumerate(pieces):
            text = tokenizer.convert_tokens_to_string([piece]) if piece is not None else ""
            table[i] = "\ufffd" in text or bool(chars & set(text))
        self._could_stop = table
        # 4 bytes per character at most, one byte per token at least
        self._tail = 4 * max(len(s) for s in self.stop_strings) + 1

    def hits(self, tokens, action, candidates, prompt_len, new_len) -> torch.Tensor:
        """Bool (B,): candidates whose response tail (ending at ``new_len``) contains a stop string."""
        out = torch.zeros_like(candidates)
        check = candidates & self._could_stop[action]
        for b in check.nonzero().squeeze(-1).tolist():
            start = max(int(prompt_len[b]), int(new_len[b]) - self._tail)
            text = self.tokenizer.decode(tokens[b, start : int(new_len[b])])
            out[b] = any(s in text for s in self.stop_strings)
        return out
