// Long text without long tasks (issue 44): an answer of a megabyte rendered as markdown
// at once held the tab for seconds, and so did laying it out as one block of text.
//
// - Long plain text (a streaming block, a long stored message or user message) is held
//   in pieces: `div.md-raw` blocks of about PIECE characters cut after a newline, each
//   with `content-visibility: auto`, so a frame lays out only the pieces on screen and
//   the one that grows.
// - A long answer that ended is rendered a part at a time (markdown.js splitBlocks),
//   parts taken in tasks of at most BUDGET_MS: each part's HTML goes in before the raw
//   pieces and the same text leaves the front of them, so the element always shows the
//   whole text exactly once, rendered at the top, raw below. Each part is a
//   `div.md-part` (also `content-visibility: auto`). `data-rendering` is set until the
//   last part is in; then the parts' HTML, concatenated, is renderMarkdown(text).

import { h } from './dom.js';
import { escapeHtml, renderMarkdown, splitBlocks } from './markdown.js';

export const LONG = 32 * 1024;  // above: pieces and slices; below: rendered at once
export const PIECE = 8 * 1024;
const BUDGET_MS = 8;

/** A piece of raw text (a block of its own). */
export function rawPiece(text) {
  const el = document.createElement('div');
  el.className = 'md-raw';
  el.textContent = text;
  return el;
}

/** `text` as pieces of about PIECE characters, cut after a newline where there is one. */
export function rawPieces(text) {
  const pieces = [];
  for (let at = 0; at < text.length;) {
    let end = Math.min(text.length, at + PIECE);
    if (end < text.length) {
      const nl = text.lastIndexOf('\n', end - 1);
      if (nl >= at + PIECE / 4) end = nl + 1;
    }
    pieces.push(rawPiece(text.slice(at, end)));
    at = end;
  }
  return pieces;
}

/** A block for `text` of a user message: pieces when it is long. */
export function textBlock(spec, text) {
  const el = h(spec);
  if (text.length > LONG) el.append(...rawPieces(text));
  else el.textContent = text;
  return el;
}

const jobs = [];
let scheduled = false;

/**
 * Render `text` (already in `el` as raw pieces, its only children) as markdown, in
 * slices. The caller has marked `el` done; `data-rendering` says it is not yet.
 */
export function renderLater(el, text) {
  el.dataset.rendering = '1';
  jobs.push({ el, parts: splitBlocks(text), next: 0, raw: el.firstElementChild });
  if (!scheduled) {
    scheduled = true;
    setTimeout(work, 0);
  }
}

function work() {
  const end = performance.now() + BUDGET_MS;
  while (jobs.length && performance.now() < end) {
    const job = jobs[0];
    step(job, job.parts[job.next]);
    job.next += 1;
    if (job.next === job.parts.length) {
      jobs.shift();
      while (job.raw) {  // only empty pieces can be left
        const after = job.raw.nextElementSibling;
        job.raw.remove();
        job.raw = after;
      }
      delete job.el.dataset.rendering;
    }
  }
  scheduled = jobs.length > 0;
  if (scheduled) setTimeout(work, 0);  // the next task: a frame may be painted first
}

function step(job, part) {
  let html;
  try {
    html = renderMarkdown(part);
  } catch (err) {
    // One bad part must not stop the rest (nor the events after it): as it is.
    console.error('markdown renderer failed; showing the text as it is', err);
    html = `<div class="md-raw">${escapeHtml(part)}</div>`;
  }
  // Each part a block of its own: a frame lays out only the parts on screen.
  const block = document.createElement('div');
  block.className = 'md-part';
  block.innerHTML = html;
  job.el.insertBefore(block, job.raw);
  // The same text leaves the front of the raw pieces.
  let left = part.length;
  while (job.raw && left > 0) {
    const length = job.raw.textContent.length;
    if (length <= left) {
      const after = job.raw.nextElementSibling;
      job.raw.remove();
      job.raw = after;
      left -= length;
    } else {
      job.raw.firstChild.deleteData(0, left);
      left = 0;
    }
  }
}
