"""Structured output (issue 16, item 2): OpenAI's response_format (json_object, json_schema),
llama.cpp's grammar (GBNF) and json_schema fields, against the real server (a process) with the
official openai client, on a made model with random weights. Its outputs are nonsense, so what is
checked is that the grammar holds every time (jsonschema validates 100 sampled answers), that the
request stops when the grammar is complete, and that rows without a grammar get the very tokens they
get alone, in windows where other rows are masked."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from tool_data import TIME, WEATHER

from strata_jax.serve.launch import ServerProcess
from strata_jax.testing.templates import HERMES_TEMPLATE

N_CTX = 1024
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "count", "ok", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me about a cat", "Describe the sea", "What is 2 + 2?", "List three colours", "Hi"]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="qwen3", layers=2, hidden=64)


@pytest.fixture(scope="module")
def server(model):
    # The default (int8) math. Its 12 free greedy answers once changed when they shared windows with
    # the 100 constrained rows (issue 33): XLA's mean in qwen3's q/k norms gave a token other bits
    # in a window of 64 or more tokens (1 ulp, which 8-bit activations turn into other tokens);
    # those norms now run in the cpu kernels' fixed order (model/transformer.py).
    with ServerProcess([str(model), "--parallel", "8", "--max-context", str(N_CTX), "--model-name",
                        "tiny"]) as srv:
        srv.wait_up().wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def free_text(client, i: int) -> str:
    """An unconstrained greedy answer of a fixed length (the reference rows)."""
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[i % 5] + f" #{i}"}],
                                       max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    return r.choices[0].message.content


def schema_answer(client, i: int):
    """A sampled answer under the strict JSON schema (seed i: each try differs)."""
    fmt = {"type": "json_schema",
           "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    return client.chat.completions.create(model="tiny",
                                          messages=[{"role": "user", "content": PROMPTS[i % 5]}],
                                          max_tokens=120, temperature=1.0, seed=i,
                                          response_format=fmt)


def test_json_schema_holds_100_times_and_leaves_other_rows_alone(client):
    with ThreadPoolExecutor(8) as pool:
        alone = list(pool.map(lambda i: free_text(client, i), range(12)))
    # 100 constrained requests and the 12 free ones, interleaved (a free one after every 8
    # constrained: they share windows)
    with ThreadPoolExecutor(16) as pool:
        jobs, free = [], []
        for i in range(100):
            jobs.append(pool.submit(schema_answer, client, i))
            if i % 8 == 7 and len(free) < 12:
                free.append(pool.submit(free_text, client, len(free)))
        answers = [j.result() for j in jobs]
        mixed = [f.result() for f in free]
    # the masks of other rows changed no token of these
    assert mixed == alone
    finishes = {}
    for r in answers:
        choice = r.choices[0]
        finishes[choice.finish_reason] = finishes.get(choice.finish_reason, 0) + 1
        # the grammar was complete: it stopped there
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # sampled: not one answer 100 times
    assert len({r.choices[0].message.content for r in answers}) > 10


def test_streamed_schema_answer_is_the_whole_one(client):
    whole = schema_answer(client, 7).choices[0].message.content
    fmt = {"type": "json_schema",
           "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    chunks = list(client.chat.completions.create(model="tiny",
                                                 messages=[{"role": "user", "content": PROMPTS[2]}],
                                                 max_tokens=120, temperature=1.0, seed=7,
                                                 response_format=fmt, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object_and_llama_cpp_fields(client, server):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=60,
                                       temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    # llama.cpp's grammar (GBNF), on completions and chat
    gbnf = 'root ::= ("yes" | "no") "." [0-9]'
    for i in range(4):
        c = client.completions.create(model="tiny", prompt="Is it?", max_tokens=20, temperature=1.0,
                                      seed=i, extra_body={"grammar": gbnf})
        assert (c.choices[0].text[:-1] in ("yes.", "no.")
                and c.choices[0].text[-1].isdigit()), c.choices[0].text
        assert c.choices[0].finish_reason == "stop"
    # llama.cpp's json_schema field, and its schema beside json_object
    small = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9, "minimum": 0}},
             "required": ["a"], "additionalProperties": False}
    for body in ({"json_schema": small},
                 {"response_format": {"type": "json_object", "schema": small}}):
        got = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30, "temperature": 0,
            **body}).json()
        jsonschema.validate(json.loads(got["choices"][0]["message"]["content"]), small)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "object",
      "properties": 5}}}}, "response_format"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"json_schema": {"type": "strange"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema"),
])
def test_a_schema_it_cannot_compile_is_a_400_naming_it(server, body, field):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    # and the server goes on
    ok = httpx.post(server.url + "/v1/completions", timeout=60,
                    json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


# ---- tool calling (issue 16, item 1): the made model's template knows no tools: llama.cpp's
# generic way ----

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def forced_call(client, i: int, choice="required"):
    return client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice=choice, max_tokens=80, temperature=1.0,
                                          seed=i, parallel_tool_calls=False)


def test_tool_choice_required_gives_a_valid_call_100_times(client):
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: forced_call(client, i), range(100)))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for r in answers:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = forced_call(client, 1,
                        {"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert named.message.tool_calls[0].function.name == "get_time"


def round_trip(client, stream: bool):
    """A forced call, its result fed back as a tool message, then the answer (tool_choice none)."""
    kw = {"model": "tiny", "tools": [WEATHER], "max_tokens": 60, "temperature": 1.0, "seed": 3,
          "parallel_tool_calls": False}
    if stream:
        chunks = list(client.chat.completions.create(messages=ASK, tool_choice="required",
                                                     stream=True, **kw))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        call = {"id": deltas[0].id, "type": "function", "function": {
            "name": deltas[0].function.name,
            "arguments": "".join(d.function.arguments or "" for d in deltas)}}
    else:
        msg = client.chat.completions.create(messages=ASK, tool_choice="required",
                                             **kw).choices[0].message
        call = msg.tool_calls[0].model_dump()
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"],
                       "content": '{"temperature": 21}'}]
    if stream:
        chunks = list(client.chat.completions.create(messages=messages, tool_choice="none",
                                                     stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        answer = client.chat.completions.create(messages=messages, tool_choice="none",
                                                **kw).choices[0]
        text, reason = answer.message.content, answer.finish_reason
        assert not answer.message.tool_calls
    assert isinstance(text, str) and text and reason in ("stop", "length")
    return call


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(client, stream):
    round_trip(client, stream)


def test_same_forced_call_streamed_and_whole(client):
    whole = forced_call(client, 5).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME],
                                                 tool_choice="required", max_tokens=80,
                                                 temperature=1.0, seed=5, stream=True,
                                                 parallel_tool_calls=False))
    assert one_call(chunks)[1:] == (whole.function.name, whole.function.arguments)


def one_call(chunks) -> tuple[str, str, str]:
    """A streamed answer's one call: (id, name, arguments), from its first piece and its argument
    pieces."""
    pieces = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert pieces and all(p.index == 0 for p in pieces) and all(p.id is None for p in pieces[1:])
    return (pieces[0].id, pieces[0].function.name,
            "".join(p.function.arguments or "" for p in pieces))


@pytest.mark.parametrize("body, field", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_tool_fields_are_400s(server, body, field):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


# ---- a template that renders the tools (Hermes / Qwen's way): <tool_call>{json}</tool_call> ----

@pytest.fixture(scope="module")
def hermes_client(model, tmp_path_factory):
    from strata_jax.testing.edit_gguf import rewrite_gguf

    path = rewrite_gguf(model, tmp_path_factory.mktemp("hermes") / "hermes.gguf",
                        set_metadata={"tokenizer.chat_template": HERMES_TEMPLATE})
    with ServerProcess([str(path), "--parallel", "4", "--max-context", str(N_CTX), "--model-name",
                        "tiny", "--cpu-math", "exact"]) as srv:
        srv.wait_up().wait_ready()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_hermes_template_calls_whole_streamed_and_round_trip(hermes_client):
    kw = {"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
          "max_tokens": 80, "temperature": 1.0, "parallel_tool_calls": False}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: hermes_client.chat.completions.create(seed=i, **kw),
                                range(16)))
    for r in answers:
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(hermes_client.chat.completions.create(seed=0, stream=True, **kw))
    whole = answers[0].choices[0].message.tool_calls[0]
    assert one_call(chunks)[1:] == (whole.function.name, whole.function.arguments)
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [whole.model_dump()]},
                      {"role": "tool", "tool_call_id": whole.id, "content": '{"temperature": 21}'}]
    answer = hermes_client.chat.completions.create(**{**kw, "messages": messages,
                                                      "tool_choice": "none",
                                                      "max_tokens": 20}).choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
