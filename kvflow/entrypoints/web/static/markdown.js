// Model replies as Markdown: parsed by marked (GitHub-flavoured, single newlines are line
// breaks as in chat UIs), code highlighted by highlight.js, and the HTML sanitized by
// DOMPurify before it reaches the page (all vendored under /ui/vendor/, see docs/web.md).
//
// A reply can never inject HTML or script: raw HTML in the Markdown is shown as text (the
// ``html`` renderer escapes it), images are shown as links (nothing is fetched from a URL
// a model wrote), and DOMPurify then removes whatever else could run (event handlers,
// javascript: URLs, <script>, <style>, forms, frames). Links open in a new tab without
// the opener.
//
// Fenced code gets a language label and a copy button (an unclosed fence, as while a
// reply streams, runs to the end of the text).

import { Marked } from "./vendor/marked/marked.esm.js";
import hljs from "./vendor/highlight.js/highlight.min.js";

const DOMPurify = window.DOMPurify; // vendor/dompurify/purify.min.js, a classic script the page loads first

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

function highlight(code, lang) {
  try {
    if (lang && hljs.getLanguage(lang)) return hljs.highlight(code, { language: lang, ignoreIllegals: true }).value;
    if (code.length <= 20000) return hljs.highlightAuto(code).value;
  } catch {
    // fall through: plain text
  }
  return escapeHtml(code);
}

const marked = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    // Raw HTML in a reply is text, never markup.
    html({ text }) {
      return escapeHtml(text);
    },
    // An image is a link to it: the page never fetches a URL a model wrote.
    image({ href, text }) {
      return `<a href="${escapeHtml(href || "")}">${escapeHtml(text || href || "image")}</a>`;
    },
    code({ text, lang }) {
      const language = (lang || "").trim().split(/\s+/)[0].toLowerCase();
      const label = language || "text";
      const cls = language ? ` class="hljs language-${escapeHtml(language)}"` : ' class="hljs"';
      return (
        `<div class="code-block"><div class="code-head"><span class="lang">${escapeHtml(label)}</span>` +
        `<button type="button" class="copy" data-copy-code>Copy</button></div>` +
        `<pre><code${cls}>${highlight(text, language)}</code></pre></div>`
      );
    },
  },
});

const PURIFY = {
  FORBID_TAGS: ["style", "script", "img", "svg", "math", "form", "input", "iframe", "object", "embed", "video", "audio", "source", "picture"],
  ADD_ATTR: ["target", "data-copy-code"],
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:|#)/i,
};

let hooked = false;
function hookLinks() {
  if (hooked) return;
  hooked = true;
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
}

// The sanitized HTML of a reply's Markdown.
export function renderMarkdown(text) {
  hookLinks();
  // (CommonMark: an unclosed fence, as while a reply streams, runs to the end.)
  const html = marked.parse(String(text));
  return DOMPurify.sanitize(html, PURIFY);
}
