// A turn that survived the daemon (CONTRACT §18): the words of its marks, and which of
// its events are void.
//
// `turn.resumed {turnId, attempt, afterSeq, reason, node?}` says that every event of that
// turn with a seq above `afterSeq` published before it (what streamed of the lost LLM
// call or tool call: chunks, tool calls, output, usage, approvals, a `turn.suspended`) is
// void. view.js keeps each live turn's events and, at a resume, draws that turn again
// from them without the void ones (`withoutVoid`), then the marker (`resumedText`).

/** `log` (events in seq order) without the void events of every `turn.resumed` in it;
 * `counts` (resumed seq -> how many of the lost attempts' events were dropped, a
 * `turn.suspended` not counted; an event voided by two resumes — a second loss after the
 * same stored step voids the first resume too — counts for the later) is filled for the
 * markers. A chunk merged for a slow client (§7) is judged by its last seq. */
export function withoutVoid(log, counts = new Map()) {
  const lost = [];
  for (const e of log) {
    if (e.eventType === 'turn.resumed') {
      lost.push({ turnId: e.turnId, after: Number(e.data?.afterSeq ?? e.seq), until: e.seq });
      counts.set(e.seq, 0);
    }
  }
  if (!lost.length) return log;
  lost.reverse();  // an event voided by two resumes counts for the later (shown) one
  return log.filter((e) => {
    const range = lost.find((r) => e.turnId === r.turnId && e.seq > r.after && e.seq < r.until);
    if (!range) return true;
    if (e.eventType !== 'turn.suspended') counts.set(range.until, counts.get(range.until) + 1);
    return false;
  });
}

const WHY = {
  restart: 'after a restart',
  shutdown: 'after a shutdown',
  node_lost: 'after its node was lost',
};

/** The marker's line: `Resumed after a restart · attempt 1`. */
export function resumedText(d) {
  const why = WHY[d.reason] || (d.reason ? `(${d.reason})` : 'after a restart');
  const where = d.node ? ` on ${d.node}` : '';
  return `Resumed${where} ${why} · attempt ${d.attempt ?? '?'}`;
}

/** What the marker says of the lost attempt's output (`dropped`: how many of its events). */
export function voidText(dropped) {
  return dropped
    ? "the interrupted attempt's output after its last saved step was discarded"
    : 'it goes on from its last saved step';
}

/** Its tooltip: what happened, in full. */
export function resumedTitle(d) {
  const cause = {
    restart: 'The daemon stopped while this turn ran (a crash or a kill) and resumed it when it started again.',
    shutdown: 'The daemon was stopped gracefully while this turn ran: it was suspended, and resumed at the next start.',
    node_lost: `The node that ran this turn was lost; ${d.node || 'another node'} resumed it.`,
  }[d.reason] || `The turn was resumed (${d.reason}).`;
  return `${cause} Events after #${d.afterSeq} of the interrupted attempt are void and no longer shown; ` +
    'a tool call that was running then is not run again.';
}

export const SUSPENDED_TEXT = 'Suspended: the daemon is shutting down. The turn is kept and resumes where it was when the daemon starts again.';

/** A past turn (GET /sessions/{id}/turns, a terminal's data) resumed `n` times. */
export function resumedCount(n) {
  return n === 1 ? 'resumed after 1 restart' : `resumed after ${n} restarts`;
}
