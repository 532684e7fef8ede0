// What Studio knows of the daemon's agents (GET /agents) and its sandbox (GET /health),
// so that every place a session is shown can mark one whose agent can run commands
// outside the sandbox (CONTRACT §16: `sandboxed: false`). An agent the daemon no longer
// lists (a session from before a config change) is not marked: nothing is known of it.

import { api } from './api.js';
import { h } from './dom.js';

const known = new Map();  // agent name → its GET /agents entry
let mode = '';            // the daemon's sandbox: 'bwrap' | 'none', '' while unknown

/**
 * Read both again (at start, and after a reconnect: a restarted daemon may run another
 * config). Resolves to `{ agents, changed }`; /health failing only leaves the mode
 * unknown (the badges do not need it, only their tooltips' wording does).
 */
export async function loadAgents() {
  const [{ agents }, health] = await Promise.all([
    api('/agents'), api('/health').catch(() => null)]);
  const before = JSON.stringify([mode, [...known.values()]]);
  known.clear();
  for (const a of agents) known.set(a.name, a);
  mode = health && typeof health.sandbox === 'string' ? health.sandbox : '';
  return { agents, changed: JSON.stringify([mode, agents]) !== before };
}

export const sandboxMode = () => mode;

/** True only for an agent the daemon says is not sandboxed. */
export function unsandboxed(name) {
  const agent = known.get(name);
  return Boolean(agent) && agent.sandboxed === false;
}

/** Why `name` is unsandboxed, in the words of its cause (the tooltip of its badge). */
export function why(name) {
  const agent = known.get(name) || {};
  let cause;
  if (agent.engine === 'claude-cli') {
    cause = `${name} runs on the claude CLI, whose own tools run outside veild's sandbox`;
  } else if (mode === 'none') {
    cause = `this daemon runs without a sandbox ([server] sandbox), so ${name}'s bash runs commands unsandboxed`;
  } else if (mode === 'bwrap') {
    cause = `${name} has sandbox = false: its bash runs commands without the sandbox`;
  } else {
    cause = `${name}'s bash runs commands without the sandbox`;
  }
  return `Unsandboxed: ${cause}. See docs/security.md.`;
}

/**
 * Keep `slot` holding the badge exactly while `name` is unsandboxed. Called on every
 * render of a row (each usage event of a running turn), so it touches the DOM only
 * when the answer changed.
 */
export function markSandbox(slot, name) {
  const title = unsandboxed(name) ? why(name) : '';
  if (slot.dataset.title === title) return;
  slot.dataset.title = title;
  slot.replaceChildren(...(title ? [h('span.badge.unsandboxed', {
    'data-testid': 'unsandboxed', title, 'aria-label': title, text: 'unsandboxed',
  })] : []));
}
