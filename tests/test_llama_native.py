"""llama.cpp's native routes and conventions (issue 17), against the real server as a process: POST
/completion (whole, streamed, token / mixed / several prompts, n_probs, logit_bias by text, stop
words, response_fields), /apply-template, POST /props, /slots/N?action=save|restore|erase, CORS,
X-Api-Key, an unknown model name, server-wide sampling defaults (-n, --temp), llama.cpp's metric
names; and the llama-server wrapper's flags. One server for the module, on the tiny qwen3 model with
BOS (as test_llama_extras)."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from strata_jax.gguf import load_tokenizer
from strata_jax.serve.launch import ServerProcess

KEY = "sk-native"
N_PREDICT = 6
ORIGIN = "http://ui.example"
LONG = "one two three four five six seven eight nine ten " * 6


@pytest.fixture(scope="module")
def model(bos_model):
    return bos_model


@pytest.fixture(scope="module")
def tok(model):
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    saves = tmp_path_factory.mktemp("slots")
    args = [str(model), "--parallel", "2", "--max-context", "256", "--model-name", "tiny", "-n",
            str(N_PREDICT),
            "--temp", "0", "--slot-save-path", str(saves), "--props", "--cors-origins", ORIGIN]
    with ServerProcess(args, api_key=KEY) as srv:
        srv.wait_ready()
        srv.saves = saves
        yield srv


def post(server, path, body, headers=None):
    return httpx.post(server.url + path, content=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json", **server.headers,
                               **(headers or {})})


def completion(server, **body):
    r = post(server, "/completion", body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- POST /completion ----------------------------------------------------------------------------


def test_completion_whole_has_llama_cpp_fields_and_server_defaults(server, tok):
    body = completion(server, prompt="Hello there", return_tokens=True)
    for key in ("content", "tokens", "id_slot", "stop", "model", "tokens_predicted",
                "tokens_evaluated", "generation_settings", "prompt", "has_new_line", "truncated",
                "stop_type", "stopping_word", "tokens_cached", "timings"):
        assert key in body, key
    assert body["stop"] is True and body["model"] == "tiny"
    settings = body["generation_settings"]
    # -n and --temp
    assert settings["n_predict"] == N_PREDICT and settings["temperature"] == 0.0
    assert body["tokens_predicted"] == len(body["tokens"]) <= N_PREDICT
    assert all(isinstance(t, int) for t in body["tokens"])
    assert tok.decode(body["tokens"]) == body["content"] or body["stop_type"] == "eos"
    assert body["tokens_evaluated"] == len(tok.encode("Hello there", add_special=True))
    assert body["stop_type"] in ("limit", "eos")
    # a request's own fields win over the server's defaults, -n among them (llama.cpp's
    # server-context.cpp: n_predict_max is the task's n_predict unless it is -1): a request may ask
    # for more than -n
    assert (completion(server, prompt="Hello there",
                       n_predict=2)["generation_settings"]["n_predict"] == 2)
    assert (completion(server, prompt="Hello there",
                       n_predict=50)["generation_settings"]["n_predict"] == 50)
    assert (completion(server, prompt="Hello there",
                       temperature=0.7)["generation_settings"]["temperature"] == 0.7)
    # greedy: the same answer as the OpenAI route's
    oai = post(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": N_PREDICT}).json()
    assert oai["choices"][0]["text"] == body["content"]


def test_completion_prompt_shapes(server, tok):
    text = "Hello there"
    ids = tok.encode(text, add_special=True)
    want = completion(server, prompt=text)["content"]
    assert completion(server, prompt=ids)["content"] == want
    assert completion(server, prompt={"prompt_string": text})["content"] == want
    several = post(server, "/completion", {"prompt": [ids, text]}).json()
    assert isinstance(several, list) and [b["content"] for b in several] == [want, want]
    assert [b["index"] for b in several] == [0, 1]
    # one prompt of ids and texts
    mixed = completion(server, prompt=[ids[0], "Hello", " there"])
    assert mixed["tokens_evaluated"] >= 2
    r = post(server, "/completion", {"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}})
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
    for bad in ("", [], [True], 3.5):
        assert post(server, "/completion", {"prompt": bad}).status_code == 400, bad


def test_completion_streamed_equals_whole(server):
    with httpx.stream("POST", server.url + "/completion", timeout=60, headers={**server.headers},
                      json={"prompt": LONG, "stream": True, "n_predict": 4,
                            "return_progress": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "prompt_progress" in chunks[0]
    tokens = [c for c in chunks if "stop" in c and not c["stop"] and "prompt_progress" not in c]
    assert tokens and all(len(c["tokens"]) == 1 for c in tokens)
    last = chunks[-1]
    assert last["stop"] is True and "timings" in last and "generation_settings" in last
    streamed = "".join(c.get("content", "") for c in chunks)
    assert streamed == completion(server, prompt=LONG, n_predict=4)["content"]


def test_completion_n_probs_and_post_sampling(server):
    body = completion(server, prompt="Hello", n_predict=3, n_probs=4)
    probs = body["completion_probabilities"]
    assert len(probs) == body["tokens_predicted"]
    for p in probs:
        assert {"id", "token", "bytes", "logprob", "top_logprobs"} <= set(p) and p["logprob"] <= 0
        assert len(p["top_logprobs"]) == 4 and all("id" in t for t in p["top_logprobs"])
        # greedy: the chosen one is the likeliest
        assert p["top_logprobs"][0]["id"] == p["id"]
    post_s = completion(server, prompt="Hello", n_predict=2, n_probs=3, post_sampling_probs=True)
    assert all(0 < p["prob"] <= 1 and "top_probs" in p for p in post_s["completion_probabilities"])


def test_completion_logit_bias_by_text_and_stop_words(server, tok):
    first = completion(server, prompt="Hello", n_predict=1, return_tokens=True)["tokens"][0]
    piece = tok.decode([first])
    for bias in ([[piece, False]], [[first, -100]], {str(first): -100}):
        again = completion(server, prompt="Hello", n_predict=1, return_tokens=True, logit_bias=bias)
        assert again["tokens"][0] != first, bias
    content = completion(server, prompt="Hello")["content"]
    word = content[len(content) // 2:][:2]
    if word.strip():
        stopped = completion(server, prompt="Hello", stop=[word])
        assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
        assert stopped["content"] == content[:content.index(word)]


def test_completion_response_fields_and_bad_fields(server):
    body = completion(server, prompt="Hi",
                      response_fields=["content", "generation_settings/n_predict"])
    assert set(body) == {"content", "generation_settings/n_predict"}
    for bad, field in (({"n_predict": "x"}, "n_predict"), ({"n_probs": -1}, "n_probs"),
                       ({"logit_bias": [[1]]}, "logit_bias"), ({"temperature": -1}, "temperature")):
        r = post(server, "/completion", {"prompt": "Hi", **bad})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (bad, r.text)


# ---- /apply-template, /tokenize, /props, /slots --------------------------------------------------


def test_apply_template_is_the_engines_rendering(server, tok):
    messages = [{"role": "user", "content": "What is today?"}]
    r = post(server, "/apply-template", {"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == tok.apply_chat_template(messages, add_generation_prompt=True)
    assert post(server, "/apply-template", {"messages": []}).status_code == 400


def test_chat_input_tokens_counts_what_a_request_reads(server, tok):
    messages = [{"role": "system", "content": "Book"},
                {"role": "user", "content": "What is the best book"}]
    r = post(server, "/chat/completions/input_tokens", {"messages": messages})
    assert r.status_code == 200, r.text
    assert (r.json() == {"input_tokens": len(
        tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True)))})
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r.json()["input_tokens"]
    assert post(server, "/chat/completions/input_tokens", {"messages": []}).status_code == 400


def test_tokenize_with_pieces(server, tok):
    r = post(server, "/tokenize", {"content": "Hello wörld", "with_pieces": True})
    pieces = r.json()["tokens"]
    assert [p["id"] for p in pieces] == tok.encode("Hello wörld", add_special=False)
    assert all("piece" in p for p in pieces)


def test_props_post_changes_the_defaults(server):
    before = httpx.get(server.url + "/props", headers=server.headers).json()
    assert (before["endpoint_props"] is True
            and before["default_generation_settings"]["params"]["n_predict"] == N_PREDICT)
    try:
        r = post(server, "/props", {"top_k": 7})
        assert r.status_code == 200 and r.json()["success"] is True
        assert completion(server, prompt="Hi")["generation_settings"]["top_k"] == 7
        after = httpx.get(server.url + "/props", headers=server.headers).json()
        assert after["default_generation_settings"]["params"]["top_k"] == 7
        assert post(server, "/props", {"top_k": "many"}).status_code == 400
        assert post(server, "/props", {"nonsense": 1}).status_code == 400
    finally:
        post(server, "/props", {"top_k": 40})


def test_slots_save_restore_erase(server):
    assert httpx.get(server.url + "/slots", headers=server.headers).status_code == 200
    first = completion(server, prompt=LONG, n_predict=2)
    saved = [post(server, f"/slots/{i}?action=save", {"filename": f"slot{i}.bin"}).json()
             for i in (0, 1)]
    # the slot that kept the prompt's KV
    held = next(s for s in saved if s["n_saved"] > 0)
    assert (server.saves / held["filename"]).is_file()
    for i in (0, 1):
        assert post(server, f"/slots/{i}?action=erase", {}).status_code == 200
    # erased: read again
    assert completion(server, prompt=LONG, n_predict=2)["timings"]["cache_n"] == 0
    for i in (0, 1):
        post(server, f"/slots/{i}?action=erase", {})
    other = 1 - held["id_slot"]
    r = post(server, f"/slots/{other}?action=restore", {"filename": held["filename"]})
    assert r.status_code == 200 and r.json()["n_restored"] == held["n_saved"], r.text
    again = completion(server, prompt=LONG, n_predict=2)
    assert (again["timings"]["cache_n"] >= held["n_saved"] - 1
            and again["content"] == first["content"])
    for bad in ("../escape.bin", "/tmp/x.bin", "a/b", ".hidden", ""):
        r = post(server, "/slots/0?action=save", {"filename": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename", bad
    assert post(server, "/slots/0?action=restore", {"filename": "missing.bin"}).status_code == 400
    assert post(server, "/slots/9?action=erase", {}).status_code == 400
    assert post(server, "/slots/0?action=explode", {}).status_code == 400


# ---- conventions ---------------------------------------------------------------------------------


def test_cors_preflight_needs_no_key_and_origins_are_checked(server):
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "Authorization"}
    r = httpx.options(server.url + "/completion", headers=ask)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.options(server.url + "/completion", headers={**ask, "Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/v1/models", headers={**server.headers, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    # on the wire the names are written as llama.cpp writes them: clients that copy the headers into
    # a plain dict (llama.cpp's own tests) look them up so
    names = {k for k, _ in r.headers.raw}
    assert ({b"Access-Control-Allow-Origin", b"Access-Control-Allow-Credentials", b"Content-Type"}
            <= names)


def test_api_key_headers_and_any_model_name(server):
    for headers, status in (({"X-Api-Key": KEY}, 200), ({"Authorization": f"Bearer {KEY}"}, 200),
                            ({"X-Api-Key": "wrong"}, 401), ({}, 401)):
        r = httpx.post(server.url + "/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 1, "model": "gpt-4o"},
                       headers=headers, timeout=60)
        assert r.status_code == status, (headers, r.text)
        if status == 200:
            assert r.json()["model"] == "tiny"          # an unknown name is served by the one model
        else:
            assert r.json()["error"]["type"] == "authentication_error"


@contextlib.contextmanager
def _capture_server():
    """A plain HTTP server that keeps the headers of the last GET (answering "ok") and answers POST
    with 204."""
    class Capture(BaseHTTPRequestHandler):
        def do_GET(self):
            self.server.captured = dict(self.headers)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def do_POST(self):
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    target = ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    target.captured = {}
    threading.Thread(target=target.serve_forever, daemon=True).start()
    try:
        yield target
    finally:
        target.shutdown()
        target.server_close()


def test_web_ui_and_its_assets_need_no_key(server):
    """The chat page at / and its assets are public (as llama-server's static files); the API still
    is not."""
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.text.startswith("<!doctype html>")
    assert ("/v1/chat/completions" in page.text
            and page.headers["content-type"].startswith("text/html"))
    for path in ("/sw.js", "/manifest.webmanifest", "/_app/version.json"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert httpx.get(server.url + "/v1/models").status_code == 401
    # off by default
    assert httpx.get(server.url + "/cors-proxy", headers=server.headers).status_code == 403


def test_timings_count_decode_steps_as_llama_cpp(server):
    """The first token comes from the prompt's last window: the rate is over n - 1 decode steps."""
    one = completion(server, prompt="Hi", n_predict=1, ignore_eos=True)["timings"]
    assert (one["predicted_n"] == 1 and one["predicted_per_second"] == 0.0
            and one["predicted_per_token_ms"] == 0.0)
    six = completion(server, prompt="Hi", n_predict=6, ignore_eos=True)["timings"]
    assert six["predicted_n"] == 6
    assert abs(six["predicted_per_second"] - 1e3 * 5 / six["predicted_ms"]) < 1e-6
    assert abs(six["predicted_per_token_ms"] - six["predicted_ms"] / 5) < 1e-6


def test_metrics_content_type_and_llama_cpp_names(server):
    completion(server, prompt="Hi", n_predict=2)
    r = httpx.get(server.url + "/metrics", headers=server.headers)
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b"Process-Start-Time-Unix" in {k for k, _ in r.headers.raw}
    assert abs(float(r.headers["Process-Start-Time-Unix"]) - __import__("time").time()) < 3600
    values = {ln.split()[0]: float(ln.split()[1]) for ln in r.text.splitlines()
              if ln.startswith("llamacpp:")}
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total",
                 "llamacpp:tokens_predicted_total", "llamacpp:prompt_seconds_total",
                 "llamacpp:tokens_predicted_seconds_total", "llamacpp:n_decode_total",
                 "llamacpp:requests_processing", "llamacpp:requests_deferred",
                 "llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds",
                 "llamacpp:n_tokens_max", "llamacpp:n_busy_slots_per_decode",
                 "llamacpp:spec_decode_num_draft_tokens_total",
                 "llamacpp:spec_decode_num_accepted_tokens_total",
                 "llamacpp:spec_decode_num_drafts_total"):
        assert name in values, name
        assert (f"# HELP {name.removesuffix('_total')}" in r.text
                or f"# HELP {name} " in r.text), name
    assert "# TYPE llamacpp:n_tokens_max counter" in r.text and values["llamacpp:n_tokens_max"] >= 3
    assert (values["llamacpp:tokens_predicted_total"] >= 2
            and values["llamacpp:requests_processing"] == 0)
    assert "strata_generated_tokens_total" in r.text


def test_verbose_puts_the_prompt_text_in_the_answer(server, tok):
    messages = [{"role": "system", "content": "Book"},
                {"role": "user", "content": "What is the best book"}]
    for path, body in (("/v1/chat/completions", {"messages": messages}),
                       ("/v1/completions", {"prompt": "Hi there"})):
        plain = post(server, path, {**body, "max_tokens": 2})
        assert plain.status_code == 200 and "__verbose" not in plain.json()
        r = post(server, path, {**body, "max_tokens": 2, "verbose": True})
        assert r.status_code == 200, r.text
        got = r.json()["__verbose"]
        ids = (tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
               if "messages" in body else tok.encode("Hi there", add_special=True))
        assert got["prompt"] == tok.decode(ids) and got["tokens_evaluated"] == len(ids)
        assert got["tokens_predicted"] == r.json()["usage"]["completion_tokens"]
    assert (post(server, "/v1/chat/completions",
                 {"messages": messages, "verbose": "yes"}).status_code == 400)


def test_reasoning_flag_sets_enable_thinking_and_verbose_responses(model, tmp_path):
    """--reasoning off|on: the template's enable_thinking when a request sets none (llama.cpp passes
    it); a request's chat_template_kwargs still win. --verbose-responses: every answer carries
    "__verbose"."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}|{% endfor %}"
                        "{% if add_generation_prompt %}A:{% endif %}{{ 'on' if enable_thinking is "
                        "defined and enable_thinking else 'off' if enable_thinking is defined else "
                        "'unset' }}")
    msgs = [{"role": "user", "content": "Hi"}]
    for flag, want in (("off", "off"), ("on", "on"), (None, "unset")):
        args = [str(model), "--max-context", "256", "--chat-template-file", str(template),
                "--verbose-responses"]
        args += [] if flag != "on" else ["--no-metrics"]
        with ServerProcess(args
                           + (["--reasoning", flag, "--prefill-assistant"] if flag else [])) as srv:
            srv.wait_ready()
            r = post(srv, "/apply-template", {"messages": msgs})
            assert r.json()["prompt"] == f"Hi|A:{want}", flag
            kept = post(srv, "/apply-template",
                        {"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}})
            assert kept.json()["prompt"] == "Hi|A:on"
            # a chat that ends in the assistant's words: a new turn by default (vLLM's way);
            # continued with --prefill-assistant (llama.cpp's: the chat before it with the
            # generation prompt, then the words)
            if flag == "on":                  # llama-server without --metrics
                off = httpx.get(srv.url + "/metrics")
                assert off.status_code == 501 and "--metrics" in off.json()["error"]["message"]
            prefill = post(srv, "/apply-template",
                           {"messages": msgs + [{"role": "assistant", "content": "Hel"}]})
            assert prefill.json()["prompt"] == (f"Hi|A:{want}Hel" if flag else "Hi|Hel|A:unset")
            if flag == "off":
                assert httpx.get(srv.url + "/metrics").status_code == 200
                chat = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
                assert (chat.status_code == 200
                        and chat.json()["__verbose"]["prompt"].endswith("Hi|A:off"))


def test_dates_aliases_tags_hosts_and_no_webui(model):
    """--llama-conventions: the template gets today's date as llama.cpp passes it (Llama 3.x's
    date_string, firefunction v2's datetime); an undefined name or none + a string is the string
    (llama.cpp's jinja), so firefunction's `functions`, which only llama.cpp's code defines, renders
    as nothing instead of a 400. --model-name a,b,c (llama.cpp's --alias): the id is the first
    alphabetically, any name is served; --tags; --host with two addresses, each answering;
    --no-webui: 404 at /; --ui-mcp-proxy's /cors-proxy."""
    template = ("{{ 'D:' + date_string + '|T:' + datetime + '|F:' + functions + '|N:' + none }}"
                # --chat-template: not a name, Jinja
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    args = [str(model), "--max-context", "256", "--chat-template", template, "--llama-conventions",
            "--model-name", "tiny-2,fim,code", "--tags", "chat,fim,small", "--strict-model-name",
            "--host", "127.0.0.1,127.0.0.2", "--no-webui", "--ui-mcp-proxy"]
    with ServerProcess(args) as srv, _capture_server() as target:
        srv.wait_ready()
        r = post(srv, "/apply-template",
                 {"messages": [{"role": "user", "content": "What is today?"}]})
        now = time.localtime()
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == (f"D:{time.strftime('%d %b %Y', now)}"
                                      f"|T:{time.strftime('%b %d %Y', now)}|F:|N:What is today?")
        (entry,) = httpx.get(srv.url + "/v1/models").json()["data"]
        assert entry["id"] == "code" and entry["aliases"] == ["tiny-2", "fim", "code"]
        assert entry["tags"] == ["chat", "fim", "small"]
        for name in ("fim", "tiny-2"):
            assert (post(srv, "/completion",
                         {"prompt": "Hi", "n_predict": 1, "model": name}).status_code == 200)
        assert (post(srv, "/v1/completions",
                     {"prompt": "Hi", "max_tokens": 1, "model": "other"}).status_code == 404)
        other = srv.url.replace("127.0.0.1", "127.0.0.2")
        assert httpx.get(other + "/health").json()["status"] == "ok"
        assert httpx.get(srv.url + "/").status_code == 404

        # --ui-mcp-proxy: only the headers marked for the target reach it; its status and body come
        # back
        r = httpx.get(f"{srv.url}/cors-proxy",
                      params={"url": f"http://127.0.0.1:{target.server_port}/capture"},
                      headers={"Cookie": "session=secret", "X-Api-Key": "k",
                               "Proxy-Authorization": "Basic s",
                               "x-llama-server-proxy-header-accept": "application/json",
                               "x-llama-server-proxy-header-authorization": "Bearer explicit"})
        assert r.status_code == 200 and r.text == "ok"
        got = {k.lower(): v for k, v in target.captured.items()}
        assert got["accept"] == "application/json" and got["authorization"] == "Bearer explicit"
        assert not {"cookie", "x-api-key", "proxy-authorization"} & set(got)
        empty = httpx.post(f"{srv.url}/cors-proxy",
                           params={"url": f"http://127.0.0.1:{target.server_port}/"})
        assert empty.status_code == 204 and empty.content == b""
        bad = httpx.get(f"{srv.url}/cors-proxy", params={"url": "file:///etc/passwd"})
        assert bad.status_code == 400 and "http" in bad.json()["error"]["message"]


def test_continue_final_message_and_add_generation_prompt(server, tok):
    """vLLM's request fields: continue_final_message continues the assistant's last message
    (transformers' way: the chat rendered whole, cut after its content); add_generation_prompt false
    renders no new turn; both true is a 400 naming them."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    whole = tok.apply_chat_template(msgs, add_generation_prompt=False)
    r = post(server, "/apply-template", {"messages": msgs, "continue_final_message": True,
                                         "add_generation_prompt": False})
    assert (r.status_code == 200
            and r.json()["prompt"] == whole[:whole.rindex("Hello the") + len("Hello the")])
    r = post(server, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True,
                                              "add_generation_prompt": False, "max_tokens": 2,
                                              "verbose": True})
    assert r.status_code == 200 and r.json()["__verbose"]["prompt"].endswith("Hello the")
    r = post(server, "/apply-template", {"messages": msgs[:1], "add_generation_prompt": False})
    assert r.json()["prompt"] == tok.apply_chat_template(msgs[:1], add_generation_prompt=False)
    bad = post(server, "/v1/chat/completions",
               {"messages": msgs, "continue_final_message": True, "max_tokens": 2})
    assert bad.status_code == 400 and "continue_final_message" in bad.json()["error"]["message"]
    bad = post(server, "/v1/chat/completions",
               {"messages": msgs[:1], "continue_final_message": True,
                                                "add_generation_prompt": False, "max_tokens": 2})
    assert (bad.status_code == 400
            and "the last message must be the assistant's" in bad.json()["error"]["message"])


# ---- scripts/llama_server_compat.py --------------------------------------------------------------


def test_wrapper_translates_llama_server_flags():
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    import llama_server_compat as compat

    argv = ["-m", "m.gguf", "--port", "8080", "--host", "0.0.0.0", "-c", "1024", "-np", "2", "-n",
            "64", "--temp", "0.7", "--top-k", "20", "-s", "-1", "--api-key", "K", "-a", "alias",
            "--jinja", "-ngl", "99", "--flash-attn", "on", "--no-slots", "--slot-save-path",
            "/tmp/s", "--props"]
    ours, warnings = compat.translate(argv)
    # llama-server's default
    assert ours[0] == "m.gguf" and "--reasoning auto" in " ".join(ours)
    assert "--verbose-responses" in compat.translate(["-m", "m.gguf", "-v"])[0]
    assert "--prefill-assistant" in ours and "--prefill-assistant" not in compat.translate(
        ["-m", "m.gguf", "--no-prefill-assistant"])[0]
    assert ("--no-metrics" in ours
            and "--no-metrics" not in compat.translate(["-m", "m.gguf", "--metrics"])[0])
    assert ("--reasoning off" in " ".join(compat.translate(["-m", "m.gguf", "--reasoning",
                                                            "off"])[0]))
    line = " ".join(ours)
    for part in ("--parallel 2", "--max-context 512", "--n-predict 64", "--temp 0.7", "--top-k 20",
                 "--seed -1", "--api-key K", "--model-name alias", "--no-slots",
                 "--slot-save-path /tmp/s", "--props", "--host 0.0.0.0", "--port 8080"):
        assert part in line, part
    assert any("-ngl 99" in w for w in warnings) and any("--flash-attn on" in w for w in warnings)
    ours, _ = compat.translate(["-c", "1024", "-np", "2", "--kv-unified"])
    assert "--max-context 1024" in " ".join(ours)
    ours, dropped = compat.translate(["--temp", "0.5", "--port", "1"], known={"--port"})
    assert ours == ["--port", "1"] and any("--temp" in w for w in dropped)


def _stream(srv, path, body):
    with httpx.stream("POST", srv.url + path, content=json.dumps({**body, "stream": True}),
                      timeout=60, headers={"Content-Type": "application/json", **srv.headers}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_prompt_progress_a_chunk_and_llama_conventions(model, tok):
    """return_progress: one prompt_progress when the prompt gets its slot (processed == cache), then
    one a prompt chunk (16 tokens here), processed rising to the total, before the first token; with
    timings_per_token their timings start at prompt_ms 0. --llama-conventions: the first chat
    chunk's content null, system_fingerprint b..., ignore_eos bans the end-of-generation tokens
    (null biases). And --prefill-assistant's rules: two assistant messages at the end are a 400; the
    continued one's text parts are joined by a blank line."""
    args = [str(model), "--max-context", "256", "--prefill", "16", "--batch-tokens", "16",
            "--llama-conventions", "--prefill-assistant", "--temp", "0"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        prompt = "the quick brown fox jumps over the lazy dog " * 6
        n = len(tok.encode(prompt, add_special=True))
        chunks = _stream(srv, "/completion", {"prompt": prompt, "n_predict": 3,
                                              "return_progress": True, "timings_per_token": True})
        progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
        assert progress[0]["processed"] == progress[0]["cache"] == 0 and progress[0]["total"] == n
        assert ([p["processed"] for p in progress[1:]]
                == [min(16 * (i + 1), n) for i in range((n + 15) // 16)])
        first_token = next(i for i, c in enumerate(chunks) if c.get("tokens"))
        assert all("prompt_progress" in c for c in chunks[:first_token])
        timed = [c["timings"] for c in chunks if "prompt_progress" in c]
        assert (timed[0]["prompt_n"] == 0 and timed[0]["prompt_ms"] == 0.0
                and timed[-1]["prompt_ms"] > 0)
        assert not any("prompt_progress" in c
                       for c in _stream(srv, "/completion", {"prompt": prompt, "n_predict": 2}))

        msgs = [{"role": "user", "content": "Hi " * 30}]
        chat = _stream(srv, "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 2, "return_progress": True,
                                                      "stream_options": {"include_usage": True}})
        assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
        assert chat[0]["system_fingerprint"].startswith("b")
        chat_progress = [c["prompt_progress"] for c in chat if "prompt_progress" in c]
        assert (len(chat_progress) >= 3
                and chat_progress[-1]["processed"] == chat_progress[-1]["total"])
        # the usage chunk, as llama.cpp's
        assert "timings" in chat[-1] and chat[-1]["choices"] == []

        banned = completion(srv, prompt="Hi", n_predict=2,
                            ignore_eos=True)["generation_settings"]["logit_bias"]
        assert (banned and {b["token"] for b in banned} == set(tok.eos_ids)
                and all(b["bias"] is None for b in banned))
        assert completion(srv, prompt="Hi", n_predict=2)["generation_settings"]["logit_bias"] == []

        two = post(srv, "/v1/chat/completions",
                   {"messages": msgs + [{"role": "assistant", "content": "a"}] * 2})
        assert two.status_code == 400 and "assistant" in two.json()["error"]["message"]
        parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
        r = post(srv, "/v1/chat/completions",
                 {"messages": msgs + [{"role": "assistant", "content": parts}],
                                               "max_tokens": 1, "verbose": True})
        assert r.status_code == 200 and r.json()["__verbose"]["prompt"].endswith("Wh\n\nill")


def test_wrapper_maps_batch_size_and_llama_conventions():
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    import llama_server_compat as compat

    line = " ".join(compat.translate(["-m", "m.gguf", "-b", "48"])[0])
    assert "--batch-tokens 48 --prefill 32" in line and "--llama-conventions" in line
    assert ("--prefill 256" in " ".join(compat.translate(["-m", "m.gguf", "--batch-size",
                                                          "2048"])[0]))
    line = " ".join(compat.translate(["-m", "m.gguf", "--host", "127.0.0.1,::1", "-a", "a,b",
                                      "--tags", "x,y", "--no-ui"])[0])
    assert "--host 127.0.0.1,::1" in line and "--model-name a,b" in line and "--tags x,y" in line
    assert ("--no-webui" in line
            and "--no-webui" not in " ".join(compat.translate(["-m", "m.gguf"])[0]))
    # llama-server: CORS localhost
    ours, warnings = compat.translate(["-m", "m.gguf", "--tools", "all"])
    assert "--cors-origins localhost" in " ".join(ours) and any("--tools" in w for w in warnings)
    assert ("--cors-origins *" in " ".join(compat.translate(["-m", "m.gguf", "--tools", "all",
                                                             "--cors-origins", "*"])[0]))
