// The csd-serve playground: streams from the OpenAI-compatible API and colours every token by provenance.
// Plain JavaScript, no build step, no network use beyond this server.
"use strict";

const KEY_STORAGE = "csd-playground-api-key";
const PROVENANCES = ["accepted", "rescued", "recovered", "bonus", "plain"];
const OCM_REFRESH_MS = 2000;
const DEFAULT_PROMPT =
  "Repeat this list exactly, twice: red apple, green pear, yellow banana, purple grape, orange orange.\n" +
  "red apple, green pear, yellow banana, purple grape, orange orange.\n";

const config = JSON.parse(document.getElementById("csd-config").textContent);
const $ = (id) => document.getElementById(id);

class ApiError extends Error {}

let controller = null; // the running request's AbortController
let ocmTimer = null;

// --- the API key: entered once, kept for this tab only ---------------------------------------------

function apiKey() {
  return $("api-key").value.trim();
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h.Authorization = `Bearer ${apiKey()}`;
  return h;
}

// --- errors ----------------------------------------------------------------------------------------

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

async function errorFromResponse(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) {
      message = body.error.message;
      if (body.error.param) message += ` (param: ${body.error.param})`;
    }
  } catch (_) {
    // not JSON: keep the status text
  }
  let text = `HTTP ${response.status}: ${message}`;
  const retry = response.headers.get("Retry-After");
  if (response.status === 429 && retry) text += ` (retry after ${retry} s)`;
  return new ApiError(text);
}

// --- one streamed run in one pane -------------------------------------------------------------------

function newPane(title) {
  const node = $("pane-template").content.firstElementChild.cloneNode(true);
  node.querySelector(".pane-title").textContent = title;
  node.dataset.method = title;
  $("panes").appendChild(node);
  return node;
}

function fmt(value, digits) {
  return Number.isFinite(value) ? value.toFixed(digits) : "—";
}

function percent(value) {
  return Number.isFinite(value) ? `${(100 * value).toFixed(1)} %` : "—";
}

class Run {
  constructor(pane) {
    this.pane = pane;
    this.stream = pane.querySelector(".stream");
    this.counts = Object.fromEntries(PROVENANCES.map((p) => [p, 0]));
    this.tokens = 0;
    this.rounds = 0;
    this.draftTokens = 0;
    this.final = null; // the server's statistics, once the finish chunk arrives
    this.started = performance.now();
    this.lastTokenAt = this.started;
  }

  addTokens(tokens, draftTokens) {
    const fragment = document.createDocumentFragment();
    for (const token of tokens) {
      const provenance = PROVENANCES.includes(token.provenance) ? token.provenance : "plain";
      const span = document.createElement("span");
      span.className = `tok ${provenance}`;
      span.textContent = token.text;
      if (provenance === "rescued" && token.replaced_text != null) {
        span.title = `rescued: the target would have said ${JSON.stringify(token.replaced_text)}`;
      } else {
        span.title = provenance;
      }
      fragment.appendChild(span);
      this.counts[provenance] += 1;
    }
    this.stream.appendChild(fragment);
    this.tokens += tokens.length;
    this.rounds += 1;
    this.draftTokens += draftTokens || 0;
    this.lastTokenAt = performance.now();
    this.render();
  }

  addText(text) {
    // A chunk without provenance (it should not happen with return_provenance): show it uncoloured.
    const span = document.createElement("span");
    span.className = "tok plain";
    span.textContent = text;
    this.stream.appendChild(span);
  }

  render() {
    const fig = (name, value) => {
      this.pane.querySelector(`[data-fig="${name}"]`).textContent = value;
    };
    const seconds = (this.lastTokenAt - this.started) / 1000;
    fig("tps", seconds > 0 ? fmt(this.tokens / seconds, 1) : "—");
    fig("tokens", String(this.final ? this.final.completion_tokens ?? this.tokens : this.tokens));
    const s = this.final;
    if (s) {
      const speculates = s.draft_tokens > 0;
      fig("acceptance", speculates ? percent(s.acceptance_rate) : "—");
      fig("rescue", speculates ? percent(s.rescue_rate) : "—");
      fig("tpf", fmt(s.tokens_per_forward, 2));
    } else {
      const kept = this.counts.accepted + this.counts.rescued;
      fig("acceptance", this.draftTokens ? percent(kept / this.draftTokens) : "—");
      fig("rescue", this.draftTokens ? percent(this.counts.rescued / this.draftTokens) : "—");
      fig("tpf", this.rounds ? fmt(this.tokens / this.rounds, 2) : "—");
    }
  }

  handle(data) {
    if (data === "[DONE]") return true;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(`error during the stream: ${chunk.error.message}`);
    const spec = chunk.speculative;
    if (spec && Array.isArray(spec.tokens)) {
      this.addTokens(spec.tokens, spec.draft_tokens);
    } else {
      const choice = chunk.choices && chunk.choices[0];
      const text = choice ? (choice.delta ? choice.delta.content : choice.text) : "";
      if (text) this.addText(text);
    }
    if (spec && typeof spec.acceptance_rate === "number") {
      this.final = { ...spec, completion_tokens: this.final && this.final.completion_tokens };
      this.render();
    }
    if (chunk.usage) {
      this.final = { ...(this.final || {}), completion_tokens: chunk.usage.completion_tokens };
      this.render();
    }
    return false;
  }
}

function requestFor(method) {
  const chat = $("chat").checked;
  const prompt = $("prompt").value;
  const number = (id) => Number($(id).value);
  const body = {
    model: config.model,
    max_tokens: number("max-tokens"),
    temperature: number("temperature"),
    stream: true,
    stream_options: { include_usage: true },
    speculative: {
      method,
      drafter: $("drafter").value,
      num_speculative_tokens: number("k"),
      tau: number("tau"),
      lambda: number("lambda"),
      return_provenance: true,
    },
  };
  if (method === "vanilla") {
    body.speculative = { method, return_provenance: true };
  }
  if (chat) body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  return { url: chat ? "/v1/chat/completions" : "/v1/completions", body };
}

async function streamInto(run, method, signal) {
  const { url, body } = requestFor(method);
  const response = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!response.ok) throw await errorFromResponse(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data && run.handle(data)) return;
    }
  }
}

// --- the OCM panel ----------------------------------------------------------------------------------

function visible(text) {
  // Whitespace made visible, so " the" and "the" differ on screen.
  return JSON.stringify(text).slice(1, -1).replace(/ /g, "\u2423");
}

async function refreshOcm() {
  try {
    const response = await fetch("/v1/ocm/top?n=10", { headers: headers() });
    if (!response.ok) throw await errorFromResponse(response);
    renderOcm(await response.json());
    $("ocm-updated").textContent = `Updated ${new Date().toLocaleTimeString()}.`;
  } catch (error) {
    $("ocm-updated").textContent = `Could not load the patterns: ${error.message}`;
  }
}

function renderOcm(top) {
  const body = $("ocm-body");
  body.replaceChildren();
  for (const namespace of top.data || []) {
    const heading = document.createElement("h3");
    heading.textContent = `drafter: ${namespace.drafter}`;
    body.appendChild(heading);
    if (!namespace.patterns.length) {
      const none = document.createElement("p");
      none.className = "note";
      none.textContent = "No divergence patterns yet.";
      body.appendChild(none);
      continue;
    }
    const table = document.createElement("table");
    table.innerHTML = "<thead><tr><th scope='col'>draft</th><th scope='col'>target</th><th scope='col'>count</th></tr></thead>";
    const rows = document.createElement("tbody");
    for (const p of namespace.patterns) {
      const row = document.createElement("tr");
      row.className = "pattern";
      for (const value of [visible(p.draft_text), visible(p.target_text), String(p.count)]) {
        const cell = document.createElement("td");
        cell.textContent = value;
        row.appendChild(cell);
      }
      rows.appendChild(row);
    }
    table.appendChild(rows);
    body.appendChild(table);
  }
}

// --- the drafters: the server's registry (GET /v1/drafters), the one list of them -------------------

function renderDrafters(list) {
  const select = $("drafter");
  const chosen = select.value; // what the user picked (or the server's default) survives a reload
  select.replaceChildren();
  for (const drafter of list.data || []) {
    const option = document.createElement("option");
    option.value = drafter.id;
    option.textContent = `${drafter.id} (${drafter.description})`;
    // Listed but not selectable where the server lacks what it needs, with the reason on hover.
    option.disabled = !drafter.available;
    if (drafter.hint) option.title = drafter.hint;
    select.appendChild(option);
  }
  const usable = [...select.options].filter((o) => !o.disabled).map((o) => o.value);
  const fallback = (list.data || []).find((d) => d.default);
  select.value = usable.includes(chosen) ? chosen : fallback ? fallback.id : usable[0] || "";
}

async function loadDrafters() {
  try {
    const response = await fetch("/v1/drafters", { headers: headers() });
    if (!response.ok) throw await errorFromResponse(response);
    renderDrafters(await response.json());
    $("drafter").title = "";
  } catch (error) {
    // The form keeps what it offers (at first the server's default alone); the reason shows on hover.
    $("drafter").title = `Could not load the drafters: ${error.message}`;
  }
}

// --- Run and Stop -----------------------------------------------------------------------------------

function setRunning(running) {
  $("run").disabled = running;
  $("stop").disabled = !running;
  document.body.classList.toggle("running", running);
  if (running) {
    ocmTimer = setInterval(refreshOcm, OCM_REFRESH_MS);
  } else {
    clearInterval(ocmTimer);
    ocmTimer = null;
  }
}

async function run(event) {
  event.preventDefault();
  if (controller) return;
  clearError();
  $("panes").replaceChildren();
  const methods = $("side-by-side").checked ? ["sd", "csd"] : [$("method").value];
  $("panes").classList.toggle("two", methods.length > 1);
  const panes = methods.map((m) => newPane(m));
  controller = new AbortController();
  setRunning(true);
  let outcome = "Done.";
  try {
    for (let i = 0; i < methods.length; i++) {
      $("status").textContent = `Running ${methods[i]}${methods.length > 1 ? ` (${i + 1} of ${methods.length})` : ""}…`;
      await streamInto(new Run(panes[i]), methods[i], controller.signal);
    }
  } catch (error) {
    if (error.name === "AbortError") {
      outcome = "Stopped.";
    } else {
      outcome = "Failed.";
      showError(error instanceof ApiError ? error.message : `request failed: ${error.message}`);
    }
  } finally {
    controller = null;
    setRunning(false);
    $("status").textContent = outcome;
    refreshOcm();
    // The store counts patterns a moment after the round (it flushes in the background): look again.
    setTimeout(refreshOcm, 1500);
  }
}

function stop() {
  if (controller) controller.abort();
}

// --- start ------------------------------------------------------------------------------------------

function init() {
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    if (apiKey()) sessionStorage.setItem(KEY_STORAGE, apiKey());
    else sessionStorage.removeItem(KEY_STORAGE);
    loadDrafters();
    refreshOcm();
  });
  if (config.auth_required) $("key-hint").textContent = "This server requires a key. " + $("key-hint").textContent;
  $("prompt").value = DEFAULT_PROMPT;
  $("method").value = config.method;
  // Until the server's list arrives (it needs the key where the server requires one), the form offers the
  // server's default drafter alone, so a run sends what the server would pick anyway.
  const initial = document.createElement("option");
  initial.value = initial.textContent = config.drafter;
  $("drafter").replaceChildren(initial);
  $("k").value = config.num_speculative_tokens;
  $("tau").value = config.tau;
  $("lambda").value = config.lambda;
  $("temperature").value = config.temperature;
  $("max-tokens").value = config.max_tokens;
  $("max-tokens").max = config.max_tokens_cap;
  $("controls").addEventListener("submit", run);
  $("stop").addEventListener("click", stop);
  // Without a key on a server that needs one, the first calls would only show a 401: wait for the key.
  if (!config.auth_required || apiKey()) {
    loadDrafters();
    refreshOcm();
  }
}

init();
