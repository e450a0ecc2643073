// The playground: send one prompt to one or two models and show each answer as it streams in.
// The server relays the inference pool's server-sent events (OpenAI's chat-completion chunks).
"use strict";

(function () {
  const form = document.getElementById("playground-form");
  const $ = (id) => document.getElementById(id);
  const csrfToken = form.querySelector("[name=csrfmiddlewaretoken]").value;
  const panes = Array.from(form.querySelectorAll(".pane")).map((root) => ({ root, history: [] }));
  let running = null; // the AbortController of the answers being streamed

  function bubble(pane, role, text, label = role) {
    const node = document.createElement("div");
    node.className = `bubble ${role}`;
    const name = document.createElement("span");
    name.className = "role";
    name.textContent = label;
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text; // text, never HTML: answers are untrusted
    node.append(name, body);
    pane.root.querySelector(".transcript").appendChild(node);
    return node;
  }

  function activePanes() {
    return $("compare").checked ? panes : panes.slice(0, 1);
  }

  // The tools box's JSON list, or null when it is empty; throws a message to show when it is not JSON.
  function tools() {
    const text = $("tools").value.trim();
    if (!text) return null;
    try {
      return JSON.parse(text);
    } catch (error) {
      throw new Error(`Tools: not JSON (${error.message}).`);
    }
  }

  function request(pane, declared) {
    const system = $("system").value.trim();
    const body = {
      model: pane.root.querySelector(".model").value,
      messages: (system ? [{ role: "system", content: system }] : []).concat(pane.history),
      temperature: Number($("temperature").value),
      max_tokens: Number($("max-tokens").value),
    };
    return declared ? { ...body, tools: declared, tool_choice: $("tool-choice").value } : body;
  }

  // The calls of the pane's last answer that no tool message has answered yet.
  function pendingCalls(pane) {
    const last = pane.history.findLastIndex((message) => message.tool_calls);
    if (last < 0) return [];
    const answered = new Set(pane.history.slice(last + 1).map((message) => message.tool_call_id));
    return pane.history[last].tool_calls.filter((call) => !answered.has(call.id));
  }

  function showCall(node, call) {
    const shown = document.createElement("code");
    shown.className = "tool-call";
    shown.textContent = `${call.function.name}(${call.function.arguments})`; // text, never HTML
    node.querySelector(".text").appendChild(shown);
  }

  async function problem(response) {
    if (response.redirected) return "Your session has ended: sign in again in another tab, then resend.";
    try {
      return (await response.json()).error.message;
    } catch {
      return `The server answered ${response.status}.`;
    }
  }

  // Calls onChunk with each parsed event until the stream ends ("[DONE]" or the connection closes).
  async function readEvents(response, onChunk) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trim()).join("");
        if (data === "[DONE]") return;
        if (data) onChunk(JSON.parse(data));
      }
    }
  }

  async function answer(pane, signal, declared) {
    const node = bubble(pane, "assistant", "");
    const text = node.querySelector(".text");
    const stats = pane.root.querySelector(".pane-stats");
    const started = performance.now();
    let firstToken = null, chunks = 0, completionTokens = null;
    node.classList.add("streaming");
    stats.textContent = "Waiting for the first token…";
    try {
      const response = await fetch(form.dataset.url, {
        method: "POST",
        headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken },
        body: JSON.stringify(request(pane, declared)),
        signal,
      });
      const streamed = (response.headers.get("content-type") || "").startsWith("text/event-stream");
      if (!response.ok || !streamed) throw new Error(await problem(response));
      const calls = []; // assembled from delta.tool_calls pieces, as OpenAI's guide does
      await readEvents(response, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) completionTokens = chunk.usage.completion_tokens;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (!delta || !(delta.content || delta.tool_calls)) return;
        firstToken = firstToken ?? performance.now();
        chunks += 1;
        node.dataset.chunks = String(chunks);
        text.textContent += delta.content || "";
        for (const piece of delta.tool_calls || []) {
          if (!calls[piece.index]) calls[piece.index] = { id: piece.id, type: "function", function: { name: piece.function.name, arguments: "" } };
          calls[piece.index].function.arguments += piece.function.arguments || "";
        }
      });
      calls.forEach((call) => showCall(node, call));
      if (calls.length) node.classList.add("calls");
      pane.history.push(calls.length ? { role: "assistant", content: text.textContent, tool_calls: calls } : { role: "assistant", content: text.textContent });
      const seconds = (performance.now() - started) / 1000;
      const generating = firstToken === null ? 0 : (performance.now() - firstToken) / 1000;
      const tokens = completionTokens ?? chunks;
      stats.textContent = `first token ${firstToken === null ? "–" : ((firstToken - started) / 1000).toFixed(2) + " s"} · ` +
        `${tokens} tokens in ${seconds.toFixed(1)} s` + (generating > 0 ? ` · ${(tokens / generating).toFixed(1)} tokens/s` : "");
      node.classList.add("done");
    } catch (error) {
      node.classList.add("error");
      const stopped = error.name === "AbortError";
      text.textContent += stopped ? " [stopped]" : `${text.textContent ? "\n" : ""}${error.message}`;
      stats.textContent = stopped ? "Stopped." : "";
      if (stopped && text.textContent) pane.history.push({ role: "assistant", content: text.textContent.replace(/ \[stopped\]$/, "") });
      if (!stopped) pane.history.pop(); // the unanswered question, so a resend is not doubled
    } finally {
      node.classList.remove("streaming");
    }
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const prompt = $("prompt").value.trim();
    if (!prompt || running) return;
    let declared;
    try {
      declared = tools();
      $("tools-error").hidden = true;
    } catch (error) {
      $("tools-error").textContent = error.message;
      $("tools-error").hidden = false;
      return;
    }
    running = new AbortController();
    $("send").disabled = true;
    $("stop").disabled = false;
    $("prompt").value = "";
    const targets = activePanes();
    targets.forEach((pane) => {
      const call = pendingCalls(pane)[0]; // a call waiting for its result: the message is that result
      pane.history.push(call ? { role: "tool", tool_call_id: call.id, content: prompt } : { role: "user", content: prompt });
      if (call) bubble(pane, "tool", prompt, `result of ${call.function.name}`);
      else bubble(pane, "user", prompt);
    });
    const waiting = targets.filter((pane) => pendingCalls(pane).length === 0); // every call has its result
    await Promise.all(waiting.map((pane) => answer(pane, running.signal, declared)));
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    $("prompt").focus();
  });

  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.abort());

  function reset(pane) {
    pane.history = [];
    pane.root.querySelector(".transcript").replaceChildren();
    pane.root.querySelector(".pane-stats").textContent = "";
  }
  $("clear").addEventListener("click", () => panes.forEach(reset));
  panes.forEach((pane) => pane.root.querySelector(".model").addEventListener("change", () => reset(pane)));
  $("compare").addEventListener("change", (event) => {
    panes.slice(1).forEach((pane) => { pane.root.hidden = !event.target.checked; });
  });
})();
