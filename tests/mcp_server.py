"""A real MCP server for the tests, written with the `mcp` SDK (FastMCP).

    python tests/mcp_server.py stdio          served on stdin/stdout (the daemon starts it)
    python tests/mcp_server.py http           Streamable HTTP on 127.0.0.1, port 0; prints
                                              "port N" on stdout once it listens

Environment: MCP_TEST_RECORD (a file each cancellation the server receives, and each
start, is appended to), MCP_TEST_START_DELAY (seconds to wait before serving: a slow
start), MCP_TEST_FAIL_START (exit 3 at once: a server that cannot start), MCP_TEST_FAIL_IF_EXISTS
(exit 3 at once if that file exists: a server whose restarts fail), MCP_TEST_ECHO
(any value: reported by the `where` tool with the cwd), MCP_TEST_GARBAGE (that many
non-JSON lines written to stdout before serving), MCP_TEST_COLLIDE (any value: two more
tools, `a.b` and `a_b`, whose names are one after mangling), MCP_TEST_TASKS (any value:
two more tools whose `execution.taskSupport` is "required" and "optional"),
MCP_TEST_REFUSE_INIT (stdio: answer `initialize` with a JSON-RPC error of that message
and stay up until stdin closes: a live server that refuses the daemon),
MCP_TEST_STALL_PING (http: the first ping that arrives while a `tools/call` is running
is answered that many seconds late, once; "ping stalled" / "ping released" recorded;
the `outlast_stall` tool reports progress until then), MCP_TEST_HANG_PINGS (http, any
value: no ping is ever answered; "ping held" recorded for each), MCP_TEST_FILES (any
value: one more tool, `look`, that lists a directory or reads a file, and says HOME). The `get_env`
tool (like server-everything's `get-env`) returns the whole environment it was started
with.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import anyio
from mcp import types
from mcp.server.fastmcp import Context, FastMCP

RECORD = os.environ.get("MCP_TEST_RECORD")


def record(line: str) -> None:
    if RECORD:
        with open(RECORD, "a") as f:
            f.write(line + "\n")


class TestServer(FastMCP):
    async def list_tools(self) -> list[types.Tool]:
        # FastMCP has no way to declare `execution`: set it on the listed tools.
        return [tool.model_copy(update={"execution": TASKS.get(tool.name)})
                for tool in await super().list_tools()]


TASKS: dict[str, types.ToolExecution] = {}
app = TestServer("testsrv")


@app.tool()
async def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@app.tool()
async def steps(count: int, ctx: Context, pause_s: float = 0) -> str:
    """Report `count` progress steps (`pause_s` apart), then finish."""
    for i in range(count):
        if i and pause_s:
            await anyio.sleep(pause_s)
        await ctx.report_progress(i + 1, count, f"step {i + 1} of {count}")
    return f"did {count} steps"


@app.tool()
async def hold(tag: str, ctx: Context) -> str:
    """Report one progress step, then wait until cancelled (records the cancellation)."""
    await ctx.report_progress(1, None, f"holding {tag}")
    try:
        await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        record(f"cancelled {tag}")
        raise
    return "unreachable"


@app.tool()
async def refuse(reason: str) -> str:
    """Fail with `reason` (an isError result)."""
    raise ValueError(reason)


@app.tool()
async def crash() -> str:
    """Exit the server process mid-call."""
    os._exit(7)


@app.tool()
async def where() -> str:
    """The server's cwd and MCP_TEST_ECHO."""
    return f"cwd={os.getcwd()} echo={os.environ.get('MCP_TEST_ECHO', '')}"


@app.tool()
async def big(size: int) -> str:
    """A text result of `size` bytes: "0123456789" repeated, then cut."""
    return ("0123456789" * (size // 10 + 1))[:size]


@app.tool()
async def spawn_setsid() -> str:
    """Start a `sleep` in a new session (out of the server's process group); its pid is
    recorded as "grandchild PID" and returned."""
    child = subprocess.Popen(["setsid", "sleep", "300"], stdin=subprocess.DEVNULL,  # noqa: ASYNC220  # noqa: ASYNC220
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record(f"grandchild {child.pid}")
    return str(child.pid)


@app.tool()
async def spawn_escapee(marker: str, crash: bool = False) -> str:
    """Start a process that leaves the server's tree by a double fork (`setsid -f`: the
    forking `setsid` exits at once, so the process is orphaned, in a session of its own)
    with `marker` in its argv; recorded as "escapee MARKER". Then exit the server with
    code 9 when `crash`."""
    subprocess.run(["setsid", "-f", sys.executable, "-c",  # noqa: ASYNC221
                    "import time; time.sleep(300)", marker],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True)
    record(f"escapee {marker}")
    if crash:
        os._exit(9)
    return marker


STALL_PING = float(os.environ.get("MCP_TEST_STALL_PING") or 0)
HANG_PINGS = bool(os.environ.get("MCP_TEST_HANG_PINGS"))
calls_running = 0
stall_over: anyio.Event | None = None


async def outlast_stall(ctx: Context) -> str:
    """Report progress every 0.2 s until a stalled ping (MCP_TEST_STALL_PING) was
    answered, then finish."""
    global stall_over
    if stall_over is None:
        stall_over = anyio.Event()
    step = 0
    while not stall_over.is_set():
        step += 1
        await ctx.report_progress(step, None, f"still here {step}")
        with anyio.move_on_after(0.2):
            await stall_over.wait()
    return "outlasted the stalled ping"


def stalling_pings(inner: Any) -> Any:
    """ASGI middleware: holds the first ping POSTed while a tool call runs (once), or
    every ping (MCP_TEST_HANG_PINGS)."""
    stalled = False

    async def app_(scope: Any, receive: Any, send: Any) -> None:
        nonlocal stalled
        global calls_running, stall_over
        if scope["type"] != "http" or scope["method"] != "POST":
            await inner(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        method = json.loads(body or b"{}").get("method") if body.startswith(b"{") else None
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if method == "ping" and HANG_PINGS:
            record("ping held")
            await anyio.sleep_forever()
        if method == "ping" and calls_running and not stalled:
            stalled = True
            record("ping stalled")
            await anyio.sleep(STALL_PING)
            record("ping released")
            if stall_over is None:
                stall_over = anyio.Event()
            stall_over.set()
        if method == "tools/call":
            calls_running += 1
            try:
                await inner(scope, replay, send)
            finally:
                calls_running -= 1
            return
        await inner(scope, replay, send)

    return app_


def refuse_initialize(message: str) -> None:
    """A live stdio server that answers `initialize` with an error, until stdin ends."""
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if request.get("method") == "initialize":
            sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": request["id"], "error": {
                "code": -32602, "message": message}}) + "\n")
            sys.stdout.flush()


def started_environment() -> dict[str, str]:
    """The environment this process was started with (/proc/self/environ where there is
    one: Python may add LC_CTYPE to os.environ itself, PEP 538)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environ)
    pairs = (item.decode("utf-8", "surrogateescape").partition("=")
             for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


@app.tool()
async def get_env() -> str:
    """The environment the server was started with, names and values, as JSON."""
    return json.dumps(started_environment(), sort_keys=True)


@app.tool()
async def grow(ctx: Context) -> str:
    """Add a tool named `grown` and tell the client the tool list changed."""

    async def grown() -> str:
        """A tool that was not there at first."""
        return "grown here"

    app.add_tool(grown, name="grown")
    await ctx.session.send_tool_list_changed()
    return "grew"


if os.environ.get("MCP_TEST_FILES"):
    @app.tool()
    async def look(path: str) -> str:
        """What the server sees at `path`: a directory's names, a file's text, or the
        error; then its HOME."""
        try:
            seen = (" ".join(sorted(os.listdir(path))) if os.path.isdir(path)  # noqa: ASYNC240
                    else open(path).read())  # noqa: ASYNC230 (a test server)
        except OSError as exc:
            seen = f"error: {exc.strerror}"
        return f"{seen}\nHOME={os.environ.get('HOME')}"


@app.tool(name="odd.name with spaces")
async def odd() -> str:
    """A tool whose name the model cannot use as is."""
    return "odd"


def optional_tools() -> None:
    if os.environ.get("MCP_TEST_COLLIDE"):
        async def dotted() -> str:
            """The tool named a.b."""
            return "dotted"

        async def underscored() -> str:
            """The tool named a_b."""
            return "underscored"

        app.add_tool(dotted, name="a.b")
        app.add_tool(underscored, name="a_b")
    if os.environ.get("MCP_TEST_TASKS"):
        async def needs_task() -> str:
            """Runs only as an MCP task."""
            return "as a task"

        async def may_task() -> str:
            """Runs as a task or not."""
            return "either way"

        app.add_tool(needs_task, name="needs_task")
        app.add_tool(may_task, name="may_task")
        TASKS["needs_task"] = types.ToolExecution(taskSupport="required")
        TASKS["may_task"] = types.ToolExecution(taskSupport="optional")
    if STALL_PING:
        app.add_tool(outlast_stall, name="outlast_stall")


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "stdio"
    optional_tools()
    garbage = int(os.environ.get("MCP_TEST_GARBAGE") or 0)
    for i in range(garbage):  # a server that logs to stdout: not JSON-RPC
        sys.stdout.write(f"debug: starting up, line {i} of {garbage} (not JSON-RPC)\n")
    sys.stdout.flush()
    marker = os.environ.get("MCP_TEST_FAIL_IF_EXISTS")
    if os.environ.get("MCP_TEST_FAIL_START") or (marker and os.path.exists(marker)):
        print("cannot start: MCP_TEST_FAIL_START is set", file=sys.stderr)
        sys.exit(3)
    record(f"start pid={os.getpid()} pgid={os.getpgid(0)}")
    delay = float(os.environ.get("MCP_TEST_START_DELAY") or 0)
    if delay:
        time.sleep(delay)
    refusal = os.environ.get("MCP_TEST_REFUSE_INIT")
    if mode == "stdio" and refusal:
        refuse_initialize(refusal)
        return
    if mode == "stdio":
        app.run("stdio")
        return
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    asgi = app.streamable_http_app()
    config = uvicorn.Config(stalling_pings(asgi) if STALL_PING or HANG_PINGS else asgi,
                            log_level="warning",
                            # held pings would hold a graceful shutdown for ever
                            timeout_graceful_shutdown=1 if HANG_PINGS else None)
    server = uvicorn.Server(config)
    print(f"port {sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
