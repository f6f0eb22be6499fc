// JustAPI's chat page: pick a model, type, watch the answer stream in (its reasoning folded away), stop it, see its
// speed. Plain script over the server's own OpenAI routes (/v1/models, /v1/chat/completions); no build, no CDN.
"use strict";

const $ = (id) => document.getElementById(id);
const key = document.querySelector('meta[name="justapi-key"]').content;  // set by the server behind --api-key
const auth = key ? { Authorization: "Bearer " + key } : {};
// absolute: a page opened as http://user:key@host/chat may not fetch relative URLs (they would carry the credentials)
const api = (path) => location.origin + path;
const state = { messages: [], controller: null, turns: 0, errors: 0 };
window.justapiChat = state;  // for tests and the curious

function status(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

function addTurn(role, text) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  div.textContent = text;
  $("log").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && (body.error.message || body.error)) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

async function loadModels() {
  const response = await fetch(api("/v1/models"), { headers: auth });
  if (!response.ok) {
    status(await errorText(response), true);
    return;
  }
  const select = $("model");
  const chosen = select.value;
  select.textContent = "";
  for (const m of (await response.json()).data) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.state ? `${m.id} (${m.state})` : m.id;
    select.appendChild(option);
  }
  if (chosen) select.value = chosen;
}

// The answer's parts as they stream: reasoning into a folded <details>, content into the turn's text.
function answerView(turn) {
  const thinking = document.createElement("details");
  const summary = document.createElement("summary");
  summary.textContent = "thinking";
  const thought = document.createElement("div");
  thinking.append(summary, thought);
  const text = document.createElement("div");
  const meta = document.createElement("div");
  meta.className = "meta";
  turn.append(text, meta);
  return {
    reason(piece) {
      if (!thinking.isConnected) turn.insertBefore(thinking, text);
      thought.textContent += piece;
    },
    say(piece) { text.textContent += piece; },
    text: () => text.textContent,
    meta(line) { meta.textContent = line; },
  };
}

// Server-sent events from a fetch body: each complete "data:" line's JSON, in order.
async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n")) >= 0) {
      const line = buffered.slice(0, end).trim();
      buffered = buffered.slice(end + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function send(prompt) {
  state.messages.push({ role: "user", content: prompt });
  addTurn("user", prompt);
  const turn = addTurn("assistant", "");
  const view = answerView(turn);
  const controller = (state.controller = new AbortController());
  $("send").disabled = true;
  $("stop").disabled = false;
  status("waiting for the first token");
  const started = performance.now();
  let first = null, tokens = 0, usage = null, finish = null;
  try {
    const response = await fetch(api("/v1/chat/completions"), {
      method: "POST",
      headers: { "Content-Type": "application/json", ...auth },
      body: JSON.stringify({
        model: $("model").value, messages: state.messages, stream: true,
        stream_options: { include_usage: true },
        max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
      }),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of events(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content) view.reason(delta.reasoning_content);
      if (delta.content) view.say(delta.content);
      if (delta.reasoning_content || delta.content) {
        tokens += 1;
        first = first || performance.now();
        status(`${speed(tokens, first)} tok/s`);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    state.messages.push({ role: "assistant", content: view.text() });
    const n = usage ? usage.completion_tokens : tokens;
    const ttft = first ? ((first - started) / 1000).toFixed(2) : "–";
    view.meta(`${n} tokens, ${speed(n, first)} tok/s, first token after ${ttft} s, ${finish || "ended"}`);
    status("");
  } catch (e) {
    if (e.name === "AbortError") {
      state.messages.push({ role: "assistant", content: view.text() });
      view.meta(`stopped after ${tokens} tokens`);
      status("stopped");
    } else {
      state.messages.pop();  // the question went unanswered: the next one follows the last answer
      state.errors += 1;
      turn.classList.add("error");
      view.meta(String(e.message || e));
      status(String(e.message || e), true);
    }
  } finally {
    state.controller = null;
    state.turns += 1;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function speed(tokens, first) {
  if (!first || tokens < 2) return "–";
  return ((tokens - 1) / ((performance.now() - first) / 1000)).toFixed(1);
}

$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || state.controller) return;
  $("prompt").value = "";
  send(prompt);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("ask").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("log").textContent = "";
});
$("model").addEventListener("focus", loadModels);
loadModels();
