"""The lines of a server-sent event stream, split at its line ends only, however the bytes arrive."""

import asyncio
import json

import pytest

from tokengym.collectors.policies._sse import event_lines


async def _chunks(data: bytes, cuts: list[int]):
    last = 0
    for cut in [*cuts, len(data)]:
        yield data[last:cut]
        last = cut


def lines(data: bytes, cuts=()) -> list[str]:
    async def collect():
        return [line async for line in event_lines(_chunks(data, list(cuts)))]

    return asyncio.run(collect())


EVENTS = [{"choices": [{"text": text, "token_ids": [i]}]} for i, text in
          enumerate(["a\u0085b", "\u2028", "x\u2029\x1cy", "é€😀"])]  # fmt: skip
STREAM = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in EVENTS) + b"data: [DONE]\n\n"


def test_unicode_line_separators_inside_json_strings_do_not_cut_a_line():
    assert "\u2028" in STREAM.decode() and STREAM.decode().splitlines()[0] != "data: " + json.dumps(EVENTS[0], ensure_ascii=False)
    data = [line for line in lines(STREAM) if line.startswith("data:")]
    assert [json.loads(line[5:]) for line in data[:-1]] == EVENTS and data[-1] == "data: [DONE]"


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64])
def test_a_stream_cut_anywhere_gives_the_same_lines(step):
    """Cut every ``step`` bytes: inside a multi-byte character, between a ``\\r`` and its ``\\n``, inside ``data:``."""
    crlf = STREAM.replace(b"\n", b"\r\n")
    for data in (STREAM, crlf):
        whole = [line for line in lines(data) if line]
        assert [line for line in lines(data, range(step, len(data), step)) if line] == whole
        assert len(whole) == len(EVENTS) + 1


def test_every_line_end_of_an_event_stream_ends_a_line_and_a_last_line_without_one_is_kept():
    assert lines(b"data: 1\r\ndata: 2\rdata: 3\ndata: 4") == ["data: 1", "data: 2", "data: 3", "data: 4"]
    assert lines(b"") == []
