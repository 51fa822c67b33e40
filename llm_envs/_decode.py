"""Response text for reward functions: a tokenizer's ``batch_decode(..., skip_special_tokens=True)``, vectorized.

For byte-level BPE tokenizers (GPT-2, Qwen, Llama 3 and the tiny test tokenizers) the text of a sequence
is the UTF-8 decoding of its tokens' bytes joined, so a table of every token's bytes turns a whole wave's
responses into one NumPy gather and one ``bytes.decode`` per response, several times faster than the
tokenizer's per-sequence decode. The table is built on first use and checked against the tokenizer on
random sequences (invalid UTF-8 included); any other tokenizer, or any mismatch, uses ``batch_decode``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ResponseDecoder"]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class ResponseDecoder:
    """``decoder(rows) -> list[str]``: the text of each 1-D id tensor, as ``tokenizer.batch_decode(rows,
    skip_special_tokens=True)`` gives it.

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> tok = tiny_tokenizer()
        >>> rows = [torch.tensor(tok.encode("12 + 7 = 19")), torch.tensor([tok.eos_token_id, *tok.encode(" ok")])]
        >>> ResponseDecoder(tok)(rows) == tok.batch_decode(rows, skip_special_tokens=True)
        True
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # bytes, offsets, lengths by id
        self.blobs: list[bytes] = []  # the bytes of each id, for a few rows (a join costs less than NumPy's setup)
        self.is_checked = False

    def __call__(self, rows: list[torch.Tensor]) -> list[str]:
        if not self.is_checked:
            self.table, self.is_checked = self._build(), True
        if self.table is None:
            return self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        if len(rows) < 8:  # a few rows: joining each row's bytes costs less than NumPy's setup
            return self._join(rows)
        return self._decode(rows)

    def _join(self, rows: list[torch.Tensor]) -> list[str]:
        blobs, out = self.blobs, []
        for row in rows:
            ids = row.tolist()
            if ids and (max(ids) >= len(blobs) or min(ids) < 0):
                return self.tokenizer.batch_decode(rows, skip_special_tokens=True)
            out.append(b"".join([blobs[i] for i in ids]).decode("utf-8", "replace"))
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            out = [self.tokenizer.clean_up_tokenization(t) for t in out]
        return out

    def _decode(self, rows: list[torch.Tensor]) -> list[str]:
        data, offsets, lengths = self.table
        ids = torch.cat(rows).numpy()
        if ids.size and (int(ids.max()) >= len(lengths) or int(ids.min()) < 0):
            return self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        n = lengths[ids]  # bytes of each token
        ends = np.cumsum(n)
        total = int(ends[-1]) if ends.size else 0
        starts = offsets[ids] - (ends - n)  # byte i of the output comes from data[i + starts[token of i]]
        flat = data[np.arange(total) + np.repeat(starts, n)].tobytes()
        row_ends = np.cumsum([len(r) for r in rows])
        cuts = np.concatenate([[0], ends[row_ends - 1]]) if ends.size else np.zeros(len(rows) + 1, dtype=np.int64)
        cuts[1:][row_ends == 0] = 0
        bounds = cuts.tolist()
        out = [flat[a:b].decode("utf-8", "replace") for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            out = [self.tokenizer.clean_up_tokenization(t) for t in out]
        return out

    def _build(self):
        """The byte table of a byte-level tokenizer, or ``None`` (then ``batch_decode`` is used)."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":
            return None
        try:
            vocab = len(tok)
            pieces = tok.convert_ids_to_tokens(list(range(vocab)))
            special = set(tok.all_special_ids)
            added = {int(i): t for i, t in (getattr(tok, "added_tokens_decoder", {}) or {}).items()}
            to_byte = _byte_decoder()
            blobs = []
            for i, piece in enumerate(pieces):
                if i in special or (i in added and added[i].special):
                    blobs.append(b"")
                elif i in added or piece is None:
                    blobs.append((added[i].content if i in added else "").encode())
                else:
                    blobs.append(bytes(to_byte[c] for c in piece))
        except (KeyError, TypeError, AttributeError, ValueError):
            return None
        lengths = np.array([len(b) for b in blobs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.table = (np.frombuffer(b"".join(blobs), dtype=np.uint8).copy(), offsets, lengths)
        self.blobs = blobs
        gen = torch.Generator().manual_seed(0)
        sample = [torch.randint(0, vocab, (int(n),), generator=gen) for n in torch.randint(0, 48, (64,), generator=gen)]
        sample.append(torch.tensor(tok.encode("héllo wörld ✓ 12+7=19\n")))
        expected = tok.batch_decode(sample, skip_special_tokens=True)
        if self._decode(sample) != expected or self._join(sample) != expected:
            return None
        return self.table
