"""CONTRACT §14, the answer ends at its end: `data: [DONE]` (Chat Completions) or
`message_stop` (Messages) completes the LLM call at once, whatever the server does with
the body after it — for both engines (openai, anthropic) and both transports (lean,
httpx), through a real daemon:
- a body held open after the end, with keep-alive comments (`: ping`) or silent, ends
  the turn `done` with the whole answer and no error, with a stall_timeout_s (3 s) that
  the body outlives (held until the client goes away), also when the held call is the
  first of two in a turn (the turn goes on to its tool and the next call);
- that connection is then closed, not pooled half-read (the next turn comes on a new
  one), while a body that ends cleanly — in the same write as the end or a segment
  later — leaves its connection to the next turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests import rawprovider as raw
from tests.harness import (
    Provider,
    Running,
    assert_one_terminal_last,
    mock,
    open_daemon,
    open_recorder,
)
from tests.rawprovider import open_raw_provider

STALL_S = 3

AGENTS = """
[providers.messages]
type = "anthropic"
base_url = "{root}"
transport = "{transport}"
stall_timeout_s = {stall}

[agents.openai]
engine = "openai"
provider = "mock"
model = "held-model"
tools = ["bash"]

[agents.anthropic]
engine = "anthropic"
provider = "messages"
model = "held-claude"
tools = ["bash"]
"""

RAW_AGENTS = """
[providers.raw]
type = "openai"
base_url = "{url}"
transport = "{transport}"
stall_timeout_s = {stall}

[providers.rawmessages]
type = "anthropic"
base_url = "{root}"
transport = "{transport}"
stall_timeout_s = {stall}

[agents.openai]
engine = "openai"
provider = "raw"
model = "m1"

[agents.anthropic]
engine = "anthropic"
provider = "rawmessages"
model = "m2"
"""


@pytest.fixture(params=["lean", "httpx"])
def transport(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


ENGINES = pytest.mark.parametrize("agent", ["openai", "anthropic"])


async def _turn(daemon: Running, agent: str, message: str) -> tuple[dict[str, Any],
                                                                    list[dict[str, Any]]]:
    """One JSON chat: its answer and its session.stream events (from /ws)."""
    async with open_recorder(daemon.ws_url) as rec:
        r = await daemon.chat(message, agent=agent)
        body: dict[str, Any] = r.json()
        turn_id = body.get("turnId") or body["error"]["details"]["turnId"]
        await rec.terminal(turn_id)
        stream = rec.stream(turn_id)
    assert r.status_code == 200, r.text
    return body, stream


def _done_without_error(stream: list[dict[str, Any]]) -> dict[str, Any]:
    terminal = assert_one_terminal_last(stream)
    assert terminal["eventType"] == "done", terminal
    assert not [e for e in stream if e["eventType"] == "error"]
    return terminal


@ENGINES
async def test_a_body_held_open_after_the_end_ends_the_turn_at_once(
    tmp_path: Path, provider: Provider, agent: str, transport: str
) -> None:
    extra = AGENTS.format(root=provider.url.removesuffix("/v1"), transport=transport,
                          stall=STALL_S)
    keys = f'transport = "{transport}"\nstall_timeout_s = {STALL_S}'
    async with open_daemon(tmp_path, provider, extra=extra, provider_keys=keys) as daemon:
        body, stream = await _turn(daemon, agent, mock(say="held answer", holdOpen=True))
        assert body["content"] == "held answer"
        terminal = _done_without_error(stream)
        assert terminal["data"]["iterations"] == 1
        # The held call first, its tool, then a second held call: the turn goes on.
        body, stream = await _turn(daemon, agent, mock(holdOpen=True, calls=[
            {"tools": [{"name": "bash", "arguments": {"command": "echo out"}}]},
            {"say": "after the tool"}]))
        assert body["content"] == "after the tool"
        terminal = _done_without_error(stream)
        assert terminal["data"]["iterations"] == 2
        results = [e["data"]["content"] for e in stream if e["eventType"] == "tool.result"]
        assert len(results) == 1 and results[0].startswith("out\n")
    held = [s for s in provider.served if s.model.startswith("held")]
    assert len(held) == 3 and all(s.fault is None for s in held)


@ENGINES
@pytest.mark.parametrize(("behaviour", "content", "reused"), [
    (raw.held_open_with_pings, "held", False),
    (raw.held_open_silent, "held", False),
    (raw.end_in_a_write_of_its_own, "apart", True),
    (raw.ok, "fine", True),
])
async def test_only_a_body_read_to_its_end_leaves_its_connection(
    tmp_path: Path, provider: Provider, agent: str, transport: str,
    behaviour: raw.Behaviour, content: str, reused: bool,
) -> None:
    async with open_raw_provider() as rawp:
        rawp.plan = [behaviour]
        extra = RAW_AGENTS.format(url=rawp.url, root=rawp.url.removesuffix("/v1"),
                                  transport=transport, stall=STALL_S)
        async with open_daemon(tmp_path, provider, extra=extra) as daemon:
            body, stream = await _turn(daemon, agent, "hello")
            assert body["content"] == content
            _done_without_error(stream)
            body, stream = await _turn(daemon, agent, "again")
            assert body["content"] == "fine"
            _done_without_error(stream)
        assert len(rawp.targets) == 2
        assert rawp.connections == (1 if reused else 2)
