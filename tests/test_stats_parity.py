"""CONTRACT §5.5 — stats parity: `done`, `chat.response` and the JSON result agree on
iterations and tokenUsage; input/output are the sums the provider reported; `model` is
the model the provider's stream named (not the configured one)."""

from __future__ import annotations

from tests.harness import Provider, Running, mock, open_recorder


async def test_stats_agree_with_provider(daemon: Running, provider: Provider) -> None:
    script = mock(model="provider-named-7", calls=[
        {"say": 12, "tools": [{"name": "bash", "arguments": {"command": "echo x"}}]},
        {"think": 4, "say": 9},
    ])
    async with open_recorder(daemon.ws_url) as rec:
        before = len(provider.served)
        r = await daemon.chat(script)
        body = r.json()
        done = await rec.terminal(body["turnId"])
        response = await rec.wait_for(lambda evs: next(
            (e for e in evs if e["type"] == "chat.response"
             and e["sessionId"] == body["sessionId"]), None))
    served = provider.served[before:]
    assert len(served) == 2
    expected_in = sum(s.usage["prompt_tokens"] for s in served if s.usage)
    expected_out = sum(s.usage["completion_tokens"] for s in served if s.usage)
    for usage in (body["tokenUsage"], done["data"]["tokenUsage"],
                  response["event"]["tokenUsage"]):
        assert (usage["input"], usage["output"]) == (expected_in, expected_out)
    assert body["iterations"] == done["data"]["iterations"] == response["event"]["iterations"] == 2
    assert body["model"] == done["data"]["model"] == "provider-named-7"
    assert body["toolCalls"] == done["data"]["toolCalls"]
    assert body["session"]["tokenUsage"]["input"] == expected_in


async def test_stats_agree_with_retries_in_the_mix(daemon: Running, provider: Provider) -> None:
    """CONTRACT §14 inside §5.5: each of the two calls fails twice before it answers
    (a 503, then an overloaded error event); the failed attempts report no usage, so
    the sums are the answered calls', and `iterations` counts calls, not attempts."""
    script = mock(model="provider-named-8", key="stats-retries",
                  fail=[{"status": 503, "retryAfterMs": 1}, {"errorEvent": "overloaded"}],
                  calls=[
                      {"say": 7, "tools": [{"name": "bash", "arguments": {"command": "true"}}]},
                      {"say": 5},
                  ])
    async with open_recorder(daemon.ws_url) as rec:
        before = len(provider.served)
        r = await daemon.chat(script)
        body = r.json()
        done = await rec.terminal(body["turnId"])
        response = await rec.wait_for(lambda evs: next(
            (e for e in evs if e["type"] == "chat.response"
             and e["sessionId"] == body["sessionId"]), None))
        retried = [e for e in rec.stream(body["turnId"]) if e["eventType"] == "provider.retry"]
    served = provider.served[before:]
    assert [s.fault is not None for s in served] == [True, True, False] * 2
    assert len(retried) == 4
    expected_in = sum(s.usage["prompt_tokens"] for s in served if s.usage)
    expected_out = sum(s.usage["completion_tokens"] for s in served if s.usage)
    assert expected_in > 0 and expected_out > 0
    for usage in (body["tokenUsage"], done["data"]["tokenUsage"],
                  response["event"]["tokenUsage"]):
        assert (usage["input"], usage["output"]) == (expected_in, expected_out)
    assert body["iterations"] == done["data"]["iterations"] == response["event"]["iterations"] == 2
    assert body["model"] == done["data"]["model"] == "provider-named-8"
