"""A small chat page at `/`, as llama-server serves its web UI there (`--no-webui` turns it off:
404).

One HTML page with its script inline, a service worker that only passes requests on, a web manifest
and `/_app/version.json` (the paths of llama.cpp's web UI, so a browser or a test that looks for
them finds them). These are public, like llama.cpp's static assets: the page asks for the API key
itself and sends it with each call, and every API route still checks it. The page streams
/v1/chat/completions and shows the answer as text (textContent: nothing the model writes is run as
HTML).
"""

from __future__ import annotations

import json

from litestar import Response, get

from ..._version import __version__

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>strata-jax</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="manifest" href="/manifest.webmanifest">
<style>
body{font:15px/1.45 system-ui,sans-serif;max-width:46rem;margin:0 auto;padding:1rem;color:#222}
#log div{white-space:pre-wrap;margin:.5rem 0;padding:.5rem .7rem;border-radius:.4rem}
.user{background:#eef}.assistant{background:#f4f4f4}.error{background:#fee}
form{display:flex;gap:.5rem}textarea{flex:1;min-height:3.5rem}header{display:flex;gap:1rem;align-items:center}
</style></head><body>
<header><h3 id="model">strata-jax</h3><input id="key" type="password" placeholder="API key (if the server has one)">
<button id="clear" type="button">New chat</button></header>
<div id="log"></div>
<form id="form"><textarea id="text" placeholder="Write a message; Enter sends, Shift+Enter breaks the line"></textarea>
<button>Send</button></form>
<script>
const log = document.getElementById("log"), text = document.getElementById("text"), key = document.getElementById("key");
key.value = localStorage.getItem("strata-key") || "";
key.onchange = () => localStorage.setItem("strata-key", key.value);
let messages = [];
const headers = () => Object.assign({"Content-Type": "application/json"},
  key.value ? {"Authorization": "Bearer " + key.value} : {});
function show(role, content) {
  const div = document.createElement("div"); div.className = role; div.textContent = content;
  log.appendChild(div); div.scrollIntoView(); return div;
}
fetch("/v1/models", {headers: headers()}).then(r => r.json()).then(j => {
  if (j.data) document.getElementById("model").textContent = j.data[0].id; }).catch(() => {});
document.getElementById("clear").onclick = () => { messages = []; log.textContent = ""; };
text.onkeydown = e => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } };
document.getElementById("form").onsubmit = e => { e.preventDefault(); send(); };
async function send() {
  const content = text.value.trim(); if (!content) return;
  text.value = ""; messages.push({role: "user", content}); show("user", content);
  const out = show("assistant", ""); let answer = "";
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
      body: JSON.stringify({messages, stream: true})});
    if (!r.ok) { const j = await r.json().catch(() => ({})); throw new Error((j.error && j.error.message) || r.statusText); }
    const reader = r.body.getReader(), dec = new TextDecoder(); let buf = "";
    for (;;) {
      const {done, value} = await reader.read(); if (done) break;
      buf += dec.decode(value, {stream: true});
      let at; while ((at = buf.indexOf("\\n\\n")) >= 0) {
        const line = buf.slice(0, at).trim(); buf = buf.slice(at + 2);
        if (!line.startsWith("data:") || line === "data: [DONE]") continue;
        const j = JSON.parse(line.slice(5));
        if (j.error) throw new Error(j.error.message);
        const d = j.choices && j.choices[0] && j.choices[0].delta;
        if (d && (d.content || d.reasoning_content)) { answer += d.content || ""; out.textContent = answer || d.reasoning_content; }
      }
    }
    messages.push({role: "assistant", content: answer});
  } catch (err) { out.className = "error"; out.textContent = String(err.message || err); messages.pop(); }
}
</script></body></html>
"""  # noqa: E501

# A service worker that caches nothing: every request goes to the server as it would without it.
SERVICE_WORKER = "self.addEventListener('fetch', () => {});\n"

MANIFEST = json.dumps({"name": "strata-jax", "short_name": "strata-jax", "start_url": "/",
                       "display": "standalone"})


def handlers() -> list:
    """The page and its assets, public (no API key): llama-server serves its UI's files the same
    way."""
    public = {"public": True}

    @get("/", opt=public, include_in_schema=False)
    async def page() -> Response:
        return Response(PAGE, media_type="text/html; charset=utf-8")

    @get("/sw.js", opt=public, include_in_schema=False)
    async def service_worker() -> Response:
        return Response(SERVICE_WORKER, media_type="text/javascript")

    @get("/manifest.webmanifest", opt=public, include_in_schema=False)
    async def manifest() -> Response:
        return Response(MANIFEST, media_type="application/manifest+json")

    @get("/_app/version.json", opt=public, include_in_schema=False)
    async def version() -> Response:
        return Response(json.dumps({"version": __version__}), media_type="application/json")

    return [page, service_worker, manifest, version]
