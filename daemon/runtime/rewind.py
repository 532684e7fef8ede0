"""Rewind and fork (CONTRACT §19): a session's history and workspace back to before a
turn, or copied into a new session at a turn. The snapshots are the workspace half
(daemon/snapshots/); the store keeps the history half (`fork_session`,
`finish_rewind`, `undo_rewind`, one transaction each).

A rewind of S before turn T, whose previous state is kept as the fork F:

    1. store: F created with all of S's messages and compactions, and S marked
       `rewinding = (T, F)` — one transaction
    2. F's snapshot store gets S's snapshots (so F can be rewound in turn)
    3. S's workspace swapped for T's snapshot, the old one renamed to F's workspace
       (snapshots/swap.py: crash-atomic, its commit point is its marker)
    4. store: S's history cut before T (its messages, and the compactions of T and
       later turns or past the cut), the rows of T and later turns moved to F, the
       mark cleared — one transaction

The truth after a crash is the workspace swap's: at the next start, once every
interrupted swap was finished or forgotten (`recover_all`), a marked session whose
fork's workspace exists went through step 3 and is finished (step 4); one whose fork's
workspace does not exist never swapped and is undone (F removed, the mark cleared). So
a SIGKILL anywhere leaves S as it was before or as it is after, never between.

A fork copies the workspace first (into the new session's workspace and snapshot
store), then stores the session with its history in one transaction: a crash between
leaves files of a session that never existed, nothing half of one that does.

`VEILD_REWIND_PAUSE=STEP:PATH` (a test seam, tests/test_rewind_crash.py): at STEP
("forked", "copied", a swap step of swap.py, "swapped") the rewind creates PATH and
blocks its process until it is killed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from daemon.clock import new_id, now_ms
from daemon.errors import Conflict, NotFound
from daemon.runtime import events as ev
from daemon.runtime.mirror import store_then_mirror
from daemon.runtime.sessions import running_turn
from daemon.snapshots import SnapshotError, Snapshots
from daemon.snapshots.service import OFF
from daemon.snapshots.swap import rmtree
from daemon.store.models import ForkPoint, MessageRecord, SessionRecord, TurnHistory

if TYPE_CHECKING:
    from daemon.runtime.sessions import SessionManager
    from daemon.runtime.state import SessionState


log = logging.getLogger(__name__)

PAUSE_ENV = "VEILD_REWIND_PAUSE"


@dataclass(frozen=True)
class Cut:
    """Where a history is cut: its first `upto` messages are kept; the workspace there
    is the snapshot of `snapshot_turn` (None: the workspace now)."""

    upto: int
    snapshot_turn: str | None
    # The turns from the point on (their compactions are not part of the cut; a
    # rewind gives the rows of its own ones to the fork).
    later: tuple[str, ...] = ()
    message: str | None = None  # the content of the turn's user message


@dataclass(frozen=True)
class Rewound:
    session: SessionRecord
    saved_as: SessionRecord
    message: str

    def wire(self) -> dict[str, Any]:
        return {"session": ev.session_wire(self.session),
                "savedAs": ev.session_wire(self.saved_as), "message": self.message}


def _pause(step: str) -> None:
    """The test seam (module docstring): blocks this thread until the process dies."""
    seam = os.environ.get(PAUSE_ENV)
    if not seam:
        return
    name, _, path = seam.partition(":")
    if name == step:
        Path(path).write_text(step)
        while True:
            time.sleep(60)


def _order(messages: Sequence[MessageRecord], turns: Sequence[TurnHistory]) -> list[str]:
    """The session's turns in order: those its history inherited (a fork's, named by
    its messages only), then its own (its turn rows)."""
    own = [t.id for t in turns]
    known = set(own)
    inherited: list[str] = []
    for m in messages:
        if m.turn_id is not None and m.turn_id not in known:
            known.add(m.turn_id)
            inherited.append(m.turn_id)
    return inherited + own


def locate(session_id: str, messages: Sequence[MessageRecord],
           turns: Sequence[TurnHistory], turn_id: str | None, at: str) -> Cut:
    """The cut of a history `at` "before" | "after" `turn_id`, or "now" (turn None).
    NotFound: no such turn in this session; Conflict: after a turn that still runs."""
    order = _order(messages, turns)
    running = {t.id for t in turns if t.ended_at is None}

    def first(tid: str) -> int:
        """Where `tid`'s messages start (a turn that stored none: where the next
        turn's do)."""
        later = order[order.index(tid):]
        return next((i for i, m in enumerate(messages) if m.turn_id in later),
                    len(messages))

    if at == "now":
        live = [t for t in order if t in running]
        if live:  # only ended turns are copied; the workspace before the running one
            return Cut(first(live[0]), live[0], tuple(order[order.index(live[0]):]))
        return Cut(len(messages), None)
    assert turn_id is not None
    if turn_id not in order:
        raise NotFound(f"no turn {turn_id!r} in session {session_id!r}",
                       {"sessionId": session_id, "turnId": turn_id})
    if at == "before":
        start = first(turn_id)
        message = next((m.content for m in messages[start:]
                        if m.turn_id == turn_id and m.role == "user"), "")
        return Cut(start, turn_id, tuple(order[order.index(turn_id):]), message)
    if turn_id in running:
        raise Conflict(f"turn {turn_id!r} is still running: a fork after it would copy "
                       "what has not ended", {"sessionId": session_id, "turnId": turn_id})
    rest = order[order.index(turn_id) + 1:]
    if rest:
        return Cut(first(rest[0]), rest[0], tuple(rest))
    return Cut(len(messages), None)


class Rewinds:
    """Rewind and fork of the sessions this node owns (api/actions.py routes them
    here). Stateless: what must not overlap is held by the session manager
    (`SessionManager.held`) and the snapshot service's per-session locks."""

    def __init__(self, sessions: SessionManager) -> None:
        self.sessions = sessions
        services = sessions.services
        self.store = sessions.store
        self.snapshots: Snapshots | None = services.snapshots
        self.workspaces: Path = services.workspaces

    def _snaps(self, session_id: str) -> Snapshots:
        if self.snapshots is None:
            raise Conflict(f"no snapshot of session {session_id!r}: {OFF}",
                           {"sessionId": session_id, "reason": OFF})
        return self.snapshots

    async def _no_snapshot(self, snaps: Snapshots, session_id: str, turn_id: str) -> None:
        """409 naming why, when `turn_id` has no snapshot."""
        why = await snaps.why_not(session_id, turn_id)
        if why is not None:
            raise Conflict(f"turn {turn_id} of session {session_id} has no snapshot: {why}",
                           {"sessionId": session_id, "turnId": turn_id, "reason": why})

    async def _cut(self, session_id: str, turn_id: str | None, at: str) -> Cut:
        messages = await self.store.messages(session_id)
        turns = await self.store.turns(session_id)
        return locate(session_id, messages, turns, turn_id, at)

    def _new_record(self, source: SessionRecord, point: ForkPoint) -> SessionRecord:
        now = now_ms()
        sid = new_id("ses")
        return SessionRecord(
            id=sid, agent_name=source.agent_name, parent_session_id=None,
            root_session_id=sid, depth=0, spawn_tool_call_id=None, status="idle",
            created_at=now, updated_at=now, model=source.model, forked_from=point)

    # -- fork -----------------------------------------------------------------------------

    async def fork(self, session_id: str, turn_id: str | None, at: str) -> SessionRecord:
        """A new top-level session with the history and workspace of `session_id` at
        that point (CONTRACT §19). Allowed while a turn runs: only ended turns are
        copied. NotFound, Conflict (no snapshot, naming why)."""
        sessions = self.sessions
        source = await sessions.record(session_id)
        sessions.agent(source.agent_name)  # NotFound: an agent no longer configured
        if sessions.rewinding(session_id):
            raise Conflict("the session is being rewound", {"sessionId": session_id})
        state = sessions.in_memory(session_id)
        running = running_turn(state) if state is not None else None
        if running is not None:  # its snapshot is taken beside its first call
            await running.snapshotted()
        cut = await self._cut(session_id, turn_id, at)
        snaps = self._snaps(session_id)
        if cut.snapshot_turn is not None:
            await self._no_snapshot(snaps, session_id, cut.snapshot_turn)
        record = self._new_record(source, ForkPoint(session_id, turn_id, at))
        ws_src, ws_dst = self.workspaces / session_id, self.workspaces / record.id
        # Shielded once begun (bounded by the snapshot service's deadline): a fork the
        # caller left goes through, or leaves nothing of itself.
        with trio.CancelScope(shield=True):
            try:
                # The restore is built beside the fork's workspace: their folder exists.
                await trio.to_thread.run_sync(
                    lambda: self.workspaces.mkdir(parents=True, exist_ok=True))
                if cut.snapshot_turn is not None:
                    await snaps.copy_to(session_id, cut.snapshot_turn, record.id, ws_dst)
                else:
                    await snaps.copy_now(session_id, ws_src, record.id, ws_dst)
            except (SnapshotError, OSError) as exc:
                await self._drop_files(record.id)
                raise Conflict(f"cannot fork session {session_id}: {exc}",
                               {"sessionId": session_id, "reason": str(exc)}) from exc
            try:
                await store_then_mirror(
                    sessions.services.stop,
                    lambda: self.store.fork_session(record, cut.upto, cut.later),
                    lambda _: self._announce(record), what=f"the fork {record.id}")
            except BaseException:
                await self._drop_files(record.id)
                raise
        return record

    def _announce(self, record: SessionRecord) -> None:
        self.sessions.bus.publish("session.created", ev.SessionRef.of(record),
                                  {"session": ev.session_wire(record)})

    async def _drop_files(self, session_id: str) -> None:
        """What a fork that did not happen left: its snapshot store and workspace."""
        assert self.snapshots is not None
        workspace = self.workspaces / session_id
        try:
            await self.snapshots.delete(session_id, workspace)
            await trio.to_thread.run_sync(rmtree, workspace)
        except (SnapshotError, OSError):
            log.warning("could not remove what the fork %s left", session_id, exc_info=True)

    # -- rewind ---------------------------------------------------------------------------

    async def rewind(self, session_id: str, before_turn: str) -> Rewound:
        """The session back to before `before_turn`, what it held kept as a fork
        (CONTRACT §19). NotFound; Conflict while a turn runs, or with no snapshot."""
        sessions = self.sessions
        state = await sessions.load(session_id)
        with sessions.held(state):
            if state.record.status != "idle":
                raise Conflict("the session is running a turn", {"sessionId": session_id})
            cut = await self._cut(session_id, before_turn, "before")
            snaps = self._snaps(session_id)
            await self._no_snapshot(snaps, session_id, before_turn)
            everything = len(await self.store.messages(session_id))
            saved = self._new_record(state.record, ForkPoint(session_id, None, "now"))
            with trio.CancelScope(shield=True):
                done = await self._rewind(state, snaps, cut, before_turn, saved, everything)
        return done

    async def _rewind(self, state: SessionState, snaps: Snapshots, cut: Cut,
                      before_turn: str, saved: SessionRecord, everything: int) -> Rewound:
        sid = state.id
        workspace, kept = self.workspaces / sid, self.workspaces / saved.id
        stop = self.sessions.services.stop
        await self.store.fork_session(saved, everything, rewinding=before_turn)  # 1
        _pause("forked")
        try:
            await snaps.copy_snapshots(sid, saved.id)  # 2
            _pause("copied")
            await trio.to_thread.run_sync(lambda: workspace.mkdir(parents=True,
                                                                  exist_ok=True))
            await snaps.restore(sid, before_turn, workspace, keep_old_as=kept,
                                step=_pause)  # 3
        except BaseException as exc:
            # The swap did not commit (or did, and failed after): the same rule as
            # after a crash decides (`settle`).
            if not await trio.to_thread.run_sync(os.path.lexists, kept):
                await self._undo(sid, saved.id)
                if isinstance(exc, SnapshotError):
                    raise Conflict(f"cannot rewind session {sid}: {exc}",
                                   {"sessionId": sid, "reason": str(exc)}) from exc
                raise
            log.warning("rewind of %s: the workspace was swapped, then %r; finishing it",
                        sid, exc)
        _pause("swapped")
        now = now_ms()

        def finished(_: None) -> SessionRecord:
            state.record = replace(state.record, updated_at=now)
            self.sessions.forget_estimate(sid)
            return state.record

        record = await store_then_mirror(  # 4
            stop, lambda: self.store.finish_rewind(sid, cut.upto, cut.later, now),
            finished, what=f"the rewind of {sid}")
        self._announce(saved)
        self.sessions.bus.publish(ev.SESSION_REWOUND, state.ref,
                                  ev.session_rewound(record, before_turn, saved))
        log.info("session rewound", extra={"sessionId": sid, "turnId": before_turn,
                                           "savedAs": saved.id})
        return Rewound(record, saved, cut.message or "")

    async def _undo(self, session_id: str, fork_id: str) -> None:
        await self.store.undo_rewind(session_id)
        await self._drop_files(fork_id)

    # -- at start -------------------------------------------------------------------------

    async def settle(self) -> None:
        """At start, before any turn: every interrupted workspace swap finished or
        forgotten, then every rewind a crash left marked finished (its swap happened)
        or undone (it did not). In a cluster the workspaces are shared: only what this
        node owns is settled, workspace by workspace (another node's swap may be
        running; the snapshot service recovers a workspace before it touches it)."""
        if self.snapshots is None:
            return
        directory = self.sessions.directory
        if directory.describe()[0] is None:  # one process: every workspace is ours
            await self.snapshots.recover_all(self.workspaces)
        for mark in await self.store.rewinds():
            if await directory.owner(mark.session_id) is not None:
                continue  # its owner's to settle
            await self.snapshots.recover(self.workspaces / mark.session_id)
            kept = self.workspaces / mark.fork_id
            if await trio.to_thread.run_sync(os.path.lexists, kept):
                cut = await self._cut(mark.session_id, mark.turn_id, "before")
                await self.store.finish_rewind(mark.session_id, cut.upto, cut.later,
                                               now_ms())
                log.warning("finished the rewind of session %s (before %s), interrupted "
                            "by the last stop", mark.session_id, mark.turn_id)
            else:
                await self._undo(mark.session_id, mark.fork_id)
                log.warning("undid the rewind of session %s (before %s), interrupted by "
                            "the last stop before its workspace changed", mark.session_id,
                            mark.turn_id)

    async def snapshot_turns(self, session_id: str) -> frozenset[str]:
        """The turns of the session that have a snapshot (GET …/turns)."""
        if self.snapshots is None:
            return frozenset()
        return await self.snapshots.turns(session_id)
