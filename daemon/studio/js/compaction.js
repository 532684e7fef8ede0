// A compaction of a session's context (CONTRACT §15) in words: the live `compaction`
// event's data, or a summary as GET /sessions/{id}/messages lists it (fromSummary).
//
//   Context compacted · threshold · 41,200 → 9,800 tokens · 12 tool results pruned
//   Context compacted · manual · 3,100 → 650 tokens
//
// Counts are grouped with commas whatever the reader's locale, so the words are the
// same in every tab (and in tests).

const REASONS = {
  threshold: 'the estimate of what would be sent passed compact_at × context_tokens',
  overflow: 'the provider refused the request for its length',
  manual: 'asked for (POST /sessions/{id}/compact, veild compact)',
};

/** 41200 → "41,200". */
export function fmtCount(n) {
  return Math.round(Number(n) || 0).toLocaleString('en-US');
}

/** "N tool result(s) pruned", or '' when none was. */
export function prunedText(n) {
  const k = Number(n) || 0;
  return k > 0 ? `${fmtCount(k)} tool result${k === 1 ? '' : 's'} pruned` : '';
}

/** The divider's line. */
export function compactionText(d) {
  return ['Context compacted', d.reason || 'compacted',
    `${fmtCount(d.beforeTokens)} → ${fmtCount(d.afterTokens)} tokens`, prunedText(d.prunedToolResults)]
    .filter(Boolean).join(' · ');
}

/** Its tooltip: why it was compacted, and what the model is sent from then on. */
export function compactionTitle(d) {
  const why = REASONS[d.reason] || d.reason || '';
  const what = typeof d.summary === 'string'
    ? 'the model is sent the summary and the messages after it; every message is kept'
    : 'older tool results are sent as placeholders; every message is kept';
  return `${d.reason}: ${why} — ${what}`;
}

/** The summary fold's label: "Summary of the first 12 messages". */
export function summaryLabel(d) {
  const n = Number(d.coversUntil) || 0;
  return n > 0 ? `Summary of the first ${fmtCount(n)} message${n === 1 ? '' : 's'}` : 'Summary';
}

/** A summary of GET /sessions/{id}/messages as the live event's data. */
export function fromSummary(m) {
  return {
    reason: m.reason, beforeTokens: m.beforeTokens, afterTokens: m.afterTokens,
    prunedToolResults: m.prunedToolResults, summary: typeof m.content === 'string' ? m.content : null,
    coversUntil: m.coversUntil,
  };
}
