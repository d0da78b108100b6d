// Talking to the kvflow server from the pages: the API key, authorized fetches, and
// server-sent events read from a fetch body (EventSource cannot send an Authorization
// header, so both pages read their streams this way).

const KEY_STORAGE = "kvflow.apiKey";

export function getKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
  for (const listener of keyListeners) listener(key);
}

const keyListeners = new Set();
export function onKeyChange(listener) {
  keyListeners.add(listener);
}

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

// The message of an OpenAI-shaped error body ({"error": {"message": ...}}), or the text.
export async function errorOf(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return new ApiError(response.status, body?.error?.message || text, body);
  } catch {
    return new ApiError(response.status, text || response.statusText, null);
  }
}

// fetch() with the stored key as "Authorization: Bearer"; a 401 opens the key dialog and
// throws. Any other non-2xx response throws an ApiError with the server's message.
export async function apiFetch(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = getKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) {
    const error = await errorOf(response);
    if (response.status === 401) askForKey(key ? "The server refused this API key." : "This server needs an API key.");
    throw error;
  }
  return response;
}

// Yields {event, data} for each server-sent event of a fetch Response's body.
export async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const raw = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
        let event = "message";
        const data = [];
        for (const line of raw.split(/\r?\n/)) {
          if (line.startsWith(":")) continue; // a comment (keep-alive)
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") event = value;
          else if (field === "data") data.push(value);
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  } finally {
    reader.releaseLock();
  }
}

// ---------------------------------------------------------------- the key dialog
let dialog = null;

function keyDialog() {
  if (dialog) return dialog;
  dialog = document.createElement("dialog");
  dialog.id = "key-dialog";
  dialog.innerHTML = `
    <form method="dialog">
      <h2>API key</h2>
      <p class="reason"></p>
      <p>The key is kept in this browser (localStorage) and sent as
         <code>Authorization: Bearer</code> with each request to this server only.</p>
      <input id="key-input" type="password" autocomplete="off" placeholder="the server's --api-key">
      <div class="row">
        <button value="clear" type="submit" class="secondary">Forget key</button>
        <button value="cancel" type="submit" class="secondary">Cancel</button>
        <button value="save" type="submit" id="key-save">Save</button>
      </div>
    </form>`;
  document.body.append(dialog);
  dialog.addEventListener("close", () => {
    const input = dialog.querySelector("#key-input");
    if (dialog.returnValue === "save") setKey(input.value.trim());
    else if (dialog.returnValue === "clear") setKey("");
    input.value = "";
  });
  return dialog;
}

export function askForKey(reason = "") {
  const d = keyDialog();
  d.querySelector(".reason").textContent = reason;
  if (!d.open) d.showModal();
  d.querySelector("#key-input").focus();
}

// The header's key button: shows whether a key is stored and opens the dialog.
export function setupKeyButton(button) {
  const show = () => {
    button.textContent = getKey() ? "API key ✓" : "API key";
    button.title = getKey() ? "A key is stored in this browser" : "No key stored (needed with --api-key)";
  };
  show();
  onKeyChange(show);
  button.addEventListener("click", () => askForKey(""));
}

// The served model's id (GET /v1/models), or null.
export async function modelInfo() {
  const response = await apiFetch("/v1/models");
  const body = await response.json();
  return body.data && body.data.length ? body.data[0] : null;
}
