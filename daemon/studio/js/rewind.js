// Rewind and fork (CONTRACT §19) in Studio, beside the transcript and the tree:
// - on each turn's user message, while the open session is idle, "Rewind to here"
//   (the session goes back to before that turn; its message comes back into the
//   composer, ready to edit and send) and "Fork from here" (a new session as it was
//   before that turn, opened);
// - a fork's row in the tree says where it came from;
// - a `session.rewound` event reloads the open session in every tab (main.js).
// The controls are added to user messages as the transcript draws them (a
// MutationObserver), so the transcript's own code (view.js) does not know of them.

import { api } from './api.js';
import { h, shortId } from './dom.js';

/** The tree row's mark of a fork (`Session.forkedFrom`), or null. */
export function forkMark(forkedFrom) {
  if (!forkedFrom) return null;
  const where = forkedFrom.at === 'now' ? 'as it was'
    : `${forkedFrom.at} turn ${shortId(forkedFrom.turnId || '')}`;
  return h('span.fork-mark', {
    'data-testid': 'fork-mark', 'data-forked-from': forkedFrom.sessionId,
    'data-turn-id': forkedFrom.turnId || '', 'data-at': forkedFrom.at,
    title: `forked from ${forkedFrom.sessionId} (${where})`, text: `⑂ ${shortId(forkedFrom.sessionId)}`,
  });
}

export class RewindControls {
  /**
   * transcript: the view's element; composer: the textarea; sessionId(): the open
   * session; openSession(id): open another; onError(err): show a failure.
   */
  constructor({ transcript, composer, sessionId, openSession, onError }) {
    this.transcript = transcript;
    this.composer = composer;
    this.sessionId = sessionId;
    this.openSession = openSession;
    this.onError = onError;
    new MutationObserver(() => this.decorate()).observe(transcript, { childList: true, subtree: true });
  }

  /** The open session changed (status): the controls show only while it is idle. */
  sync(s) {
    const idle = !!s && s.id === this.sessionId() && s.status === 'idle';
    this.transcript.dataset.rewindable = idle ? 'true' : 'false';
  }

  /** Each turn's own user message gets its two controls, once. */
  decorate() {
    for (const turn of this.transcript.querySelectorAll(':scope > article.turn[data-turn-id]')) {
      const turnId = turn.dataset.turnId;
      if (!turnId.startsWith('turn_') || turn.querySelector('.msg-actions')) continue;
      const msg = turn.querySelector('[data-testid=user-message][data-from=""]');
      if (!msg) continue;
      const text = msg.querySelector('.user-text');
      msg.append(h('div.msg-actions', {},
        h('button.msg-action', {
          type: 'button', 'data-testid': 'rewind-here', 'data-turn-id': turnId, text: '↶ Rewind to here',
          title: 'Take this session back to before this message (history and workspace); what it holds now is kept as a fork',
          onclick: () => this.rewind(turnId, text ? text.textContent : ''),
        }),
        h('button.msg-action', {
          type: 'button', 'data-testid': 'fork-here', 'data-turn-id': turnId, text: '⑂ Fork from here',
          title: 'A new session with this history and workspace as they were before this message',
          onclick: () => this.fork(turnId),
        })));
    }
  }

  async rewind(turnId, shown) {
    const id = this.sessionId();
    if (!id) return;
    try {
      const out = await api(`/sessions/${encodeURIComponent(id)}/rewind`, { method: 'POST', body: { beforeTurn: turnId } });
      this.composer.value = typeof out.message === 'string' ? out.message : shown;
      this.composer.focus();
      this.composer.dataset.rewoundFrom = out.savedAs.id;  // a test hook: where the rest went
    } catch (err) {
      this.onError(err);
    }
  }

  async fork(turnId) {
    const id = this.sessionId();
    if (!id) return;
    try {
      const out = await api(`/sessions/${encodeURIComponent(id)}/fork`, { method: 'POST', body: { beforeTurn: turnId } });
      await this.openSession(out.session.id);
    } catch (err) {
      this.onError(err);
    }
  }
}
