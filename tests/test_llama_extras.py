"""llama.cpp's /tokenize, /detokenize and /props, and the latency histograms and cache gauges on
/metrics (issue 16, items 5 and 6), against the real server as a process (`python -m strata_jax
serve`) on a tiny qwen3 model whose tokenizer adds BOS (so add_special shows). One server for the
module."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from prometheus_client.utils import floatToGoString

from strata_jax.gguf import load_tokenizer
from strata_jax.serve.http.latency import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS
from strata_jax.serve.launch import ServerProcess

N_CTX, PARALLEL = 256, 2
TEXT = "Hello wörld 媽 and emoji 🤗 <|im_start|>user"


@pytest.fixture(scope="module")
def model(bos_model):
    return bos_model


@pytest.fixture(scope="module")
def tok(model):
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def server(model):
    with ServerProcess([str(model), "--parallel", str(PARALLEL), "--max-context", str(N_CTX),
                        "--model-name", "tiny"]) as srv:
        srv.wait_ready()
        yield srv


def post(server, path, body):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json"},
                      timeout=60)


# ---- /tokenize, /detokenize ----------------------------------------------------------------------


def test_tokenize_round_trip_is_the_engine_tokenizers(server, tok):
    r = post(server, "/tokenize", {"content": TEXT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == tok.encode(TEXT, add_special=False) and len(ids) > 10
    # parse_special: true by default (llama.cpp's)
    assert tok.token_to_id("<|im_start|>") in ids
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"content": tok.decode(ids)}
    assert tok.decode(ids) == TEXT

    with_bos = post(server, "/tokenize", {"content": TEXT, "add_special": True}).json()["tokens"]
    assert with_bos == [tok.bos_id] + ids
    plain = post(server, "/tokenize", {"content": TEXT, "parse_special": False}).json()["tokens"]
    assert plain == tok.encode(TEXT, add_special=False, parse_special=False) and plain != ids

    # llama.cpp's mixed content: texts and ids in order, BOS only before a leading text
    mixed = post(server, "/tokenize",
                 {"content": ["Hello", 7, " there"], "add_special": True}).json()["tokens"]
    assert (mixed == [tok.bos_id, *tok.encode("Hello", add_special=False), 7,
                      *tok.encode(" there", add_special=False)])
    assert post(server, "/tokenize",
                {"content": [7, "Hi"], "add_special": True}).json()["tokens"] == \
        [7, *tok.encode("Hi", add_special=False)]
    # llama.cpp's answers to a body without the field
    assert post(server, "/tokenize", {}).json() == {"tokens": []}
    assert post(server, "/detokenize", {}).json() == {"content": ""}


def test_tokenize_with_pieces(server, tok):
    r = post(server, "/tokenize", {"content": TEXT, "with_pieces": True})
    assert r.status_code == 200, r.text
    pieces = r.json()["tokens"]
    assert [p["id"] for p in pieces] == tok.encode(TEXT, add_special=False)
    partial = 0
    for p in pieces:
        raw = tok.token_bytes(p["id"])
        # part of a character: its bytes, as llama.cpp gives them
        if isinstance(p["piece"], list):
            partial += 1
            assert bytes(p["piece"]) == raw
            with pytest.raises(UnicodeDecodeError):
                raw.decode("utf-8")
        else:
            assert p["piece"].encode("utf-8") == raw and p["piece"]
    assert partial >= 2                           # this byte-level vocabulary splits ö, 媽 and 🤗


@pytest.mark.parametrize("path, body, param, shown", [
    ("/tokenize", {"content": 5}, "content", "content = 5"),
    ("/tokenize", {"content": ["a", True]}, "content", "content[1] = true"),
    ("/tokenize", {"content": ["a", 1.5]}, "content", "content[1] = 1.5"),
    # the vocabulary is 0..511
    ("/tokenize", {"content": ["a", 512]}, "content", "content[1] = 512"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces", 'with_pieces = "yes"'),
    ("/tokenize", {"content": "a", "add_special": 1}, "add_special", "add_special = 1"),
    ("/detokenize", {"tokens": "abc"}, "tokens", 'tokens = "abc"'),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens", "tokens[1] = 99999"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens", "tokens[1] = -1"),
    ("/detokenize", {"tokens": [2 ** 70]}, "tokens", f"tokens[0] = {2 ** 70}"),
    ("/detokenize", {"tokens": [None]}, "tokens", "tokens[0] = null"),
    ("/detokenize", [1, 2], None, "the request body is [1,2]"),
    ("/tokenize", b"{not json", None, "not valid JSON"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param, shown):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"] == "invalid_request_error" and err.get("param") == param
            and shown in err["message"]), err


def test_props_are_the_servers_settings(server, model):
    r = httpx.get(server.url + "/props", timeout=30)
    assert r.status_code == 200, r.text
    props = r.json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == N_CTX and settings["speculative"] is False
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    assert settings["params"]["n_predict"] == -1 and settings["params"]["repeat_last_n"] == 64
    assert props["total_slots"] == PARALLEL and props["model_alias"] == "tiny"
    # its name, never its folder
    assert props["model_path"] == model.name and ".gguf" in props["model_path"]
    assert (props["chat_template"] == load_tokenizer(model).chat_template
            and "im_start" in props["chat_template"])
    assert (props["bos_token"], props["eos_token"]) == ("<|endoftext|>", "<|im_end|>")
    assert props["build_info"].startswith("strata-jax ")
    # --seed: what a /completion without a seed samples with
    assert settings["params"]["seed"] == 0


# ---- /metrics ------------------------------------------------------------------------------------


def scrape(server) -> str:
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


def value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} is not on /metrics"
    return float(m.group(1))


HISTOGRAMS = {"strata_time_to_first_token_seconds": TTFT_BUCKETS,
              "strata_inter_token_latency_seconds": ITL_BUCKETS,
              "strata_request_time_per_output_token_seconds": ITL_BUCKETS,
              "strata_e2e_request_latency_seconds": REQUEST_BUCKETS,
              "strata_request_queue_time_seconds": REQUEST_BUCKETS}


def test_latency_histograms_and_cache_counters(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    before = scrape(server)
    messages = [{"role": "user", "content": "Tell me about rivers and the sea."}]
    start = time.monotonic()
    answers = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                              temperature=0,
                                              extra_body={"ignore_eos": True}) for _ in range(3)]
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                            stream=True,
                                            temperature=0, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    # a streamed request is counted as its stream closes, a moment after the client read [DONE]
    end = time.monotonic() + 10
    while (value(after := scrape(server), "strata_e2e_request_latency_seconds_count")
           < value(before, "strata_e2e_request_latency_seconds_count") + 4
           and time.monotonic() < end):
        time.sleep(0.05)
    wall = time.monotonic() - start
    # requests: 3 chats of 6 tokens, a streamed completion of 5
    n = 4
    usages = [a.usage for a in answers] + [chunks[-1].usage]
    assert [u.completion_tokens for u in usages] == [6, 6, 6, 5]

    for name, bounds in HISTOGRAMS.items():
        assert f"# TYPE {name} histogram" in after
        les = re.findall(rf'^{name}_bucket{{le="([^"]+)"}} ', after, re.MULTILINE)
        assert les == [floatToGoString(b) for b in bounds] + ["+Inf"], name
        grew = value(after, f"{name}_count") - value(before, f"{name}_count")
        want = 3 * (6 - 1) + (5 - 1) if name == "strata_inter_token_latency_seconds" else n
        assert grew == want, (name, grew, want)
        assert value(after, f'{name}_bucket{{le="+Inf"}}') == value(after, f"{name}_count")

    ttft = (value(after, "strata_time_to_first_token_seconds_sum")
            - value(before, "strata_time_to_first_token_seconds_sum"))
    e2e = (value(after, "strata_e2e_request_latency_seconds_sum")
           - value(before, "strata_e2e_request_latency_seconds_sum"))
    assert 0 < ttft < e2e < wall, (ttft, e2e, wall)
    itl = (value(after, "strata_inter_token_latency_seconds_sum")
           - value(before, "strata_inter_token_latency_seconds_sum"))
    assert 0 < itl < e2e - ttft + 1e-3

    # vLLM's prefix-cache counters, in prompt tokens: the same chat thrice reuses its prefix
    queries = (value(after, "strata_prefix_cache_queries_total")
               - value(before, "strata_prefix_cache_queries_total"))
    hits = (value(after, "strata_prefix_cache_hits_total")
            - value(before, "strata_prefix_cache_hits_total"))
    assert queries == sum(u.prompt_tokens for u in usages)
    assert hits == sum(u.prompt_tokens_details.cached_tokens for u in usages) > 0
    assert value(after, "strata_kv_cache_usage_perc") == 0.0             # nothing runs now


def test_kv_cache_usage_while_a_request_runs(server, tok):
    """From its first token on a request holds its prompt's KV. The tiny model decodes 200 tokens in
    a fraction of a second on a quiet machine, faster than a streamed answer's lines were read and
    scraped (this was flaky then): so the request runs on a thread while /metrics is scraped in a
    loop, and the largest value counts. /metrics reads the engine's stats with a timeout and shows
    the last known ones after it."""
    import threading

    prompt = "Once upon a time"
    body = {"prompt": prompt, "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    done = threading.Event()

    def run():               # a few in a row: a longer time to scrape in, one slot busy at a time
        try:
            for _ in range(4):
                httpx.post(server.url + "/v1/completions", json=body, timeout=60).raise_for_status()
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    seen = []
    while not done.is_set():
        seen.append(value(scrape(server), "strata_kv_cache_usage_perc"))
    thread.join()
    n_prompt = len(tok.encode(prompt))
    assert (seen and n_prompt / (PARALLEL * N_CTX) <= max(seen)
            <= (n_prompt + 240) / (PARALLEL * N_CTX)), seen
    assert value(scrape(server), "strata_kv_cache_usage_perc") == 0.0


def test_the_engine_process_runs_decode_windows_ahead(server):
    """Run-ahead decode (engine/execute/run_ahead.py) in the real engine process, the server's
    defaults: a greedy answer's decode windows are dispatched ahead and taken (/metrics' counters),
    and the streamed answer is the same text as the whole one."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    before = scrape(server)
    kw = {"model": "tiny", "prompt": "Rivers run to the sea and", "max_tokens": 24,
          "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == whole
    after = scrape(server)
    ran = (value(after, "strata_engine_windows_ahead")
           - value(before, "strata_engine_windows_ahead"))
    taken = (value(after, "strata_engine_windows_ahead_taken")
             - value(before, "strata_engine_windows_ahead_taken"))
    # 24 tokens each: the prompt's window gives the first, 23 decode windows the rest, of which all
    # but the last (its token ends the answer by length) dispatch the next one, unless a job for the
    # engine (a stats poll) was waiting at that window
    assert 22 <= taken <= ran <= 2 * 22, (ran, taken)
