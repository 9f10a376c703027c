// tandem's page: chat over /v1/chat/completions (SSE) and a live view of the cluster (/cluster).
// No build step and no other origin: this file, app.css and the two vendored libraries are all there is.
// Every string from a user or a model reaches the page as text (textContent), or for the model's
// Markdown through marked with raw HTML escaped, then DOMPurify.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "tandem.conversations";
const KEY = "tandem.apiKey";
const CLUSTER_EVERY_MS = 1000;

// ---------------------------------------------------------------- text and Markdown

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

let markedReady = false;
function renderMarkdown(text) {
  if (!markedReady) {
    // raw HTML in a model's answer is shown, never interpreted
    marked.use({gfm: true, breaks: true, renderer: {html: (token) => escapeHtml(token.text)}});
    markedReady = true;
  }
  return DOMPurify.sanitize(marked.parse(String(text)), {USE_PROFILES: {html: true}});
}

function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---------------------------------------------------------------- API (bearer key when asked for one)

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

let keyWaiters = [];
function askKey() {
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

async function api(path, opts = {}) {
  for (let tries = 0; tries < 3; tries += 1) {
    const headers = {...(opts.headers || {})};
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    const r = await fetch(path, {...opts, headers});
    if (r.status !== 401) return r;
    sessionStorage.removeItem(KEY);
    await askKey();
  }
  throw new ApiError(401, "the server refused the API key");
}

async function errorOf(r) {
  try {
    const body = await r.json();
    return new ApiError(r.status, body.error?.message || `HTTP ${r.status}`);
  } catch {
    return new ApiError(r.status, `HTTP ${r.status}`);
  }
}

// ---------------------------------------------------------------- conversations (kept in this browser)

let conversations = [];
let current = null;
let model = null;
let defaults = {};
let running = null; // {controller, reply} while an answer streams

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "[]");
    conversations = Array.isArray(saved) ? saved : [];
  } catch {
    conversations = [];
  }
  current = conversations[0] || newConversation();
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
}

function newConversation() {
  const conv = {id: crypto.randomUUID(), title: "New chat", system: "", messages: []};
  conversations.unshift(conv);
  return conv;
}

function renderList() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const conv of conversations) {
    const li = el("li", conv === current ? {class: "current"} : {});
    const open = el("button", {type: "button", class: "open", title: conv.title}, conv.title);
    open.addEventListener("click", () => { if (!running) { current = conv; showConversation(); } });
    const del = el("button", {type: "button", class: "delete", "aria-label": `Delete ${conv.title}`}, "×");
    del.addEventListener("click", () => {
      if (running) return;
      conversations = conversations.filter((c) => c !== conv);
      if (current === conv) current = conversations[0] || newConversation();
      save();
      showConversation();
    });
    li.append(open, del);
    list.append(li);
  }
}

//: why a prompt was prefilled where it was (actors/prefill_choice.py, actors/decode.py)
const REASONS = {
  short_prompt: "a short prompt", remote_faster: "faster on a prefill worker",
  decode_stall: "here it would stall the other streams", prefill_backlog: "the prefill queue is long",
  local_faster: "faster here", migrated: "a moved stream", aggregated: "one worker does both",
  no_prefill_worker: "no prefill worker alive", target_endpoint: "that worker was asked for",
  remote_fallback: "the remote prefill failed",
};

function metaText(meta) {
  if (!meta) return "";
  if (meta.error) return meta.error;
  const parts = [];
  if (meta.stopped) parts.push("stopped");
  if (meta.ttft_ms != null) parts.push(`TTFT ${Math.round(meta.ttft_ms)} ms`);
  if (meta.tokens_per_s != null) parts.push(`${meta.tokens_per_s.toFixed(1)} tok/s`);
  if (meta.tokens != null) parts.push(`${meta.tokens} tokens`);
  const t = meta.tandem;
  if (t && t.prefill) {
    let where = `prefill ${t.prefill}`;
    if (t.prefill_worker) where += ` on ${t.prefill_worker}`;
    if (t.prefill_reason) where += ` (${REASONS[t.prefill_reason] || t.prefill_reason})`;
    parts.push(where);
    if (t.kv_bytes) parts.push(`KV ${fmtBytes(t.kv_bytes)} via ${t.kv_transfer || "?"}`);
    if (t.decode_worker) parts.push(`decode on ${t.decode_worker}`);
  }
  return parts.join(" · ");
}

function messageElement(msg) {
  const box = el("div", {class: `msg ${msg.role}`});
  const body = el("div", {class: "body"});
  if (msg.role === "assistant") body.innerHTML = renderMarkdown(msg.content);
  else body.textContent = msg.content;
  box.append(body);
  if (msg.role === "assistant") box.append(el("div", {class: msg.meta?.error ? "meta error" : "meta"}, metaText(msg.meta)));
  return box;
}

function showConversation() {
  $("system-prompt").value = current.system || "";
  const list = $("messages");
  list.replaceChildren(...current.messages.map(messageElement));
  list.scrollTop = list.scrollHeight;
  renderList();
}

// ---------------------------------------------------------------- sending, streaming, stopping

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("prompt").disabled = on;
}

async function send(text) {
  const conv = current;
  if (conv.messages.length === 0) conv.title = text.slice(0, 60);
  conv.system = $("system-prompt").value;
  conv.messages.push({role: "user", content: text});
  const reply = {role: "assistant", content: "", meta: null};
  conv.messages.push(reply);
  save();
  showConversation();
  const box = $("messages").lastElementChild;
  const body = box.querySelector(".body");
  const meta = box.querySelector(".meta");

  const history = conv.messages.slice(0, -1).map(({role, content}) => ({role, content}));
  const messages = conv.system.trim() ? [{role: "system", content: conv.system}, ...history] : history;
  const request = {model, messages, stream: true, stream_options: {include_usage: true}};
  for (const [field, id] of [["temperature", "temperature"], ["max_tokens", "max-tokens"], ["seed", "seed"]]) {
    const v = number(id);
    if (v !== null && !Number.isNaN(v)) request[field] = v;
  }

  const controller = new AbortController();
  running = {controller, reply};
  setRunning(true);
  const t0 = performance.now();
  let tFirst = null;
  let tLast = null;
  let usage = null;
  let painted = false;
  const paint = () => {
    painted = false;
    body.innerHTML = renderMarkdown(reply.content);
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(request),
      signal: controller.signal,
    });
    if (!r.ok) throw await errorOf(r);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new ApiError(chunk.error.code || 500, chunk.error.message);
          const delta = chunk.choices?.[0]?.delta?.content;
          if (delta) {
            tLast = performance.now();
            if (tFirst === null) tFirst = tLast;
            reply.content += delta;
            if (!painted) { painted = true; requestAnimationFrame(paint); }
          }
          if (chunk.usage) usage = chunk.usage;
        }
      }
    }
    reply.meta = {};
  } catch (e) {
    reply.meta = e.name === "AbortError" ? {stopped: true} : {error: `error: ${e.message}`};
  } finally {
    running = null;
    setRunning(false);
  }
  if (!reply.meta.error) {
    if (tFirst !== null) reply.meta.ttft_ms = tFirst - t0;
    if (usage) {
      reply.meta.tokens = usage.completion_tokens;
      reply.meta.tandem = usage.tandem?.choices?.[0] || null;
      if (usage.completion_tokens > 1 && tLast > tFirst) {
        reply.meta.tokens_per_s = (usage.completion_tokens - 1) / ((tLast - tFirst) / 1000);
      }
    }
  }
  paint();
  meta.className = reply.meta.error ? "meta error" : "meta";
  meta.textContent = metaText(reply.meta);
  save();
  $("prompt").focus();
}

// ---------------------------------------------------------------- the cluster view

let clusterTimer = null;

function cell(text, cls) {
  return el("td", cls ? {class: cls} : {}, text == null ? "–" : String(text));
}

function fill(table, rows) {
  table.querySelector("tbody").replaceChildren(...rows);
}

function when(ts) {
  return ts ? new Date(ts * 1000).toLocaleTimeString() : "–";
}

function renderCluster(c) {
  const alive = c.workers.filter((w) => w.alive).length;
  $("cluster-summary").textContent =
    `gateway ${c.gateway_id} · model ${c.model} · NATS ${c.nats_connected ? "connected" : "DISCONNECTED"} · ` +
    `${alive} of ${c.workers.length} workers alive`;
  fill($("workers"), c.workers.map((w) => {
    const tr = el("tr", {"data-worker": w.worker_id, class: w.alive ? "alive" : "dead"});
    const used = w.used_blocks == null ? "–" : `${w.used_blocks} / ${w.free_blocks}`;
    tr.append(cell(w.worker_id), cell(w.role), cell(w.alive ? (w.draining ? "draining" : "alive") :
      `dead (silent ${Math.round(w.silent_s)} s)`), cell(w.host), cell(w.cpus || "any"), cell(used, "num"),
      cell(w.running, "num"), cell(w.queued, "num"), cell(w.kv_transfer));
    return tr;
  }));
  fill($("pools"), c.pools.map((p) => {
    const tr = el("tr");
    tr.append(cell(p.pool), cell(p.pending ?? p.error, "num"), cell(p.in_flight, "num"));
    return tr;
  }));
  $("transfer-count").textContent = `(${c.transfers_total} so far)`;
  $("transfer-count").dataset.total = String(c.transfers_total);
  fill($("transfers"), c.transfers.map((t) => {
    const tr = el("tr");
    const gbps = t.seconds > 0 ? (t.bytes / t.seconds / 1e9).toFixed(2) : "–";
    tr.append(cell(when(t.at)), cell(t.request_id), cell(`${t.from} → ${t.to}`), cell(t.engine),
      cell(fmtBytes(t.bytes), "num"), cell(gbps, "num"));
    return tr;
  }));
  fill($("decisions"), c.decisions.map((d) => {
    const tr = el("tr");
    tr.append(cell(when(d.at)), cell(d.worker), cell(d.request_id), cell(d.mode),
      cell(REASONS[d.reason] || d.reason), cell(d.tokens, "num"));
    return tr;
  }));
}

async function refreshCluster() {
  clusterTimer = null;
  if ($("cluster-view").hidden) return;
  try {
    const r = await api("/cluster");
    if (!r.ok) throw await errorOf(r);
    renderCluster(await r.json());
  } catch (e) {
    $("cluster-summary").textContent = `cannot read the cluster: ${e.message}`;
  }
  if (!$("cluster-view").hidden) clusterTimer = setTimeout(refreshCluster, CLUSTER_EVERY_MS);
}

function showTab(name) {
  for (const tab of ["chat", "cluster"]) {
    $(`tab-${tab}`).setAttribute("aria-selected", String(tab === name));
    $(`${tab}-view`).hidden = tab !== name;
  }
  if (name === "cluster" && clusterTimer === null) refreshCluster();
}

// ---------------------------------------------------------------- start

async function loadModel() {
  try {
    const r = await api("/v1/models");
    if (!r.ok) throw await errorOf(r);
    const card = (await r.json()).data[0];
    model = card.id;
    defaults = card.sampling_defaults || {};
    $("model-name").textContent = model;
    if (defaults.temperature != null) $("temperature").placeholder = String(defaults.temperature);
    $("max-tokens").placeholder = String(card.default_max_tokens ?? card.max_model_len ?? "");
  } catch (e) {
    $("notice").hidden = false;
    $("notice").textContent = `cannot reach the model: ${e.message}`;
  }
}

function start() {
  load();
  showConversation();
  $("tab-chat").addEventListener("click", () => showTab("chat"));
  $("tab-cluster").addEventListener("click", () => showTab("cluster"));
  $("new-chat").addEventListener("click", () => {
    if (running) return;
    current = newConversation();
    save();
    showConversation();
  });
  $("system-prompt").addEventListener("change", () => { current.system = $("system-prompt").value; save(); });
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || running || !model) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running?.controller.abort());
  $("key-form").addEventListener("submit", () => {
    sessionStorage.setItem(KEY, $("api-key").value.trim());
    $("api-key").value = "";
    const waiting = keyWaiters;
    keyWaiters = [];
    waiting.forEach((resolve) => resolve());
  });
  loadModel();
}

document.addEventListener("DOMContentLoaded", start);
