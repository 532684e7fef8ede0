// The session tree: every session, children under their parent in spawn order, live.
//
// The model (one object per session) is updated from new bus events and from HTTP
// loads; each session's row is one element that is updated in place. Rows stay in the
// page when a subtree is collapsed (only hidden), so every session always has its row.

import { markSandbox } from './agents.js';
import { api } from './api.js';
import { fmtCost, fmtTokens, h, shortId } from './dom.js';
import { queueText } from './queue.js';
import { forkMark } from './rewind.js';
import { cause, fallbackText } from './retry.js';

const TERMINAL_FETCH_CONCURRENCY = 4;
const OVER_KEPT = 2000;
// How long after a stored retry's wait a tab opened then still shows the session as
// retrying (the retried request has not streamed yet, or nothing said so since).
const RETRY_SHOWN_MS = 10_000;

export class Tree {
  constructor(el, { onOpen, onChange, onError, onRemove }) {
    this.el = el;
    this.onOpen = onOpen;
    this.onRemove = onRemove;  // (id) => void, after a session (and its row) is gone
    this.onChange = onChange;  // (session) => void, after any change of a session
    this.onError = onError;
    this.sessions = new Map();
    this.selected = null;
    this.terminalQueue = [];
    // Approvals and turns known to be over, so that a GET /approvals answered before
    // their end (but read after it) does not bring them back. Bounded.
    this.over = new Set();
    this.terminalWorkers = 0;
    el.addEventListener('keydown', (e) => this.key(e));
    el.addEventListener('focus', (e) => {
      if (e.target === el) this.focusRow(this.selected || this.firstVisible());
    });
  }

  get(id) { return this.sessions.get(id); }

  // -- model ------------------------------------------------------------------------

  /** Insert or update a session from its wire form; `fromHttp` loses to newer live state. */
  upsert(wire, { fromHttp = false, spawnToolCallId } = {}) {
    let s = this.sessions.get(wire.id);
    if (!s) {
      s = {
        id: wire.id, agentName: wire.agentName, parentSessionId: wire.parentSessionId || null,
        depth: wire.depth || 0, createdAt: wire.createdAt || 0, updatedAt: -1,
        status: 'idle', tokenUsage: { input: 0, output: 0, cache: 0, cost: 0 }, model: null,
        terminal: null, terminalKnown: false, live: null, approvals: new Map(),
        retry: null,  // while its running call is retried: {fallback, text, provider}
        queued: null,  // while its turn (or call) waits for a slot: the words
        suspended: '',  // its turn was suspended at a shutdown (§18): the reason
        // The running turn's usage events ([seq, turnId, tokenUsage]): a resume (§18)
        // goes back to the last one that is not void. Also each pending approval's seq.
        usages: [], approvalSeqs: new Map(),
        spawnToolCallId: spawnToolCallId || null, dom: null,
        forkedFrom: wire.forkedFrom || null,  // CONTRACT §19: where a fork came from
      };
      this.sessions.set(s.id, s);
      this.mount(s);
      if (fromHttp) this.wantTerminal(s);
    }
    if (spawnToolCallId) s.spawnToolCallId = spawnToolCallId;
    const newer = fromHttp ? (wire.updatedAt || 0) > s.updatedAt : true;
    if (newer) {
      if (wire.status) s.status = wire.status;
      if (wire.tokenUsage) s.tokenUsage = wire.tokenUsage;
      if (wire.model) s.model = wire.model;
      s.updatedAt = Math.max(s.updatedAt, wire.updatedAt || 0);
      if (s.status !== 'running') {
        s.live = null;
        s.retry = null;
        s.queued = null;
        s.usages = [];
      }
    }
    this.render(s);
    return s;
  }

  /** A session seen only through an event's envelope (not listed yet). */
  ensure(e) {
    return this.sessions.get(e.sessionId) || this.upsert({
      id: e.sessionId, agentName: e.agentName, parentSessionId: e.parentSessionId,
      depth: e.depth, createdAt: e.ts, updatedAt: 0, status: 'idle',
    }, { fromHttp: true, spawnToolCallId: e.spawnToolCallId });
  }

  remove(id) {
    const s = this.sessions.get(id);
    if (!s) return;
    this.sessions.delete(id);
    s.dom.node.remove();
    if (this.selected === id) this.selected = null;
    this.countChanged();
    this.onRemove(id);
  }

  /** A new event from the bus (each seen once, in seq order). */
  apply(e) {
    switch (e.type) {
      case 'session.created': this.upsert(e.session, { spawnToolCallId: e.spawnToolCallId }); return;
      case 'session.updated': this.upsert(e.session); return;
      case 'session.rewound': this.upsert(e.session); return;  // CONTRACT §19
      case 'session.deleted': this.remove(e.session.id); return;
      case 'session.stream': break;
      default: return;
    }
    const type = e.eventType;
    if (type === 'inference.chunk' || type === 'thinking.chunk' || type === 'tool.chunk') {
      const s = this.sessions.get(e.sessionId);
      if (s) s.seenLive = true;
      if (s && s.retry) this.retried(s);  // the retried call streams
      return;
    }
    const s = this.ensure(e);
    const d = e.data;
    s.seenLive = true;  // newer than what its stored notes say (noted)
    if (type === 'provider.retry') {
      // A subtle state of the row while the call is retried (the notice is in the view).
      s.retry = {
        fallback: Boolean(d.fallback),
        text: d.fallback ? fallbackText(d, s.retry && s.retry.provider) : `${cause(d)}: retry ${d.attempt} of ${d.maxRetries}`,
        provider: d.provider,
      };
      this.render(s);
      return;
    }
    if (s.retry && type !== 'usage') this.retried(s);
    if (type === 'turn.queued' || type === 'turn.admitted') {
      s.queued = type === 'turn.queued' ? queueText(d, 'waiting') : null;
      this.render(s);
      return;
    }
    if (type === 'turn.start') {
      s.live = null;
      s.usages = [];
      s.suspended = '';
      this.render(s);
    } else if (type === 'turn.suspended') {
      s.suspended = d.reason || 'shutdown';
      this.render(s);
    } else if (type === 'turn.resumed') {
      this.resumed(s, e);
    } else if (type === 'usage') {
      s.live = d.tokenUsage;
      s.usages.push([e.seq, e.turnId, d.tokenUsage]);
      this.render(s);
    } else if (type === 'done' || type === 'error') {
      s.terminal = type === 'done' ? { terminal: 'done', code: '', reason: '', finish: d.finishReason || 'stop' }
        : { terminal: 'error', code: d.code || '', reason: (d.details && d.details.reason) || '' };
      s.terminalKnown = true;
      s.live = null;
      s.queued = null;
      s.usages = [];
      s.suspended = '';
      for (const [id, turnId] of s.approvals) if (turnId === e.turnId) s.approvals.delete(id);
      this.isOver(e.turnId);
      if (d.session) this.upsert(d.session);
      this.approvalsChanged(s);
      this.render(s);
    } else if (type === 'approval.request') {
      s.approvals.set(d.approvalId, e.turnId);
      s.approvalSeqs.set(d.approvalId, e.seq);
      this.approvalsChanged(s);
    } else if (type === 'approval.result') {
      s.approvals.delete(d.approvalId);
      s.approvalSeqs.delete(d.approvalId);
      this.isOver(d.approvalId);
      this.approvalsChanged(s);
    }
  }

  /** turn.resumed (§18): what the lost attempt published after `afterSeq` is void — its
   * usage, its pending approvals (asked again, same id, if still wanted), its retry. */
  resumed(s, e) {
    const after = Number(e.data.afterSeq);
    s.suspended = '';
    s.retry = null;
    s.usages = s.usages.filter(([seq, turnId]) => turnId !== e.turnId || seq <= after);
    const last = s.usages.filter(([, turnId]) => turnId === e.turnId).pop();
    s.live = last ? last[2] : null;
    for (const [id, turnId] of s.approvals) {
      if (turnId === e.turnId && (s.approvalSeqs.get(id) ?? Infinity) > after) {
        s.approvals.delete(id);
        s.approvalSeqs.delete(id);
      }
    }
    this.approvalsChanged(s);
  }

  retried(s) {
    s.retry = null;
    this.render(s);
  }

  isOver(id) {
    this.over.add(id);
    if (this.over.size > OVER_KEPT) this.over.delete(this.over.values().next().value);
  }

  /** Approvals pending before this tab saw their request (GET /approvals). */
  applyApprovals(approvals) {
    for (const a of approvals) {
      if (this.over.has(a.approvalId) || this.over.has(a.turnId)) continue;
      const s = this.sessions.get(a.sessionId);  // not listed (beyond the limit): no row to count on
      if (s && !s.approvals.has(a.approvalId)) {
        s.approvals.set(a.approvalId, a.turnId);
        this.approvalsChanged(s);
      }
    }
  }

  /** Every session from GET /sessions (newest first). */
  async load() {
    // Both at once: the pending approvals need no second round trip.
    const [{ sessions }, { approvals }] = await Promise.all([
      api('/sessions?limit=500'), api('/approvals')]);
    // Oldest first, so that parents exist before their children.
    for (const wire of sessions.slice().reverse()) this.upsert(wire, { fromHttp: true });
    this.applyApprovals(approvals);
  }

  wantTerminal(s) {
    this.terminalQueue.push(s.id);
    while (this.terminalWorkers < TERMINAL_FETCH_CONCURRENCY && this.terminalQueue.length) {
      this.terminalWorkers += 1;
      this.terminalWorker().finally(() => { this.terminalWorkers -= 1; });
    }
  }

  async terminalWorker() {
    while (this.terminalQueue.length) {
      const s = this.sessions.get(this.terminalQueue.shift());
      if (!s || s.terminalKnown) continue;
      try {
        const { turns } = await api(`/sessions/${encodeURIComponent(s.id)}/turns`);
        const running = turns.filter((t) => !t.terminal).pop();
        if (running && s.status === 'running') this.noted(s, running.notes || []);
        const last = turns.filter((t) => t.terminal).pop();
        if (last && !s.terminalKnown) {
          s.terminal = { terminal: last.terminal, code: last.errorCode || '', reason: last.cancelReason || '', finish: last.finishReason || '' };
          this.render(s);
        }
      } catch (err) {
        if (err.status !== 404) this.onError(err);
      }
    }
  }

  /** A running turn's stored notes (GET …/turns): what its queued and retrying badges
   * were before this tab saw its events — queued while a wait for a slot has no
   * admission yet; retrying while its last note is a retry whose wait (plus a bound
   * for the retried request to start streaming) is not long over. An event of the
   * session seen live since wins: it is newer. */
  noted(s, notes) {
    if (s.seenLive) return;
    let queued = null;
    let retry = null;
    for (const n of notes) {
      const d = n.data || {};
      if (n.eventType === 'turn.queued') queued = queueText(d, 'waiting');
      else if (n.eventType === 'turn.admitted') queued = null;
      retry = n.eventType === 'provider.retry' && Date.now() - (n.ts || 0) < (d.waitMs || 0) + RETRY_SHOWN_MS
        ? { fallback: Boolean(d.fallback), provider: d.provider,
            text: d.fallback ? fallbackText(d, retry && retry.provider) : `${cause(d)}: retry ${d.attempt} of ${d.maxRetries}` }
        : null;
    }
    s.queued = queued;
    s.retry = retry;
    this.render(s);
  }

  pendingApprovals(s) {
    let n = s.approvals.size;
    for (const child of this.childrenOf(s)) n += this.pendingApprovals(child);
    return n;
  }

  approvalsChanged(s) {
    for (let cur = s; cur; cur = this.sessions.get(cur.parentSessionId)) this.render(cur);
  }

  childrenOf(s) {
    return [...s.dom.kids.children].map((node) => this.sessions.get(node.dataset.node)).filter(Boolean);
  }

  // -- DOM --------------------------------------------------------------------------

  mount(s) {
    const row = h('div.row', {
      'data-testid': 'session-row', 'data-session-id': s.id, 'data-parent-id': s.parentSessionId || '',
      'data-agent': s.agentName, role: 'treeitem', tabindex: '-1',
      onclick: (e) => {
        if (e.target.closest('.caret')) { this.toggle(s); return; }
        this.focusRow(row);
        this.onOpen(s.id);
      },
    });
    const caret = h('span.caret', { 'aria-hidden': 'true' });
    const dot = h('span.status-dot');
    const agent = h('span.agent', { text: s.agentName });
    const sid = h('span.sid', { text: shortId(s.id), title: s.id });
    const badge = h('span.badge');
    const sandbox = h('span.sandbox-slot');  // the unsandboxed badge, when its agent is
    const approvals = h('span.approvals-badge', { title: 'waiting for approval' });
    const retry = h('span.retry-badge');
    const queued = h('span.queued-badge', { 'data-testid': 'queued-badge' });
    const tokens = h('span.tokens');
    const cost = h('span.cost');
    row.append(caret, dot, h('span.names', {}, agent, sid, forkMark(s.forkedFrom)), sandbox, queued,
      retry, approvals, badge, h('span.meter', {}, tokens, cost));
    const kids = h('div.kids', { role: 'group' });
    const node = h('div.node', { 'data-node': s.id }, row, kids);
    s.dom = { node, row, kids, badge, sandbox, approvals, retry, queued, tokens, cost, dot };
    this.place(s);
    // Sessions that arrived before their parent move under it now.
    for (const other of this.sessions.values()) {
      if (other !== s && other.parentSessionId === s.id && other.dom.node.parentElement !== kids) {
        this.place(other);
      }
    }
    this.countChanged();
  }

  place(s) {
    const parent = s.parentSessionId ? this.sessions.get(s.parentSessionId) : null;
    const container = parent ? parent.dom.kids : this.el;
    const siblings = [...container.children];
    // Roots newest first; children in spawn order (oldest first).
    const before = siblings.find((node) => {
      const other = this.sessions.get(node.dataset.node);
      if (!other || other === s) return false;
      return parent ? other.createdAt > s.createdAt : other.createdAt < s.createdAt;
    });
    container.insertBefore(s.dom.node, before || null);
    s.dom.row.style.setProperty('--depth', String(parent ? Number(parent.dom.row.style.getPropertyValue('--depth') || 0) + 1 : 0));
    s.dom.row.setAttribute('aria-level', String(s.depth + 1));
    if (parent) this.render(parent);
  }

  render(s) {
    const { row, badge, sandbox, approvals, retry, queued, tokens, cost, dot } = s.dom;
    row.dataset.status = s.status;
    markSandbox(sandbox, s.agentName);
    const t = s.terminal;
    row.dataset.terminal = t ? t.terminal : '';
    row.dataset.errorCode = t ? t.code : '';
    row.dataset.cancelReason = t ? t.reason : '';
    const pending = this.pendingApprovals(s);
    row.dataset.approvals = String(pending);
    approvals.textContent = pending ? `${pending} ⚑` : '';
    row.dataset.queued = s.queued ? 'true' : '';
    queued.textContent = s.queued ? '⏸ queued' : '';
    queued.title = s.queued || '';
    const r = s.retry;
    row.dataset.retrying = r ? (r.fallback ? 'fallback' : 'retry') : '';
    retry.textContent = r ? (r.fallback ? '⇢ fallback' : '↻ retrying') : '';
    retry.title = r ? r.text : '';
    row.dataset.suspended = s.suspended;
    dot.className = `status-dot ${s.status}${r ? ' retrying' : ''}${s.queued ? ' queued' : ''}${s.suspended ? ' suspended' : ''}`;
    dot.title = s.suspended ? `${s.status} · suspended: resumes when the daemon starts again`
      : r ? `${s.status} · ${r.text}` : s.queued ? `${s.status} · ${s.queued}` : s.status;
    if (t && t.terminal === 'error') {
      badge.className = `badge error${t.code === 'CANCELLED' ? ' cancelled' : ''}`;
      badge.textContent = t.reason || t.code;
      badge.title = t.reason ? `${t.code} · ${t.reason}` : t.code;
    } else if (t) {
      const cut = t.finish === 'length';  // CONTRACT §14.1: the answer was cut at its limit
      badge.className = cut ? 'badge done cut' : 'badge done';
      badge.textContent = cut ? 'cut off' : 'done';
      badge.title = cut ? 'last turn: done, its answer cut off at the length limit' : 'last turn: done';
    } else {
      badge.className = 'badge';
      badge.textContent = '';
    }
    const u = s.tokenUsage || {};
    const live = s.live || {};
    tokens.textContent = fmtTokens((u.input || 0) + (u.output || 0) + (live.input || 0) + (live.output || 0));
    cost.textContent = fmtCost((u.cost || 0) + (live.cost || 0));
    const hasKids = s.dom.kids.children.length > 0;
    row.classList.toggle('has-kids', hasKids);
    if (hasKids) row.setAttribute('aria-expanded', String(!s.dom.node.classList.contains('collapsed')));
    this.onChange(s);
  }

  /** Every row again: what is known of the agents changed (GET /agents). */
  renderAll() {
    for (const s of this.sessions.values()) this.render(s);
  }

  countChanged() {
    const count = document.getElementById('session-count');
    if (count) count.textContent = String(this.sessions.size);
  }

  toggle(s, open) {
    const collapsed = open === undefined ? !s.dom.node.classList.contains('collapsed') : !open;
    s.dom.node.classList.toggle('collapsed', collapsed);
    this.render(s);
  }

  select(id) {
    if (this.selected) this.sessions.get(this.selected)?.dom.row.classList.remove('selected');
    this.selected = id;
    const s = id && this.sessions.get(id);
    if (s) {
      s.dom.row.classList.add('selected');
      s.dom.row.setAttribute('aria-selected', 'true');
      for (let p = this.sessions.get(s.parentSessionId); p; p = this.sessions.get(p.parentSessionId)) {
        this.toggle(p, true);
      }
    }
  }

  // -- keyboard ---------------------------------------------------------------------

  visibleRows() {
    return [...this.el.querySelectorAll('[data-testid=session-row]')]
      .filter((row) => !row.parentElement.parentElement.closest('.collapsed'));
  }

  firstVisible() { return this.visibleRows()[0] || null; }

  focusRow(row) {
    if (typeof row === 'string') row = this.sessions.get(row)?.dom.row;
    if (!row) return;
    for (const r of this.el.querySelectorAll('.row[tabindex="0"]')) r.setAttribute('tabindex', '-1');
    row.setAttribute('tabindex', '0');
    row.focus({ preventScroll: false });
  }

  /** Move the focus by `delta` rows (from anywhere: Alt+↑/↓). */
  move(delta) {
    const rows = this.visibleRows();
    if (!rows.length) return null;
    const current = rows.indexOf(document.activeElement);
    const from = current >= 0 ? current : rows.findIndex((r) => r.dataset.sessionId === this.selected);
    const next = rows[Math.max(0, Math.min(rows.length - 1, (from < 0 ? -1 : from) + delta))] || rows[0];
    this.focusRow(next);
    return next;
  }

  key(e) {
    const row = document.activeElement?.closest?.('[data-testid=session-row]');
    const s = row && this.sessions.get(row.dataset.sessionId);
    if (e.key === 'ArrowDown' || e.key === 'j') { this.move(1); e.preventDefault(); }
    else if (e.key === 'ArrowUp' || e.key === 'k') { this.move(-1); e.preventDefault(); }
    else if (e.key === 'Home') { this.focusRow(this.firstVisible()); e.preventDefault(); }
    else if (e.key === 'End') { this.focusRow(this.visibleRows().pop()); e.preventDefault(); }
    else if (e.key === 'Enter' && s) { this.onOpen(s.id); e.preventDefault(); }
    else if (e.key === 'ArrowLeft' && s) {
      if (s.dom.kids.children.length && !s.dom.node.classList.contains('collapsed')) this.toggle(s, false);
      else if (s.parentSessionId) this.focusRow(s.parentSessionId);
      e.preventDefault();
    } else if (e.key === 'ArrowRight' && s) {
      if (s.dom.node.classList.contains('collapsed')) this.toggle(s, true);
      else if (s.dom.kids.firstElementChild) this.focusRow(s.dom.kids.firstElementChild.dataset.node);
      e.preventDefault();
    }
  }
}
