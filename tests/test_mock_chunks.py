"""The mock provider's text chunks, encoded once per stream but for their text, are the
bytes the whole-chunk encoder makes: any text, either field."""

from __future__ import annotations

import json

import pytest

from daemon.mock.provider import _chunk, _TextChunks

TEXTS = ["word7 ", "", " ", 'quote " and \\ backslash', "line\nbreak\r\t", "é ü 日本 🎉",
         "\x00\x1f control", "\u2028\u2029", "word@1764590000123456789"]


@pytest.mark.parametrize("field", ["content", "reasoning_content", "reasoning"])
def test_a_text_chunk_is_the_whole_encoding(field: str) -> None:
    encode = _TextChunks("bench-model", "chatcmpl-abc123", 1764590000)
    for text in TEXTS:
        made = encode(field, text)
        assert made == _chunk("bench-model", "chatcmpl-abc123", {field: text},
                              created=1764590000)
        assert made.startswith(b"data: ") and made.endswith(b"\n\n")
        body = json.loads(made[len(b"data: "):])
        assert body["choices"][0]["delta"] == {field: text}
        assert body["choices"][0]["finish_reason"] is None
