// The chat playground: a conversation streamed from /v1/chat/completions (SSE), with a
// system prompt, sampling controls, a stop button (closing the stream aborts the request
// on the server, which frees its KV blocks), TTFT and tokens/s of each reply, Markdown.

import { apiFetch, modelInfo, onKeyChange, setupKeyButton, sseEvents } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const SETTINGS_STORAGE = "kvflow.chatSettings";
const DEFAULTS = { system: "", temperature: 0.7, top_p: 1, max_tokens: 512, seed: "" };

const history = []; // {role, content} of finished turns
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

// ---------------------------------------------------------------- messages
function addMessage(role, text) {
  $("empty-hint")?.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.innerHTML = `<div class="role"><span>${role}</span></div><div class="body"></div><div class="stats"></div>`;
  const body = el.querySelector(".body");
  if (role === "user") body.textContent = text;
  else body.innerHTML = renderMarkdown(text);
  if (role === "assistant") {
    const copy = document.createElement("button");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.title = "Copy the reply's Markdown";
    copy.dataset.copyMessage = "";
    el.querySelector(".role").append(copy);
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

async function send(text) {
  let fields;
  try {
    fields = samplingFields();
  } catch (error) {
    alert(error.message);
    return;
  }
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history, { role: "user", content: text });
  addMessage("user", text);
  const el = addMessage("assistant", "");
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
    if (!body.querySelector(".error")) render();
    el.dataset.finish = reply.finish || "";
    el.dataset.done = stopped ? "stopped" : "done";
  }
  if (reply.text) {
    history.push({ role: "user", content: text }, { role: "assistant", content: reply.text });
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

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
  history.length = 0;
  $("messages").innerHTML = "";
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
setupKeyButton($("key-button"));
onKeyChange(showModel);
showModel();
