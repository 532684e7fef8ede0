"""What `make bench` relies on to fail a run: its ledger catches every kind of loss, and
the mock's `stamp` option writes each word with the time it was sent, in order.

The ledger is the bench's only correctness gate (bench/table.py): a missing or doubled
terminal, a lost, doubled, reordered or altered word must each be a loss. The stamp is
what P2's and P5's latencies are measured from (daemon/mock/script.py `stamp`).
"""

from __future__ import annotations

import time

from bench import realmodel, responses_stream, snapshots, toolcost
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


def test_realmodel_rows_compare_each_way_with_the_server_direct() -> None:
    def run(rate: float, ttft: float) -> realmodel.Run:  # 101 deltas over 100/rate s
        return realmodel.Run(ttft=ttft, tokens=101, first=1.0, last=1.0 + 100 / rate)

    got = {"direct": [run(60, 0.100), run(50, 0.300), run(70, 0.200)],
           "sse": [run(58, 0.210), run(57, 0.205), run(59, 0.250)],
           "v1": [run(40, 0.400), run(45, 0.500), run(41, 0.450)]}
    rows = realmodel.rows_of(got, 30.0, 1500.0)
    (sse, v1, sse_ttft, v1_ttft, cpu) = rows
    assert (sse.figure, sse.bare, sse.ratio, sse.holds) == ("58.0", "60.0", "0.97", True)
    assert (v1.figure, v1.ratio, v1.holds) == ("41.0", "0.68", False)
    assert (sse_ttft.figure, sse_ttft.bare, sse_ttft.ratio, sse_ttft.holds) == (
        "210", "200", "+10 ms", True)
    assert v1_ttft.holds is False
    assert (cpu.figure, cpu.bare, cpu.ratio, cpu.holds) == ("30", "1500", "0.020", None)
    assert realmodel.Run(tokens=1, first=2.0, last=2.0).rate == 0.0  # one delta: no rate


def test_responses_rows_hold_within_ten_percent() -> None:
    rate, cpu = responses_stream.rows_of((9_500.0, 20.0), (10_000.0, 19.0))
    assert (rate.ratio, rate.holds, cpu.ratio, cpu.holds) == ("0.95", True, "1.05", True)
    rate, cpu = responses_stream.rows_of((8_000.0, 25.0), (10_000.0, 20.0))
    assert (rate.holds, cpu.holds) == (False, False)


def test_toolcost_rows_put_each_way_beside_no_sandbox() -> None:
    got = {toolcost.BARE: [(2.0, 1.0), (4.0, 1.0), (3.0, 1.0)],
           toolcost.BRANCH_NONE: [(20.0, 18.0)] * 3,
           toolcost.BRANCH_BOX: [(27.0, 21.0)] * 3,
           toolcost.MAIN_BOX: [(30.0, 22.0)] * 3}
    rows = toolcost.rows_of(got, "rlimit")
    assert [(r.figure, r.bare, r.ratio) for r in rows] == [
        ("27.0", "3.0", "9.0x"), ("21.0", "1.0", "21.0x"),
        ("20.0", "3.0", "6.7x"), ("18.0", "1.0", "18.0x"),
        ("27.0", "30.0", "0.9x"), ("21.0", "22.0", "1.0x")]
    assert rows[0].note == "limits by rlimit" and all(r.holds is None for r in rows)
    no_bwrap = toolcost.rows_of({toolcost.BARE: got[toolcost.BARE],
                                 toolcost.BRANCH_NONE: got[toolcost.BRANCH_NONE]}, "rlimit")
    assert len(no_bwrap) == 3 and no_bwrap[-1].figure == "no bwrap"


def test_snapshot_rows_hold_per_turn_and_compare_starts() -> None:
    m = snapshots.Measured(
        first_s=7.0, first_disk=100 * 1024 * 1024,
        source=snapshots.Turns([0.030, 0.040, 0.090], [8192, 12288, 4096]),
        binary=snapshots.Turns([0.045, 0.060, 0.055], [122880] * 3), restore_s=0.7)
    rows = snapshots.rows_of(m, [0.013, 0.015, 0.011], [0.003, 0.004, 0.002],
                             {"one file back": 0.5})
    first, store, src_t, src_d, bin_t, bin_d, start, restore, rewound = rows
    assert (first.figure, store.figure, first.holds) == ("7000", "100.0 MB", None)
    assert (src_t.figure, src_t.holds, src_d.figure, src_d.holds) == ("40", True, "8 KB", True)
    assert (bin_t.figure, bin_t.holds, bin_d.figure, bin_d.holds) == ("55", False, "120 KB", None)
    assert (start.figure, start.bare, start.ratio) == ("13", "3", "+10 ms")
    assert (restore.figure, rewound.figure) == ("700", "500")
    assert "one file back" in rewound.name
    assert len(snapshots.rows_of(m, [], [], {})) == 7  # no turn starts, no rewinds
