// A provider's retry or fallback (CONTRACT §14 `provider.retry`) in words — the same
// words `veild chat` prints (daemon/cli/render.py: retry_text).
//
//   rate limited by openai, retrying in 4 s — attempt 2 of 4
//   openai overloaded, retrying in 850 ms — attempt 1 of 4
//   openai: HTTP 500 failed, retrying now — attempt 3 of 4
//   openai failed (HTTP 529): falling back to backup · backup-model
//
// `attempt` is which retry of `maxRetries` it is; a fallback (`fallback: true`) names the
// provider and model the call goes to, so the one that failed is the provider of the
// call's previous announcement (or "the provider" when this call had none).

/** What went wrong, in a few words: from the status, else the error's gist. */
export function failure(d) {
  const s = d.status;
  if (s === 429) return 'rate limited';
  if (s === 503 || s === 529) return 'overloaded';
  if (s) return `HTTP ${s} failed`;
  const error = String(d.error || '');
  if (/overload/i.test(error)) return 'overloaded';
  if (/rate.?limit/i.test(error)) return 'rate limited';
  if (/timed out|timeout|stalled|within \d/i.test(error)) return 'timed out';
  if (/refused|reset|connect/i.test(error)) return 'connection failed';
  const gist = error.replace(/^provider /, '').split(/[:\n]/)[0].trim();
  return gist.length > 60 ? `${gist.slice(0, 59)}…` : gist || 'failed';
}

/** `ms` of a wait as said: "850 ms", "1.5 s", "12 s". */
export function fmtWait(ms) {
  if (ms < 1000) return `${Math.max(0, Math.round(ms))} ms`;
  const s = ms / 1000;
  return s < 10 ? `${Number(s.toFixed(1))} s` : `${Math.round(s)} s`;
}

/** "rate limited by raw" / "raw overloaded" / "raw: HTTP 500 failed". */
export function cause(d) {
  const why = failure(d);
  if (why === 'rate limited') return `rate limited by ${d.provider}`;
  if (why === 'overloaded') return `${d.provider} overloaded`;
  return `${d.provider}: ${why}`;
}

/** The fallback's sentence; `from`: the provider that failed, if known. */
export function fallbackText(d, from) {
  const what = d.status ? `HTTP ${d.status}` : failure(d);
  return `${from || 'the provider'} failed (${what}): falling back to ${d.provider} · ${d.model}`;
}

/** A wait still to come as said: under a second in ms, else whole seconds (rounded up). */
export function fmtLeft(waitMs, left) {
  return waitMs < 1000 ? fmtWait(left) : `${Math.ceil(left / 1000)} s`;
}

/**
 * A retry's sentence, by the state of its notice: `waiting` with `left` ms of its wait
 * to come — "retrying in 4 s" (counted down in whole seconds; a wait under a second in
 * ms), "retrying now" once it is over; `retried` — "retried after 4 s"; `ended` (the
 * turn ended during the wait) — "not retried: the turn ended".
 */
export function retryText(d, state, left = 0) {
  const wait = d.waitMs || 0;
  let when;
  if (state === 'retried') when = `retried after ${fmtWait(wait)}`;
  else if (state === 'ended') when = 'not retried: the turn ended';
  else if (left <= 0) when = 'retrying now';
  else when = `retrying in ${fmtLeft(wait, left)}`;
  return `${cause(d)}, ${when} — attempt ${d.attempt} of ${d.maxRetries}`;
}
