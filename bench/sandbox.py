"""What the bubblewrap sandbox of a bash call costs (issue 22, CONTRACT §16), as rows
S1-S4; in these rows the "bare client" column is the same thing unsandboxed (S3: the
sandboxed bash call, beside the MCP call).

One daemon (`veild serve`, `[server] sandbox = "bwrap"`, the in-process mock provider,
the notes MCP server of bench/mcp_call.py) with two agents: `bench` (sandboxed, bash and
mcp:notes) and `open` (`sandbox = false`). Its data dir is under var/, not /tmp, so the
sandbox hides it as it would /var/lib/veild (nothing under the host's /tmp is mounted
over: the sandbox's /tmp is private anyway).

  S1  one-call turns, each a new session with one `bash` running `true`: sandboxed,
      unsandboxed, and issue 11's MCP call (`notes__list_notes`), interleaved (one of
      each in turn, so the machine's noise falls on each alike), 200 of each: the call's
      durationMs (call → result, as the daemon timed it) and the whole chat round trip
      (POST → JSON answer), median and p90.
  S3  the MCP call of S1 beside the sandboxed bash call (bench/mcp_call.py's figure).
  S2  50 chats at once, each a new session whose one answer runs one `bash` `true` (bash
      calls within one answer run one after another, so the 50 are 50 sessions):
      wall time from the first POST to the last answer, and each call's durationMs;
      sandboxed and unsandboxed batches alternate (A B B A …), 6 of each after one of
      each that is not counted; wall: median of the 6, per call: median and p90 of 300.
  S4  whole processes, no daemon: the four ways of running `bash -c true` that differ
      in the supervisor (daemon/toolproc/supervise.py) and bubblewrap, with bubblewrap's
      arguments from daemon.toolproc.sandbox.Sandbox.wrap for a workspace of this daemon's
      config (hidden_paths of it), i.e. exactly what the daemon runs:
        supervise.py bwrap ARGS -- bash -c true   (what the daemon ships)
        bwrap ARGS -- bash -c true                (the PID namespace alone)
        supervise.py bash -c true                 (sandbox = false)
        bash -c true
      and, for scale, `python -I -S -c pass` (the supervisor's interpreter starting);
      each posix_spawn'ed with the tool environment and /dev/null for stdio, timed to
      its wait4 (wall, and its user+sys CPU with its reaped descendants'); 300 rounds,
      the five in each round in a rotating order; medians.

Every S1 and S2 turn is checked (answer 200, the call not an error, the content the mock
sent); before measuring, one turn per agent checks that the sandboxed bash does not see
the config file and the unsandboxed one does, so the rows measure what they say.
`python -m bench.sandbox` runs only these rows (about two minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import trio

from bench.mcp_call import (
    BASH_TRUE,
    MCP_CALL,
    ROOT,
    Timings,
    chat,
    interleaved,
    median,
    open_daemon,
    p90,
    script,
)
from bench.table import Ledger, Row, bench_header, print_report
from daemon.config import load_config
from daemon.toolproc.sandbox import Sandbox, empty_file, hidden_paths

S1_RUNS = 200
S2_SESSIONS = 50
S2_ROUNDS = 6
S4_ROUNDS = 300
SERVER = 'sandbox = "bwrap"\n'
OPEN = ('[agents.open]\nengine = "openai"\nprovider = "mock"\nmodel = "m"\n'
        'tools = ["bash"]\nsandbox = false\n')
SANDBOXED, UNSANDBOXED = "bench", "open"


def _checker(ledger: Ledger) -> Callable[[str, httpx.Response], None]:
    """Each one-call turn: answered 200 (the turn's one terminal is `done`), the call
    not an error, the content what the mock said; anything else is one loss."""

    def check(what: str, r: httpx.Response) -> None:
        if r.status_code != 200:
            ledger.turns += 1
            ledger.lost(f"sandbox: {what}: answered {r.status_code}: {r.text[:200]}")
            return
        body = r.json()
        if any(c["isError"] for c in body["toolCalls"]):
            ledger.turns += 1
            ledger.lost(f"sandbox: {what}: the tool call failed: {body['toolCalls']}")
            return
        ledger.check(f"sandbox: {what}", 1, body["content"], "ok")

    return check


async def _confined(http: httpx.AsyncClient, config: Path, ledger: Ledger) -> None:
    """The sandboxed agent's bash does not see the config file; the other one does."""
    probe: dict[str, object] = {"name": "bash", "arguments": {
        "command": f"test -e {config} && echo visible || echo hidden"}}
    message = "probe\n#mock " + json.dumps({"calls": [{"tools": [probe]}]})
    health = (await http.get("/health")).json()
    agents = {a["name"]: a["sandboxed"] for a in (await http.get("/agents")).json()["agents"]}
    if health["sandbox"] != "bwrap" or agents != {SANDBOXED: True, UNSANDBOXED: False}:
        raise RuntimeError(f"not the sandbox this phase measures: {health}, {agents}")
    for agent, expected in ((SANDBOXED, "hidden"), (UNSANDBOXED, "visible")):
        r, _ = await chat(http, agent, message)
        content = r.json().get("content", "")
        ledger.turns += 1
        if r.status_code != 200 or expected not in content:
            ledger.lost(f"sandbox: the {agent} agent's bash did not find the config "
                        f"{expected}: {r.status_code} {content[:200]!r}")


async def _batch(http: httpx.AsyncClient, agent: str, n: int, check: Callable[
        [str, httpx.Response], None], what: str) -> tuple[float, list[float]]:
    """n chats at once, one bash `true` each: (wall ms, each call's durationMs)."""
    message = script(BASH_TRUE)
    calls: list[float] = []

    async def one(i: int) -> None:
        r, _ = await chat(http, agent, message)
        check(f"{what} chat {i}", r)
        calls.append(float(r.json()["toolCalls"][0]["durationMs"]))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return (time.perf_counter() - started) * 1000, calls


async def _concurrent(http: httpx.AsyncClient, check: Callable[[str, httpx.Response], None]
                      ) -> dict[str, tuple[list[float], list[float]]]:
    """Per agent: the wall ms of each batch, and every call's durationMs."""
    out: dict[str, tuple[list[float], list[float]]] = {
        SANDBOXED: ([], []), UNSANDBOXED: ([], [])}
    for agent in out:  # warm: not counted
        await _batch(http, agent, S2_SESSIONS, check, f"{agent} warm batch")
    for round_ in range(S2_ROUNDS):
        order = (SANDBOXED, UNSANDBOXED) if round_ % 2 == 0 else (UNSANDBOXED, SANDBOXED)
        for agent in order:
            wall, calls = await _batch(http, agent, S2_SESSIONS, check,
                                       f"{agent} batch {round_}")
            out[agent][0].append(wall)
            out[agent][1].extend(calls)
    return out


# S4: whole processes.
WAYS = ("supervise+bwrap", "bwrap", "supervise+bash", "bash", "python")
DEVNULL = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
           (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
           (os.POSIX_SPAWN_DUP2, 1, 2)]


def _argvs(config: Path) -> tuple[dict[str, list[str]], Path]:
    """The four command lines, bubblewrap's part as the daemon builds it for a session
    workspace of this config; and that workspace."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise RuntimeError("bwrap is not on PATH (apt-get install bubblewrap)")
    cfg = load_config(config)
    workspace = (cfg.server.data_dir / "workspaces" / "ses_bench_s4").resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    bash = ["bash", "-c", "true"]
    box = Sandbox(bwrap, hidden_paths(cfg), empty=empty_file(cfg.server.data_dir),
                  allow=cfg.server.sandbox_allow, limits=cfg.server.tool_limits)
    sandboxed = box.wrap(bash, workspace, network=False)

    def shipped(confined: bool) -> list[str]:  # the supervisor with the limits (§16.1)
        return box.command(bash, limits=box.limits, workspace=workspace, network=False,
                           confined=confined)

    return {"supervise+bwrap": shipped(True), "bwrap": sandboxed,
            "supervise+bash": shipped(False), "bash": bash,
            "python": [sys.executable, "-I", "-S", "-c", "pass"]}, workspace


def _spawn(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """One whole process: (wall ms to its wait4, its user+sys CPU ms)."""
    started = time.perf_counter()
    pid = os.posix_spawnp(argv[0], argv, env, file_actions=DEVNULL)
    _, status, usage = os.wait4(pid, 0)
    wall = (time.perf_counter() - started) * 1000
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv} exited {os.waitstatus_to_exitcode(status)}")
    return wall, (usage.ru_utime + usage.ru_stime) * 1000


def _processes(argvs: dict[str, list[str]], workspace: Path
               ) -> dict[str, tuple[list[float], list[float]]]:
    """Runs in a worker thread: S4_ROUNDS of each way, the order rotating per round."""
    # The tool environment's shape (daemon/toolproc/env.py): no daemon secrets to carry.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workspace), "TERM": "dumb"}
    out: dict[str, tuple[list[float], list[float]]] = {w: ([], []) for w in WAYS}
    for way in WAYS:  # warm the page cache
        _spawn(argvs[way], env)
    for round_ in range(S4_ROUNDS):
        for k in range(len(WAYS)):
            way = WAYS[(round_ + k) % len(WAYS)]
            wall, cpu = _spawn(argvs[way], env)
            out[way][0].append(wall)
            out[way][1].append(cpu)
    return out


def _ms(values: list[float]) -> str:
    return f"{median(values):.1f}"


def _x(a: list[float], b: list[float]) -> str:
    return f"{median(a) / max(median(b), 0.01):.2f}x"


def _rows(s1: dict[str, Timings], s2: dict[str, tuple[list[float], list[float]]],
          s4: dict[str, tuple[list[float], list[float]]]) -> list[Row]:
    sb, ub, mcp = s1["sandboxed"], s1["unsandboxed"], s1["mcp"]
    (sw, sc), (uw, uc) = s2[SANDBOXED], s2[UNSANDBOXED]
    wall = {w: s4[w][0] for w in WAYS}
    cpu = {w: s4[w][1] for w in WAYS}

    def d(a: str, b: str) -> str:
        return f"{median(wall[a]) - median(wall[b]):+.1f} ms"

    return [
        Row("S1 bash `true` call (durationMs), sandboxed: median ms", _ms(sb.calls),
            _ms(ub.calls), _x(sb.calls, ub.calls),
            note=f"'bare client' column here: the same call unsandboxed (sandbox = false); "
                 f"{S1_RUNS} of each, interleaved with S3's MCP call, a new session each; "
                 f"p90 {p90(sb.calls):.1f} vs {p90(ub.calls):.1f} ms"),
        Row("S1 bash `true` whole chat round trip, sandboxed: median ms", _ms(sb.turns),
            _ms(ub.turns), _x(sb.turns, ub.turns),
            note=f"POST → JSON answer; p90 {p90(sb.turns):.1f} vs {p90(ub.turns):.1f} ms; "
                 f"the sandbox adds {median(sb.turns) - median(ub.turns):+.1f} ms a call"),
        Row(f"S2 {S2_SESSIONS} chats at once, one bash `true` each, sandboxed: wall ms",
            _ms(sw), _ms(uw), _x(sw, uw),
            note=f"first POST → last answer, median of {S2_ROUNDS} alternating batches "
                 f"(sandboxed {', '.join(f'{v:.0f}' for v in sw)}; unsandboxed "
                 f"{', '.join(f'{v:.0f}' for v in uw)})"),
        Row(f"S2 {S2_SESSIONS} at once: each call's durationMs, sandboxed: median ms",
            _ms(sc), _ms(uc), _x(sc, uc),
            note=f"p90 {p90(sc):.1f} vs {p90(uc):.1f} ms ({len(sc)} calls of each)"),
        Row("S3 MCP call (issue 11) beside the sandboxed bash call: median ms",
            _ms(mcp.calls), _ms(sb.calls), _x(mcp.calls, sb.calls),
            note=f"'bare client' column here: S1's sandboxed bash `true`, same run; MCP p90 "
                 f"{p90(mcp.calls):.1f} ms; whole turn {_ms(mcp.turns)} vs {_ms(sb.turns)} "
                 f"ms (unsandboxed bash {_ms(ub.calls)} ms, turn {_ms(ub.turns)})"),
        Row("S4 process: supervise.py + bwrap vs bwrap alone (PID namespace): median ms",
            _ms(wall["supervise+bwrap"]), _ms(wall["bwrap"]),
            _x(wall["supervise+bwrap"], wall["bwrap"]),
            note=f"'bare client' column here: bwrap alone; the supervisor adds "
                 f"{d('supervise+bwrap', 'bwrap')}; CPU (user+sys, with reaped "
                 f"descendants) {_ms(cpu['supervise+bwrap'])} vs {_ms(cpu['bwrap'])} ms; "
                 f"{S4_ROUNDS} rounds of the five ways, rotating order"),
        Row("S4 process: supervise.py + bash vs bash (unsandboxed): median ms",
            _ms(wall["supervise+bash"]), _ms(wall["bash"]),
            _x(wall["supervise+bash"], wall["bash"]),
            note=f"the supervisor adds {d('supervise+bash', 'bash')}; CPU "
                 f"{_ms(cpu['supervise+bash'])} vs {_ms(cpu['bash'])} ms; of which the "
                 f"interpreter's start (`python -I -S -c pass`, same rounds) "
                 f"{_ms(wall['python'])} ms, CPU {_ms(cpu['python'])} ms"),
        Row("S4 process: bwrap + bash vs bash (bubblewrap's own cost): median ms",
            _ms(wall["bwrap"]), _ms(wall["bash"]), _x(wall["bwrap"], wall["bash"]),
            note=f"bubblewrap adds {d('bwrap', 'bash')}; with the supervisor on both "
                 f"sides (what the daemon pays per call) {d('supervise+bwrap', 'supervise+bash')}"
                 f" ({_x(wall['supervise+bwrap'], wall['supervise+bash'])})"),
    ]


async def sandbox_rows(ledger: Ledger) -> list[Row]:
    check = _checker(ledger)
    (ROOT / "var").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-", dir=ROOT / "var") as name:
        tmp = Path(name)
        async with open_daemon(tmp, SERVER, OPEN) as http:
            await _confined(http, tmp / "daemon.toml", ledger)
            bash = script(BASH_TRUE)
            s1 = await interleaved(http, {"sandboxed": (SANDBOXED, bash),
                                          "unsandboxed": (UNSANDBOXED, bash),
                                          "mcp": (SANDBOXED, script(MCP_CALL))},
                                   S1_RUNS, check)
            s2 = await _concurrent(http, check)
        # No daemon meanwhile: the processes have the machine to themselves (but for
        # whatever else it runs).
        argvs, workspace = _argvs(tmp / "daemon.toml")
        s4 = await trio.to_thread.run_sync(_processes, argvs, workspace)
    return _rows(s1, s2, s4)


async def main() -> int:
    """`python -m bench.sandbox`: only these rows, in make bench's table."""
    header = bench_header()
    ledger = Ledger()
    rows = await sandbox_rows(ledger)
    return print_report(rows, header, ledger)


if __name__ == "__main__":
    raise SystemExit(trio.run(main))

