"""The web console in a real headless Chromium: the chat page streams a reply from the demo model through
the real stages (the same text the API gives for the same conversation), renders markdown safely and folds
reasoning (scripted source with GLM-5's template); the engine page shows the `coli stats` figures moving
while the model generates. COLI_CONSOLE_SHOTS=DIR also saves the screenshots (docs/console-*.png)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from chromium import Chromium, find_chromium
from scripted_server import ScriptedServer, glm5_container

EXE = find_chromium()
pytestmark = pytest.mark.skipif(EXE is None, reason="Chromium is not installed (Debian: apt-get install chromium; "
                                                    ".ci/run installs it), so the console's browser test cannot run")
QUESTION = "What does os.path.join do?"


@pytest.fixture(scope="module")
def browser():
    b = Chromium(EXE)
    yield b
    b.close()


def shots(tmp_path) -> Path:
    d = Path(os.environ.get("COLI_CONSOLE_SHOTS") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


def ask(browser, text: str) -> None:
    browser.js(f"document.getElementById('prompt').value = {json.dumps(text)};"
               "document.getElementById('composer').requestSubmit(); true")


@pytest.mark.timeout(180)
def test_chat_page_streams_the_models_reply(browser, gateway, tmp_path):
    browser.navigate(gateway.url + "/")
    browser.wait_js("window.coliModel")
    browser.js("document.getElementById('temperature').value = '0'; document.getElementById('max_tokens').value = "
               "'48'; true")
    ask(browser, QUESTION)
    browser.wait_js("!!document.querySelector('.msg.assistant[data-done]')",
                    timeout=120)
    got = browser.js("(() => { const d = document.querySelector('.msg.assistant');"
                     " return {raw: d.dataset.raw, updates: Number(d.dataset.updates || 0), finish: d.dataset.finish,"
                     " error: d.querySelector('.error') && d.querySelector('.error').textContent,"
                     " shown: d.querySelector('.content').textContent}; })()")
    assert got["error"] is None
    status, api = gateway.post("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                                                        "temperature": 0, "max_tokens": 48})
    assert status == 200
    want = api["choices"][0]["message"]["content"]
    assert got["raw"] == want and got["finish"] == api["choices"][0]["finish_reason"]
    if api["usage"]["completion_tokens"] >= 4 and want:
        assert got["updates"] >= 2, "the reply was not streamed"
    assert " ".join(want.split())[:20] in " ".join(got["shown"].split())
    browser.screenshot(shots(tmp_path) / "console-chat.png")
    # markdown: formatted, and model text can never become markup
    html = browser.js("renderMarkdown('**bold** and `x<y>`\\n\\n```py\\n<script>alert(1)</script>\\n```\\n- a\\n- b')")
    assert "<strong>bold</strong>" in html and "<code>x&lt;y&gt;</code>" in html
    assert "&lt;script&gt;" in html and "<script>" not in html and "<ul><li>a</li><li>b</li></ul>" in html


@pytest.mark.timeout(120)
def test_chat_page_folds_reasoning_and_shows_tool_calls(browser, tmp_path_factory):
    container = glm5_container(tmp_path_factory.mktemp("console"))
    s = ScriptedServer(container, ["Two and two.\n</think>It is **4**.", "</think><tool_call>get_time"
                                   "<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>"], delay=0.01)
    try:
        browser.navigate(s.url + "/")
        browser.wait_js("window.coliModel")
        ask(browser, "2+2?")
        browser.wait_js("document.querySelectorAll('.msg.assistant[data-done]').length == 1")
        got = browser.js("(() => { const d = document.querySelector('.msg.assistant');"
                         " const r = d.querySelector('details.reasoning');"
                         " return {hidden: r.hidden, open: r.open, reasoning: r.querySelector('.body').textContent,"
                         " html: d.querySelector('.content').innerHTML}; })()")
        assert got == {"hidden": False, "open": False, "reasoning": "Two and two.",
                       "html": "<p>It is <strong>4</strong>.</p>"}
    finally:
        s.stop()


@pytest.mark.timeout(180)
def test_engine_page_figures_move_while_the_model_generates(browser, gateway, tmp_path):
    browser.navigate(gateway.url + "/engine")
    browser.wait_js("!!document.getElementById('card-tokens_s')", timeout=30)
    before = browser.js("Number(document.getElementById('card-tokens_s').dataset.samples)")
    done = threading.Event()

    def generate():
        try:
            n = 1500 if os.environ.get("COLI_CONSOLE_SHOTS") else 400  # longer for a screenshot with full charts
            gateway.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": n, "ignore_eos": True}, timeout=120)
        finally:
            done.set()

    t = threading.Thread(target=generate)
    t.start()
    try:
        browser.wait_js("Number(document.getElementById('card-tokens_s').dataset.max) > 0", timeout=60)
        browser.wait_js("Number(document.getElementById('card-batch').dataset.max) >= 1", timeout=30)
        browser.wait_js("Number(document.getElementById('card-step_tokens').dataset.max) >= 1", timeout=30)
        if os.environ.get("COLI_CONSOLE_SHOTS"):  # for docs/: let the charts fill a little first
            browser.wait_js(f"Number(document.getElementById('card-tokens_s').dataset.samples) > {before + 30}")
        browser.screenshot(shots(tmp_path) / "console-engine.png")
    finally:
        t.join(120)
    cards = browser.js("[...document.querySelectorAll('.card')].map(c => c.id)")
    for key in ("nvme_mb_s", "ram_hit", "copy_busy", "sm_busy", "fallbacks_s", "tokens_s", "batch", "step_tokens",
                "prefill_share"):
        assert f"card-{key}" in cards
    after = browser.js("Number(document.getElementById('card-tokens_s').dataset.samples)")
    assert after > before + 2  # it keeps polling
    assert browser.js("document.getElementById('status').textContent").startswith("run ")


def test_console_files_and_stats_api(gateway):
    for path, kind in (("/", "text/html"), ("/engine", "text/html"), ("/web/chat.js", "text/javascript"),
                       ("/web/app.css", "text/css")):
        status, headers, _ = gateway.request("GET", path)
        assert status == 200 and headers["content-type"].startswith(kind), path
    for path in ("/web/../gateway.py", "/web/nope.js", "/web/%2e%2e%2fgateway.py"):
        status, _, _ = gateway.request("GET", path)
        assert status == 404, path
    status, _, data = gateway.request("GET", "/api/stats")
    snap = json.loads(data)
    assert status == 200 and {"executor", "ramtier", "reader"} <= set(snap["stats"]) and "queued" in snap


@pytest.mark.timeout(120)
def test_chat_page_stop_cancels_the_request(browser, tmp_path_factory):
    container = glm5_container(tmp_path_factory.mktemp("console-stop"))
    s = ScriptedServer(container, ["</think>" + "word " * 400], delay=0.05)  # ~20 s of tokens if not stopped
    try:
        browser.navigate(s.url + "/")
        browser.wait_js("window.coliModel")
        ask(browser, "Talk for a long time.")
        browser.wait_js("Number((document.querySelector('.msg.assistant') || {dataset: {}}).dataset.updates) >= 3")
        browser.js("document.getElementById('stop').click(); true")
        browser.wait_js("!!document.querySelector('.msg.assistant[data-done]')", timeout=10)
        assert browser.js("document.querySelector('.msg.assistant .error').textContent") == "(stopped)"
        (stream,) = s.run.streams
        deadline = time.monotonic() + 10
        while not stream.cancelled:  # the gateway saw the hang-up and cancelled at the source
            assert time.monotonic() < deadline, "the stopped request was not cancelled"
            time.sleep(0.05)
        assert len(stream.ids) < len(s.tok.encode("word " * 400))  # long before its end
    finally:
        s.stop()
