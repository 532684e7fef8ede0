// Every request Studio makes: the tab's token, the contract's error shape.

const KEY = 'veild.token';

/** Take `?token=` from the address (kept for this tab), and drop it from the address bar. */
export function adoptUrlToken() {
  const url = new URL(location.href);
  const token = url.searchParams.get('token');
  if (token) {
    sessionStorage.setItem(KEY, token);
    url.searchParams.delete('token');
    history.replaceState(null, '', url.pathname + url.search + url.hash);
  }
}

export const getToken = () => sessionStorage.getItem(KEY) || '';
export const setToken = (token) => sessionStorage.setItem(KEY, token);

export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details;
  }
}

function headers(json) {
  const h = {};
  const token = getToken();
  if (token) h.Authorization = `Bearer ${token}`;
  if (json) h['Content-Type'] = 'application/json';
  return h;
}

async function failure(response) {
  const text = await response.text().catch(() => '');
  let error = null;
  try { error = JSON.parse(text).error; } catch { /* not the error shape */ }
  if (error && typeof error.message === 'string' && error.message) {
    return new ApiError(response.status, error.code || `HTTP_${response.status}`, error.message, error.details);
  }
  return new ApiError(response.status, `HTTP_${response.status}`,
    `${response.status} ${response.statusText || 'request failed'}${text ? `: ${text.slice(0, 200)}` : ''}`);
}

async function send(path, init) {
  try {
    return await fetch(path, init);
  } catch (err) {
    throw new ApiError(0, 'NETWORK', `cannot reach the daemon (${err.message})`);
  }
}

export async function api(path, { method = 'GET', body } = {}) {
  const response = await send(path, {
    method, headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) throw await failure(response);
  return response.status === 204 ? null : response.json();
}

/**
 * Start a chat turn and learn its session as soon as the turn starts: the SSE form of
 * POST /agents/{name}/chat, read up to its first frame, then let go (the turn belongs
 * to the daemon, not to this request; its events reach us over /ws like any other).
 */
export async function startChat(agent, message) {
  const abort = new AbortController();
  const response = await send(`/agents/${encodeURIComponent(agent)}/chat`, {
    method: 'POST', headers: headers(true), signal: abort.signal,
    body: JSON.stringify({ message, sse: true }),
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const match = buffer.match(/^data: (.*)$/m);
      if (match && buffer.indexOf('\n', match.index) !== -1) {
        const envelope = JSON.parse(match[1]);
        return { sessionId: envelope.sessionId, turnId: envelope.turnId };
      }
      if (buffer.length > 1 << 20) break;
    }
  } finally {
    abort.abort();
  }
  throw new ApiError(0, 'BAD_STREAM', 'the chat stream ended before its turn started');
}
