// Shared by both pages: the API key (kept in this browser's localStorage, sent as a bearer token) and the
// model name in the header.
"use strict";

const keyInput = document.getElementById("apikey");
keyInput.value = localStorage.getItem("coli-api-key") || "";
keyInput.addEventListener("change", () => localStorage.setItem("coli-api-key", keyInput.value));

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  if (keyInput.value) h["Authorization"] = "Bearer " + keyInput.value;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: authHeaders() });
    const j = await r.json();
    if (!r.ok) throw new Error(j.error ? j.error.message : r.statusText);
    window.coliModel = j.data[0].id;
    document.getElementById("model").textContent = "serving " + window.coliModel;
  } catch (e) {
    document.getElementById("model").textContent = "model unknown (" + e.message + ")";
  }
}
loadModel();
