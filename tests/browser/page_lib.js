// In-page helpers for the browser tests, reached only through the CONTRACT §8 test
// hooks (evaluated by chromium.Tab.goto; Studio itself never loads this file).
(() => {
  // A turn's (or a child turn's) own text: not that of the sub-agents nested in it.
  const own = (root) => {
    const self = root.matches('[data-testid=child-turn]') ? root : null;
    return [...root.querySelectorAll('[data-testid=assistant-text]')]
      .filter((el) => el.closest('[data-testid=child-turn]') === self);
  };
  const lib = {
    turn: (id) => document.querySelector(
      `[data-testid=transcript] [data-testid=turn][data-turn-id="${id}"]`),
    child: (sid) => document.querySelector(`[data-testid=child-turn][data-session-id="${sid}"]`),
    textOf: (root) => root ? own(root).map((el) => el.textContent).join(' ') : null,
    turnText: (id) => { const t = lib.turn(id); return t ? { text: lib.textOf(t), terminal: t.dataset.terminal } : null; },
    childText: (sid) => {
      const c = lib.child(sid);
      return c ? { text: lib.textOf(c), terminal: c.dataset.terminal || '', status: c.dataset.status } : null;
    },
    toolOutput: (id) => {
      const t = document.querySelector(
        `[data-testid=tool-call][data-tool-call-id="${id}"] [data-testid=tool-output]`);
      return t && [...t.querySelectorAll('[data-stream]')].map((p) => [p.dataset.stream, p.textContent]);
    },
    connState: () => document.querySelector('[data-testid=connection]').dataset.state,
    lastSeq: () => Number(document.querySelector('[data-testid=connection]').dataset.lastSeq),
    transcriptId: () => document.querySelector('[data-testid=transcript]').dataset.sessionId,
    turnIds: () => [...document.querySelectorAll('[data-testid=transcript] [data-testid=turn]')]
      .map((t) => t.dataset.turnId),
    row: (id) => {
      const r = document.querySelector(`[data-testid=session-row][data-session-id="${id}"]`);
      return r && { ...r.dataset };
    },
    rows: () => [...document.querySelectorAll('[data-testid=session-row]')]
      .map((r) => [r.dataset.sessionId, r.dataset.parentId, r.dataset.agent]),
    spawned: () => [...document.querySelectorAll(
      '[data-testid=tool-call][data-tool-name=agent_spawn] [data-testid=child-turn]')]
      .map((c) => c.dataset.sessionId),
    words: (text) => (text || '').split(' ').filter(Boolean).length,
    watches: {},
    watch(name, measure, arg, keepText) {
      const w = { samples: [], maxGap: 0, frames: 0, last: undefined, prev: performance.now(), on: true };
      lib.watches[name] = w;
      const tick = () => {
        if (!w.on) return;
        const now = performance.now();
        w.maxGap = Math.max(w.maxGap, now - w.prev);
        w.prev = now;
        w.frames += 1;
        let v = lib[measure](arg);
        if (v && !keepText && typeof v.text === 'string') v = { ...v, text: undefined, len: v.text.length };
        const key = JSON.stringify(v);
        if (key !== w.last) { w.last = key; w.samples.push([now, v]); }
        requestAnimationFrame(tick);
      };
      requestAnimationFrame(tick);
    },
    stop(name) {
      const w = lib.watches[name];
      w.on = false;
      return { samples: w.samples, maxGap: w.maxGap, frames: w.frames };
    },
  };
  // Every change of the connection's state, as it happens (not sampled per frame).
  lib.states = [];
  const conn = document.querySelector('[data-testid=connection]');
  new MutationObserver(() => lib.states.push(conn.dataset.state))
    .observe(conn, { attributes: true, attributeFilter: ['data-state'] });
  window.__t = lib;
})
