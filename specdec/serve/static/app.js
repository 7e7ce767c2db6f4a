// specdec's chat page: a conversation streamed from this server's own /v1/chat/completions, each reply
// tinted by who wrote it (the chunks' "specdec" extension: accepted draft tokens and their drafter, or
// the target's own token), and a live panel from /stats. Plain script, no build step, nothing loaded
// from another host (the page's Content-Security-Policy says so too). Paths are relative: the page works
// behind a reverse proxy that serves it under a prefix.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY = "specdec.apiKey", SETTINGS = "specdec.settings";
  const FIELDS = ["system", "temperature", "top_p", "max_tokens", "seed"];
  const PALETTE = 8; // drafter colours d0..d7 (style.css)
  const POLL_MS = 2000; // the live panel's refresh
  const CHART_SECONDS = [60, 600]; // the charts' span: the history's, at least a minute, at most the 10 /stats keeps

  const state = {
    model: null,
    messages: [], // the conversation sent with each request: [{role, content}]
    controller: null, // the running reply's AbortController
    drafters: new Map(), // drafter name -> colour index, in the order met
    keyWanted: false,
  };

  // -- the API key and requests

  function apiKey() { return localStorage.getItem(KEY) || ""; }

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function askForKey(message) {
    state.keyWanted = true;
    $("change-key").hidden = false;
    const error = $("key-error");
    error.hidden = !message;
    error.textContent = message || "";
    const dialog = $("key-dialog");
    if (!dialog.open) dialog.showModal();
    $("key").focus();
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return `HTTP ${response.status}`;
  }

  // Which model this server serves; a 401 asks for the key.
  async function connect() {
    let response;
    try {
      response = await fetch("v1/models", { headers: headers(false) });
    } catch (e) {
      $("model").textContent = "server unreachable";
      return false;
    }
    if (response.status === 401) {
      askForKey(apiKey() ? "That key was refused." : "");
      return false;
    }
    if (!response.ok) {
      $("model").textContent = await errorMessage(response);
      return false;
    }
    const body = await response.json();
    state.model = body.data && body.data.length ? body.data[0].id : null;
    $("model").textContent = state.model || "";
    return true;
  }

  // -- settings (kept in this browser)

  function loadSettings() {
    let saved = {};
    try { saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}"); } catch (e) { saved = {}; }
    for (const name of FIELDS) if (typeof saved[name] === "string") $(name).value = saved[name];
  }

  function saveSettings() {
    const values = {};
    for (const name of FIELDS) values[name] = $(name).value;
    localStorage.setItem(SETTINGS, JSON.stringify(values));
  }

  function number(id) {
    const v = $(id).value.trim();
    return v === "" ? null : Number(v);
  }

  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.messages);
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (state.model) body.model = state.model;
    for (const name of ["temperature", "top_p", "max_tokens", "seed"]) {
      const v = number(name);
      if (v !== null && !Number.isNaN(v)) body[name] = v;
    }
    return body;
  }

  // -- the conversation

  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function addMessage(role, text) {
    $("empty").hidden = true;
    const el = document.createElement("div");
    el.className = "msg " + role;
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    el.appendChild(body);
    $("messages").appendChild(el);
    scrollDown();
    return el;
  }

  function drafterClass(name) {
    if (!state.drafters.has(name)) {
      state.drafters.set(name, state.drafters.size % PALETTE);
      const li = document.createElement("li");
      const sample = document.createElement("span");
      sample.className = `tok draft d${state.drafters.get(name)}`;
      sample.textContent = "abc";
      li.append(sample, ` drafted by ${name}, kept by the target`);
      $("legend-items").appendChild(li);
    }
    return "d" + state.drafters.get(name);
  }

  function describe(piece) {
    const what = piece.draft ? `drafted by ${piece.drafter}, kept by the target` : "the target's own token";
    const step = piece.drafted
      ? `${piece.drafter} drafted ${piece.drafted}, ${piece.accepted} kept`
      : piece.step === 1 ? "the prompt's prefill" : "nothing drafted";
    return `step ${piece.step}: ${what} (${step})`;
  }

  // Appends streamed text; pieces (the chunk's "specdec" extension) say who wrote which part.
  function appendText(reply, text, pieces) {
    if (!pieces || !pieces.length) pieces = [{ text, draft: false, step: 0, drafter: null, drafted: 0, accepted: 0 }];
    for (const piece of pieces) {
      const last = reply.text.lastElementChild;
      if (last && last.dataset.step === String(piece.step) && last.dataset.draft === String(piece.draft)) {
        last.textContent += piece.text; // the same step's same side: one span
        continue;
      }
      const span = document.createElement("span");
      span.className = "tok " + (piece.draft ? "draft " + drafterClass(piece.drafter) : "target");
      span.dataset.step = String(piece.step);
      span.dataset.draft = String(piece.draft);
      if (piece.draft) span.dataset.drafter = piece.drafter;
      if (piece.step) span.title = describe(piece);
      span.textContent = piece.text;
      reply.text.appendChild(span);
    }
    reply.content += text;
  }

  function fmt(x, digits) { return x === null || x === undefined || !Number.isFinite(x) ? "–" : x.toFixed(digits); }

  function showStats(reply, usage, seconds) {
    const s = (usage && usage.specdec) || {};
    const tokens = usage ? usage.completion_tokens : null;
    const tau = tokens && s.steps ? tokens / s.steps : null;
    const rate = tokens && seconds > 0 ? tokens / seconds : null;
    const ttft = s.time_to_first_token_s;
    const el = document.createElement("div");
    el.className = "stats";
    Object.assign(el.dataset, { tokens: tokens ?? "", steps: s.steps ?? "", tau: tau ?? "",
                                tokensPerSecond: rate ?? "", ttft: ttft ?? "" });
    el.textContent = `${tokens ?? "?"} tokens · ${fmt(rate, 1)} tokens/s · tau ${fmt(tau, 2)} ` +
      `(${s.steps ?? "?"} target steps) · first token ${fmt(ttft, 3)} s · ` +
      `${s.accepted_tokens ?? 0} of ${s.drafted_tokens ?? 0} drafted tokens kept`;
    el.title = "tokens/s: over the whole reply, from the request to its last token; tau: tokens per target step";
    reply.el.appendChild(el);
  }

  function note(reply, text, error) {
    const el = document.createElement("div");
    el.className = error ? "error" : "note";
    el.textContent = text;
    reply.el.appendChild(el);
  }

  // Server-sent events from a fetch body: yields each "data:" payload.
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (data) yield data;
      }
    }
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    document.body.classList.toggle("busy", busy);
  }

  async function send(text) {
    state.messages.push({ role: "user", content: text });
    addMessage("user", text);
    const el = addMessage("assistant", "");
    const reply = { el, text: el.querySelector(".text"), content: "" };
    el.dataset.state = "streaming";
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    const started = performance.now();
    let usage = null, failed = null, ended = null;
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(true), body: JSON.stringify(requestBody()), signal: controller.signal,
      });
      if (!response.ok) {
        failed = await errorMessage(response);
        if (response.status === 401) askForKey("The server refused the key.");
      } else {
        for await (const data of events(response)) {
          if (data === "[DONE]") break;
          const chunk = JSON.parse(data);
          if (chunk.error) { failed = chunk.error.message; continue; }
          if (chunk.usage) usage = chunk.usage;
          const choice = chunk.choices && chunk.choices[0];
          const delta = choice && choice.delta && choice.delta.content;
          if (delta) {
            appendText(reply, delta, chunk.specdec && chunk.specdec.pieces);
            scrollDown();
          }
        }
      }
      ended = performance.now();
    } catch (e) {
      if (e.name !== "AbortError") failed = String(e.message || e);
    } finally {
      state.controller = null;
      setBusy(false);
    }
    if (reply.content) state.messages.push({ role: "assistant", content: reply.content });
    else state.messages.pop(); // nothing was said: the question goes too, so roles keep alternating
    if (controller.signal.aborted) {
      el.dataset.state = "stopped";
      note(reply, "stopped");
    } else if (failed) {
      el.dataset.state = "error";
      note(reply, failed, true);
    } else {
      el.dataset.state = "done";
      showStats(reply, usage, (ended - started) / 1000);
    }
    scrollDown();
    refreshLive();
  }

  function newChat() {
    if (state.controller) state.controller.abort();
    state.messages = [];
    for (const el of [...$("messages").querySelectorAll(".msg")]) el.remove();
    $("empty").hidden = false;
    $("input").focus();
  }

  // -- the live panel

  function svg(tag, attrs) {
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    return el;
  }

  // A line over the last ``span`` seconds: points [{age, value}] (value null: a gap), y from 0 to top.
  function drawChart(chart, points, span, top, className) {
    chart.replaceChildren();
    const [w, h] = [Number(chart.viewBox.baseVal.width), Number(chart.viewBox.baseVal.height)];
    let run = [];
    const flush = () => {
      if (run.length === 1) run.push([run[0][0] + 1, run[0][1]]); // a lone point: a dash
      const points = run.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" ");
      if (run.length) chart.appendChild(svg("polyline", { points, class: className || "" }));
      run = [];
    };
    for (const p of points) {
      if (p.value === null || p.value === undefined || p.age > span) { flush(); continue; }
      run.push([w * (1 - p.age / span), h - 2 - (h - 4) * Math.min(1, p.value / (top || 1))]);
    }
    flush();
  }

  function spanOf(history, every) {
    const oldest = history.length ? history[0].age + every : 0;
    return Math.min(CHART_SECONDS[1], Math.max(CHART_SECONDS[0], Math.ceil(oldest / 60) * 60));
  }

  function setMetric(name, text) {
    for (const el of document.querySelectorAll(`#live [data-metric="${name}"]`)) el.textContent = text;
  }

  function showLive(s) {
    setMetric("batch_size", String(s.batch_size));
    setMetric("max_batch", String(s.max_batch));
    setMetric("queue_length", String(s.queue_length));
    setMetric("tokens_per_second", fmt(s.tokens_per_second, 1));
    setMetric("tau", fmt(s.tau, 2));
    setMetric("generated_tokens", String(s.generated_tokens));
    setMetric("steps", String(s.steps));
    const span = spanOf(s.history, s.sample_every);
    const minutes = `last ${span / 60} min`;
    $("rate-caption").textContent = `tokens/s, ${minutes}`;
    $("chart-span").textContent = minutes;
    const rates = s.history.map((p) => ({ age: p.age, value: p.tokens_per_second }));
    drawChart($("rate-chart"), rates, span, Math.max(1, ...rates.map((p) => p.value)));
    const body = $("drafters").tBodies[0];
    for (const d of s.drafters) {
      let row = body.querySelector(`tr[data-drafter="${CSS.escape(d.name)}"]`);
      if (!row) {
        row = document.createElement("tr");
        row.dataset.drafter = d.name;
        const name = document.createElement("td");
        const swatch = document.createElement("span");
        swatch.className = "swatch " + drafterClass(d.name);
        name.append(swatch, d.name);
        row.appendChild(name);
        for (const metric of ["drafted", "accepted", "rate"]) {
          const td = document.createElement("td");
          td.dataset.metric = metric;
          row.appendChild(td);
        }
        const cell = document.createElement("td");
        cell.appendChild(svg("svg", { class: "chart", viewBox: "0 0 80 22", preserveAspectRatio: "none" }));
        row.appendChild(cell);
        body.appendChild(row);
      }
      row.querySelector('[data-metric="drafted"]').textContent = String(d.drafted);
      row.querySelector('[data-metric="accepted"]').textContent = String(d.accepted);
      row.querySelector('[data-metric="rate"]').textContent = d.rate === null ? "–" : `${Math.round(100 * d.rate)}%`;
      const points = s.history.map((p) => ({ age: p.age, value: p.acceptance[d.name] ?? null }));
      drawChart(row.querySelector("svg"), points, span, 1, "drafter " + drafterClass(d.name));
    }
  }

  let polling = false;
  async function refreshLive() {
    if (polling || state.keyWanted) return;
    polling = true;
    try {
      const response = await fetch("stats", { headers: headers(false) });
      if (response.status === 401) askForKey("The server refused the key.");
      else if (response.ok) {
        showLive(await response.json());
        $("live-state").textContent = "";
        $("live").dataset.updated = String(Date.now());
      } else $("live-state").textContent = `(${response.status})`;
    } catch (e) {
      $("live-state").textContent = "(unreachable)";
    } finally {
      polling = false;
    }
  }

  // -- wiring

  function start() {
    loadSettings();
    for (const name of FIELDS) $(name).addEventListener("change", saveSettings);
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("input").value;
      if (!text.trim() || state.controller) return;
      $("input").value = "";
      send(text);
    });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => state.controller && state.controller.abort());
    $("new-chat").addEventListener("click", newChat);
    $("toggle-side").addEventListener("click", () => {
      const open = document.body.classList.toggle("side-open");
      $("toggle-side").setAttribute("aria-expanded", String(open));
      $("toggle-side").textContent = open ? "Chat" : "Settings";
    });
    $("change-key").addEventListener("click", () => askForKey(""));
    $("key-form").addEventListener("submit", async (e) => {
      e.preventDefault();
      localStorage.setItem(KEY, $("key").value.trim());
      state.keyWanted = false;
      $("key-dialog").close();
      if (await connect()) refreshLive();
    });
    connect().then((ok) => { if (ok) refreshLive(); });
    setInterval(() => { if (!document.hidden) refreshLive(); }, POLL_MS);
    $("input").focus();
  }

  start();
})();
