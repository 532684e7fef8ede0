"""`veild rewind SESSION TURN` and `veild fork SESSION [--before TURN | --after TURN]`
(CONTRACT §19); `veild show` names where a fork came from (`forked_from`)."""

from __future__ import annotations

import argparse
from typing import Any

from daemon.cli.safe import safe


def forked_from(session: dict[str, Any]) -> str | None:
    """The line `veild show` prints for a fork: where it came from."""
    point = session.get("forkedFrom")
    if not point:
        return None
    where = ("as it was" if point["at"] == "now"
             else f"{point['at']} turn {point.get('turnId')}")
    return f"forked from {point['sessionId']} ({where})"


def rewind(args: argparse.Namespace) -> int:
    out = args.remote.call("POST", f"/sessions/{args.id}/rewind",
                           json={"beforeTurn": args.turn})
    saved = out["savedAs"]["id"]
    print(safe(f"{args.id}: rewound to before turn {args.turn}; what it held is kept as "
               f"{saved} (veild show {saved})"))
    if out.get("message"):
        print(safe(f"that turn's message was:\n{out['message']}"))
    return 0


def fork(args: argparse.Namespace) -> int:
    body: dict[str, str] = {}
    if args.before:
        body["beforeTurn"] = args.before
    if args.after:
        body["afterTurn"] = args.after
    out = args.remote.call("POST", f"/sessions/{args.id}/fork", json=body)
    session = out["session"]
    print(safe(f"{session['id']}: {forked_from(session)}"))
    return 0


def add_verbs(sub: Any, remote: Any) -> None:
    """The two verbs on `veild`'s parser (`remote`: commands._remote)."""
    rewind_p = remote(sub.add_parser(
        "rewind", help="take an idle session back to before a turn (history and "
                       "workspace); what it held is kept as a fork"))
    rewind_p.add_argument("id")
    rewind_p.add_argument("turn")
    rewind_p.set_defaults(func=rewind)
    fork_p = remote(sub.add_parser(
        "fork", help="a new session with a session's history and workspace at a turn "
                     "(default: as it is now)"))
    fork_p.add_argument("id")
    where = fork_p.add_mutually_exclusive_group()
    where.add_argument("--before", metavar="TURN", help="as it was before this turn")
    where.add_argument("--after", metavar="TURN", help="as it was after this turn")
    fork_p.set_defaults(func=fork)
