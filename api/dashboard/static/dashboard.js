// Ratchet dashboard: times in the viewer's zone, live regions, confirmations. No framework.
"use strict";

function localTimes(root) {
  for (const el of root.querySelectorAll("time[datetime]")) {
    const when = new Date(el.getAttribute("datetime"));
    if (!isNaN(when)) {
      el.textContent = when.toLocaleString();
      el.title = el.getAttribute("datetime");
    }
  }
}

let paused = localStorage.getItem("ratchet.paused") === "1";

function showPaused() {
  const button = document.getElementById("live-toggle");
  if (!button) return;
  button.setAttribute("aria-pressed", String(paused));
  button.textContent = paused ? "Resume live" : "Pause live";
}

// A region marked data-live="N" is fetched again every N seconds and swapped in place,
// unless live updates are paused, a box in it is ticked (a selection in progress), someone
// is writing in one of its text fields (an answer, a reason), or it is final (a finished
// task's page stops once it has shown the end).
function editing(region) {
  const focused = document.activeElement;
  if (focused && region.contains(focused) && focused.matches("textarea, input[type=text], input:not([type])")) return true;
  return [...region.querySelectorAll("textarea")].some((box) => box.value !== box.defaultValue);
}

async function refresh(region) {
  if (paused || document.hidden) return;
  if (region.hasAttribute("data-hold-when-checked") && region.querySelector("input:checked")) return;
  if (editing(region)) return;
  const response = await fetch(location.href, { headers: { "X-Live": "1" }, credentials: "same-origin" });
  if (response.redirected || !response.ok) return;
  const html = new DOMParser().parseFromString(await response.text(), "text/html");
  const fresh = html.getElementById(region.id);
  if (!fresh) return;
  region.innerHTML = fresh.innerHTML;
  if (fresh.hasAttribute("data-final")) region.setAttribute("data-final", "");
  localTimes(region);
  wire(region);
  followStream();
}

function refreshAll() {
  for (const region of document.querySelectorAll("[data-live][id]")) refresh(region).catch(() => {});
}

// The answer as the model writes it. An element [data-stream] names a task's event stream
// (the one the API serves, read with the session); its message.delta events are shown in
// the page's [data-partial] element, as text (never as markup), until the step commits: a
// committed event clears it and fetches the page again, which then shows the committed step.
// message.discarded clears it too (the call is made again; new deltas follow). Events a
// reconnection replays are skipped by their ids (a committed event's seq, a delta's
// "<seq>.<pos>").
const COMMITTED = ["task.queued", "task.started", "step.model_response", "step.tool_call",
  "step.completed", "task.awaiting_approval", "task.waiting", "wait.settled", "task.succeeded",
  "task.failed", "task.cancelled"];
const ENDS = ["task.succeeded", "task.failed", "task.cancelled"];
const follow = { path: null, source: null, seq: 0, pos: 0, step: 0, text: "", calls: [] };

function clearPartial() {
  follow.step = 0;
  follow.text = "";
  follow.calls = [];
}

function showPartial() {
  const box = document.querySelector("[data-partial]");
  if (!box) return;
  const calls = follow.calls.filter(Boolean).map((c) => `→ ${c.name}(${c.arguments}`);
  const shown = [follow.text, ...calls].filter(Boolean).join("\n");
  box.querySelector("pre").textContent = shown;
  box.hidden = !shown;
}

function position(id) {
  const [seq, pos] = (id || "0").split(".");
  return [Number(seq) || 0, Number(pos) || 0];
}

function onDelta(event) {
  const [seq, pos] = position(event.lastEventId);
  if (seq < follow.seq || (seq === follow.seq && pos <= follow.pos)) return;
  follow.pos = pos;
  const delta = JSON.parse(event.data);
  if (delta.step !== follow.step) clearPartial();
  follow.step = delta.step;
  if (delta.text) follow.text += delta.text;
  for (const piece of delta.tool_calls || []) {
    const call = follow.calls[piece.index] || (follow.calls[piece.index] = { name: "", arguments: "" });
    if (piece.name) call.name = piece.name;
    if (piece.arguments) call.arguments += piece.arguments;
  }
  showPartial();
}

function onDiscarded(event) {
  const [seq, pos] = position(event.lastEventId);
  if (seq < follow.seq || (seq === follow.seq && pos <= follow.pos)) return;
  follow.pos = pos;
  clearPartial();
  showPartial();
}

function onCommitted(event) {
  const [seq] = position(event.lastEventId);
  if (seq <= follow.seq) return;
  follow.seq = seq;
  follow.pos = 0;
  clearPartial();
  showPartial();
  if (ENDS.includes(event.type)) stopFollowing();
  refreshAll();
}

function stopFollowing() {
  if (follow.source) follow.source.close();
  follow.source = null;
  follow.path = null;
}

function followStream() {
  const marker = document.querySelector("[data-stream]");
  const path = marker && !paused ? marker.getAttribute("data-stream") : null;
  if (path !== follow.path) {
    stopFollowing();
    clearPartial();
    if (path) {
      const after = Number(marker.getAttribute("data-after")) || 0;
      follow.seq = after;
      follow.pos = 0;
      follow.path = path;
      follow.source = new EventSource(`${path}?after=${after}`);
      follow.source.addEventListener("message.delta", onDelta);
      follow.source.addEventListener("message.discarded", onDiscarded);
      for (const type of COMMITTED) follow.source.addEventListener(type, onCommitted);
    }
  }
  showPartial();
}

function live() {
  for (const region of document.querySelectorAll("[data-live][id]")) {
    const seconds = Number(region.getAttribute("data-live")) || 5;
    const timer = setInterval(() => {
      if (region.hasAttribute("data-final")) { clearInterval(timer); return; }
      refresh(region).catch(() => {});
    }, seconds * 1000);
  }
}

function wire(root) {
  const all = root.querySelector("#select-all");
  if (all) {
    all.addEventListener("change", () => {
      for (const box of document.querySelectorAll('input[name="ids"]')) box.checked = all.checked;
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  localTimes(document);
  wire(document);
  showPaused();
  const toggle = document.getElementById("live-toggle");
  if (toggle) toggle.addEventListener("click", () => {
    paused = !paused;
    localStorage.setItem("ratchet.paused", paused ? "1" : "0");
    showPaused();
    followStream();
  });
  // Delegated, so forms swapped in by a live refresh ask too.
  document.addEventListener("submit", (event) => {
    const form = event.target.closest("form[data-confirm]");
    if (form && !confirm(form.getAttribute("data-confirm"))) event.preventDefault();
  });
  live();
  followStream();
});
