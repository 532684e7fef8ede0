// The tab's one WebSocket: /ws?batch=1, resumed with since= on every reconnect.
//
// The Connection knows nothing about sessions. It hands each frame's events to
// `onEvents` in order, and asks `resumeFrom()` where a new connection must start
// (the lowest seq any consumer still needs). A `replay(since)` asks the daemon, on the
// same connection, to start over from `since` (a subscribe op): the answer is a
// `subscribed` frame, then every retained event after `since`, then live ones.

const CLOSE_LAGGED = 1013;
const CLOSE_UNAUTHORIZED = 4401;
const MAX_BACKOFF_MS = 5000;

export class Connection {
  constructor({ url, onEvents, onHello, onSubscribed, onGap, onState, onUnauthorized, onClose, resumeFrom }) {
    this.url = url;  // () => the ws URL without since
    this.onEvents = onEvents;
    this.onHello = onHello;
    this.onSubscribed = onSubscribed;
    this.onGap = onGap;
    this.onState = onState;
    this.onUnauthorized = onUnauthorized;
    this.onClose = onClose;  // (code, reason) of every close of a socket
    this.resumeFrom = resumeFrom;
    this.ws = null;
    this.state = 'closed';
    this.attempt = 0;
    this.timer = null;
    this.hello = false;  // a hello arrived on the current socket
    this.stopped = false;
  }

  start() {
    this.stopped = false;
    this.connect();
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.ws) this.ws.close(1000, 'bye');
    this.setState('closed');
  }

  setState(state) {
    if (state !== this.state) {
      this.state = state;
      this.onState(state);
    }
  }

  connect() {
    clearTimeout(this.timer);
    this.setState('connecting');
    const url = new URL(this.url());
    const since = this.resumeFrom();
    if (since !== null && since !== undefined) url.searchParams.set('since', String(since));
    const ws = new WebSocket(url);
    this.ws = ws;
    this.hello = false;
    ws.onmessage = (message) => {
      if (ws !== this.ws) return;
      let frame;
      try { frame = JSON.parse(message.data); } catch { return; }
      const items = Array.isArray(frame) ? frame : [frame];
      const events = [];
      for (const item of items) {
        if (item.type === 'hello') {
          this.hello = true;
          this.attempt = 0;
          this.setState('open');
          this.onHello(item);
        } else if (item.type === 'subscribed') {
          this.deliver(events);
          this.onSubscribed(item);
        } else if (item.type === 'stream.gap') {
          this.deliver(events);
          this.onGap(item);
        } else if (item.type === 'error') {
          console.warn('veild /ws:', item.message);
        } else if (typeof item.seq === 'number') {
          events.push(item);
        }
      }
      this.deliver(events);
    };
    ws.onclose = (close) => {
      if (ws !== this.ws) return;
      this.ws = null;
      this.onClose(close.code, close.reason);
      if (this.stopped) return;
      if (close.code === CLOSE_UNAUTHORIZED) {
        this.setState('closed');
        this.onUnauthorized();
        return;
      }
      // 1013 (lagged) means "resume from where you are": at once. Anything else backs off.
      const delay = close.code === CLOSE_LAGGED || (this.hello && this.attempt === 0)
        ? 0 : Math.min(MAX_BACKOFF_MS, 250 * 2 ** this.attempt);
      this.attempt += 1;
      this.setState('connecting');
      this.timer = setTimeout(() => this.connect(), delay);
    };
  }

  deliver(events) {
    if (events.length) {
      this.onEvents(events);
      events.length = 0;
    }
  }

  /** Restart the subscription (every session) from `since`, on this connection. */
  replay(since) {
    if (this.ws && this.hello && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({
        op: 'subscribe', sessionIds: null, includeChildren: true, types: null, since,
      }));
      return true;
    }
    return false;  // the next connection starts from resumeFrom(), which covers it
  }
}
