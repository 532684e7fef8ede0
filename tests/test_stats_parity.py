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
