"""CONTRACT §14.1 in the CLI, run as `python -m daemon …` against the scripted provider
as a real HTTP server (and a real daemon for `veild chat`):

- `veild doctor` asks each Chat Completions provider for `{base_url}/models`: a
  base_url without `/v1` that answers 404 where `…/v1/models` answers fails, naming
  the URL meant ("did you mean …/v1?");
- it reports the window the server says (llama.cpp's `/props` n_ctx, else `/v1/models`'
  `max_model_len`) and warns about an agent whose `context_tokens` is larger (a
  warning: doctor still passes); an agent that fits says so;
- what an MCP server's SDK logs (its INFO "Processing request of type …") is not in
  doctor's output, stdout or stderr;
- `veild chat` prints a terminal error's message after its line, and a `done` whose
  answer was cut at the limit says "cut off".
The same doctor checks against a real llama-cpp-python server are in
tests/test_real_model_server.py.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest
import trio

from daemon.mock.provider import serve_mock_provider
from tests.harness import Running, mock
from tests.test_cli import cli

SERVER = Path(__file__).parent / "mcp_server.py"


@pytest.fixture
async def windowed() -> AsyncIterator[str]:
    """The scripted provider's root URL (no /v1), saying a window of 4096 tokens."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_mock_provider, window_tokens=4096))
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


def config(tmp_path: Path, base_url: str, *, more: str = "") -> Path:
    path = tmp_path / "daemon.toml"
    path.write_text(f"""
[server]
data_dir = "{tmp_path / 'data'}"
sandbox = "none"

[providers.local]
type = "openai"
base_url = "{base_url}"

[agents.big]
engine = "openai"
provider = "local"
model = "mock-1"

[agents.fits]
engine = "openai"
provider = "local"
model = "mock-1"
context_tokens = 4096
{more}""")
    return path


def lines_of(p: trio.CompletedProcess[bytes]) -> list[str]:
    return p.stdout.decode().splitlines()


async def test_doctor_reports_the_window_and_warns_about_a_larger_context(
        tmp_path: Path, windowed: str) -> None:
    p = await cli("doctor", "--config", str(config(tmp_path, f"{windowed}/v1")))
    lines = lines_of(p)
    assert p.returncode == 0, lines
    [provider] = [x for x in lines if x.startswith("provider local (")]
    assert provider.endswith(f"ok: window 4096 tokens ({windowed}/props n_ctx)"), provider
    [big] = [x for x in lines if x.startswith("agent big: ")]
    assert big.startswith("agent big: context_tokens: WARNING: context_tokens = 128000 is "
                          "larger than the window 4096"), big
    assert "set context_tokens = 4096" in big
    [fits] = [x for x in lines if x.startswith("agent fits: ")]
    assert fits.startswith("agent fits: context_tokens: ok: context_tokens = 4096 fits"), fits
    assert lines[-1] == "doctor: all checks passed"


async def test_doctor_names_the_v1_a_base_url_lacks(tmp_path: Path, windowed: str) -> None:
    p = await cli("doctor", "--config", str(config(tmp_path, windowed)))
    lines = lines_of(p)
    assert p.returncode == 1, lines
    [provider] = [x for x in lines if x.startswith("provider local (")]
    assert f"GET {windowed}/models answers 404" in provider, provider
    assert f"did you mean {windowed}/v1?" in provider, provider
    assert lines[-1] == f"doctor: 1 failed: provider local ({windowed})"


async def test_doctor_keeps_an_mcp_sdks_log_lines_out(tmp_path: Path, windowed: str) -> None:
    mcp = (f'\n[mcp.good]\ncommand = "{sys.executable}"\nargs = ["{SERVER}", "stdio"]\n'
           f'env = {{ MCP_TEST_RECORD = "{tmp_path / "record"}" }}\n')
    p = await cli("doctor", "--config", str(config(tmp_path, f"{windowed}/v1", more=mcp)),
                  VEILD_LOG="INFO")
    out, err = p.stdout.decode(), p.stderr.decode()
    assert p.returncode == 0, out + err
    assert any(x.startswith("mcp good (") and ": ok: 12 tool(s)" in x
               for x in out.splitlines()), out
    for text in (out, err):
        assert "Processing request" not in text and "ListToolsRequest" not in text, text
        assert "INFO" not in text, text


# -- veild chat --------------------------------------------------------------------------


async def test_chat_prints_the_terminals_message(daemon: Running) -> None:
    p = await cli("chat", "assistant", mock(say="half a story", noFinish=True),
                  "--url", daemon.url, VEILD_LOG="ERROR")
    assert p.returncode == 1
    last = lines_of(p)[-1]
    assert last.startswith("[error PROVIDER_ERROR session="), last
    message = last.split("] ", 1)[1]
    assert "without a finish reason" in message and "cut short" in message, last


async def test_chat_says_cut_off(daemon: Running) -> None:
    p = await cli("chat", "assistant", mock(say="once upon", finish="length"),
                  "--url", daemon.url, VEILD_LOG="ERROR")
    assert p.returncode == 0, p.stderr.decode()
    last = lines_of(p)[-1]
    assert last.startswith("[done (cut off) session="), last
