"""The lines of a server-sent event stream (what the inference servers stream their chunks as).

An event stream's lines end at ``\\r\\n``, ``\\n`` or ``\\r`` and nowhere else. ``httpx``'s ``aiter_lines`` splits as
:meth:`str.splitlines` does, also at U+0085, U+2028, U+2029 and the ASCII separators ``\\x1c``-``\\x1e``, which a JSON
string may hold unescaped: a server streaming a generated text that holds one (a model can sample the two bytes of
U+0085) had its chunk cut in two, and the wave failed on a ``JSONDecodeError``. The lines are split here, on bytes.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator

__all__ = ["event_lines"]

_LINE_END = re.compile(rb"\r\n|\r|\n")


async def event_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """Each line of the byte stream ``chunks`` (a response's ``aiter_bytes()``), decoded as UTF-8, without its end; a
    last line with no end is yielded too. A ``\\r\\n`` cut between two chunks gives an empty line more (an event
    stream's lines of interest are the ``data:`` ones)."""
    rest = b""
    async for chunk in chunks:
        *lines, rest = _LINE_END.split(rest + chunk)
        for line in lines:
            yield line.decode("utf-8")
    if rest:
        yield rest.decode("utf-8")
