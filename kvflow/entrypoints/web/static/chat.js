// The chat playground: a conversation streamed from /v1/chat/completions (SSE), with a
// system prompt, sampling controls, a stop button (closing the stream aborts the request
// on the server, which frees its KV blocks), TTFT and tokens/s of each reply, Markdown
// with highlighted code (markdown.js), conversations saved in this browser (localStorage),
// regenerate a reply and edit a message (the conversation continues from there).

import { apiFetch, modelInfo, onKeyChange, setupKeyButton, sseEvents } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const SETTINGS_STORAGE = "kvflow.chatSettings";
const DEFAULTS = { system: "", temperature: 0.7, top_p: 1, max_tokens: 512, seed: "" };

const CONVERSATIONS_STORAGE = "kvflow.conversations";
const CURRENT_STORAGE = "kvflow.currentConversation";
const MAX_CONVERSATIONS = 100; // the oldest are dropped beyond this (and when storage is full)

let conversations = []; // [{id, title, updated, messages: [{role, content, stats?, finish?}]}], newest first
let current = null; // the conversation shown
let controller = null; // AbortController of the reply in progress

// ---------------------------------------------------------------- settings
function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
  } catch {
    saved = {};
  }
  const s = { ...DEFAULTS, ...saved };
  $("system").value = s.system;
  for (const name of ["temperature", "top_p"]) {
    $(name).value = s[name];
    $(`${name}-range`).value = s[name];
    $(`${name}-range`).addEventListener("input", () => {
      $(name).value = $(`${name}-range`).value;
      saveSettings();
    });
    $(name).addEventListener("input", () => {
      $(`${name}-range`).value = $(name).value;
    });
  }
  $("max_tokens").value = s.max_tokens;
  $("seed").value = s.seed;
  for (const id of ["system", "temperature", "top_p", "max_tokens", "seed"]) $(id).addEventListener("change", saveSettings);
}

function saveSettings() {
  const s = {
    system: $("system").value,
    temperature: $("temperature").value,
    top_p: $("top_p").value,
    max_tokens: $("max_tokens").value,
    seed: $("seed").value,
  };
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(s));
}

// The request's sampling fields; a field left empty is not sent (the server's default).
function samplingFields() {
  const fields = {};
  const number = (id, parse) => {
    const raw = $(id).value.trim();
    if (raw === "") return;
    const value = parse(raw);
    if (!Number.isFinite(value)) throw new Error(`${id} must be a number, got ${JSON.stringify(raw)}`);
    fields[id] = value;
  };
  number("temperature", parseFloat);
  number("top_p", parseFloat);
  number("max_tokens", (v) => (/^\d+$/.test(v) ? parseInt(v, 10) : NaN));
  number("seed", (v) => (/^-?\d+$/.test(v) ? parseInt(v, 10) : NaN));
  return fields;
}

// ---------------------------------------------------------------- conversations (localStorage)
function loadConversations() {
  try {
    const saved = JSON.parse(localStorage.getItem(CONVERSATIONS_STORAGE) || "[]");
    conversations = Array.isArray(saved) ? saved.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages)) : [];
  } catch {
    conversations = [];
  }
  const id = localStorage.getItem(CURRENT_STORAGE);
  current = conversations.find((c) => c.id === id) || null;
}

// Writes every conversation with messages (an empty one is not kept); drops the oldest
// when the browser's storage is full.
function saveConversations() {
  if (current && current.messages.length && !conversations.includes(current)) conversations.unshift(current);
  conversations.sort((a, b) => b.updated - a.updated);
  const kept = conversations.filter((c) => c.messages.length).slice(0, MAX_CONVERSATIONS);
  for (;;) {
    try {
      localStorage.setItem(CONVERSATIONS_STORAGE, JSON.stringify(kept));
      break;
    } catch (error) {
      if (kept.length <= 1) {
        console.warn("kvflow: could not save the conversation", error);
        break;
      }
      kept.pop();
    }
  }
  conversations = kept;
  if (current) localStorage.setItem(CURRENT_STORAGE, current.id);
  else localStorage.removeItem(CURRENT_STORAGE);
  renderList();
}

function newConversation() {
  return { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`, title: "", updated: Date.now(), messages: [] };
}

function touch() {
  current.updated = Date.now();
  if (!current.title) {
    const first = current.messages.find((m) => m.role === "user");
    if (first) current.title = first.content.replace(/\s+/g, " ").trim().slice(0, 60);
  }
  saveConversations();
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    if (current && c.id === current.id) li.className = "active";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title || "(untitled)";
    open.title = `${c.title}\n${new Date(c.updated).toLocaleString()} · ${c.messages.length} messages`;
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.textContent = "×";
    del.title = "Delete this conversation";
    del.setAttribute("aria-label", `Delete conversation ${c.title}`);
    li.append(open, del);
    list.append(li);
  }
  if (!conversations.length) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "(none yet)";
    list.append(li);
  }
}

$("conversations").addEventListener("click", (event) => {
  const li = event.target.closest("li[data-id]");
  if (!li || controller) return;
  if (event.target.closest("button.delete")) {
    conversations = conversations.filter((c) => c.id !== li.dataset.id);
    if (current && current.id === li.dataset.id) current = newConversation();
    saveConversations();
    renderConversation();
  } else if (event.target.closest("button.open")) {
    current = conversations.find((c) => c.id === li.dataset.id) || newConversation();
    saveConversations();
    renderConversation();
    setPanel(false);
  }
});

// ---------------------------------------------------------------- messages
function renderConversation() {
  const box = $("messages");
  box.replaceChildren();
  if (!current.messages.length) {
    const hint = document.createElement("p");
    hint.className = "empty-hint";
    hint.id = "empty-hint";
    hint.textContent = "Ask something. Replies stream token by token; Stop aborts the request and frees its KV blocks.";
    box.append(hint);
  }
  current.messages.forEach((m, i) => {
    const el = addMessage(m.role, m.content, i);
    if (m.stats) el.querySelector(".stats").textContent = m.stats;
    if (m.finish) el.dataset.done = m.finish;
  });
  renderList();
}

function button(label, title, data) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.title = title;
  b.dataset[data] = "";
  return b;
}

function addMessage(role, text, index) {
  $("empty-hint")?.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.dataset.index = index;
  el.dataset.raw = text;
  el.innerHTML = `<div class="role"><span></span></div><div class="body"></div><div class="stats"></div>`;
  el.querySelector(".role span").textContent = role;
  const body = el.querySelector(".body");
  if (role === "assistant") body.innerHTML = renderMarkdown(text);
  else body.textContent = text;
  const bar = el.querySelector(".role");
  if (role === "assistant") {
    bar.append(button("Copy", "Copy the reply's Markdown", "copyMessage"));
    bar.append(button("Regenerate", "Ask for this reply again", "regenerate"));
  } else if (role === "user") {
    bar.append(button("Edit", "Edit this message and continue from it", "edit"));
  }
  $("messages").append(el);
  scrollDown();
  return el;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

function flash(button, label) {
  const old = button.textContent;
  button.textContent = label;
  setTimeout(() => (button.textContent = old), 1200);
}

$("messages").addEventListener("click", async (event) => {
  const button = event.target.closest("button");
  if (!button) return;
  let text = null;
  if ("copyCode" in button.dataset) text = button.closest(".code-block").querySelector("code").textContent;
  else if ("copyMessage" in button.dataset) text = button.closest(".msg").dataset.raw || "";
  if (text === null) return;
  try {
    await copyText(text);
    flash(button, "Copied");
  } catch {
    flash(button, "Copy failed");
  }
});


$("messages").addEventListener("click", (event) => {
  const b = event.target.closest("button");
  const msg = b?.closest(".msg");
  if (!msg || controller) return;
  const index = Number(msg.dataset.index);
  if ("regenerate" in b.dataset) regenerate(index);
  else if ("edit" in b.dataset) startEdit(msg, index);
});

// Regenerate the assistant message at ``index``: the conversation is cut before it and
// the reply asked for again.
function regenerate(index) {
  if (current.messages[index]?.role !== "assistant") return;
  current.messages.length = index;
  touch();
  renderConversation();
  generate();
}

// Edit the user message at ``index`` in place; Save & send cuts the conversation after it
// and asks for a new reply.
function startEdit(msg, index) {
  if (msg.querySelector(".edit-box")) return;
  const body = msg.querySelector(".body");
  const box = document.createElement("div");
  box.className = "edit-box";
  const area = document.createElement("textarea");
  area.value = current.messages[index].content;
  area.rows = Math.min(12, Math.max(2, area.value.split("\n").length));
  const row = document.createElement("div");
  row.className = "row";
  const cancel = button("Cancel", "Keep the message as it was", "editCancel");
  cancel.className = "secondary";
  const save = button("Save & send", "Replace the message and ask for a new reply", "editSave");
  row.append(cancel, save);
  box.append(area, row);
  body.hidden = true;
  msg.insertBefore(box, body);
  area.focus();
  cancel.addEventListener("click", () => {
    box.remove();
    body.hidden = false;
  });
  save.addEventListener("click", () => {
    const text = area.value.trim();
    if (!text || controller) return;
    current.messages.length = index;
    current.messages.push({ role: "user", content: text });
    touch();
    renderConversation();
    generate();
  });
}

// ---------------------------------------------------------------- one reply
function formatStats(r) {
  const parts = [];
  if (r.ttft !== null) parts.push(`TTFT ${(r.ttft / 1000).toFixed(2)} s`);
  if (r.tokens > 1 && r.lastAt > r.firstAt) {
    parts.push(`${(((r.tokens - 1) * 1000) / (r.lastAt - r.firstAt)).toFixed(1)} tok/s`);
  }
  parts.push(`${r.exact ? "" : "≈"}${r.tokens} tokens`);
  if (r.finish) parts.push(`finish: ${r.finish}`);
  return parts.join(" · ");
}

function send(text) {
  if (!current) current = newConversation();
  current.messages.push({ role: "user", content: text });
  addMessage("user", text, current.messages.length - 1);
  touch();
  generate();
}

// Streams a reply to the current conversation's messages and appends it.
async function generate() {
  let fields;
  try {
    fields = samplingFields();
  } catch (error) {
    alert(error.message);
    return;
  }
  const conversation = current;
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation.messages.map(({ role, content }) => ({ role, content })));
  const el = addMessage("assistant", "", conversation.messages.length);
  el.classList.add("streaming");
  const body = el.querySelector(".body");
  const stats = el.querySelector(".stats");
  const reply = { text: "", ttft: null, firstAt: 0, lastAt: 0, tokens: 0, exact: false, finish: null };
  let pending = false;
  const render = () => {
    pending = false;
    body.innerHTML = renderMarkdown(reply.text);
    el.dataset.raw = reply.text;
    stats.textContent = formatStats(reply);
    scrollDown();
  };
  const schedule = () => {
    if (!pending) {
      pending = true;
      requestAnimationFrame(render);
    }
  };

  controller = new AbortController();
  setBusy(true);
  const sentAt = performance.now();
  let stopped = false;
  let failed = false;
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ messages, stream: true, stream_options: { include_usage: true }, ...fields }),
      signal: controller.signal,
    });
    for await (const { data } of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) {
        reply.tokens = chunk.usage.completion_tokens;
        reply.exact = true;
      }
      for (const choice of chunk.choices || []) {
        const delta = choice.delta?.content || "";
        if (delta) {
          const now = performance.now();
          if (reply.ttft === null) {
            reply.ttft = now - sentAt;
            reply.firstAt = now;
          }
          reply.lastAt = now;
          reply.text += delta;
          reply.tokens += 1; // one chunk per step; exact once the usage chunk comes
        }
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
      schedule();
    }
  } catch (error) {
    if (error.name === "AbortError") {
      stopped = true;
      reply.finish = "stopped";
    } else {
      failed = true;
      const p = document.createElement("p");
      p.className = "error";
      p.textContent = error.message;
      render();
      body.append(p);
    }
  } finally {
    controller = null;
    setBusy(false);
    el.classList.remove("streaming");
    if (!failed) render();
    // A reply (even a stopped one) joins the conversation; a failed request leaves it as it
    // was, so that Regenerate or Send can try again.
    if (!failed && (reply.text || stopped)) {
      conversation.messages.push({ role: "assistant", content: reply.text, stats: formatStats(reply), finish: stopped ? "stopped" : "done" });
      if (conversation === current) touch();
      else saveConversations();
    } else if (failed) {
      el.querySelector("[data-regenerate]")?.remove();
    }
    el.dataset.done = stopped ? "stopped" : failed ? "error" : "done";
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

// ---------------------------------------------------------------- the side panel (narrow screens)
function setPanel(open) {
  document.body.classList.toggle("panel-open", open);
  $("panel-toggle").setAttribute("aria-expanded", String(open));
}
$("panel-toggle").addEventListener("click", () => setPanel(!document.body.classList.contains("panel-open")));

// ---------------------------------------------------------------- wiring
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", () => {
  controller?.abort();
  current = newConversation();
  saveConversations();
  renderConversation();
  setPanel(false);
  $("prompt").focus();
});

async function showModel() {
  try {
    const model = await modelInfo();
    $("model-name").textContent = model ? `${model.id} · context ${model.max_model_len}` : "";
  } catch (error) {
    $("model-name").textContent = error.status === 401 ? "(API key needed)" : "";
  }
}

loadSettings();
loadConversations();
if (!current) current = newConversation();
renderConversation();
setupKeyButton($("key-button"));
onKeyChange(showModel);
showModel();
