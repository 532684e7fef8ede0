// Studio: wires the connection, the session tree, the open session and the controls.
//
// Event flow: every bus event reaches `onEvents` once per stream position, in seq
// order. The tree takes each event once (seq > cursor). The view takes each event once
// (seq > rendered) while it is ready; opening a session renders its finished turns over
// HTTP and asks the connection to replay from just before its running turn started, so
// the running turn is drawn from its first event. A reconnect resumes from the lowest
// seq either still needs.

import { loadAgents, markSandbox, sandboxMode } from './agents.js';
import { adoptUrlToken, api, ApiError, getToken, setToken, startChat } from './api.js';
import { Connection } from './conn.js';
import { RewindControls } from './rewind.js';
import { fmtCost, fmtTokens, h, shortId } from './dom.js';
import { afterFlush, schedule } from './flush.js';
import { Tree } from './tree.js';
import { View } from './view.js';

const $ = (id) => document.getElementById(id);
const byTestId = (id) => document.querySelector(`[data-testid=${id}]`);

const state = {
  cursor: null,       // highest seq the tree has taken (the hello seq at first)
  lastSeq: 0,         // highest event seq processed (data-last-seq)
  rendered: 0,        // stream position of the view
  viewReady: false,
  awaiting: false,    // a replay for the view was asked for and has not begun
  pendingOps: 0,
  booted: false,
};

// -- toasts (every failed request shows its message) ---------------------------------

function showError(err) {
  const message = err instanceof ApiError ? err.message : String(err && err.message ? err.message : err);
  const code = err instanceof ApiError && err.code ? err.code : '';
  if (err instanceof ApiError && err.status === 401) askToken(message);
  const toast = h('div.toast', { 'data-testid': 'error', onclick: () => toast.remove() },
    code ? h('b', { text: code }) : null, h('span', { text: message }));
  $('toasts').append(toast);
  setTimeout(() => toast.remove(), 10000);
}

// -- tree and view ---------------------------------------------------------------------

const tree = new Tree($('tree'), {
  onOpen: (id) => openSession(id),
  onChange: (s) => view && view.sessionChanged(s),
  onRemove: (id) => { if (view.sessionId === id) closeSession(); },
  onError: showError,
});

const view = new View({ el: $('transcript'), tree, onError: showError, onHeader: renderHeader });
view.onReload = (id) => openSession(id);

// CONTRACT §19: "Rewind to here" and "Fork from here" on user messages (rewind.js).
const rewinds = new RewindControls({
  transcript: $('transcript'), composer: $('composer'), sessionId: () => view.sessionId,
  openSession: (id) => openSession(id), onError: showError,
});

function renderHeader(s) {
  const head = $('session-head');
  if (!s || s.id !== view.sessionId) return;
  rewinds.sync(s);
  head.hidden = false;
  $('head-agent').textContent = s.agentName;
  markSandbox($('head-sandbox'), s.agentName);
  $('head-id').textContent = s.id;
  $('head-status').className = `status-dot ${s.status}${s.retry ? ' retrying' : ''}${s.suspended ? ' suspended' : ''}`;
  $('head-status').title = s.suspended ? `${s.status} · suspended: resumes when the daemon starts again`
    : s.retry ? `${s.status} · ${s.retry.text}` : s.status;
  const parent = $('head-parent');
  if (s.parentSessionId) {
    const p = tree.get(s.parentSessionId);
    parent.hidden = false;
    parent.dataset.open = s.parentSessionId;
    parent.textContent = `↰ spawned by ${p ? p.agentName : 'session'} ${shortId(s.parentSessionId)}`;
  } else {
    parent.hidden = true;
  }
  const u = s.tokenUsage || {};
  const live = view.liveUsage() || {};
  const input = (u.input || 0) + (live.input || 0);
  const output = (u.output || 0) + (live.output || 0);
  const usage = byTestId('usage');
  usage.dataset.input = String(input);
  usage.dataset.output = String(output);
  $('usage-in').textContent = fmtTokens(input);
  $('usage-out').textContent = fmtTokens(output);
  $('usage-cost').textContent = fmtCost((u.cost || 0) + (live.cost || 0));
  const slot = $('budget-slot');
  const b = view.budgetInfo;
  if (b && b.budgetTokens) {
    const used = (b.tokenUsage.input || 0) + (b.tokenUsage.output || 0);
    const pct = Math.min(100, (100 * used) / b.budgetTokens);
    let bar = byTestId('budget');
    if (!bar) {
      bar = h('div.budget-bar', { 'data-testid': 'budget', title: 'token budget of the running turn' },
        h('div.budget-fill'), h('span.budget-text'));
      slot.replaceChildren(bar);
    }
    bar.dataset.used = String(used);
    bar.dataset.budget = String(b.budgetTokens);
    bar.classList.toggle('over', used > b.budgetTokens);
    bar.firstChild.style.width = `${pct}%`;
    bar.lastChild.textContent = `${fmtTokens(used)} / ${fmtTokens(b.budgetTokens)} budget`;
  } else {
    slot.replaceChildren();
  }
  $('composer').placeholder = `Message ${s.agentName} ${shortId(s.id)} — Enter sends (${$('delivery').value})`;
  $('delivery').disabled = false;
}

async function openSession(id) {
  if (!id) return;
  tree.select(id);
  if (location.hash !== `#${id}`) history.replaceState(null, '', `${location.pathname}${location.search}#${id}`);
  $('empty').hidden = true;
  state.viewReady = false;
  state.awaiting = false;
  byTestId('receipt')?.remove();
  stuck = true;
  let since;
  try {
    since = await view.open(id, state.cursor ?? 0);
  } catch (err) {
    showError(err);
    return;
  }
  if (since === null || view.sessionId !== id) return;  // another session was opened meanwhile
  state.rendered = since;
  state.awaiting = true;
  if (conn.replay(since)) state.pendingOps += 1;
  schedule();
}

function closeSession() {
  view.close();
  tree.select(null);
  state.viewReady = false;
  state.awaiting = false;
  $('session-head').hidden = true;
  $('empty').hidden = false;
  $('delivery').disabled = true;
  const agent = byTestId('new-chat-agent').value;
  $('composer').placeholder = `Message ${agent || 'an agent'} — starts a new chat`;
  if (location.hash) history.replaceState(null, '', location.pathname + location.search);
}

// -- the connection ----------------------------------------------------------------------

function wsUrl() {
  const url = new URL('/ws', location.href);
  url.protocol = location.protocol === 'https:' ? 'wss:' : 'ws:';
  url.searchParams.set('batch', '1');
  const token = getToken();
  if (token) url.searchParams.set('token', token);
  return url.toString();
}

function onEvents(events) {
  for (const e of events) {
    if (state.cursor === null || e.seq > state.cursor) {
      tree.apply(e);
      state.cursor = e.seq;
      if (e.seq > state.lastSeq) state.lastSeq = e.seq;
    }
    if (state.viewReady && e.seq > state.rendered) {
      view.apply(e);
      state.rendered = e.seq;
      // A rewind changed the open session's history: every tab shows the new one.
      if (e.type === 'session.rewound' && e.session.id === view.sessionId) openSession(view.sessionId);
    }
  }
  schedule();
}

function viewBegins() {
  if (state.awaiting && state.pendingOps === 0) {
    state.awaiting = false;
    state.viewReady = true;
  }
}

const conn = new Connection({
  url: wsUrl,
  onEvents,
  resumeFrom: () => {
    if (state.cursor === null) return null;
    return view.sessionId && (state.viewReady || state.awaiting) ? Math.min(state.cursor, state.rendered) : state.cursor;
  },
  onHello: (hello) => {
    state.pendingOps = 0;
    if (state.cursor === null) state.cursor = hello.seq;
    viewBegins();  // this connection began at resumeFrom(): the view's replay is in it
    if (!state.booted) {
      state.booted = true;
      boot();
    } else {
      // A reconnect may be to a restarted daemon with another config. Best effort: boot
      // reported a failure already; a failing refresh keeps what is known until the next.
      refreshAgents().catch(() => {});
    }
  },
  onSubscribed: () => {
    state.pendingOps = Math.max(0, state.pendingOps - 1);
    viewBegins();
  },
  onGap: (gap) => {
    const treeLost = state.cursor !== null && gap.to > state.cursor;
    if (state.cursor !== null) state.cursor = Math.max(state.cursor, gap.to);
    if (state.viewReady && gap.to > state.rendered) {
      view.gap(gap);
      state.rendered = gap.to;
    }
    if (treeLost) {  // events we never saw: reload what they may have changed
      tree.load().catch(showError);
      if (view.sessionId) openSession(view.sessionId);
    }
  },
  onState: (s) => renderConnection(s),
  onClose: (code, reason) => {
    const el = byTestId('connection');
    el.dataset.closeCode = String(code);
    el.dataset.closeReason = reason || '';
  },
  // The socket only says 4401: ask over HTTP for the daemon's own words.
  onUnauthorized: () => api('/agents').then(() => askToken('the daemon refused the token'),
    (err) => askToken(err.message)),
});

function renderConnection(s) {
  const el = byTestId('connection');
  el.dataset.state = s;
  el.querySelector('.conn-label').textContent = { open: 'Live', connecting: 'Connecting…', closed: 'Offline' }[s];
  el.title = s === 'open' ? 'connected to the daemon (/ws)' : s === 'connecting' ? 'reconnecting: resumes where it left off' : 'not connected';
}

let lastShownSeq = -1;
afterFlush(() => {
  if (state.lastSeq !== lastShownSeq) {
    lastShownSeq = state.lastSeq;
    byTestId('connection').dataset.lastSeq = String(state.lastSeq);
  }
});

// -- scrolling: follow the end unless the reader scrolled up -----------------------------

// Only the reader's own scrolling (wheel, touch, keys, the scrollbar) unsticks: a scroll
// event caused by content changing size (markdown rendered, a block folded) does not.
const scroller = $('scroller');
let stuck = true;
let byReader = false;
for (const type of ['wheel', 'touchmove', 'mousedown', 'keydown']) {
  scroller.addEventListener(type, () => { byReader = true; }, { passive: true });
}
// Follow the end whenever the transcript's size changes (after layout, at most once a
// frame): new text, a rendered block, a block folded or skipped by content-visibility.
new ResizeObserver(() => {
  if (stuck && !view.el.hidden) scroller.scrollTop = scroller.scrollHeight;
}).observe($('transcript'));
scroller.addEventListener('scroll', () => {
  if (scroller.scrollHeight - scroller.scrollTop - scroller.clientHeight < 40) stuck = true;
  else if (byReader) stuck = false;
  byReader = false;
}, { passive: true });

// -- controls ------------------------------------------------------------------------

async function send() {
  const box = $('composer');
  const message = box.value;
  if (!message.trim()) return;
  const button = byTestId('send');
  button.disabled = true;
  try {
    if (view.sessionId) {
      await api(`/sessions/${encodeURIComponent(view.sessionId)}/messages`, {
        method: 'POST', body: { message, delivery: $('delivery').value },
      });
      box.value = '';
    } else {
      const agent = byTestId('new-chat-agent').value;
      if (!agent) throw new ApiError(0, 'NO_AGENT', 'no agent to chat with: the daemon lists none');
      const { sessionId } = await startChat(agent, message);
      box.value = '';
      await openSession(sessionId);
    }
  } catch (err) {
    showError(err);
  } finally {
    button.disabled = false;
  }
}

async function stop(scope) {
  const id = view.sessionId;
  if (!id) return;
  try {
    const receipt = await api(`/sessions/${encodeURIComponent(id)}/cancel`, { method: 'POST', body: { scope } });
    if (view.sessionId !== id) return;
    const n = receipt.cancelled.length;
    const el = h('span.receipt', { 'data-testid': 'receipt', 'data-count': String(n), 'data-scope': scope, title: `receipt seq ${receipt.seq}` },
      n ? `Stopped ${n} turn${n === 1 ? '' : 's'}` : 'Nothing was running');
    $('receipt-slot').replaceChildren(el);
  } catch (err) {
    showError(err);
  }
}

$('composer-form').addEventListener('submit', (e) => { e.preventDefault(); send(); });
$('composer').addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
byTestId('new-chat').addEventListener('click', () => { closeSession(); $('composer').focus(); });
byTestId('new-chat-agent').addEventListener('change', () => { if (!view.sessionId) closeSession(); });
$('delivery').addEventListener('change', () => renderHeader(tree.get(view.sessionId)));
byTestId('stop-turn').addEventListener('click', () => stop('turn'));
byTestId('stop-tree').addEventListener('click', () => stop('tree'));
document.addEventListener('click', (e) => {
  const link = e.target.closest && e.target.closest('[data-open]');
  if (link) { e.preventDefault(); openSession(link.dataset.open); }
});

function typing(target) {
  return target && (target.tagName === 'TEXTAREA' || target.tagName === 'INPUT' || target.tagName === 'SELECT');
}

document.addEventListener('keydown', (e) => {
  if (!$('token-overlay').hidden) return;
  if (e.key === 'Escape' && view.sessionId) {
    e.preventDefault();
    stop(e.shiftKey ? 'tree' : 'turn');
    return;
  }
  if (e.altKey && (e.key === 'ArrowDown' || e.key === 'ArrowUp')) {
    const row = tree.move(e.key === 'ArrowDown' ? 1 : -1);
    if (row) openSession(row.dataset.sessionId);
    e.preventDefault();
    return;
  }
  if (typing(e.target) || e.ctrlKey || e.metaKey || e.altKey) return;
  if (e.key === 'n') { e.preventDefault(); closeSession(); $('composer').focus(); }
  else if (e.key === '/') { e.preventDefault(); $('composer').focus(); }
  else if (e.key === 't') { e.preventDefault(); tree.focusRow(tree.selected || tree.firstVisible()); }
});

// -- token ---------------------------------------------------------------------------

function askToken(message) {
  $('token-overlay').hidden = false;
  byTestId('token-prompt').hidden = false;
  $('token-error').textContent = message || '';
  $('token-input').focus();
}

byTestId('token-prompt').addEventListener('submit', (e) => {
  e.preventDefault();
  const token = $('token-input').value.trim();
  if (!token) return;
  setToken(token);
  $('token-overlay').hidden = true;
  byTestId('token-prompt').hidden = true;
  $('token-input').value = '';
  if (!state.booted) conn.start(); else boot();
});

// -- start ---------------------------------------------------------------------------

/** The agents (the new-chat choice, which of them are unsandboxed) and the sandbox mode. */
async function refreshAgents() {
  const { agents, changed } = await loadAgents();
  if (!changed) return;
  const select = byTestId('new-chat-agent');
  const current = select.value;
  select.replaceChildren(...agents.map((a) => h('option', { value: a.name, text: a.name, title: `${a.engine} · ${a.model || ''}` })));
  if (current && agents.some((a) => a.name === current)) select.value = current;
  renderSandboxMode();
  tree.renderAll();  // the badges of rows (and through them the header, child turns)
}

// Discreet: the daemon-wide mode, loud only when there is no sandbox at all.
function renderSandboxMode() {
  const el = $('sandbox-mode');
  const mode = sandboxMode();
  el.hidden = !mode;
  el.dataset.mode = mode;
  el.textContent = mode === 'none' ? 'no sandbox' : `sandbox: ${mode}`;
  el.title = mode === 'none'
    ? 'This daemon runs every bash call without a sandbox ([server] sandbox). See docs/security.md.'
    : `Bash calls run in a ${mode} sandbox, except for agents marked unsandboxed. See docs/security.md.`;
}

async function boot() {
  try {
    await Promise.all([refreshAgents(), tree.load()]);
    const wanted = decodeURIComponent(location.hash.slice(1));
    if (wanted) openSession(wanted);
    else if (!view.sessionId) closeSession();
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) askToken(err.message);
    else showError(err);
  }
}

adoptUrlToken();
renderConnection('connecting');
conn.start();
