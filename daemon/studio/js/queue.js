// A turn (or its LLM call) waiting for a slot — `turn.queued`, then `turn.admitted`
// (docs/bursts.md) — in words; the same words `veild chat` prints (daemon/cli/render.py: queue_text).
//
//   queued: waiting for a turn slot (max_running_turns = 4, 3 waiting)
//   queued: waiting for openai (max_concurrent = 2, 5 waiting)
//   waited 1.2 s for a turn slot
//   waited 850 ms for openai
//   ended while queued for a turn slot

import { fmtWait } from './retry.js';

/** What it waits for: "a turn slot" (max_running_turns) or the provider's name. */
export function queueFor(d) {
  return d.reason === 'max_concurrent' ? (d.provider || 'the provider') : 'a turn slot';
}

/** The sentence of a queued turn by state: `waiting`, `admitted` (with waitedMs), `ended`. */
export function queueText(d, state) {
  const what = queueFor(d);
  if (state === 'admitted') return `waited ${fmtWait(d.waitedMs || 0)} for ${what}`;
  if (state === 'ended') return `ended while queued for ${what}`;
  const bound = d.reason === 'max_concurrent' ? 'max_concurrent' : 'max_running_turns';
  const waiting = d.waiting ? `, ${d.waiting} waiting` : '';
  return `queued: waiting for ${what} (${bound} = ${d.limit}${waiting})`;
}
