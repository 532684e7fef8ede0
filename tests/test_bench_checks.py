"""What `make bench` relies on to fail a run: its ledger catches every kind of loss, and
the mock's `stamp` option writes each word with the time it was sent, in order.

The ledger is the bench's only correctness gate (bench/table.py): a missing or doubled
terminal, a lost, doubled, reordered or altered word must each be a loss. The stamp is
what P2's and P5's latencies are measured from (daemon/mock/script.py `stamp`).
"""

from __future__ import annotations

import time

from bench.bare import one_stream
from bench.clients import script, words
from bench.table import Ledger
from tests.harness import Provider


def test_ledger_accepts_exactly_what_was_sent() -> None:
    ledger = Ledger()
    ledger.check("whole", 1, words(3), words(3))
    ledger.stamped("stamped", 1, "word0@5 word1@6 word2@9", 3)
    ledger.prefix("cancelled", 1, "word0 word1 ")
    ledger.prefix("cancelled before a word", 1, "")
    assert ledger.losses == []
    assert ledger.turns == 4


def test_ledger_flags_every_kind_of_loss() -> None:
    cases = [
        lambda led: led.check("no terminal", 0, words(3), words(3)),
        lambda led: led.check("two terminals", 2, words(3), words(3)),
        lambda led: led.check("lost word", 1, "word0 word2", words(3)),
        lambda led: led.check("cut short", 1, "word0 word1", words(3)),
        lambda led: led.check("doubled", 1, "word0 word1 word1 word2", words(3)),
        lambda led: led.stamped("stamped lost", 1, "word0@5 word2@9", 3),
        lambda led: led.stamped("stamped reordered", 1, "word1@6 word0@5 word2@9", 3),
        lambda led: led.stamped("stamped unstamped", 1, "word0@5 word1 word2@9", 3),
        lambda led: led.stamped("stamped no terminal", 0, "word0@5 word1@6 word2@9", 3),
        lambda led: led.prefix("prefix gap", 1, "word0 word2 "),
        lambda led: led.prefix("prefix doubled", 1, "word0 word0 word1"),
        lambda led: led.prefix("prefix two terminals", 2, "word0 "),
    ]
    for case in cases:
        ledger = Ledger()
        case(ledger)
        assert len(ledger.losses) == 1, ledger.losses


async def test_mock_stamps_each_word_when_it_sends_it(provider: Provider) -> None:
    before = time.time_ns()
    stream = await one_stream(provider.url, script(say=50, delay_ms=1, stamp=True))
    after = time.time_ns()
    assert stream.finished
    ledger = Ledger()
    ledger.stamped("stamped stream", 1, stream.content, 50)
    assert ledger.losses == []
    stamps = [int(w.partition("@")[2]) for w in stream.content.split(" ")]
    assert stamps == sorted(stamps)
    assert before <= stamps[0] and stamps[-1] <= after
    # Paced at 1 ms: the words were stamped as they went out, not all at once.
    assert stamps[-1] - stamps[0] >= 49 * 1_000_000


def test_sandbox_rows_check_every_turn() -> None:
    """bench/sandbox.py's check of each one-call turn: a 200 whose call succeeded and
    whose content is what the mock said passes; anything else is a loss."""
    import httpx

    from bench.sandbox import _checker

    def answer(status: int, content: str = "ok", error: bool = False) -> httpx.Response:
        return httpx.Response(status, json={"content": content, "toolCalls": [
            {"name": "bash", "isError": error, "durationMs": 3}]})

    ledger = Ledger()
    _checker(ledger)("fine", answer(200))
    assert ledger.losses == [] and ledger.turns == 1
    for bad in (answer(500), answer(200, error=True), answer(200, content="ok ok")):
        ledger = Ledger()
        _checker(ledger)("bad", bad)
        assert len(ledger.losses) == 1, ledger.losses
