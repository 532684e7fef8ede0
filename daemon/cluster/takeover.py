"""A swept node's open turns, resumed by the node that swept it (CONTRACT §18 "Cluster",
§13.4, §13.8).

The sweep (cluster/node.py) has fenced the dead node — a new epoch in the store, then on
the bus — before this runs, so nothing the old node still tries for these turns lands:
its store writes and its appends carry the old epoch and are refused (Fenced), and it
stops. Each open turn is then, in its order:

- closed with the terminal it had published (its end was not stored): as before;
- taken: its session becomes this node's by a compare-and-set on the dead owner
  (`adopt_sessions`, under this node's own lease; one statement for all of them), so a
  second sweep of the same node (this sweeper died midway) never finds it again — a
  turn is resumed once per loss;
- resumed here as at a start (runtime/recovery.py `resume_or_end`: same turnId, its
  stored progress, `turn.resumed {reason: "node_lost" | "shutdown", node}`), all the
  taken ones as one wave (planned, then started with one write) — or, when it may not
  be (resume_max, resume_within_s, a cancel had answered, claude-cli, nothing stored),
  ended with what recovery says, on this node.

A turn whose session some other node took meanwhile is not this sweep's: skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.errors import TurnClosed
from daemon.runtime.progress import LoggedTurn

if TYPE_CHECKING:
    from daemon.cluster.ports import Coordination
    from daemon.runtime.published import Published
    from daemon.runtime.sessions import SessionManager
    from daemon.store.models import InboxRecord, TurnRecord

log = logging.getLogger(__name__)


@dataclass
class TakenOver:
    """What a sweep did with a dead node's open turns."""

    resumed: int = 0
    ended: int = 0
    owed: list[InboxRecord] = field(default_factory=list)


async def take_over(sessions: SessionManager, coordination: Coordination, dead: str,
                    turns: Sequence[TurnRecord], published: dict[str, Published],
                    logged: dict[str, LoggedTurn]) -> TakenOver:
    """Resume (or end) each of `dead`'s open `turns` on this node, by what the log says
    of each (`logged`: runtime/progress.py, read once by the sweep behind the fences;
    `published`: the terminals among it); the replies those that ended owe are
    returned, stored, for the sweep to hand over once it has released the dead node's
    other sessions."""
    me = coordination.node_id
    done = TakenOver()
    message = f"node {dead} stopped while this turn ran"
    for turn in turns:
        if turn.id in published:
            try:
                done.owed.extend(await sessions.interrupt(turn, message, published[turn.id]))
            except TurnClosed:
                continue  # ended (stored) by another sweep meanwhile: it has its terminal
            done.ended += 1
    rest = [t for t in turns if t.id not in published]
    # Every session taken before any of its turns is resumed: one compare-and-set each,
    # in one statement.
    adopted = await coordination.adopt_sessions(sorted({t.session_id for t in rest}),
                                                dead, me)
    taken = []
    for turn in rest:
        if turn.session_id in adopted:
            taken.append(turn)
        else:
            log.info("turn %s of node %s: its session moved meanwhile (not this sweep's)",
                     turn.id, dead)
    ends = await sessions.recovery.resume_or_end(
        [(t, logged.get(t.id) or LoggedTurn()) for t in taken], "node_lost", me)
    done.resumed += len(taken) - len(ends)
    for turn in taken:
        if turn.id not in ends:
            continue
        code, why, details = ends[turn.id]
        try:
            done.owed.extend(await sessions.recovery.interrupt(
                turn, why.replace("the daemon", f"node {dead}", 1), code=code,
                details=details))
        except TurnClosed:
            continue
        done.ended += 1
    return done
