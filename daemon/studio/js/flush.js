// Streaming text, outside any framework: each live block owns a TextSink; a delta is
// appended to the sink's pending string and the sink is marked dirty. Once per
// animation frame every dirty sink appends its pending text to its DOM text node
// (Text.appendData: no re-render, no layout read). Frame hooks run after the flush
// (sticky scrolling, a few attributes), so layout is touched at most once per frame.
// A sink made with `pieces` moves what it holds, once it is long, into blocks of about
// PIECE characters cut after a newline (slices.js): a frame then lays out the growing
// piece, not the whole text.

import { PIECE, rawPiece } from './slices.js';

const dirty = new Set();
const hooks = new Set();
let scheduled = false;

export class TextSink {
  constructor(parent, { pieces = false } = {}) {
    this.parent = parent;
    this.node = document.createTextNode('');
    parent.appendChild(this.node);
    this.pieces = pieces;
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
      if (this.pieces) this.cut();
    }
    dirty.delete(this);
  }

  /** Full pieces out of the growing text node (a text without newlines stays). */
  cut() {
    const { node } = this;
    while (node.length > PIECE) {
      let nl = node.data.lastIndexOf('\n', PIECE - 1);
      if (nl < PIECE / 4) nl = node.data.indexOf('\n', PIECE);
      if (nl < 0) return;
      this.parent.insertBefore(rawPiece(node.data.slice(0, nl + 1)), node);
      node.deleteData(0, nl + 1);
    }
  }

  /** Everything into pieces: the parent then holds only `div.md-raw` blocks. */
  seal() {
    this.flush();
    if (this.node.length) this.parent.insertBefore(rawPiece(this.node.data), this.node);
    this.node.remove();
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
