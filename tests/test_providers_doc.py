"""docs/providers.md's configurations are real: every TOML block in it loads as a
veild config (each provider and agent valid, CONTRACT §2), and the llama-cpp-python
one says what the suite's real-server tests run (max_concurrent = 1, a context_tokens
and a max_output_tokens)."""

from __future__ import annotations

import re
from pathlib import Path

from daemon.config import load_config

DOC = Path(__file__).parent.parent / "docs" / "providers.md"
BLOCK = re.compile(r"```toml\n(.*?)```", re.DOTALL)


def _blocks() -> list[str]:
    return BLOCK.findall(DOC.read_text())


def test_every_toml_block_loads(tmp_path: Path) -> None:
    blocks = _blocks()
    assert len(blocks) == 4
    for i, block in enumerate(blocks):
        path = tmp_path / f"block{i}.toml"
        path.write_text(f'[server]\ndata_dir = "{tmp_path / "data"}"\n{block}')
        config = load_config(path)
        for agent in config.agents.values():
            assert agent.context_tokens < 128_000  # each says its server's window
            assert agent.max_output_tokens > 0


def test_the_llama_cpp_python_block_is_what_the_suite_runs(tmp_path: Path) -> None:
    [block] = [b for b in _blocks() if "llamacpppy" in b]
    path = tmp_path / "daemon.toml"
    path.write_text(block)
    config = load_config(path)
    assert config.providers["llamacpppy"].max_concurrent == 1
    assert config.providers["llamacpppy"].base_url.endswith("/v1")
