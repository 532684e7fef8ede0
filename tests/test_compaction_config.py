"""CONTRACT §15's settings: defaults, what is refused (file and key named), and where the
summarising call goes (`compact_model`) against a real daemon and mock provider."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import load_config
from daemon.errors import ConfigError
from tests.harness import Provider, mock, open_daemon
from tests.test_cli import cli, out

BASE = ("[providers.p]\ntype = \"mock\"\n[providers.q]\ntype = \"mock\"\n"
        "[providers.other]\ntype = \"anthropic\"\n")


def load(tmp: Path, agent: str) -> object:
    path = tmp / "daemon.toml"
    path.write_text(BASE + "[agents.a]\nprovider = \"p\"\nmodel = \"m\"\n" + agent)
    return load_config(path).agents["a"]


def test_defaults(tmp_path: Path) -> None:
    a = load(tmp_path, "")
    assert (a.context_tokens, a.compact_at, a.compact_keep_tokens, a.compact_model) == (  # type: ignore[attr-defined]
        128_000, 0.8, 32_000, None)
    a = load(tmp_path, "context_tokens = 32000\n")
    assert a.compact_keep_tokens == 8000  # type: ignore[attr-defined]


@pytest.mark.parametrize(("agent", "model"), [
    ('compact_model = "q:small"\n', ("q", "small")),
    ('compact_model = "q"\n', ("q", "m")),
    ('compact_model = "tiny"\n', ("p", "tiny")),
    ('compact_model = "gpt:4o"\n', ("p", "gpt:4o")),  # not a provider: a model name
])
def test_compact_model_forms(tmp_path: Path, agent: str, model: tuple[str, str]) -> None:
    assert load(tmp_path, agent).compact_model == model  # type: ignore[attr-defined]


@pytest.mark.parametrize(("agent", "key"), [
    ("context_tokens = -1\n", "context_tokens"),
    ("compact_at = 0\n", "compact_at"),
    ("compact_at = 1.5\n", "compact_at"),
    ("compact_at = true\n", "compact_at"),
    ("context_tokens = 1000\ncompact_keep_tokens = 800\n", "compact_keep_tokens"),
    ('compact_model = ""\n', "compact_model"),
    ('compact_model = "q:"\n', "compact_model"),
    ('compact_model = "other:claude"\n', "compact_model"),  # speaks another engine's API
])
def test_refused(tmp_path: Path, agent: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, agent)
    assert info.value.key == f"agents.a.{key}"


def test_claude_cli_keeps_its_own_context(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text("[agents.c]\nengine = \"claude-cli\"\ncontext_tokens = 1000\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "agents.c.context_tokens"
    assert "keeps its own context" in str(info.value)
    path.write_text("[agents.c]\nengine = \"claude-cli\"\n")
    assert load_config(path).agents["c"].context_tokens == 0


AGENT = """
[agents.cheap]
engine = "openai"
provider = "mock"
model = "main-model"
tools = []
compact_model = "summary-model"
"""


async def test_the_summarising_call_goes_to_compact_model(tmp_path: Path,
                                                          provider: Provider) -> None:
    async with open_daemon(tmp_path, provider, extra=AGENT) as d:
        first = (await d.chat("a long story " * 50 + mock(say="ok"), agent="cheap")).json()
        sid = first["sessionId"]
        await d.chat(mock(say="more"), agent="cheap", sessionId=sid)
        r = await d.http.post(f"/sessions/{sid}/compact")
        assert r.status_code == 200, r.text
        summarising = [s for s in provider.served if s.compaction]
        assert [s.model for s in summarising] == ["summary-model"]
        assert r.json()["model"] == "summary-model"  # the compact turn's only call
        assert r.json()["session"]["model"] == "main-model"
        # Nothing new to summarise: said so.
        assert "nothing needed summarising" in out(await cli("compact", sid, url=d.url))
        # `veild compact` does it from the CLI, and `show` lists both summaries.
        await d.chat(mock(say="even more"), agent="cheap", sessionId=sid)
        p = await cli("compact", sid, url=d.url)
        assert f"{sid}: compacted in turn" in out(p)
        shown = out(await cli("show", sid, url=d.url))
        assert shown.count("[summary of the first") == 2
        # The agent's own calls stayed on its model.
        assert {s.model for s in provider.served if not s.compaction} == {"main-model"}
