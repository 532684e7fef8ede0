"""`veild serve | mock-provider | chat | tail | agents | sessions | show | send | cancel |
compact | schedules | approve | prune | doctor`: argument parsing and dispatch; the verbs live
beside it in daemon/cli/."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from datetime import datetime
from typing import Any

import httpx
import trio

from daemon import __version__
from daemon.cli import agents as cli_agents
from daemon.cli import rewind as cli_rewind
from daemon.cli import sessions as cli_sessions
from daemon.cli.http import (
    DEFAULT_IDLE_S,
    EXIT_USAGE,
    CliError,
    HttpFailure,
    Remote,
    UsageError,
    positive_seconds,
    resolve_idle,
    resolve_url,
)
from daemon.cli.safe import print_table, safe, safe_line
from daemon.config import Config, bind_host, check_exposure, load_config, resolve_config_path
from daemon.errors import BusUnavailable, ConfigError, Fenced, StoreError, leaves
from daemon.observe.logs import configure_logging, one_line

EXIT_CONFIG = EXIT_USAGE
log = logging.getLogger("daemon.cli")


def _log_level() -> str:
    return os.environ.get("VEILD_LOG", "INFO")


def _serve(args: argparse.Namespace) -> int:
    from daemon.mock.provider import serve_mock_provider
    from daemon.serve.server import serve_daemon

    try:
        config = load_config(resolve_config_path(args.config)).with_overrides(
            host=args.host, port=args.port, data_dir=args.data_dir
        )
        check_exposure(config)
    except ConfigError as exc:
        # The config did not load, so its log_format is unknown: the default applies.
        print(one_line(f"config error: {exc}", args.log_format), file=sys.stderr)
        return EXIT_CONFIG
    log_format = configure_logging(config.server.log_format, level=_log_level())

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(
                lambda task_status: serve_daemon(config, handle_signals=True,
                                                 serve_mock=serve_mock_provider,
                                                 task_status=task_status)
            )
            print(f"veild listening on {daemon.url}", flush=True)
            log.info("Studio is at %s/studio", daemon.url)

    try:
        trio.run(main)
    except BaseException as exc:  # trio raises what nurseries collect as groups
        found = leaves(exc)
        if all(isinstance(leaf, ConfigError) for leaf in found):
            # Found at start, not in the file: `sandbox = "bwrap"` that does not work.
            print(one_line(f"config error: {found[0]}", log_format), file=sys.stderr)
            return EXIT_CONFIG
        line = _startup_failure(exc, config)
        if line is None:
            raise
        print(one_line(line, log_format), file=sys.stderr)
        return 1
    return 0


def _startup_failure(exc: BaseException, config: Config) -> str | None:
    """One line for a failure a user can act on (CONTRACT §12), else None (also when
    anything else failed with it: that keeps its traceback)."""
    found = leaves(exc)
    if not all(isinstance(leaf, (StoreError, BusUnavailable, OSError)) for leaf in found):
        return None
    for leaf in found:
        if isinstance(leaf, BusUnavailable):  # the cluster's Redis (§13): it names it
            return f"bus error: {leaf}"
        if isinstance(leaf, Fenced):  # §13.8: stopped, it rejoins when restarted
            return f"cluster: {leaf}: exiting (a restart joins with a new epoch)"
        if isinstance(leaf, StoreError):
            if config.cluster is not None:  # PostgreSQL: the data dir holds none of it
                return f"store error: {leaf}"
            return f"store error: {leaf} (data dir {config.server.data_dir})"
        if isinstance(leaf, OSError):
            server = config.server
            where = f"{server.host}:{server.port}"
            if leaf.errno == errno.EADDRINUSE:
                return f"cannot listen on {where}: the address is already in use"
            if leaf.filename is not None:
                return f"cannot use {leaf.filename}: {leaf.strerror}"
            return f"cannot start (listening on {where}): {leaf}"
    return None


def _mock_provider(args: argparse.Namespace) -> int:
    from daemon.mock.provider import serve_mock_provider

    host = bind_host(args.host)
    shown = f"[{host}]" if ":" in host else host

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_mock_provider, host, args.port)
            print(f"mock provider listening on http://{shown}:{port}/v1", flush=True)

    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass
    return 0


def _chat(args: argparse.Namespace) -> int:
    from rich.console import Console

    from daemon.cli.render import chat

    console = Console(soft_wrap=True, highlight=False)
    try:
        code: int = trio.run(chat, args.remote, args.agent, args.message, args.session,
                             console)
    except BaseException as exc:
        error = args.remote.translate(exc)
        if error is None:
            raise
        raise error from None
    return code


def _approve(args: argparse.Namespace) -> int:
    """`veild approve SESSION APPROVAL_ID [--deny REASON]` (CONTRACT §12, §9)."""
    body: dict[str, Any] = {"decision": "allow"}
    if args.deny is not None:
        body = {"decision": "deny", "reason": args.deny}
    answer = args.remote.call("POST",
                              f"/sessions/{args.session}/approvals/{args.approval_id}",
                              json=body)
    print(safe(f"{args.approval_id}: {answer['decision']}"))
    return 0


def _tail(args: argparse.Namespace) -> int:
    """Events as JSON lines (json.dumps escapes every control character, so a model's
    text cannot reach the terminal raw). It ends by Ctrl-C (exit 0), or by the stream
    ending, which is a failure with its own line and exit code (Remote.closed)."""
    query = "batch=1"
    if args.session:
        query += f"&sessionIds={args.session}"
        if args.children:
            query += "&includeChildren=1"
    if args.since is not None:
        query += f"&since={args.since}"

    async def main() -> None:
        async with args.remote.open_events(query) as events:
            while True:
                frame = await events.get()
                for event in frame if isinstance(frame, list) else [frame]:
                    print(json.dumps(event), flush=True)

    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass
    except BaseException as exc:
        error = args.remote.translate(exc)
        if error is None:
            raise
        raise error from None
    return 0


def _prune(args: argparse.Namespace) -> int:
    """Over HTTP to the running daemon (DELETE /sessions?olderThan=): the daemon owns
    the data dir, knows which turns run, publishes `session.deleted` and removes the
    workspaces; a second writer on its database would do none of that."""
    try:
        answer = args.remote.call("DELETE", "/sessions", params={"olderThan": args.older_than})
    except HttpFailure as exc:
        raise CliError(f"prune failed ({exc.status}): {exc.message}") from None
    print(f"pruned {answer['pruned']} sessions idle for more than {args.older_than}")
    return 0


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _schedules(args: argparse.Namespace) -> int:
    """`veild schedules` lists them; `veild schedules run|pause|resume NAME` acts."""
    if args.action != "list":
        if not args.name:
            print(f"veild: schedules {args.action} needs a schedule name", file=sys.stderr)
            return EXIT_CONFIG
        body = args.remote.call("POST", f"/schedules/{args.name}/{args.action}")
        print(safe(f"{args.name}: started turn {body['turnId']} in session {body['sessionId']}"
                   if args.action == "run" else f"{args.name}: {args.action}d"))
        return 0
    rows = [("NAME", "AGENT", "WHEN", "STATE", "NEXT", "LAST", "OUTCOME", "SKIPPED")]
    for s in args.remote.call("GET", "/schedules")["schedules"]:
        when = (f"every {s['every']}" if "every" in s
                else f"cron {s['cron']} {s['timezone']}")
        state = ("running" if s["running"] else "paused" if s["paused"]
                 else "enabled" if s["enabled"] else "disabled")
        rows.append((s["name"], s["agent"], when, state, _when(s["nextRunAt"]),
                     _when(s["lastRunAt"]), s["lastOutcome"] or "-", str(s["skipped"])))
    print_table(rows)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from daemon.cli import doctor

    # Only a --url given (before or after the verb) asks for the daemon check.
    return doctor.run(args.config, resolve_url(args.url) if args.url else None)


URL_HELP = "the daemon (default $VEILD_URL, else http://127.0.0.1:7433)"
IDLE_HELP = (f"give up when the daemon says nothing for this long (default "
             f"$VEILD_IDLE_TIMEOUT, else {DEFAULT_IDLE_S:g}; its streams send a keepalive "
             "every 15 s, so a quiet turn never meets it)")


def _seconds(raw: str) -> float:
    try:
        return positive_seconds(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _remote(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A verb that talks to a daemon also takes `--url` and `--idle-timeout` after it;
    SUPPRESS keeps one given before the verb from being overwritten by the verb's
    default."""
    sub.add_argument("--url", default=argparse.SUPPRESS, help=URL_HELP)
    sub.add_argument("--idle-timeout", type=_seconds, default=argparse.SUPPRESS,
                     metavar="SECONDS", help=IDLE_HELP)
    sub.set_defaults(verb_parser=sub)
    return sub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="veild", description="The veild agent daemon.")
    parser.add_argument("--version", action="version", version=f"veild {__version__}")
    parser.add_argument("--url", default=None, help=URL_HELP)
    parser.add_argument("--idle-timeout", type=_seconds, default=None, metavar="SECONDS",
                        help=IDLE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--data-dir")
    serve.set_defaults(func=_serve)

    mock = sub.add_parser("mock-provider", help="run the scripted OpenAI-compatible provider")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=int, default=0)
    mock.set_defaults(func=_mock_provider)

    chat = _remote(sub.add_parser("chat", help="send one message and stream the turn"))
    chat.add_argument("agent")
    chat.add_argument("message")
    chat.add_argument("--session")
    chat.set_defaults(func=_chat)

    tail = _remote(sub.add_parser("tail", help="print bus events as JSON lines"))
    tail.add_argument("--session", help="only this session's events")
    tail.add_argument("--children", action="store_true",
                      help="with --session: its descendants' events too")
    tail.add_argument("--since", type=int, metavar="SEQ",
                      help="replay the events after SEQ first (0: all that are kept)")
    tail.set_defaults(func=_tail)

    agents = _remote(sub.add_parser("agents", help="list the daemon's agents, marking "
                                                   "those that run commands unsandboxed"))
    agents.set_defaults(func=cli_agents.agents)

    sessions = _remote(sub.add_parser("sessions", help="list sessions, newest first"))
    sessions.add_argument("--tree", action="store_true", help="nest children under parents")
    sessions.add_argument("--agent")
    sessions.add_argument("--limit", type=int, default=100)
    sessions.set_defaults(func=cli_sessions.sessions)

    show = _remote(sub.add_parser("show", help="a session and its messages"))
    show.add_argument("id")
    show.set_defaults(func=cli_sessions.show)

    send = _remote(sub.add_parser("send", help="send a message into a session's inbox"))
    send.add_argument("id")
    send.add_argument("message")
    send.add_argument("--queue", action="store_true",
                      help="deliver after the running turn instead of steering it")
    send.set_defaults(func=cli_sessions.send)

    cancel = _remote(sub.add_parser("cancel", help="cancel a session's turn or its tree"))
    cancel.add_argument("id")
    cancel.add_argument("--scope", choices=("turn", "tree"), default="tree")
    cancel.set_defaults(func=cli_sessions.cancel)

    compact = _remote(sub.add_parser(
        "compact", help="compact an idle session's context now (summarise its history)"))
    compact.add_argument("id")
    compact.set_defaults(func=cli_sessions.compact)

    cli_rewind.add_verbs(sub, _remote)  # CONTRACT §19

    prune = _remote(sub.add_parser(
        "prune", help="delete idle session trees last updated longer ago than a duration"))
    prune.add_argument("--older-than", required=True, metavar="AGE",
                       help="e.g. 30d, 12h, 15m, 45s")
    prune.set_defaults(func=_prune)
    schedules = _remote(sub.add_parser("schedules",
                                       help="list schedules, or run|pause|resume one"))
    schedules.add_argument("action", nargs="?", default="list",
                           choices=("list", "run", "pause", "resume"))
    schedules.add_argument("name", nargs="?")
    schedules.set_defaults(func=_schedules)

    approve = _remote(sub.add_parser("approve",
                                     help="allow (or --deny) a tool call that waits"))
    approve.add_argument("session")
    approve.add_argument("approval_id")
    approve.add_argument("--deny", metavar="REASON",
                         help="deny the call; the model sees REASON in its result")
    approve.set_defaults(func=_approve)

    doctor = sub.add_parser("doctor", help="check the config, data dir, providers, MCP "
                                           "servers, the claude CLI and (--url) the daemon")
    doctor.add_argument("--config", help="default $VEILD_CONFIG, else the default path")
    doctor.add_argument("--url", default=argparse.SUPPRESS,
                        help="also check the daemon there (GET /health)")
    doctor.set_defaults(func=_doctor)
    return parser


def _not_utf8(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The first argument that cannot be sent (JSON is UTF-8; on POSIX, Python hands
    argv bytes that are not UTF-8 over as lone surrogates), by the name the user typed."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                if action.option_strings:
                    return action.option_strings[0]
                return str(action.metavar or action.dest).upper()
    return None


def _remote_of(args: argparse.Namespace) -> Remote:
    bad = _not_utf8(args.verb_parser, args)
    if bad is not None:
        raise UsageError(f"{bad} is not valid UTF-8 text")
    return Remote(resolve_url(args.url), resolve_idle(args.idle_timeout))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Until a config says otherwise: text on a terminal, JSON lines otherwise.
    args.log_format = configure_logging(level=_log_level())
    try:
        result = _run_verb(args)
    except BaseException as exc:
        if not any(isinstance(leaf, BrokenPipeError) for leaf in leaves(exc)):
            raise
        return _reader_left()
    return result


EXIT_READER_LEFT = 141  # 128 + SIGPIPE, as a shell reports a pipe's writer that it ended


def _reader_left() -> int:
    """stdout's reader closed it (`veild tail | head -1`): it has what it wanted, so no
    line and no traceback. stdout goes to /dev/null first: the interpreter's own flush
    at exit would meet the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_READER_LEFT


def _run_verb(args: argparse.Namespace) -> int:
    remote: Remote | None = None
    try:
        if hasattr(args, "verb_parser"):  # a verb that talks to a daemon
            remote = args.remote = _remote_of(args)
        result: int = args.func(args)
    except CliError as exc:
        print(f"veild: {safe_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except httpx.HTTPError as exc:  # a verb that streams (chat) meets it mid-way
        if remote is None:
            raise
        error = remote.failure(exc)
        print(f"veild: {safe_line(str(error))}", file=sys.stderr)
        return error.exit_code
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        if remote is None:
            raise
        # A 2xx JSON answer without what the verb reads: not this veild's daemon. The
        # traceback is there for a bug of ours: VEILD_LOG=DEBUG.
        log.debug("unexpected answer", exc_info=True)
        print(f"veild: {safe_line(remote.url)} answered JSON this veild does not expect "
              f"({type(exc).__name__}: {safe_line(str(exc))}): is it a veild daemon of "
              "this version?", file=sys.stderr)
        return 1
    return result
