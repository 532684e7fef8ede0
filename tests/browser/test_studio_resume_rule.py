"""The rule Studio draws a resumed turn by (CONTRACT §18, daemon/studio/js/resume.js),
run in chromium on hand-made event logs: which events are void (those of that turn
with afterSeq < seq < the resume's seq), what is counted for each marker, and the words.
The browser tests of test_studio_resumed.py show it end to end on a real daemon.
"""

from __future__ import annotations

from typing import Any

import trio

from tests.browser.chromium import BrowserThread, open_tab
from tests.harness import Running

RUN = """async (log) => {
  const m = await import('/studio/js/resume.js');
  const counts = new Map();
  const kept = m.withoutVoid(log, counts).map((e) => e.seq);
  return { kept, counts: Object.fromEntries(counts) };
}"""


def ev(seq: int, kind: str, turn: str = "A", **data: Any) -> dict[str, Any]:
    return {"seq": seq, "type": "session.stream", "turnId": turn, "eventType": kind,
            "sessionId": "ses_1", "data": data}


async def test_void_events_and_counts(chromium: BrowserThread, daemon: Running) -> None:
    log = [
        ev(1, "turn.start"), ev(2, "inference.chunk", content="kept "),
        ev(3, "message", role="assistant"),
        {**ev(5, "inference.chunk", content="lost"), "seqFrom": 4},  # merged: its last seq
        ev(6, "tool.chunk", toolCallId="c1"), ev(7, "inference.chunk", turn="B"),
        ev(8, "turn.suspended", reason="shutdown"),
        ev(9, "turn.resumed", turnId="A", attempt=1, afterSeq=3, reason="shutdown"),
        ev(10, "inference.chunk", content="again"),
        ev(11, "turn.resumed", turnId="A", attempt=2, afterSeq=3, reason="restart"),
        ev(12, "inference.chunk", content="final"),
        ev(13, "turn.resumed", turnId="A", attempt=3, afterSeq=12, reason="restart"),
    ]
    with trio.fail_after(60):
        async with open_tab(chromium, daemon.url + "/studio") as tab:
            await tab.connected()
            got = await tab.eval(RUN, log)
            # B's chunk is another turn's; the second loss (after the same step) voids the
            # first resume and what followed it; the third resume (after 12) voids nothing.
            assert got["kept"] == [1, 2, 3, 7, 11, 12, 13], got
            assert got["counts"] == {"9": 0, "11": 4, "13": 0}, got  # 5, 6, 9, 10 (8 not)
            assert await tab.eval("async () => (await import('/studio/js/resume.js'))"
                                  ".withoutVoid([1, 2].map((seq) => ({ seq })))"
                                  ".map((e) => e.seq)") == [1, 2]
            words = await tab.eval("""async () => {
              const m = await import('/studio/js/resume.js');
              return [
                m.resumedText({ attempt: 1, reason: 'restart' }),
                m.resumedText({ attempt: 2, reason: 'shutdown' }),
                m.resumedText({ attempt: 1, reason: 'node_lost', node: 'node-b' }),
                m.voidText(0), m.voidText(3), m.resumedCount(1), m.resumedCount(2),
              ]; }""")
            assert words == [
                "Resumed after a restart · attempt 1",
                "Resumed after a shutdown · attempt 2",
                "Resumed on node-b after its node was lost · attempt 1",
                "it goes on from its last saved step",
                "the interrupted attempt's output after its last saved step was discarded",
                "resumed after 1 restart", "resumed after 2 restarts",
            ], words
