// mlxr's dashboard. Plain JavaScript, no build step, nothing loaded from elsewhere.
// State comes from one Server-Sent-Events stream (/ui/events: `models` and `running` events);
// actions are the public API's own routes (/api/pull, /api/copy, /api/delete, /api/chat,
// /api/generate with keep_alive 0 to unload). Text from the server is only ever set as text.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "mlxr-api-key";

// -- helpers -------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

function ago(iso) {
  const s = (Date.now() - Date.parse(iso)) / 1000;
  if (!isFinite(s)) return "";
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} days ago`;
}

function until(iso) {
  const s = (Date.parse(iso) - Date.now()) / 1000;
  if (!isFinite(s) || s > 365 * 86400) return "never (keep_alive < 0)";
  if (s <= 0) return "now";
  if (s < 120) return `in ${Math.round(s)} s`;
  if (s < 7200) return `in ${Math.round(s / 60)} min`;
  return `in ${(s / 3600).toFixed(1)} h`;
}

// -- the API -------------------------------------------------------------------------------

function headers(extra) {
  const out = { ...(extra || {}) };
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function call(method, path, body, signal) {
  const response = await fetch(path, {
    method, signal,
    headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const data = await response.json();
      if (data && data.error) message = typeof data.error === "string" ? data.error : data.error.message;
    } catch (e) { /* not JSON */ }
    if (response.status === 401) askForKey(message);
    throw new ApiError(response.status, message);
  }
  return response;
}

// Ollama's streams: one JSON object per line. An `error` line ends the stream with that error.
async function* ndjson(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (value) buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, nl).trim();
      buffer = buffer.slice(nl + 1);
      if (!line) continue;
      const data = JSON.parse(line);
      if (data.error) throw new ApiError(0, data.error);
      yield data;
    }
    if (done) break;
  }
  if (buffer.trim()) {
    const data = JSON.parse(buffer);
    if (data.error) throw new ApiError(0, data.error);
    yield data;
  }
}

// -- the API key ---------------------------------------------------------------------------

function askForKey(reason) {
  const dialog = $("key-dialog");
  if (dialog.open) return;
  $("key-input").value = "";
  dialog.dataset.reason = reason || "";
  dialog.showModal();
}

function initKey() {
  $("key-button").addEventListener("click", () => askForKey());
  $("key-form").addEventListener("submit", () => {
    const key = $("key-input").value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key);
    else sessionStorage.removeItem(KEY_STORE);
    feed.restart();
  });
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
}

// -- the live feed (Server-Sent Events, read with fetch so the key can be sent) -------------

const state = { models: [], running: [] };

const feed = {
  controller: null,
  retryMs: 2000,
  timer: null,

  restart() {
    if (this.controller) this.controller.abort();
    clearTimeout(this.timer);
    this.connect();
  },

  setLive(on, text) {
    const el = $("live");
    el.className = `live ${on ? "on" : "off"}`;
    el.textContent = text;
  },

  async connect() {
    const controller = new AbortController();
    this.controller = controller;
    try {
      const response = await fetch("/ui/events", { headers: headers(), signal: controller.signal });
      if (response.status === 401) {
        this.setLive(false, "API key needed");
        askForKey("invalid or missing API key");
        return;  // the key dialog restarts the feed
      }
      if (!response.ok) throw new Error(`${response.status}`);
      this.setLive(true, "live");
      await this.read(response);
    } catch (e) {
      if (controller.signal.aborted) return;
    }
    if (this.controller !== controller) return;
    this.setLive(false, "reconnecting");
    this.timer = setTimeout(() => this.connect(), this.retryMs);
  },

  async read(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith(":")) continue;
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") name = val;
          else if (field === "data") data.push(val);
          else if (field === "retry" && /^\d+$/.test(val)) this.retryMs = Number(val);
        }
        if (data.length) this.dispatch(name, JSON.parse(data.join("\n")));
      }
    }
  },

  dispatch(name, data) {
    if (name === "hello") $("version").textContent = `v${data.version}`;
    else if (name === "models") { state.models = data.models; renderModels(); renderModelChoice(); }
    else if (name === "running") { state.running = data.models; renderRunning(); }
  },
};

// -- tabs ----------------------------------------------------------------------------------

function showTab(name) {
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".panel")) p.hidden = p.id !== `tab-${name}`;
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
  if (name === "running") renderRunning();
}

function initTabs() {
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => showTab(b.dataset.tab));
  const wanted = location.hash.slice(1);
  showTab(["models", "running", "playground"].includes(wanted) ? wanted : "models");
}

// -- models --------------------------------------------------------------------------------

function flash(message) {
  const el = $("models-error");
  el.textContent = message;
  el.hidden = !message;
}

function renderModels() {
  const body = $("models").querySelector("tbody");
  body.replaceChildren(...state.models.map(modelRow));
  $("models-empty").hidden = state.models.length > 0;
}

function modelRow(m) {
  const d = m.details || {};
  const caps = (m.capabilities || []).map((c) => h("span", { class: `badge cap-${c}`, text: c }));
  const actions = h("td", { class: "actions" },
    h("button", { class: "small", "data-testid": "chat-model", onclick: () => chatWith(m.name) }, "Chat"),
    h("button", { class: "small secondary", "data-testid": "copy-model", onclick: (e) => copyModel(m.name, e.target) }, "Copy"),
    h("button", { class: "small danger", "data-testid": "delete-model", onclick: () => deleteModel(m.name) }, "Delete"));
  return h("tr", { "data-model": m.name },
    h("td", { class: "name", text: m.name }),
    h("td", { text: bytes(m.size) }),
    h("td", { text: d.family || "" }),
    h("td", { text: d.parameter_size || "" }),
    h("td", { text: d.quantization_level || "" }),
    h("td", {}, caps),
    h("td", { text: ago(m.modified_at), title: m.modified_at }),
    actions);
}

function copyModel(name, button) {
  const cell = button.closest("td");
  const input = h("input", { value: `${name.split(":")[0]}-copy`, "data-testid": "copy-name" });
  const go = async () => {
    try {
      await call("POST", "/api/copy", { source: name, destination: input.value.trim() });
      flash("");
    } catch (e) { flash(`copy failed: ${e.message}`); }
    renderModels();
  };
  const form = h("form", { class: "inline", onsubmit: (e) => { e.preventDefault(); go(); } },
    input, h("button", { class: "small", type: "submit", "data-testid": "copy-confirm" }, "Copy"),
    h("button", { class: "small secondary", type: "button", onclick: renderModels }, "Cancel"));
  cell.replaceChildren(form);
  input.select();
}

async function deleteModel(name) {
  if (!confirm(`Delete ${name}?`)) return;
  try {
    await call("DELETE", "/api/delete", { model: name });
    state.models = state.models.filter((m) => m.name !== name);
    renderModels();
    flash("");
  } catch (e) { flash(`delete failed: ${e.message}`); }
}

function initPull() {
  $("pull-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const name = $("pull-name").value.trim();
    if (name) pull(name, $("pull-insecure").checked);
    $("pull-name").value = "";
  });
}

// One bar per layer, as `ollama pull` draws them (layers download one after another), and
// the whole pull's share of the bytes known so far.
async function pull(name, insecure) {
  const label = h("span", { class: "pull-status", "data-testid": "pull-status", text: "starting" });
  const percent = h("span", { class: "pull-percent", "data-testid": "pull-percent", text: "0%" });
  const layers = h("div", { class: "layers" });
  const box = h("div", { class: "pull", "data-pull": name },
    h("div", { class: "pull-head" }, h("strong", { text: name }), percent, label), layers);
  $("pulls").prepend(box);
  const seen = new Map();  // digest -> {bar, pct, completed, total}
  const overall = () => {
    let done = 0, all = 0;
    for (const l of seen.values()) { done += l.completed; all += l.total; }
    return [done, all];
  };
  try {
    const response = await call("POST", "/api/pull", { model: name, insecure, stream: true });
    for await (const line of ndjson(response)) {
      label.textContent = line.status || "";
      if (line.digest && line.total) {
        let layer = seen.get(line.digest);
        if (!layer) {
          const bar = h("progress", { max: 100, value: 0 });
          const pct = h("span", { class: "layer-percent", text: "0%" });
          layers.append(h("div", { class: "layer", "data-digest": line.digest },
            h("code", { text: line.digest.replace("sha256:", "").slice(0, 12) }), bar, pct,
            h("span", { class: "muted", text: bytes(line.total) })));
          layer = { bar, pct, completed: 0, total: line.total };
          seen.set(line.digest, layer);
        }
        layer.completed = line.completed || 0;
        const p = Math.floor((100 * layer.completed) / layer.total);
        layer.bar.value = p;
        layer.pct.textContent = `${p}%`;
        const [done, all] = overall();
        percent.textContent = `${Math.floor((100 * done) / all)}%`;
        label.textContent = `${line.status || ""} (${bytes(done)} of ${bytes(all)})`;
      }
      if (line.status === "success") {
        percent.textContent = "100%";
        label.textContent = "success";
      }
    }
    box.classList.add("done");
  } catch (e) {
    box.classList.add("failed");
    label.textContent = `error: ${e.message}`;
  }
}

// -- running -------------------------------------------------------------------------------

function renderRunning() {
  $("running-count").textContent = state.running.length ? String(state.running.length) : "";
  const host = $("runners");
  const seen = new Set();
  for (const m of state.running) {
    seen.add(m.name);
    let card = host.querySelector(`[data-runner="${CSS.escape(m.name)}"]`);
    if (!card) {
      card = runnerCard(m.name);
      host.append(card);
    }
    updateCard(card, m);
  }
  for (const card of [...host.children]) if (!seen.has(card.dataset.runner)) card.remove();
  $("runners-empty").hidden = state.running.length > 0;
}

function runnerCard(name) {
  const field = (key, label) => h("div", { class: "field" }, h("span", { class: "label", text: label }),
    h("span", { class: "value", "data-field": key }));
  const card = h("div", { class: "card", "data-runner": name, "data-testid": "runner" },
    h("div", { class: "card-head" }, h("strong", { text: name }),
      h("button", { class: "small danger", "data-testid": "unload", onclick: () => unload(name, card) }, "Unload")),
    h("div", { class: "fields" },
      field("memory", "memory"), field("context", "context"), field("sequences", "active / waiting"),
      field("prefix", "prefix-cache hits"), field("expires", "unloads"), field("rate", "tok/s now"),
      field("weights", "weights")),
    h("div", { class: "kv" }, h("span", { class: "label", text: "KV pool" }),
      h("div", { class: "meter" }, h("div", { class: "used" }), h("div", { class: "cached" })),
      h("span", { class: "value", "data-field": "kv" })),
    h("canvas", { class: "chart", width: 480, height: 80, "data-testid": "rate-chart" }),
    h("p", { class: "error", hidden: true }));
  return card;
}

function updateCard(card, m) {
  const set = (key, text) => { card.querySelector(`[data-field="${key}"]`).textContent = text; };
  const kv = m.kv || {};
  const rates = m.tokens_per_s || [];
  set("memory", bytes(m.size));
  set("context", m.context_length ? `${m.context_length} tokens` : "");
  set("sequences", `${m.active || 0} / ${m.waiting || 0}`);
  set("prefix", kv.prefix_hit_rate !== undefined ? `${(100 * kv.prefix_hit_rate).toFixed(1)}%` : "n/a");
  set("expires", until(m.expires_at));
  set("rate", rates.length ? rates[rates.length - 1].toFixed(1) : "0.0");
  set("weights", m.weights || "as stored");
  const total = kv.blocks_total || 0;
  const used = kv.blocks_used || 0, cached = kv.blocks_cached || 0;
  card.querySelector(".meter .used").style.width = total ? `${(100 * (used - cached)) / total}%` : "0";
  card.querySelector(".meter .cached").style.width = total ? `${(100 * cached) / total}%` : "0";
  set("kv", total ? `${used} of ${total} blocks (${cached} cached), ${bytes(kv.live_bytes || 0)} live` : "n/a");
  drawChart(card.querySelector("canvas"), rates);
}

function drawChart(canvas, rates) {
  // drawn at the element's own size in device pixels, so it stays sharp at any width
  const scale = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height, pad = 14;
  if (canvas.width !== Math.round(w * scale)) canvas.width = Math.round(w * scale);
  if (canvas.height !== Math.round(h * scale)) canvas.height = Math.round(h * scale);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(scale, 0, 0, scale, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const top = Math.max(1, ...rates);
  ctx.fillStyle = "#8a8f98";
  ctx.font = "11px sans-serif";
  ctx.fillText(`${top.toFixed(0)} tok/s`, 2, 11);
  ctx.fillText("last 60 s", w - 52, h - 2);
  ctx.strokeStyle = "#2f7de1";
  ctx.lineWidth = 2;
  ctx.beginPath();
  const n = 60;
  rates.slice(-n).forEach((r, i, all) => {
    const x = w - (all.length - 1 - i) * (w / (n - 1));
    const y = h - pad - (r / top) * (h - 2 * pad);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

async function unload(name, card) {
  const error = card.querySelector(".error");
  try {
    await call("POST", "/api/generate", { model: name, keep_alive: 0 });
    card.classList.add("unloading");
  } catch (e) {
    error.textContent = `unload failed: ${e.message}`;
    error.hidden = false;
  }
}

// -- playground ----------------------------------------------------------------------------

const chat = { messages: [], controller: null };
const OPTIONS = ["temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed", "num_predict", "num_ctx"];
const INTEGER_OPTIONS = new Set(["top_k", "seed", "num_predict", "num_ctx"]);

function renderModelChoice() {
  const select = $("pg-model");
  const current = select.value;
  const chatty = state.models.filter((m) => !m.capabilities || m.capabilities.includes("completion"));
  select.replaceChildren(...chatty.map((m) => h("option", { value: m.name, text: m.name })));
  if (chatty.some((m) => m.name === current)) select.value = current;
}

function chatWith(name) {
  showTab("playground");
  $("pg-model").value = name;
  $("pg-input").focus();
}

function readFormat() {
  const text = $("pg-format").value.trim();
  const error = $("pg-format-error");
  error.hidden = true;
  if (!text) return undefined;
  if (text === "json") return "json";
  try {
    return JSON.parse(text);
  } catch (e) {
    error.textContent = `format is neither "json" nor a JSON schema: ${e.message}`;
    error.hidden = false;
    throw e;
  }
}

function readOptions() {
  const out = {};
  for (const name of OPTIONS) {
    const raw = $(`pg-${name}`).value.trim();
    if (raw === "") continue;
    out[name] = INTEGER_OPTIONS.has(name) ? parseInt(raw, 10) : parseFloat(raw);
  }
  return out;
}

function bubble(role, text) {
  const body = h("div", { class: "text", text });
  const el = h("div", { class: `msg ${role}`, "data-role": role }, h("div", { class: "role", text: role }), body);
  $("pg-log").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

async function send() {
  const input = $("pg-input");
  const text = input.value.trim();
  const model = $("pg-model").value;
  if (!text || !model || chat.controller) return;
  let format;
  try { format = readFormat(); } catch (e) { return; }
  input.value = "";
  chat.messages.push({ role: "user", content: text });
  bubble("user", text);
  const reply = bubble("assistant", "");
  reply.classList.add("streaming");
  const body = reply.querySelector(".text");
  const thinking = h("div", { class: "thinking" });
  body.before(thinking);
  const stats = h("div", { class: "stats", "data-testid": "reply-stats" });
  reply.append(stats);
  const system = $("pg-system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...chat.messages] : chat.messages;
  const request = { model, messages, stream: true, options: readOptions() };
  if (format !== undefined) request.format = format;
  if ($("pg-think").value) request.think = $("pg-think").value === "true";
  chat.controller = new AbortController();
  $("pg-send").hidden = true;
  $("pg-stop").hidden = false;
  const started = performance.now();
  let first = null, content = "";
  try {
    const response = await call("POST", "/api/chat", request, chat.controller.signal);
    for await (const line of ndjson(response)) {
      const msg = line.message || {};
      if ((msg.content || msg.thinking) && first === null) {
        first = performance.now();
        stats.textContent = `TTFT ${Math.round(first - started)} ms`;
      }
      if (msg.thinking) thinking.textContent += msg.thinking;
      if (msg.content) { content += msg.content; body.textContent = content; }
      if (line.done) {
        const ttft = first === null ? "n/a" : `${Math.round(first - started)} ms`;
        const rate = line.eval_duration ? (line.eval_count / (line.eval_duration / 1e9)).toFixed(1) : "n/a";
        stats.textContent = `TTFT ${ttft} · ${rate} tok/s · ${line.eval_count || 0} tokens · ` +
          `prompt ${line.prompt_eval_count || 0} tokens · ${line.done_reason || "stop"}`;
        reply.dataset.done = "true";
      }
    }
    chat.messages.push({ role: "assistant", content });
  } catch (e) {
    const aborted = chat.controller && chat.controller.signal.aborted;
    stats.textContent = aborted ? "stopped" : `error: ${e.message}`;
    reply.classList.add(aborted ? "stopped" : "failed");
    if (content) chat.messages.push({ role: "assistant", content });
  } finally {
    reply.classList.remove("streaming");
    chat.controller = null;
    $("pg-send").hidden = false;
    $("pg-stop").hidden = true;
  }
}

function initPlayground() {
  $("pg-form").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("pg-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("pg-stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("pg-clear").addEventListener("click", () => { chat.messages = []; $("pg-log").replaceChildren(); });
  $("pg-format").addEventListener("input", () => { try { readFormat(); } catch (e) { /* shown */ } });
}

// -- start ---------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  initTabs();
  initKey();
  initPull();
  initPlayground();
  setInterval(() => { if (!$("tab-running").hidden) for (const m of state.running) {
    const card = $("runners").querySelector(`[data-runner="${CSS.escape(m.name)}"] [data-field="expires"]`);
    if (card) card.textContent = until(m.expires_at);
  } }, 1000);
  feed.connect();
});
