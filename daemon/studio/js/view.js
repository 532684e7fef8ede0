// The open session: its past turns (HTTP), then its running turn and every live event.
//
// One Body renders one turn's events into blocks (user message, thinking, text, tool
// calls). Streaming text goes into TextSinks (flush.js); a block that ends is rendered
// once (markdown) and marked `done` (content-visibility: auto). A sub-agent's turn is a
// ChildTurn inside the ToolCall that spawned it, with a Body of its own, so its own
// tool calls (and their sub-agents) nest the same way.
//
// A provider's retry or fallback (`provider.retry`, CONTRACT §14) is a notice where the
// call's answer would stream: live while it waits (a countdown), then a small past note
// that stays above the answer (retry.js has the words). A turn or call that waits for a
// slot (`turn.queued`, then `turn.admitted`) is a notice the same way (queue.js). A
// finished turn drawn from the store draws both again from its `notes` (GET …/turns:
// those events as published, each after how many of its messages it came), as past
// notes where the live view had them.
//
// A compaction of the context (CONTRACT §15) is a divider at its place in the turn that
// made it — from the live `compaction` event, or from a `summary` entry of the stored
// messages (`compaction` for one where pruning was enough; compaction.js has the words).
// Each turn is drawn from exactly one of the two (a finished turn from the store, a
// running one from the bus), so a divider is never doubled.
//
// A turn that survived the daemon (CONTRACT §18, resume.js): each live Body keeps the
// events it drew (its own and those of the sub-agents inside it); at a `turn.resumed` it
// is drawn again from them without the void ones — the lost attempt's partial text,
// tool output, tool calls, approval cards, usage — and the marker goes where the turn
// went on. Live and in a replay (a reload, another tab) alike: the same events give the
// same view. `turn.suspended` is a notice (the turn is waiting for the daemon), not an end.

import { markSandbox } from './agents.js';
import { api } from './api.js';
import { compactionText, compactionTitle, fromSummary, summaryLabel } from './compaction.js';
import { fmtCost, fmtDuration, fmtTime, fmtTokens, h, shortId } from './dom.js';
import { TextSink } from './flush.js';
import { renderMarkdown } from './markdown.js';
import { queueText } from './queue.js';
import { resumedCount, resumedText, resumedTitle, SUSPENDED_TEXT, voidText, withoutVoid } from './resume.js';
import { fallbackText, retryText } from './retry.js';
import { LONG, rawPieces, renderLater, textBlock } from './slices.js';

const DELIVERY = /^\[veild delivery from (?:session (\S+) \(agent "([^"]*)"\)|outside[^\]]*)(?:: ([^\]]*))?\]$/;

function triggerLabel(trigger) {
  return {
    http: 'chat', sse: 'chat', agent_spawn: 'spawned', agent_message: 'message',
    async_inform: 'async message', wake: 'wake', schedule: 'schedule', compact: 'compaction',
    openai: 'openai api',
  }[trigger] || trigger || 'turn';
}

function parseJson(text) {
  try { return JSON.parse(text); } catch { return null; }
}

// -- blocks -------------------------------------------------------------------------

class StreamBlock {
  constructor(parent, kind) {
    this.kind = kind;
    if (kind === 'thinking') {
      this.summary = h('summary', {}, h('span.label', { text: 'Thinking' }), h('span.spinner'));
      this.textEl = h('div.thinking-text');
      this.el = h('details.thinking.streaming', { 'data-testid': 'thinking', open: true },
        this.summary, this.textEl);
    } else {
      this.textEl = h('div.md.streaming', { 'data-testid': 'assistant-text' });
      this.el = this.textEl;
    }
    parent.append(this.el);
    this.sink = new TextSink(this.textEl, { pieces: true });
  }

  append(text) { this.sink.append(text); }

  finish() {
    this.sink.flush();
    const text = this.sink.text;
    if (this.kind === 'thinking') {
      const words = text.trim() ? text.trim().split(/\s+/).length : 0;
      this.summary.replaceChildren(h('span.label', { text: 'Thought' }), h('span.dim', { text: ` · ${words} words` }));
      this.el.open = false;  // collapsed: the element and its text stay
    } else if (text.length > LONG) {
      this.sink.seal();
      renderLater(this.textEl, text);  // in slices (slices.js)
    } else {
      renderInto(this.textEl, text);
    }
    this.el.classList.remove('streaming');
    this.el.classList.add('done');
  }
}

/** Markdown into `el`; should the renderer ever throw, the text as it is (one bad
 * message must not stop the events after it from being shown). */
function renderInto(el, text) {
  try {
    el.innerHTML = renderMarkdown(text);
  } catch (err) {
    console.error('markdown renderer failed; showing the text as it is', err);
    el.textContent = text;
  }
}

/** A compaction's divider (`d`: the `compaction` event's data): its line, and its
 * summary folded (rendered as markdown) when it summarised; none when pruning was enough. */
function compactionDivider(d) {
  const summarised = typeof d.summary === 'string';
  const el = h('div.compaction', {
    'data-testid': 'compaction', 'data-reason': d.reason || '',
    'data-before-tokens': String(d.beforeTokens ?? ''), 'data-after-tokens': String(d.afterTokens ?? ''),
    'data-pruned': String(d.prunedToolResults ?? 0), 'data-summarised': String(summarised),
    'data-covers-until': String(d.coversUntil ?? ''),
  }, h('div.compaction-line', { title: compactionTitle(d) },
    h('span.compaction-text', { text: compactionText(d) })));
  if (summarised) {
    const body = h('div.md.compaction-summary', { 'data-testid': 'compaction-summary' });
    renderInto(body, d.summary);
    el.append(h('details.compaction-fold', {}, h('summary', { text: summaryLabel(d) }), body));
  }
  return el;
}

function finishedText(parent, content) {
  const el = h('div.md.done', { 'data-testid': 'assistant-text' });
  if (content.length > LONG) {  // a session's history: long answers in slices too
    el.append(...rawPieces(content));
    renderLater(el, content);
  } else {
    renderInto(el, content);
  }
  parent.append(el);
  return el;
}

/**
 * A user message. `delivered` is what the daemon said of it — `{fromSessionId}` for a
 * message it took from the inbox (the `message` event's `delivered`, or a stored wake
 * turn's own message), else null — never what its text looks like: only then is a first
 * line in the delivery format (delivery_text.py) shown as where it came from, and a
 * session's only when the daemon named that same session. Anything else is the text as
 * typed, header-like first line included.
 */
function userBubble(content, label = 'user', delivered = null) {
  const lines = String(content).split('\n');
  const first = delivered && lines[0].length <= 1000 ? lines[0].match(DELIVERY) : null;
  const [, fromId, agent, kind] = first || [];
  if (!first || (fromId || null) !== (delivered.fromSessionId || null)) {
    return h('div.user-msg', { 'data-testid': 'user-message', 'data-from': '' },
      h('div.who', { text: label }), textBlock('div.user-text', String(content)));
  }
  const who = fromId
    ? h('div.who', {}, 'from ', h('a.session-link', { href: `#${fromId}`, 'data-open': fromId, text: `${agent} ${shortId(fromId)}` }), kind ? ` · ${kind}` : '')
    : h('div.who', { text: 'delivered from outside' });
  return h('div.user-msg.delivery', { 'data-testid': 'user-message', 'data-from': fromId || 'outside' },
    who, textBlock('div.user-text', lines.slice(1).join('\n')));
}

export class ToolCall {
  constructor(view, parent, { id, name, args, live, owner = null }) {
    this.view = view;
    this.owner = owner;  // the Body it is drawn in (a sub-agent's events are kept there too)
    this.id = id;
    this.name = name;
    this.children = new Map();
    this.streams = { current: null, kind: null };
    this.status = h('span.tool-status', { text: live ? 'running' : '' });
    if (live) this.status.append(h('span.spinner'));
    this.output = h('pre.tool-output', { 'data-testid': 'tool-output' });
    this.kids = h('div.tool-children');
    this.resultEl = h('div.tool-result', { hidden: true });
    this.el = h('div.tool', { 'data-testid': 'tool-call', 'data-tool-call-id': id, 'data-tool-name': name },
      h('div.tool-head', {}, h('span.tool-icon', { text: name === 'bash' ? '$' : name.startsWith('agent_') ? '⇢' : 'ƒ' }),
        h('span.tool-name', { text: name }), this.summary(args), this.status),
      this.argsDetail(args), this.kids, this.output, this.resultEl);
    if (!live) this.el.classList.add('done');
    parent.append(this.el);
    view.toolCalls.set(id, this);
  }

  summary(args) {
    if (this.name === 'bash' && args && typeof args.command === 'string') {
      return h('code.tool-arg', { text: args.command });
    }
    if (this.name === 'agent_spawn' && args && typeof args === 'object') {
      return h('span.tool-arg', {}, h('b', { text: args.agent || '?' }),
        args.wait === false ? h('span.pill', { text: 'no wait' }) : null,
        h('span.dim', { text: ` ${args.message || ''}` }));
    }
    if (this.name === 'agent_message' && args && typeof args === 'object') {
      return h('span.tool-arg', {}, h('b', { text: shortId(args.sessionId || '') }),
        h('span.dim', { text: ` ${args.message || ''}` }));
    }
    return h('code.tool-arg', { text: typeof args === 'string' ? args : JSON.stringify(args) });
  }

  argsDetail(args) {
    const text = typeof args === 'string' ? args : JSON.stringify(args, null, 2);
    return h('details.tool-args', {}, h('summary', { text: 'arguments' }), h('pre', { text }));
  }

  chunk(stream, content) {
    if (this.streams.kind !== stream) {
      // A new piece enters the page with its first text: never shown empty for a frame.
      const piece = h('span', { 'data-stream': stream, class: `out-${stream}` });
      this.streams = { kind: stream, sink: new TextSink(piece) };
      this.streams.sink.append(content);
      this.streams.sink.flush();
      this.output.append(piece);
      return;
    }
    this.streams.sink.append(content);
  }

  result({ content, isError, durationMs }) {
    if (this.streams.sink) this.streams.sink.flush();
    this.status.replaceChildren(document.createTextNode(
      [isError ? 'error' : 'ok', fmtDuration(durationMs)].filter(Boolean).join(' · ')));
    this.el.classList.toggle('failed', Boolean(isError));
    this.el.classList.add('done');
    this.resultEl.hidden = false;
    this.resultEl.className = `tool-result${isError ? ' error' : ''}`;
    const label = isError ? 'error' : 'result';
    if (this.output.childNodes.length || this.kids.childNodes.length) {
      // The output (or the sub-agent's turn) was shown as it streamed: the result, which
      // repeats it, folds away behind its last line.
      const last = String(content).trim().split('\n').pop() || '';
      this.resultEl.replaceChildren(h('details', {}, h('summary', {}, h('span.label', { text: label }),
        h('span.dim', { text: ` ${last.slice(0, 120)}` })), h('pre', { text: content })));
    } else {
      this.resultEl.replaceChildren(h('div.label', { text: label }), h('pre', { text: content }));
    }
    if (this.name === 'agent_spawn') {
      const answer = parseJson(content);
      const sid = (answer && answer.sessionId) || (String(content).match(/session (ses_[\w-]+)/) || [])[1];
      if (sid) this.view.spawned(this, sid, answer);
    }
  }

  stopped() {
    if (!this.el.classList.contains('done')) {
      if (this.streams.sink) this.streams.sink.flush();
      this.status.replaceChildren(document.createTextNode('stopped'));
      this.el.classList.add('done', 'failed');
    }
  }

  child(sessionId, agentName) {
    let child = this.children.get(sessionId);
    if (!child) {
      child = new ChildTurn(this.view, this.kids, sessionId, agentName, this.owner);
      this.children.set(sessionId, child);
      this.view.childTurns.set(sessionId, child);
    }
    return child;
  }
}

class Body {
  constructor(view, el, sessionId, who = 'user') {
    this.view = view;
    this.el = el;
    this.sessionId = sessionId;
    this.who = who;  // what a user message is, seen from here ('task' inside a sub-agent)
    this.open = null;
    this.prompted = false;
    this.approvals = new Map();
    this.retrying = null;  // the live notice of the running call's retry
    this.queued = null;  // the live notice of a wait for a slot: {el, text, d}
    this.route = null;     // the provider of the running call's last announcement
    this.compactOnly = false;  // a turn with trigger `compact`: it has no user message
    this.turnId = null;    // the turn drawn here (set by its TurnView or ChildTurn)
    this.host = null;      // that TurnView or ChildTurn (told of a suspend or resume)
    this.parentBody = null;  // a sub-agent's: the Body holding the tool call it is in
    // Every event drawn here while the turn can still be resumed, in seq order (its own
    // and its sub-agents'): what a `turn.resumed` draws it again from. null once over.
    this.log = [];
    this.usage = null;     // the turn's last (not void) `usage` data
    this.suspendedEl = null;
    this.gapNotice = null;  // the "part of this turn is no longer retained" notice
  }

  /** Keep `e` here and in every Body this one is drawn inside (each seq once). */
  record(e) {
    for (let body = this; body; body = body.parentBody) {
      const log = body.log;
      if (log && (!log.length || e.seq > log[log.length - 1].seq)) log.push(e);
    }
  }

  /** A `turn.resumed` of this turn: draw it again from its events without the void
   * ones (resume.js); the resumed event itself, last among them, draws the marker. */
  rebuild() {
    const counts = new Map();
    const events = withoutVoid(this.log, counts);
    this.clear();
    this.log = [];
    const view = this.view;
    const outer = view.rebuilding;
    view.rebuilding = counts;
    try {
      for (const e of events) {
        if (e.sessionId === this.sessionId && e.turnId === this.turnId) {
          this.apply(e);
        } else {
          const tool = e.spawnToolCallId && view.toolCalls.get(e.spawnToolCallId);
          if (tool) tool.child(e.sessionId, e.agentName).apply(e);
        }
      }
    } finally {
      view.rebuilding = outer;
    }
  }

  /** Forget everything drawn here (its tool calls and sub-agents too). */
  clear() {
    this.open = null;  // a block's sink may still flush: into a detached node
    if (this.retrying) clearTimeout(this.retrying.timer);
    this.retrying = null;
    this.queued = null;
    this.route = null;
    this.approvals.clear();
    this.usage = null;
    this.suspendedEl = null;
    const view = this.view;
    for (const el of this.el.querySelectorAll('[data-testid=tool-call]')) {
      if (view.toolCalls.get(el.dataset.toolCallId)?.el === el) view.toolCalls.delete(el.dataset.toolCallId);
    }
    for (const el of this.el.querySelectorAll('[data-testid=child-turn]')) {
      if (view.childTurns.get(el.dataset.sessionId)?.el === el) view.childTurns.delete(el.dataset.sessionId);
    }
    this.el.replaceChildren(...(this.gapNotice ? [this.gapNotice] : []));
  }

  /** turn.resumed, drawn: where the turn went on after the daemon was lost. */
  resumed(e) {
    const d = e.data || {};
    this.finishOpen();
    const dropped = this.view.rebuilding instanceof Map ? this.view.rebuilding.get(e.seq) || 0 : 0;
    this.el.append(h('div.turn-resumed', {
      'data-testid': 'turn-resumed', 'data-attempt': String(d.attempt ?? ''), 'data-reason': d.reason || '',
      'data-after-seq': String(d.afterSeq ?? ''), 'data-node': d.node || '', 'data-voided': String(dropped),
      title: resumedTitle(d),
    }, h('span.resumed-icon', { text: '↻' }), h('b', { text: resumedText(d) }),
    h('span.dim', { text: ` — ${voidText(dropped)}` })));
    this.host?.onResumed?.(d);
  }

  /** turn.suspended: the daemon stopped it at a graceful stop; it waits for the next start. */
  suspended(e) {
    const d = e.data || {};
    this.finishOpen();
    this.suspendedEl = h('div.turn-suspended', { 'data-testid': 'turn-suspended', 'data-reason': d.reason || '' },
      h('span.suspended-icon', { text: '‖' }), h('span', { text: SUSPENDED_TEXT }));
    this.el.append(this.suspendedEl);
    this.host?.onSuspended?.(d);
  }

  finishOpen() {
    if (this.open) {
      this.open.finish();
      this.open = null;
    }
  }

  stream(kind, text) {
    if (!this.open || this.open.kind !== kind) {
      this.finishOpen();
      this.open = new StreamBlock(this.el, kind);
    }
    this.open.append(text);
  }

  apply(e) {
    const d = e.data || {};
    this.record(e);
    if (e.eventType === 'turn.resumed' && !this.view.rebuilding) {
      this.rebuild();  // it draws this event too, last
      return;
    }
    // Anything of the call (or the turn's end) after a retry: the retry was made.
    if (this.retrying && e.eventType !== 'provider.retry' && e.eventType !== 'usage'
        && e.eventType !== 'turn.resumed' && e.eventType !== 'turn.suspended') this.settle(e.eventType);
    switch (e.eventType) {
      case 'thinking.chunk': this.stream('thinking', d.content); break;
      case 'inference.chunk': this.stream('text', d.content); break;
      case 'inference.tool':
        this.finishOpen();
        new ToolCall(this.view, this.el, { id: d.toolCallId, name: d.name, args: d.arguments, live: true, owner: this });
        break;
      case 'tool.chunk': this.view.toolCalls.get(d.toolCallId)?.chunk(d.stream, d.content); break;
      case 'tool.result': this.view.toolCalls.get(d.toolCallId)?.result(d); break;
      case 'provider.retry': this.retry(e); break;
      case 'turn.queued': this.queue(e.data || {}); break;
      case 'turn.admitted': this.admitted(e.data || {}); break;
      case 'compaction':
        this.finishOpen();
        this.el.append(compactionDivider(d));
        break;
      case 'message':
        this.route = null;  // a call ended: the next one starts at the agent's provider
        if (d.role === 'user') {
          this.finishOpen();
          if (this.compactOnly && !d.content) break;  // a compaction's turn: no bubble
          this.el.append(userBubble(d.content, this.who, d.delivered ? { fromSessionId: d.fromSessionId } : null));
        } else if (d.role === 'assistant') {
          this.finishOpen();
        }
        break;
      case 'approval.request': this.approval(e); break;
      case 'approval.result': this.decided(d); break;
      case 'usage': this.usage = d; break;
      case 'turn.resumed': this.resumed(e); break;
      case 'turn.suspended': this.suspended(e); break;
      case 'done': case 'error': this.admitted(null); this.end(); break;
      default: break;
    }
  }

  /** turn.queued: a live notice while the turn (or its call) waits for a slot. */
  queue(d) {
    this.finishOpen();
    this.admitted(null);
    const text = h('span.queue-text', { text: queueText(d, 'waiting') });
    const el = h('div.turn-queued', {
      'data-testid': 'turn-queued', 'data-reason': d.reason || '', 'data-state': 'waiting',
      'data-provider': d.provider || '',
    }, h('span.spinner'), text);
    this.el.append(el);
    this.queued = { el, text, d };
  }

  /** turn.admitted (d), or the turn's end while it waited (null): the notice stays as a
   * past note. */
  admitted(d) {
    const notice = this.queued;
    if (!notice) return;
    this.queued = null;
    notice.el.querySelector('.spinner')?.remove();
    notice.el.classList.add('past');
    notice.el.dataset.state = d ? 'admitted' : 'ended';
    notice.text.textContent = queueText(d ? { ...notice.d, ...d } : notice.d, notice.el.dataset.state);
  }

  approval(e) {
    const d = e.data;
    // The approval's own session decides (a sub-agent's, when shown inside its parent).
    const path = `/sessions/${encodeURIComponent(e.sessionId)}/approvals/${encodeURIComponent(d.approvalId)}`;
    const approve = h('button.btn.primary', { type: 'button', 'data-testid': 'approve', text: 'Allow' });
    const deny = h('button.btn.danger', { type: 'button', 'data-testid': 'deny', text: 'Deny' });
    const reason = h('input.approval-reason', {
      type: 'text', 'data-testid': 'deny-reason', 'aria-label': 'Reason (sent with Deny)',
      placeholder: 'reason (optional, sent with Deny)', maxlength: '2000',
    });
    const decide = async (decision) => {
      approve.disabled = true;
      deny.disabled = true;
      const body = { decision };
      if (decision === 'deny' && reason.value.trim()) body.reason = reason.value.trim();
      try {
        await api(path, { method: 'POST', body });
      } catch (err) {
        approve.disabled = false;
        deny.disabled = false;
        this.view.onError(err);
      }
    };
    approve.addEventListener('click', () => decide('allow'));
    deny.addEventListener('click', () => decide('deny'));
    reason.addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter') { ev.preventDefault(); decide('deny'); }
    });
    const el = h('div.approval', { 'data-testid': 'approval', 'data-approval-id': d.approvalId },
      h('div.approval-text', {}, h('b', { text: `${d.toolName}` }), ' waits for your approval',
        d.expiresAt ? h('span.dim', { text: ` · expires ${fmtTime(d.expiresAt)}` }) : null),
      h('pre.approval-args', { text: JSON.stringify(d.arguments, null, 2) }),
      h('div.approval-actions', {}, approve, deny, reason));
    const tool = this.view.toolCalls.get(d.toolCallId);
    if (tool) tool.status.replaceChildren(document.createTextNode('waiting for approval'));
    // Above the call's output and result: it comes before them.
    if (tool) tool.el.insertBefore(el, tool.kids); else this.el.append(el);
    this.approvals.set(d.approvalId, el);
  }

  /** approval.result: the request goes, the decision stays in its tool call. */
  decided(d) {
    const pending = this.approvals.get(d.approvalId);
    this.approvals.delete(d.approvalId);
    const text = {
      allow: 'allowed', deny: 'denied', expired: 'expired: no decision in time',
      cancelled: 'cancelled with its turn',
    }[d.decision] || d.decision;
    const el = h(`div.approval-decision.${d.decision}`, {
      'data-testid': 'approval-decision', 'data-approval-id': d.approvalId, 'data-decision': d.decision,
    }, h('b', { text: 'approval ' }), text, d.reason ? h('span.reason', { text: ` · ${d.reason}` }) : null);
    const tool = this.view.toolCalls.get(d.toolCallId);
    if (pending) pending.replaceWith(el);
    else if (tool) tool.el.insertBefore(el, tool.kids);
    else this.el.append(el);
    if (tool && !tool.el.classList.contains('done')) {
      const status = d.decision === 'allow' ? 'running' : text;
      tool.status.replaceChildren(document.createTextNode(status));
      if (d.decision === 'allow') tool.status.append(h('span.spinner'));
    }
  }

  /** provider.retry: a live notice (a retry's countdown) or a fallback's note. */
  retry(e) {
    const d = e.data || {};
    this.finishOpen();
    this.settle('provider.retry');
    const from = this.route;
    this.route = d.provider;
    const text = h('span.retry-text');
    const el = h('div.provider-retry', {
      'data-testid': 'provider-retry', 'data-provider': d.provider, 'data-model': d.model,
      'data-attempt': d.attempt, 'data-max-retries': d.maxRetries, 'data-wait-ms': d.waitMs,
      'data-status': d.status ?? '', 'data-fallback': String(Boolean(d.fallback)),
      title: d.error || '',
    });
    this.el.append(el);
    if (d.fallback) {
      el.dataset.state = 'fallback';
      el.classList.add('fallback');  // done at once: a note from the start
      text.textContent = fallbackText(d, from);
      el.append(h('span.retry-icon', { text: '⇢' }), text);
      return;
    }
    el.dataset.state = 'waiting';
    el.append(h('span.spinner'), text);
    // From when the daemon announced it (a replayed notice counts down what is left).
    const now = Date.now();
    const notice = { el, text, d, start: Math.min(now, e.ts || now), timer: null };
    this.retrying = notice;
    this.tick(notice);
  }

  tick(notice) {
    if (this.retrying !== notice || !notice.el.isConnected) return;
    const left = (notice.d.waitMs || 0) - (Date.now() - notice.start);
    notice.text.textContent = retryText(notice.d, 'waiting', left);
    if (left > 0) {
      // At the next whole second of the countdown (a wait under a second: at its end).
      const next = notice.d.waitMs < 1000 ? left : left % 1000 || 1000;
      notice.timer = setTimeout(() => this.tick(notice), next + 5);
    } else {
      notice.el.dataset.state = 'retrying';  // the request is being made again
    }
  }

  /** The live notice becomes a past note: retried, or the turn ended during its wait. */
  settle(kind) {
    const notice = this.retrying;
    if (!notice) return;
    this.retrying = null;
    clearTimeout(notice.timer);
    const { el, text, d } = notice;
    el.querySelector('.spinner')?.remove();
    el.classList.add('past');
    const ended = (kind === 'done' || kind === 'error') && el.dataset.state === 'waiting';
    el.dataset.state = ended ? 'ended' : 'retried';
    text.textContent = retryText(d, el.dataset.state);
  }

  end() {
    this.finishOpen();
    this.log = null;  // over: it cannot be resumed any more
    if (this.suspendedEl) {  // suspended, then ended (not resumed): a past note
      this.suspendedEl.classList.add('past');
      this.suspendedEl = null;
    }
    for (const el of this.approvals.values()) el.remove();
    this.approvals.clear();
    for (const tool of this.el.querySelectorAll('[data-testid=tool-call]:not(.done)')) {
      this.view.toolCalls.get(tool.dataset.toolCallId)?.stopped();
    }
  }

  /** A stored turn's messages (GET /sessions/{id}/messages), rendered finished, with
   * its notes (`turn.notes`: its queued and retry events, each `after` that many of its
   * messages) drawn where the live view drew them. A user message's origin is what the
   * store kept of it (`delivered`, `fromSessionId`: its `message` event's words); a
   * wake turn's own message, stored before that was kept, is its delivery from the
   * turn's `fromSessionId`. */
  past(messages, turn = {}) {
    this.log = null;  // drawn from the store: nothing of it is replayed
    const notes = Array.isArray(turn.notes) ? turn.notes : [];
    let next = 0;  // the next note to draw
    let count = 0;  // the turn's messages drawn so far
    // Its notes that came after `count` messages (and, before a divider, before it).
    const drawNotes = (before = Infinity) => {
      while (next < notes.length && (notes[next].after ?? 0) <= count
             && (notes[next].ts ?? 0) < before) {
        this.pastNote(notes[next]);
        next += 1;
      }
    };
    let own = true;
    for (const m of messages) {
      if (m.role === 'summary' || m.role === 'compaction') {
        drawNotes(m.createdAt ?? Infinity);
        this.el.append(compactionDivider(fromSummary(m)));
        continue;
      }
      drawNotes();
      if (this.retrying) this.settle('message');  // the call after a retry: it was made
      this.route = null;  // a call ended: the next one starts at the agent's provider
      count += 1;
      if (m.role === 'user') {
        if (turn.trigger === 'compact' && !m.content) continue;  // a compaction's turn
        let delivered = m.delivered ? { fromSessionId: m.fromSessionId ?? null } : null;
        if (!delivered && own && turn.trigger === 'wake') delivered = { fromSessionId: turn.fromSessionId };
        own = false;
        this.el.append(userBubble(m.content, 'user', delivered));
      } else if (m.role === 'system') {  // a session's own system prompt (§17: seeded)
        this.el.append(userBubble(m.content, 'system'));
      } else if (m.role === 'assistant') {
        if (m.content) finishedText(this.el, m.content);
        for (const call of m.toolCalls || []) {
          new ToolCall(this.view, this.el, { id: call.id, name: call.name, args: call.arguments, live: false, owner: this });
        }
      } else if (m.role === 'tool') {
        this.view.toolCalls.get(m.toolCallId)?.result({ content: m.content, isError: null, durationMs: null });
      }
    }
    drawNotes();
    this.pastEnd(turn);
  }

  /** One stored note, drawn as its live event was. */
  pastNote(n) {
    this.apply({ eventType: n.eventType, data: n.data || {}, ts: n.ts, seq: 0 });
  }

  /** The stored turn's end, for its notes: a retry's wait the end cut short is "not
   * retried" (live: the end came while it counted down), one over by then was made; a
   * wait for a slot it never got ended with the turn. */
  pastEnd(turn) {
    const notice = this.retrying;
    if (notice) {
      clearTimeout(notice.timer);
      const cut = turn.endedAt != null && turn.endedAt - notice.start < (notice.d.waitMs || 0);
      notice.el.dataset.state = cut ? 'waiting' : 'retrying';
      this.settle(turn.terminal === 'error' ? 'error' : 'done');
    }
    this.admitted(null);
  }
}

// How a `done` whose answer did not simply stop says so (CONTRACT §14.1, finishReason).
const CUT_LABELS = { length: 'cut off', content_filter: 'filtered' };

/** The mark after a cut answer's text in the transcript. */
function markCut(bodyEl, finishReason) {
  const label = CUT_LABELS[finishReason];
  // The turn's own text: a sub-agent's, shown inside its tool call, is not its answer.
  const texts = [...bodyEl.querySelectorAll('[data-testid=assistant-text]')]
    .filter((el) => !el.closest('[data-testid=child-turn]'));
  const last = texts[texts.length - 1];
  if (!label || !last || last.nextElementSibling?.dataset.testid === 'cut-mark') return;
  last.classList.add('cut');
  last.after(h('div.cut-mark', { 'data-testid': 'cut-mark', text: `— ${label}: the answer reached its length limit` }));
}

function terminalBadge(kind, d) {
  const bits = [];
  if (d.durationMs !== undefined && d.durationMs !== null) bits.push(fmtDuration(d.durationMs));
  const u = d.tokenUsage;
  if (u) bits.push(`${fmtTokens((u.input || 0) + (u.output || 0))} tokens`);
  if (u && u.cost) bits.push(fmtCost(u.cost));
  if (d.model) bits.push(d.model);
  if (d.resumed) bits.push(resumedCount(d.resumed));
  if (kind === 'done') {
    // CONTRACT §14.1: an answer the provider cut at its limit is said so.
    const cut = CUT_LABELS[d.finishReason];
    return h('div.terminal-badge.done', { 'data-finish-reason': d.finishReason || 'stop' },
      h('b', { text: '✓ done' }), cut ? h('span.cut', { 'data-testid': 'cut-off', text: ` · ${cut}` }) : null,
      bits.length ? h('span.dim', { text: ` · ${bits.join(' · ')}` }) : null);
  }
  const reason = d.details && d.details.reason;
  return h('div.terminal-badge.error', {}, h('b', { text: d.code || 'error' }),
    reason ? h('span.reason', { text: ` ${reason}` }) : null,
    d.message && d.code !== 'CANCELLED' ? h('span.msg', { text: ` · ${d.message}` }) : null,
    bits.length ? h('span.dim', { text: ` · ${bits.join(' · ')}` }) : null);
}

class ChildTurn {
  constructor(view, parent, sessionId, agentName, owner = null) {
    this.view = view;
    this.sessionId = sessionId;
    this.turnId = null;  // the spawn turn shown here; 'past' when shown from the store
    this.agentName = agentName;
    this.statusEl = h('span.status-dot');
    this.terminalEl = h('span.child-terminal');
    this.sandboxEl = h('span.sandbox-slot');
    const open = h('a.open-child', { href: `#${sessionId}`, 'data-open': sessionId, text: 'open ↗', title: 'open this session' });
    this.bodyEl = h('div.child-body');
    this.el = h('div.child-turn', { 'data-testid': 'child-turn', 'data-session-id': sessionId, 'data-status': 'idle' },
      h('div.child-head', {}, this.statusEl, h('span.agent', { text: agentName || 'sub-agent' }),
        h('span.sid', { text: shortId(sessionId) }), this.sandboxEl, this.terminalEl, open),
      this.bodyEl);
    parent.append(this.el);
    this.body = new Body(view, this.bodyEl, sessionId, 'task');
    this.body.parentBody = owner;
    this.body.host = this;
    markSandbox(this.sandboxEl, agentName);
    this.status(view.tree.get(sessionId));
  }

  /** Its session changed in the tree (also: what is known of the agents did). */
  status(s) {
    if (!s) return;
    this.el.dataset.status = s.status;
    this.statusEl.className = `status-dot ${s.status}${s.retry ? ' retrying' : ''}${s.suspended ? ' suspended' : ''}`;
    markSandbox(this.sandboxEl, this.agentName || s.agentName);
  }

  apply(e) {
    if (e.type !== 'session.stream') return;
    if (this.turnId === null) {
      if (e.eventType !== 'turn.start' || e.data.trigger !== 'agent_spawn') return;
      this.turnId = e.turnId;
      this.body.turnId = e.turnId;
    }
    if (e.turnId !== this.turnId) return;
    this.body.apply(e);
    if (e.eventType === 'done' || e.eventType === 'error') {
      const d = e.data;
      this.el.dataset.terminal = e.eventType;
      this.el.dataset.errorCode = e.eventType === 'error' ? d.code || '' : '';
      this.el.dataset.cancelReason = (d.details && d.details.reason) || '';
      this.terminalEl.replaceChildren(e.eventType === 'done'
        ? h(d.finishReason === 'length' ? 'span.badge.done.cut' : 'span.badge.done', { text: d.finishReason === 'length' ? 'cut off' : 'done' })
        : h('span.badge.error', { text: (d.details && d.details.reason) || d.code }));
      this.el.classList.add('done');
      this.el.dataset.suspended = '';
    }
  }

  onSuspended(d) { this.el.dataset.suspended = d.reason || 'shutdown'; }

  onResumed(d) {
    this.el.dataset.suspended = '';
    this.el.dataset.resumed = String(d.attempt ?? '');
  }

  /** Shown from the store: its final answer, from the spawn's result or its messages. */
  async past(answer) {
    this.turnId = 'past';
    if (answer && typeof answer.content === 'string') {
      finishedText(this.bodyEl, answer.content);
      return;
    }
    try {
      const { messages } = await api(`/sessions/${encodeURIComponent(this.sessionId)}/messages`);
      const first = messages.length ? messages[0].turnId : null;
      const answerMsg = messages.filter((m) => m.turnId === first && m.role === 'assistant' && m.content).pop();
      if (answerMsg) finishedText(this.bodyEl, answerMsg.content);
    } catch (err) {
      this.view.onError(err);
    }
  }
}

class TurnView {
  constructor(view, parent, turnId, meta) {
    this.view = view;
    this.turnId = turnId;
    this.trigger = h('span.trigger');
    this.from = h('span.from');
    this.time = h('span.time');
    this.footer = h('div.turn-foot');
    this.bodyEl = h('div.turn-body');
    this.el = h('article.turn', { 'data-testid': 'turn', 'data-turn-id': turnId, 'data-terminal': '', 'data-error-code': '', 'data-cancel-reason': '' },
      h('div.turn-head', {}, this.trigger, this.from, this.time), this.bodyEl, this.footer);
    parent.append(this.el);
    this.body = new Body(view, this.bodyEl, view.sessionId);
    this.body.turnId = turnId;
    this.body.host = this;
    this.meta(meta || {});
  }

  /** Its last `usage` that is not void (a resume draws the body again). */
  get usage() { return this.body.usage; }

  onSuspended(d) { this.el.dataset.suspended = d.reason || 'shutdown'; }

  onResumed(d) {
    this.el.dataset.suspended = '';
    this.el.dataset.resumed = String(d.attempt ?? '');
    const u = this.body.usage;  // the lost call's usage is void
    this.view.budgetInfo = u && u.budgetTokens ? u : null;
  }

  meta({ trigger, fromSessionId, startedAt, schedule }) {
    if (trigger) {
      // A scheduled turn names its schedule (CONTRACT §11): `schedule nightly`.
      this.trigger.textContent = schedule ? `${triggerLabel(trigger)} ${schedule}` : triggerLabel(trigger);
      this.el.dataset.trigger = trigger;
      this.el.dataset.schedule = schedule || '';
      this.body.compactOnly = trigger === 'compact';
    }
    if (fromSessionId) {
      const from = this.view.tree.get(fromSessionId);
      this.from.replaceChildren('from ', h('a.session-link', { href: `#${fromSessionId}`, 'data-open': fromSessionId, text: `${from ? from.agentName : 'session'} ${shortId(fromSessionId)}` }));
    }
    if (startedAt) this.time.textContent = fmtTime(startedAt);
  }

  get running() { return !this.el.dataset.terminal; }

  terminal(kind, d) {
    this.el.dataset.terminal = kind;
    this.el.dataset.errorCode = kind === 'error' ? d.code || '' : '';
    this.el.dataset.cancelReason = kind === 'error' ? (d.details && d.details.reason) || d.cancelReason || '' : '';
    this.el.dataset.suspended = '';
    if (d.resumed) this.el.dataset.resumed = String(d.resumed);
    this.el.dataset.finishReason = kind === 'done' ? d.finishReason || 'stop' : '';
    this.footer.replaceChildren(terminalBadge(kind, d));
    if (kind === 'done') markCut(this.bodyEl, d.finishReason);
    this.el.classList.add('ended', 'done');
  }

  apply(e) {
    const d = e.data || {};
    if (e.eventType === 'turn.start') this.meta({ trigger: d.trigger, fromSessionId: d.fromSessionId, startedAt: e.ts, schedule: d.schedule });
    else if (e.eventType === 'usage') this.view.budget(d);
    this.body.apply(e);
    if (e.eventType === 'done' || e.eventType === 'error') {
      this.terminal(e.eventType, d);
      if (this.gapped) this.view.reload();
    }
  }
}

// -- the view -------------------------------------------------------------------------

export class View {
  constructor({ el, tree, onError, onHeader }) {
    this.el = el;
    this.tree = tree;
    this.onError = onError;
    this.onHeader = onHeader;  // (session, view) => void: header, usage, controls
    this.sessionId = null;
    this.gen = 0;
    this.reset();
  }

  reset() {
    this.gapSeen = null;
    this.turns = new Map();
    this.pastTurns = new Set();
    this.toolCalls = new Map();
    this.childTurns = new Map();
    this.budgetInfo = null;
    this.rebuilding = false;  // while a resumed turn is drawn again: resumed seq -> events dropped
    this.el.replaceChildren();
  }

  close() {
    this.gen += 1;
    this.sessionId = null;
    this.reset();
    this.el.dataset.sessionId = '';
    this.el.hidden = true;
  }

  /**
   * Open a session: render its finished turns from HTTP; return the seq from which the
   * bus must be replayed so that its running turns (and those of running sub-agents
   * shown in past tool calls) are shown from their start. The caller replays from it.
   */
  async open(sessionId, cursor) {
    const gen = ++this.gen;
    this.sessionId = sessionId;
    this.reset();
    this.el.dataset.sessionId = sessionId;
    this.el.hidden = false;
    this.el.classList.add('loading');
    const path = `/sessions/${encodeURIComponent(sessionId)}`;
    const [{ turns }, { messages }] = await Promise.all([api(`${path}/turns`), api(`${path}/messages`)]);
    if (gen !== this.gen) return null;
    let since = cursor;
    const byTurn = new Map();
    for (const m of messages) {
      if (!byTurn.has(m.turnId)) byTurn.set(m.turnId, []);
      byTurn.get(m.turnId).push(m);
    }
    const known = new Set(turns.map((t) => t.turnId));
    const legacy = [...byTurn.keys()].filter((id) => !known.has(id));
    for (const id of legacy) {  // messages stored before turns were recorded with them
      const turn = new TurnView(this, this.el, id || 'earlier', {});
      turn.body.past(byTurn.get(id));
      this.pastTurns.add(id);
    }
    for (const t of turns) {
      if (t.terminal) {
        const turn = new TurnView(this, this.el, t.turnId, t);
        turn.body.past(byTurn.get(t.turnId) || [], t);
        // What the live terminal said, as the turns list keeps it (CONTRACT §14.1).
        turn.terminal(t.terminal, { code: t.errorCode, cancelReason: t.cancelReason, details: t.cancelReason ? { reason: t.cancelReason } : null, tokenUsage: t.tokenUsage, model: t.model, message: t.error ? t.error.message : '', finishReason: t.finishReason, resumed: t.resumed });
        turn.el.classList.add('done');
        this.pastTurns.add(t.turnId);
      } else if (t.startSeq) {
        since = Math.min(since, t.startSeq - 1);
      }
    }
    // Running sub-agents shown inside past tool calls (a no-wait spawn outlives its turn).
    for (const child of this.childTurns.values()) {
      const s = this.tree.get(child.sessionId);
      if (child.turnId === 'live' && s && s.status === 'running') {
        try {
          const r = await api(`/sessions/${encodeURIComponent(child.sessionId)}/turns`);
          if (gen !== this.gen) return null;
          const spawn = r.turns.find((t) => t.trigger === 'agent_spawn' && !t.terminal && t.startSeq);
          if (spawn) since = Math.min(since, spawn.startSeq - 1);
        } catch (err) {
          this.onError(err);
        }
        child.turnId = null;
      }
    }
    this.el.classList.remove('loading');
    this.onHeader(this.tree.get(sessionId), this);
    return Math.max(0, since);
  }

  /** A finished agent_spawn call named its child: show it there. */
  spawned(tool, childId, answer) {
    const s = this.tree.get(childId);
    const child = tool.child(childId, s ? s.agentName : undefined);
    // Live: the child's own events fill it. From the store: its answer, unless it still
    // runs (a no-wait spawn outlives its turn): then open() replays its running turn.
    if (!this.el.classList.contains('loading') || child.turnId !== null) return;
    if (s && s.status === 'running' && !(answer && typeof answer.content === 'string')) {
      child.turnId = 'live';
    } else {
      child.past(answer);
    }
  }

  /** One bus event, in seq order, each at most once. */
  apply(e) {
    if (!this.sessionId || this.el.classList.contains('loading')) return;
    if (e.sessionId === this.sessionId) {
      if (e.type !== 'session.stream' || this.pastTurns.has(e.turnId)) return;
      let turn = this.turns.get(e.turnId);
      if (!turn) {
        turn = new TurnView(this, this.el, e.turnId, {});
        this.turns.set(e.turnId, turn);
        if (e.eventType === 'turn.start') this.budgetInfo = null;
        else if (this.gapSeen) this.markGapped(turn, this.gapSeen);  // its start is gone
      }
      turn.apply(e);
      if (e.eventType === 'usage' || e.eventType === 'done' || e.eventType === 'error' || e.eventType === 'turn.start'
          || e.eventType === 'turn.resumed') {
        this.onHeader(this.tree.get(this.sessionId), this);
      }
      return;
    }
    if (!e.spawnToolCallId) return;
    const tool = this.toolCalls.get(e.spawnToolCallId);
    if (!tool) return;
    tool.child(e.sessionId, e.agentName).apply(e);
  }

  /** The bus could not replay some events: say so; a turn that had a hole reloads at its end. */
  gap(g) {
    this.gapSeen = g;
    for (const turn of this.turns.values()) if (turn.running) this.markGapped(turn, g);
  }

  markGapped(turn, g) {
    if (turn.gapped) return;
    turn.gapped = true;
    turn.bodyEl.prepend(turn.body.gapNotice = h('div.notice', { text: `Part of this turn's live output (events ${g.from}–${g.to}) is no longer retained by the daemon; its stored transcript is shown when it ends.` }));
  }

  reload() {
    if (this.sessionId) this.onReload?.(this.sessionId);
  }

  sessionChanged(s) {
    const child = this.childTurns.get(s.id);
    if (child) child.status(s);
    if (s.id === this.sessionId) this.onHeader(s, this);
  }

  budget(usage) {
    if (usage.budgetTokens) this.budgetInfo = usage;
  }

  /** The running turn's live usage (not yet in the session's totals). */
  liveUsage() {
    for (const turn of this.turns.values()) if (turn.running && turn.usage) return turn.usage.tokenUsage;
    return null;
  }
}
