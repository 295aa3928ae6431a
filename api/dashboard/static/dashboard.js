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
// unless live updates are paused, a box in it is ticked (a selection in progress), or it
// is final (a finished task's page stops once it has shown the end).
async function refresh(region) {
  if (paused || document.hidden) return;
  if (region.hasAttribute("data-hold-when-checked") && region.querySelector("input:checked")) return;
  const response = await fetch(location.href, { headers: { "X-Live": "1" }, credentials: "same-origin" });
  if (response.redirected || !response.ok) return;
  const html = new DOMParser().parseFromString(await response.text(), "text/html");
  const fresh = html.getElementById(region.id);
  if (!fresh) return;
  region.innerHTML = fresh.innerHTML;
  if (fresh.hasAttribute("data-final")) region.setAttribute("data-final", "");
  localTimes(region);
  wire(region);
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
  });
  // Delegated, so forms swapped in by a live refresh ask too.
  document.addEventListener("submit", (event) => {
    const form = event.target.closest("form[data-confirm]");
    if (form && !confirm(form.getAttribute("data-confirm"))) event.preventDefault();
  });
  live();
});
