"""The provider stream's line splitter (daemon.llm.sse.split_payloads): however a body
is cut into reads, the `data:` payloads it yields are those of the whole body, split on
LF, CRLF and lone CR as the event-stream grammar says, and the unfinished last line
waits in the buffer (taken at the end by last_payloads)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.errors import ProviderError
from daemon.llm import sse


def _reference(body: bytes) -> list[bytes]:
    return [line[5:].strip() for line in re.split(rb"\r\n|\r|\n", body)
            if line.startswith(b"data:")]


_lines = st.lists(st.one_of(
    st.binary(max_size=40).map(lambda b: b"data: " + b.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from([b"", b": comment", b"event: x", b"id: 7", b"data:[DONE]", b"data:"]),
), max_size=30)
_ends = st.sampled_from([b"\n", b"\r\n", b"\r"])


@settings(max_examples=300, deadline=None)
@given(lines=_lines, ends=st.lists(_ends, min_size=1), cuts=st.lists(st.integers(0, 2000)),
       unterminated=st.booleans())
def test_any_cut_of_the_body_yields_its_payloads(lines: list[bytes], ends: list[bytes],
                                                 cuts: list[int], unterminated: bool) -> None:
    body = b"".join(line + ends[i % len(ends)] for i, line in enumerate(lines))
    if unterminated:
        body += b"data: {\"last\": true}"
    points = sorted({c % (len(body) + 1) for c in cuts})
    pieces = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    buffer = bytearray()
    got: list[bytes] = []
    for piece in pieces:
        got += sse.split_payloads(buffer, piece)
        assert b"\r" not in buffer
    got += sse.last_payloads(buffer)
    assert got == _reference(body)


def test_an_oversized_line_is_refused_however_it_arrives() -> None:
    size = sse.LINE_MAX + 1
    with pytest.raises(ProviderError, match="oversized"):
        sse.split_payloads(bytearray(), b"data: " + b"x" * size)
    buffer = bytearray()
    with pytest.raises(ProviderError, match="oversized"):
        for _ in range(size // 65536 + 2):
            sse.split_payloads(buffer, b"x" * 65536)
    with pytest.raises(ProviderError, match="oversized"):
        sse.split_payloads(bytearray(), b"data: " + b"x" * size + b"\n")
