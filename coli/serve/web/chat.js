// The chat page: the conversation is kept here and sent whole each turn to /v1/chat/completions with
// stream: true; the server-sent events are read as they come (fetch + a stream reader), content is shown as
// markdown and reasoning in a folded <details>. Stop aborts the request, which stops the executor.
"use strict";

const messagesEl = document.getElementById("messages");
const promptEl = document.getElementById("prompt");
const sendBtn = document.getElementById("send");
const stopBtn = document.getElementById("stop");
let conversation = [];
let controller = null;

function addMessage(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.innerHTML = '<div class="who"></div><details class="reasoning" hidden><summary>Reasoning</summary>' +
    '<div class="body"></div></details><div class="content"></div><div class="tools"></div>';
  div.querySelector(".who").textContent = role;
  messagesEl.appendChild(div);
  return div;
}

function show(div, state) {
  div.dataset.updates = String(Number(div.dataset.updates || 0) + 1);  // one per event shown: streamed, not at once
  div.querySelector(".content").innerHTML = renderMarkdown(state.content);
  if (state.reasoning) {
    const d = div.querySelector(".reasoning");
    d.hidden = false;
    d.querySelector(".body").textContent = state.reasoning;
  }
  div.querySelector(".tools").innerHTML = state.tools.map((t) =>
    '<div class="tool">' + escapeHtml(t.name + "(" + t.args + ")") + "</div>").join("");
  window.scrollTo(0, document.body.scrollHeight);
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user").querySelector(".content").innerHTML = renderMarkdown(text);
  const div = addMessage("assistant");
  const state = { content: "", reasoning: "", tools: [] };
  controller = new AbortController();
  sendBtn.disabled = true; stopBtn.disabled = false;
  const body = { model: window.coliModel, messages: conversation, stream: true,
                 temperature: Number(document.getElementById("temperature").value),
                 max_tokens: Number(document.getElementById("max_tokens").value) };
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", signal: controller.signal,
      headers: authHeaders({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error(j.error ? j.error.message : "HTTP " + r.status);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const frame = buf.slice(0, cut); buf = buf.slice(cut + 2);
        if (!frame.startsWith("data: ") || frame === "data: [DONE]") continue;
        const ev = JSON.parse(frame.slice(6));
        if (ev.error) throw new Error(ev.error.message);
        const d = (ev.choices && ev.choices[0] && ev.choices[0].delta) || {};
        if (d.content) state.content += d.content;
        if (d.reasoning_content) state.reasoning += d.reasoning_content;
        for (const t of d.tool_calls || []) {
          if (!state.tools[t.index]) state.tools[t.index] = { name: t.function.name, args: "" };
          state.tools[t.index].args += t.function.arguments || "";
        }
        if (ev.choices && ev.choices[0] && ev.choices[0].finish_reason) div.dataset.finish = ev.choices[0].finish_reason;
        show(div, state);
      }
    }
  } catch (e) {
    const err = document.createElement("div");
    err.className = "error";
    err.textContent = e.name === "AbortError" ? "(stopped)" : "error: " + e.message;
    div.appendChild(err);
  } finally {
    conversation.push({ role: "assistant", content: state.content });
    div.dataset.done = "1";
    div.dataset.raw = state.content;
    controller = null;
    sendBtn.disabled = false; stopBtn.disabled = true;
  }
}

document.getElementById("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = promptEl.value.trim();
  if (!text || controller) return;
  promptEl.value = "";
  send(text);
});
promptEl.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); document.getElementById("composer").requestSubmit(); }
});
stopBtn.addEventListener("click", () => { if (controller) controller.abort(); });
document.getElementById("clear").addEventListener("click", () => { conversation = []; messagesEl.innerHTML = ""; });
