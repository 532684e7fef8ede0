// Streaming text, outside any framework: each live block owns a TextSink; a delta is
// appended to the sink's pending string and the sink is marked dirty. Once per
// animation frame every dirty sink appends its pending text to its DOM text node
// (Text.appendData: no re-render, no layout read). Frame hooks run after the flush
// (sticky scrolling, a few attributes), so layout is touched at most once per frame.

const dirty = new Set();
const hooks = new Set();
let scheduled = false;

export class TextSink {
  constructor(parent) {
    this.node = document.createTextNode('');
    parent.appendChild(this.node);
    this.pending = '';
    this.text = '';  // everything appended so far (markdown is rendered from it once)
  }

  append(text) {
    if (!text) return;
    this.pending += text;
    this.text += text;
    dirty.add(this);
    schedule();
  }

  flush() {
    if (this.pending) {
      this.node.appendData(this.pending);
      this.pending = '';
    }
    dirty.delete(this);
  }
}

export function schedule() {
  if (!scheduled) {
    scheduled = true;
    requestAnimationFrame(frame);
  }
}

function frame() {
  scheduled = false;
  for (const sink of dirty) sink.flush();
  dirty.clear();
  for (const hook of hooks) hook();
}

/** Run `fn` after every frame that flushed something (or was scheduled). */
export function afterFlush(fn) {
  hooks.add(fn);
}
