"""`veild sessions [--tree] | show ID | send ID MSG [--queue] | cancel ID [--scope] |
compact ID`;
the listings mark the sessions of unsandboxed agents (agents.py)."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from datetime import datetime
from typing import Any

import httpx

from daemon.cli.agents import mark, unsandboxed_agents
from daemon.cli.rewind import forked_from
from daemon.cli.safe import print_table, safe


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _tokens(usage: dict[str, Any] | None) -> str:
    if not usage:
        return "-"
    return f"{usage.get('input', 0)}in/{usage.get('output', 0)}out"


def _row(s: dict[str, Any], marked: set[str], indent: int = 0) -> tuple[str, ...]:
    return ("  " * indent + s["id"], s["agentName"], s["status"], _when(s["updatedAt"]),
            _tokens(s.get("tokenUsage")), mark(s["agentName"], marked))


def sessions(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit}
    if args.agent:
        params["agent"] = args.agent
    listed: list[dict[str, Any]] = args.remote.call("GET", "/sessions", params=params)["sessions"]
    marked = unsandboxed_agents(args.remote)
    rows: list[tuple[str, ...]] = [("ID", "AGENT", "STATUS", "UPDATED", "TOKENS", "")]
    if not args.tree:
        rows += [_row(s, marked) for s in listed]
    else:
        ids = {s["id"] for s in listed}
        children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
        for s in listed:
            # A child whose parent is not in this page is shown at the top, not lost.
            parent = s["parentSessionId"] if s["parentSessionId"] in ids else None
            children[parent].append(s)

        def walk(parent: str | None, depth: int) -> None:
            # The top level stays newest first; a session's children in spawn order.
            kids = children[parent] if parent is None else sorted(
                children[parent], key=lambda s: s["createdAt"])
            for s in kids:
                rows.append(_row(s, marked, depth))
                walk(s["id"], depth + 1)

        walk(None, 0)
    print_table(rows)
    return 0


def show(args: argparse.Namespace) -> int:
    """Every line through `safe()`: the messages are the model's and the tools' text."""
    s = args.remote.call("GET", f"/sessions/{args.id}")
    messages = args.remote.call("GET", f"/sessions/{args.id}/messages")["messages"]
    agent = f"{s['agentName']} {mark(s['agentName'], unsandboxed_agents(args.remote))}".rstrip()
    print(safe(f"session {s['id']}  agent {agent}  status {s['status']}  "
               f"depth {s['depth']}  model {s.get('model') or '-'}"))
    print(safe(f"parent {s['parentSessionId'] or '-'}  root {s['rootSessionId']}  "
               f"tokens {_tokens(s.get('tokenUsage'))}  updated {_when(s['updatedAt'])}"))
    if s.get("children"):
        print(safe("children " + " ".join(s["children"])))
    if (fork := forked_from(s)) is not None:  # CONTRACT §19
        print(safe(fork))
    for m in messages:
        if m["role"] == "summary":  # CONTRACT §15: where the context was compacted
            print(safe(f"\n[summary of the first {m.get('coversUntil')} messages] "
                       f"{m.get('content') or ''}".rstrip()))
            continue
        if m["role"] == "compaction":  # pruning was enough: nothing summarised
            print(safe(f"\n[context compacted: {m.get('prunedToolResults')} tool results "
                       "pruned]"))
            continue
        print(safe(f"\n[{m['role']}] {m.get('content') or ''}".rstrip()))
        for tc in m.get("toolCalls") or []:
            print(safe(f"  -> {tc.get('name')} {json.dumps(tc.get('arguments'))}"))
    return 0


def send(args: argparse.Namespace) -> int:
    body = {"message": args.message, "delivery": "queue" if args.queue else "steer"}
    args.remote.call("POST", f"/sessions/{args.id}/messages", json=body)
    print(f"{args.id}: {'queued' if args.queue else 'sent'}")
    return 0


def compact(args: argparse.Namespace) -> int:
    """`veild compact ID` (CONTRACT §15): compact the idle session's context now; the
    answer comes once the summarising call ended (no read timeout: Ctrl-C leaves)."""
    out = args.remote.call("POST", f"/sessions/{args.id}/compact",
                           timeout=httpx.Timeout(10.0, read=None))
    usage = out.get("tokenUsage") or {}
    if out.get("cancelled"):
        print(safe(f"{args.id}: the compaction was cancelled ({out.get('cancelReason')})"))
        return 1
    summary = out.get("content") or ""
    print(safe(f"{args.id}: compacted in turn {out['turnId']}  "
               f"({usage.get('input', 0)}in/{usage.get('output', 0)}out tokens)"))
    print(safe(summary) if summary else "nothing needed summarising")
    return 0


def cancel(args: argparse.Namespace) -> int:
    receipt = args.remote.call("POST", f"/sessions/{args.id}/cancel",
                               json={"scope": args.scope})
    stopped = receipt["cancelled"]
    if not stopped:
        print(f"{args.id}: nothing was running")
    for c in stopped:
        print(safe(f"cancelled turn {c['turnId']} in session {c['sessionId']}"))
    return 0
