// A small, safe markdown renderer: everything is escaped first, and only the tags
// written here are produced (no raw HTML passes through, links only http(s)/mailto).
// Rendered once, when a block has finished streaming.
//
// It is total: it ends, in time linear in its input, on whatever a model writes.
// Every turn of the block loop consumes at least one line; block quotes nest at most
// MAX_QUOTE deep (deeper `>` are text) and lists MAX_LIST deep; no regular expression
// here can backtrack over more than the text between two of its delimiters (code spans
// are found by a scan, not a regex). tests/browser/test_studio_markdown_fuzz.py holds it
// to that with pathological and random documents in chromium.

const ESC = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
export const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);

export const MAX_QUOTE = 8;
export const MAX_LIST = 8;

// -- inline -----------------------------------------------------------------------------

// What is already HTML (a code span, a link) waits in `slots` while emphasis is applied
// to the rest; in the text it stands as a private-use mark (never matched by emphasis,
// and removed from the source first) so that `*` or `__` in a URL or a code span stays
// as written.
const OPEN = '\uE000';
const CLOSE = '\uE001';
const SLOT = /\uE000(\d+)\uE001/g;
const PRIVATE = /[\uE000\uE001]/g;
const URL_CHARS = '[^\\s()\\uE000\\uE001]';
// Link text has no brackets; a URL may hold one level of balanced parentheses.
const LINK = new RegExp(
  `\\[([^\\[\\]\\n]+)\\]\\(((?:https?:\\/\\/|mailto:)(?:${URL_CHARS}|\\(${URL_CHARS}*\\))+)\\)`,
  'g');

function emphasis(html) {
  return html
    .replace(/\*\*([^*\n]+)\*\*/g, '<strong>$1</strong>')
    .replace(/__([^_\n]+)__/g, '<strong>$1</strong>')
    .replace(/(^|[^*\w])\*([^*\s][^*\n]*?)\*(?![*\w])/g, '$1<em>$2</em>')
    .replace(/~~([^~\n]+)~~/g, '<del>$1</del>');
}

const fill = (html, slots) => html.replace(SLOT, (_, n) => slots[Number(n)]);

/** Code spans (CommonMark: a run of n backticks up to the next run of exactly n) become
 * slots. The runs are listed once and each length's next run is kept, so the scan is
 * linear however the backticks are arranged. */
function codeSpans(text, slots) {
  const runs = [];
  for (let i = 0; i < text.length;) {
    if (text[i] !== '`') { i += 1; continue; }
    let j = i;
    while (j < text.length && text[j] === '`') j += 1;
    runs.push([i, j - i]);
    i = j;
  }
  if (runs.length < 2) return text;
  const byLength = new Map();  // length → indexes into runs, in order
  runs.forEach(([, n], k) => {
    if (!byLength.has(n)) byLength.set(n, []);
    byLength.get(n).push(k);
  });
  const next = new Map();  // length → position in byLength's list
  let out = '';
  let at = 0;  // text before `at` is in `out`
  for (let k = 0; k < runs.length; k += 1) {
    const [start, n] = runs[k];
    if (start < at) continue;
    const list = byLength.get(n);
    let p = next.get(n) || 0;
    while (p < list.length && list[p] <= k) p += 1;
    next.set(n, p);
    if (p === list.length) continue;  // no closer: the run is text
    const close = runs[list[p]][0];
    let body = text.slice(start + n, close);
    if (body.length > 1 && body.startsWith(' ') && body.endsWith(' ') && body.trim()) body = body.slice(1, -1);
    out += text.slice(at, start) + OPEN + slots.length + CLOSE;
    slots.push(`<code>${escapeHtml(body)}</code>`);
    at = close + n;
    next.set(n, p + 1);
  }
  return out + text.slice(at);
}

export function inline(text) {
  const slots = [];
  let s = codeSpans(String(text).replace(PRIVATE, '\uFFFD'), slots);
  s = s.replace(LINK, (_, label, url) => {
    slots.push(`<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">`
      + `${fill(emphasis(escapeHtml(label)), slots)}</a>`);
    return OPEN + (slots.length - 1) + CLOSE;
  });
  return fill(emphasis(escapeHtml(s)), slots);
}

// -- blocks -----------------------------------------------------------------------------

const LIST = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^\s*>/;

const indentOf = (line) => {
  const n = line.search(/[^ \t]/);
  return n < 0 ? line.length : n;
};

/** An opening fence: a run of 3 or more ` or ~ after any indent, then an info string
 * (a backtick fence's may not hold a backtick: ```x``` is inline code). */
function openFence(line) {
  const indent = indentOf(line);
  const char = line[indent];
  if (char !== '`' && char !== '~') return null;
  let end = indent;
  while (line[end] === char) end += 1;
  if (end - indent < 3) return null;
  const info = line.slice(end).trim();
  if (char === '`' && info.includes('`')) return null;
  return { char, length: end - indent, indent, lang: info.split(/\s/, 1)[0] };
}

/** A closing fence: the same char, at least as many, nothing after but spaces. */
function closesFence(line, fence) {
  const text = line.trim();
  if (text.length < fence.length) return false;
  for (const c of text) if (c !== fence.char) return false;
  return true;
}

function isRule(line) {  // three or more of one of - * _, spaces between
  let char = null;
  let marks = 0;
  for (const c of line) {
    if (c === ' ' || c === '\t') continue;
    if (char === null && (c === '-' || c === '*' || c === '_')) char = c;
    else if (c !== char) return false;  // at its first other character
    marks += 1;
  }
  return marks >= 3;
}

function heading(line) {
  const m = line.match(/^(#{1,6})\s+(.*)$/);
  if (!m) return null;
  // A closing run of # goes (`## Title ##`), when a space comes before it.
  let text = m[2].trimEnd();
  let end = text.length;
  while (end > 0 && text[end - 1] === '#') end -= 1;
  if (end === 0) text = '';
  else if (end < text.length && /\s/.test(text[end - 1])) text = text.slice(0, end).trimEnd();
  return { level: m[1].length, text };
}

const startsBlock = (line, depth) => Boolean(
  openFence(line) || heading(line) || LIST.test(line) || (depth < MAX_QUOTE && QUOTE.test(line)));

function fenced(lines, i, fence) {
  const body = [];
  let j = i + 1;
  for (; j < lines.length && !closesFence(lines[j], fence); j += 1) {
    // The fence's own indent is taken off its lines (as far as they have it).
    body.push(lines[j].slice(Math.min(fence.indent, indentOf(lines[j]))));
  }
  const lang = fence.lang ? ` data-lang="${escapeHtml(fence.lang)}"` : '';
  const html = `<pre class="code"${lang}><code>${escapeHtml(body.join('\n'))}</code></pre>`;
  return [html, Math.min(j + 1, lines.length)];  // an unclosed fence runs to the end
}

/** Items, nested by indent up to MAX_LIST deep (deeper ones are siblings); an indented
 * line that starts nothing else continues its item; blank lines between items do not
 * end the list. */
function list(lines, i) {
  const open = [];  // the lists open, outermost first: {indent, tag}
  let html = '';
  while (i < lines.length) {
    const line = lines[i];
    const m = line.match(LIST);
    if (!m) {
      if (!line.trim()) {
        let j = i;
        while (j < lines.length && !lines[j].trim()) j += 1;
        if (j < lines.length && LIST.test(lines[j]) && !isRule(lines[j])) { i = j; continue; }
        break;
      }
      if (indentOf(line) === 0 || startsBlock(line, 0) || isRule(line)) break;
      html += `<br>${inline(line.trim())}`;
      i += 1;
      continue;
    }
    if (isRule(line) && open.length) break;
    const indent = m[1].replace(/\t/g, '    ').length;
    const tag = /\d/.test(m[2]) ? 'ol' : 'ul';
    while (open.length && open[open.length - 1].indent > indent) html += `</li></${open.pop().tag}>`;
    const top = open[open.length - 1];
    const start = tag === 'ol' && parseInt(m[2], 10) !== 1 ? ` start="${parseInt(m[2], 10)}"` : '';
    if (!top || (indent > top.indent && open.length < MAX_LIST)) {
      html += `<${tag}${start}>`;
      open.push({ indent, tag });
    } else if (top.tag !== tag) {
      html += `</li></${top.tag}><${tag}${start}>`;
      top.tag = tag;
    } else {
      html += '</li>';
    }
    html += `<li>${inline(m[3])}`;
    i += 1;
  }
  while (open.length) html += `</li></${open.pop().tag}>`;
  return [html, i];
}

function blocks(lines, depth) {
  const out = [];
  let i = 0;
  while (i < lines.length) {  // every branch consumes at least lines[i]
    const line = lines[i];
    const fence = openFence(line);
    if (fence) {
      const [html, next] = fenced(lines, i, fence);
      out.push(html);
      i = next;
      continue;
    }
    if (!line.trim()) { i += 1; continue; }
    const head = heading(line);
    if (head) {
      const level = Math.min(head.level + 2, 6);  // h3..h6 inside a message
      out.push(`<h${level}>${inline(head.text)}</h${level}>`);
      i += 1;
      continue;
    }
    if (isRule(line)) { out.push('<hr>'); i += 1; continue; }
    if (depth < MAX_QUOTE && QUOTE.test(line)) {
      const quote = [];
      while (i < lines.length && QUOTE.test(lines[i])) quote.push(lines[i++].replace(/^\s*>\s?/, ''));
      out.push(`<blockquote>${blocks(quote, depth + 1)}</blockquote>`);
      continue;
    }
    if (LIST.test(line)) {
      const [html, next] = list(lines, i);
      out.push(html);
      i = next;
      continue;
    }
    const para = [line];
    i += 1;
    while (i < lines.length && lines[i].trim() && !isRule(lines[i]) && !startsBlock(lines[i], depth)) {
      para.push(lines[i++]);
    }
    out.push(`<p>${para.map(inline).join('<br>\n')}</p>`);
  }
  return out.join('');
}

export function renderMarkdown(source) {
  return blocks(String(source).replace(/\r\n?/g, '\n').split('\n'), 0);
}

/**
 * `source` cut into parts whose renderings, concatenated, are renderMarkdown(source)
 * exactly (and whose texts, concatenated, are `source`), each about `size` characters or
 * more: a cut falls only after a blank line outside a fenced block, where the next
 * non-blank line does not go on a list — where the block loop above starts afresh
 * whatever came before. A long answer is then rendered a part at a time (slices.js).
 * Text with a lone CR (a line break only after normalising) is not cut.
 */
export function splitBlocks(source, size = 16384) {
  const text = String(source);
  if (text.length <= size || /\r(?!\n)/.test(text)) return [text];
  const lines = text.split('\n');
  const parts = [];
  let fence = null;
  let start = 0;  // offset of the part being gathered
  let at = 0;  // offset of lines[i]
  for (let i = 0; i < lines.length; i += 1) {
    const line = lines[i];
    const next = at + line.length + 1;
    if (fence) {
      if (closesFence(line, fence)) fence = null;
    } else if (!line.trim()) {
      if (next - start >= size && next < text.length) {
        let j = i + 1;
        while (j < lines.length && !lines[j].trim()) j += 1;
        if (j < lines.length && !(LIST.test(lines[j]) && !isRule(lines[j]))) {
          parts.push(text.slice(start, next));
          start = next;
        }
      }
    } else {
      fence = openFence(line);
    }
    at = next;
  }
  parts.push(text.slice(start));
  return parts;
}
