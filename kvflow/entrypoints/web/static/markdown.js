// A small Markdown renderer for model replies (no dependency). Every piece of the input is
// HTML-escaped before any markup is added, so a reply can never inject HTML or script.
//
// Blocks: fenced code (``` or ~~~, with a language label and a copy button; an unclosed
// fence, as while a reply streams, runs to the end), ATX headings, paragraphs (single
// newlines are line breaks, as in chat UIs), bullet and numbered lists (nested by
// indentation), block quotes, GitHub-style tables, horizontal rules.
// Inline: `code`, **bold**, __bold__, *italic*, _italic_, ~~strike~~, [links](http://...)
// (http, https and mailto only; anything else stays text).

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const HOLE = "\u0000"; // placeholder delimiter (NULs are removed from the input first)

function emphasis(escaped) {
  return escaped
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^\w*])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![\w*])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
}

export function renderInline(text) {
  const held = [];
  const hold = (html) => `${HOLE}${held.push(html) - 1}${HOLE}`;
  // Code spans first: nothing inside them is markup.
  let out = text.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) =>
    hold(`<code>${escapeHtml(code.replace(/^ (.*) $/, "$1"))}</code>`),
  );
  // Links (http, https, mailto only), their label and URL escaped.
  out = out.replace(/\[([^\]\n]+)\]\(\s*([^)\s]+)\s*\)/g, (whole, label, url) => {
    if (!/^(https?:\/\/|mailto:)/i.test(url)) return whole;
    return hold(`<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${emphasis(escapeHtml(label))}</a>`);
  });
  out = emphasis(escapeHtml(out));
  // A link's label may hold code spans: restore until no placeholder is left.
  const placeholder = new RegExp(`${HOLE}(\\d+)${HOLE}`, "g");
  for (let pass = 0; pass <= held.length && out.includes(HOLE); pass++) {
    out = out.replace(placeholder, (_, i) => held[Number(i)]);
  }
  return out;
}

export function codeBlock(lang, code) {
  const label = lang ? `<span class="lang">${escapeHtml(lang)}</span>` : "<span class=\"lang\">text</span>";
  const cls = lang ? ` class="language-${escapeHtml(lang)}"` : "";
  return (
    `<div class="code-block"><div class="code-head">${label}` +
    `<button type="button" class="copy" data-copy-code>Copy</button></div>` +
    `<pre><code${cls}>${escapeHtml(code)}</code></pre></div>`
  );
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function tableCells(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function isOrdered(line) {
  return /\d/.test(line.match(ITEM)[2]);
}

function indentOf(line) {
  return line.match(/^\s*/)[0].replace(/\t/g, "    ").length;
}

function renderList(lines) {
  // lines: the list's lines; items start with a marker at the first item's indent.
  const base = indentOf(lines[0]);
  const ordered = isOrdered(lines[0]);
  const start = ordered ? parseInt(lines[0].match(ITEM)[2], 10) : 1;
  const items = [];
  for (const line of lines) {
    const m = line.match(ITEM);
    if (m && indentOf(line) <= base + 1) items.push({ first: m[3], rest: [] });
    else if (items.length) items[items.length - 1].rest.push(line);
  }
  const body = items
    .map((item) => {
      const rest = item.rest.length ? renderBlocks(dedent(item.rest)) : "";
      return `<li>${renderInline(item.first)}${rest}</li>`;
    })
    .join("");
  if (!ordered) return `<ul>${body}</ul>`;
  return start === 1 ? `<ol>${body}</ol>` : `<ol start="${start}">${body}</ol>`;
}

function dedent(lines) {
  const indents = lines.filter((l) => l.trim()).map(indentOf);
  const cut = indents.length ? Math.min(...indents) : 0;
  return lines.map((l) => l.replace(/\t/g, "    ").slice(Math.min(cut, indentOf(l))));
}

function renderBlocks(lines) {
  let html = "";
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      const fence = m[1];
      const closing = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}\\s*$`);
      const body = [];
      i++;
      while (i < lines.length && !closing.test(lines[i])) body.push(lines[i++]);
      i++; // the closing fence (or past the end: an unclosed fence runs to the end)
      html += codeBlock(m[2], body.join("\n"));
    } else if (!line.trim()) {
      i++;
    } else if ((m = line.match(HEADING))) {
      const level = m[1].length;
      html += `<h${level}>${renderInline(m[2])}</h${level}>`;
      i++;
    } else if (RULE.test(line)) {
      html += "<hr>";
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && QUOTE.test(lines[i])) inner.push(lines[i++].replace(QUOTE, ""));
      html += `<blockquote>${renderBlocks(inner)}</blockquote>`;
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      const head = tableCells(line);
      const aligns = tableCells(lines[i + 1]).map((c) =>
        c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "",
      );
      const cell = (tag, text, j) =>
        `<${tag}${aligns[j] ? ` style="text-align:${aligns[j]}"` : ""}>${renderInline(text)}</${tag}>`;
      let table = `<table><thead><tr>${head.map((c, j) => cell("th", c, j)).join("")}</tr></thead><tbody>`;
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
        const cells = tableCells(lines[i++]);
        table += `<tr>${head.map((_, j) => cell("td", cells[j] ?? "", j)).join("")}</tr>`;
      }
      html += `${table}</tbody></table>`;
    } else if (ITEM.test(line)) {
      const block = [];
      const base = indentOf(line);
      const ordered = isOrdered(line);
      // an item of this list, or a line inside one of its items
      const goesOn = (l) =>
        indentOf(l) > base + 1 || (ITEM.test(l) && isOrdered(l) === ordered);
      while (i < lines.length) {
        const l = lines[i];
        if (!l.trim()) {
          // a blank line ends the list unless it goes on
          const next = lines[i + 1];
          if (next !== undefined && next.trim() && goesOn(next)) {
            block.push(l);
            i++;
            continue;
          }
          break;
        }
        if (block.length && ITEM.test(l) && !goesOn(l)) break; // another kind of list
        if (block.length && !ITEM.test(l) && indentOf(l) <= base && startsBlock(l)) break;
        if (block.length && !ITEM.test(l) && indentOf(l) <= base && !block[block.length - 1].trim()) break;
        block.push(l);
        i++;
      }
      html += renderList(block.filter((l, j) => l.trim() || j < block.length - 1));
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && (!para.length || !startsBlock(lines[i]))) para.push(lines[i++]);
      html += `<p>${para.map((l) => renderInline(l.trim())).join("<br>")}</p>`;
    }
  }
  return html;
}

// The HTML of a Markdown text (safe to assign to innerHTML).
export function renderMarkdown(text) {
  const lines = String(text).replace(/\u0000/g, "").replace(/\r\n?/g, "\n").split("\n");
  return renderBlocks(lines);
}
