"""The per-token path splices a chunk's own fields (seq, ts, content, a tool.chunk's
offset) into its turn's pre-encoded envelope (events.ChunkEncoder): what it makes must be
byte for byte what a full encode of the same event (events.build) makes — for any
content: escapes, control characters, non-ASCII, emoji, U+2028, and lone surrogates
(which orjson refuses: both fall back to the escaped form, and it still decodes)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from daemon.runtime.events import (
    INFERENCE_CHUNK,
    THINKING_CHUNK,
    TOOL_CHUNK,
    ChunkEncoder,
    Envelope,
    SessionRef,
    build,
)

ROOT = SessionRef("ses_root", "planner", None, "ses_root", 0, None, ("ses_root",))
# A child with a non-ASCII agent name: the constant part holds non-ASCII too.
CHILD = SessionRef("ses_child", "hélper-ü", "ses_root", "ses_root", 1, "call_7",
                   ("ses_child", "ses_root"))

CONTENTS = [
    "", "word ", 'quote " and backslash \\ and slash /', "new\nline\r\ttab\b\f",
    "\x00\x01\x1f\x7f", "é ü ß — “typographic”", "emoji 😀 and 👩‍👩‍👧", "\u2028\u2029",
    "half \ud83d", "\udfff alone", "pair \ud83d\ude00 as two code points", "</script>",
]


def _full(ref: SessionRef, event_type: str, seq: int, ts: int, data: dict[str, object]
          ) -> Envelope:
    return build(seq, ts, "session.stream", ref, {"data": data}, turn_id="turn_1",
                 event_type=event_type)


def _same(spliced: Envelope, full: Envelope) -> None:
    assert spliced.data == full.data
    assert spliced.json == full.json
    assert spliced.sse_frame() == full.sse_frame()
    assert (spliced.seq, spliced.type, spliced.session_id, spliced.lineage, spliced.turn_id,
            spliced.event_type) == (full.seq, full.type, full.session_id, full.lineage,
                                    full.turn_id, full.event_type)
    assert spliced.size >= len(spliced.data) + len(spliced.sse_frame())


def test_spliced_text_chunks_equal_a_full_encode() -> None:
    for ref in (ROOT, CHILD):
        for event_type in (INFERENCE_CHUNK, THINKING_CHUNK):
            encoder = ChunkEncoder(ref, "turn_1", event_type)
            for seq, content in enumerate(CONTENTS, start=1):
                ts = 1_764_000_000_000 + seq
                spliced = encoder.envelope(seq, ts, content)
                _same(spliced, _full(ref, event_type, seq, ts, {"content": content}))
                # A client reads back what was sent (two halves of a pair as the pair).
                decoded = json.loads(spliced.data)
                assert decoded["data"] == {"content": json.loads(json.dumps(content))}
                assert decoded["seq"] == seq and decoded["ts"] == ts


def test_spliced_tool_chunks_equal_a_full_encode() -> None:
    for ref in (ROOT, CHILD):
        for stream in ("stdout", "stderr"):
            encoder = ChunkEncoder(ref, "turn_1", TOOL_CHUNK, ("call_ü\"1", "bash", stream))
            offset = 0
            for seq, content in enumerate(CONTENTS, start=1):
                spliced = encoder.envelope(seq, 5, content, offset)
                data = {"toolCallId": "call_ü\"1", "toolName": "bash", "content": content,
                        "stream": stream, "offset": offset}
                assert encoder.data(content, offset) == data
                _same(spliced, _full(ref, TOOL_CHUNK, seq, 5, data))
                offset += len(content.encode("utf-8", "surrogatepass"))


def test_a_lone_surrogate_is_escaped_as_the_full_encode_escapes_it() -> None:
    spliced = ChunkEncoder(CHILD, "turn_1", INFERENCE_CHUNK).envelope(9, 9, "half \ud83d")
    assert b"\\ud83d" in spliced.data and spliced.data.isascii()
    assert spliced.data == spliced.json.encode()


@given(st.text(alphabet=st.characters(codec=None), max_size=40),
       st.integers(min_value=0, max_value=2**53), st.integers(min_value=0, max_value=2**31))
def test_any_content_splices_like_a_full_encode(content: str, seq: int, offset: int) -> None:
    text = ChunkEncoder(CHILD, "turn_1", INFERENCE_CHUNK).envelope(seq, 1, content)
    _same(text, _full(CHILD, INFERENCE_CHUNK, seq, 1, {"content": content}))
    tool = ChunkEncoder(ROOT, "turn_1", TOOL_CHUNK, ("c", "bash", "stdout"))
    _same(tool.envelope(seq, 1, content, offset),
          _full(ROOT, TOOL_CHUNK, seq, 1, tool.data(content, offset)))
