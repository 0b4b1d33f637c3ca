"""A fuzzer for four generation routes (issue 13, item 9): the two completion routes,
Anthropic's Messages (`/v1/messages`) and OpenAI's Responses (`/v1/responses`). Hypothesis
generates thousands of request bodies (valid ones, every field out of range or of the wrong type,
huge numbers, edge floats, lone surrogates, deep nesting, duplicated keys, non-object JSON, bytes
that are not UTF-8, truncated JSON, bodies near the size limit) and sends them to one real server
process. Every answer must be a 200, a 4xx in the route's error shape, or a 503 with Retry-After
(load shedding); never another 5xx, a hang or a dropped connection. The completion routes answer
in OpenAI's shape (a stream ends in `data: [DONE]`, an error event inside it in OpenAI's shape and
not a server error); `/v1/messages` in Anthropic's (errors `{"type": "error", "error": {"type",
"message"}}`, a stream ends with `event: message_stop` or an `event: error` in that shape, a whole
answer is a "message"); `/v1/responses` has OpenAI's errors, a stream ends with
`response.completed`, `response.incomplete` or `response.failed`, a whole answer is a "response".
After them an ordinary request is served and the engine never restarted.

The summary (bodies tried, answers by status, and by route and status) is printed (`pytest -s`)
and written to $TMPDIR/strata-jax-fuzz.json. STRATA_FUZZ_KEEP_GOING=1 records every failing body
instead of stopping at the first (hypothesis then does not shrink): for hunting several bugs in one
run.
STRATA_FUZZ_CORPUS=FILE writes every body sent and the status it got (JSON lines), which
scripts/fuzz_replay.py sends again to another build of the server and compares, status by status (a
refactoring's check that the HTTP answers stay the same).
"""

from __future__ import annotations

import base64
import collections
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from strata_jax.serve.http.messages_answer import ERROR_TYPES
from strata_jax.serve.launch import ServerProcess

N_CTX = 256
VOCAB = 512                       # make_model's default vocabulary
MAX_BODY = 8 << 20                # the server's default --max-body-bytes
EXAMPLES = 3000
MIN_TRIED = 2000
MODEL = "fuzz"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
CHAT, TEXT, MESSAGES, RESPONSES = ROUTES
SUMMARY = Path(tempfile.gettempdir()) / "strata-jax-fuzz.json"
KEEP_GOING = os.environ.get("STRATA_FUZZ_KEEP_GOING") == "1"
CORPUS = os.environ.get("STRATA_FUZZ_CORPUS")
# bodies near the 8 MiB limit: a few, each costs the server a full read
HUGE_BODIES = 6


@pytest.fixture(scope="module")
def server(tiny_model):
    model = tiny_model(arch="qwen3", layers=2, hidden=64)
    args = [str(model), "--parallel", "2", "--max-context", str(N_CTX), "--model-name", MODEL]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        yield srv


# ---- values --------------------------------------------------------------------------------------

SPECIAL_TEXT = ["\x00", "\u202e", "\u200f", "\ufeff", "😀", "👩‍👩‍👧", "\U0010ffff", "\r\n", "\\",
                '"', "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
                "{{ 7*7 }}", "{% raw %}", "%s%n", "\ud800",
                # lone surrogates: escaped ("\ud800") or as bytes that are not UTF-8, by the case
                "a\udc00"]
text = st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL_TEXT),
                 st.lists(st.sampled_from(SPECIAL_TEXT) | st.text(max_size=5),
                          max_size=6).map("".join))
INT_EDGES = [0, -1, 1, 2, 5, 255, 256, 257, 511, 512, 513, 2**15, 2**16, 2**24, 2**24 + 1,
             2**31 - 1, 2**31,
             2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**31) - 1,
             -(2**63), -(2**63) - 1, -(2**64), 10**30, -(10**30), 10**400]
FLOAT_EDGES = [0.0, -0.0, 1e-300, 5e-324, -5e-324, 1e-6, 1e-5, 0.5, 0.999999, 1.0, 1.0000001, 2.0,
               99.9, 100.0,
               100.0001, 1e10, 1e308, -1e308, -1.0, float("nan"), float("inf"), float("-inf")]
scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(INT_EDGES), st.floats(),
                   st.sampled_from(FLOAT_EDGES), text)
wild = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(text, inner, max_size=4),
                    max_leaves=8)

# Raw JSON text put in place of a value: what json.dumps cannot write, or writes only one way.
DEEP = 10_000
RAW_VALUES = ["1e999", "-1e999", "1E400", "1e308", "-0.0", "-0", "5e-324", "2.4e-324", "4.9e-324",
              "1e-400", "123456789012345678901234567890123", "-99999999999999999999999999",
              "18446744073709551616", "9223372036854775808", "NaN", "Infinity", "-Infinity", "0x10",
              "01", "1.", ".5", "+1", "1e", "--1", '"\\ud800"', '"\\udfff"', '"\\udfff\\ud800"',
              '"a\\ud800b"', '"\\u0000"', '"\\ud83d\\ude00"', '"\\u202e\\u200f"', '"\\x41"',
              '"\\u12"', '"\t"', "true", "false", "null", '""', "[]", "{}",
              '[{"type": "text", "text": "\\ud800"}]', '[{"role": "user", "content": "\\udc00"}]',
              "[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP, "[" * DEEP,
              '{"a":' * DEEP, '[{"role": "user", "content": ' + "[" * DEEP + "]" * DEEP + "}]",
              '{"include_usage": ' + "[" * DEEP + "]" * DEEP + "}"]
NOT_OBJECTS = ["[]", "[1, 2]", '[{"role": "user", "content": "hi"}]', "0", "-1", "1e999", '"hello"',
               '"\\ud800"', "null", "true", "false", " ", "\n", "", "{", "}", "{}", '{"": 1}',
               "[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP, "\ufeff{}",
               '{"messages": [], }', "{'prompt': 'hi'}", '{"prompt": "hi"} trailing',
               '{"prompt": "hi"}{"prompt": "hi"}']
BAD_BYTES = [b"\xff", b"\xfe\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xed\xbf\xbf",
             b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82", b"\xf0\x9f\x98", b"\x00"]

CONTROL_FIELDS = ["logit_bias", "presence_penalty", "frequency_penalty", "repeat_penalty",
                  "repeat_last_n"]
# structured output (issue 16)
STRUCTURED_FIELDS = ["response_format", "grammar", "json_schema"]
CHAT_FIELDS = ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
               "min_p", "seed", "stop", "n", "stream", "stream_options", "ignore_eos",
               "chat_template_kwargs", "reasoning_format", "model", "logprobs", "top_logprobs",
               "tools", "tool_choice", "parallel_tool_calls"] + CONTROL_FIELDS + STRUCTURED_FIELDS
TEXT_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
               "n", "stream", "stream_options", "ignore_eos", "echo", "model",
               "logprobs"] + CONTROL_FIELDS + STRUCTURED_FIELDS
MESSAGES_FIELDS = ["model", "messages", "max_tokens", "system", "stop_sequences", "temperature",
                   "top_p", "top_k", "stream", "thinking", "tools", "tool_choice", "metadata",
                   "service_tier", "cache_control"]
RESPONSES_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                    "stream", "store", "tools", "tool_choice", "text", "reasoning", "metadata",
                    "previous_response_id", "truncation", "parallel_tool_calls", "seed", "stop",
                    "top_k", "include", "background"]
FIELDS = {CHAT: CHAT_FIELDS, TEXT: TEXT_FIELDS, MESSAGES: MESSAGES_FIELDS,
          RESPONSES: RESPONSES_FIELDS}
IGNORED_FIELDS = ["user", "suffix", "best_of"]

# A field's value at the edge of its shape: lists too long, strings too long, token ids outside the
# vocabulary.
SHAPE_EDGES = {
    "stop": [["s"] * 16, ["s"] * 17, ["s"] * 1000, "x" * 512, "x" * 513, ["x" * 513], [""], "",
             [None], [["a"]], ["é" * 512], ["😀" * 513]],
    "prompt": [[-1], [VOCAB], [VOCAB - 1], [2**31], [-(2**31) - 1], [2**63], [2**64], [0] * 300,
               [0] * (N_CTX - 1),
               [True], [1.5], ["a", 1], [1, "a"], ["a", "b"], [[1]], [], "", [""], " " * 2000,
               "a" * 100_000, "😀" * 300, {"text": "a"}],
    "messages": [[], [{}], [{"role": "user"}], [{"content": "hi"}],
                 [{"role": "user", "content": None}],
                 [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
                 [{"role": "user", "content": []}],
                 [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": [{"text": "hi"}]}],
                 [{"role": "user", "content": "hi"}] * 500,
                 [{"role": "user", "content": "a" * 100_000}], [{"role": "USER", "content": "hi"}],
                 [{"role": "user", "content": "hi", "tool_calls": "x"}],
                 {"role": "user", "content": "hi"},
                 [{"role": "assistant", "content": "hi", "tool_calls": [{"id": 2**64}]}],
                 [{"role": "assistant", "content": None,
                   "tool_calls": [{"function": {"arguments": -(10**30)}}]}],
                 [{"role": "tool", "content": "1", "tool_call_id": "x" * 10_000,
                   "name": "\u202e"}]],
    "chat_template_kwargs": [{"chat_template": "{{ 7*7 }}"}, {"messages": []},
                             {"add_generation_prompt": False},
                             {"tools": [1]}, {"bos_token": "x"}, {"enable_thinking": {"a": [1]}},
                             {"x" * 10_000: 1}, {"": None}, [], "enable_thinking", {"x": 2**64},
                             {"x": -(2**63) - 1},
                             {"x": [10**30]}, {"x": {"y": 2**64 - 1}}, {"x": 1e308}],
    "stream_options": [{}, {"include_usage": None}, {"include_usage": 1},
                       {"continuous_usage_stats": True}, []],
    "logit_bias": [{"1": 1e308}, {"-1": 5}, {str(2**64): 1}, {"a": "b"}],
    "response_format": [{"type": "json_object"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {
                        "schema": {"type": "strange"}}},
                        {"type": "json_schema", "json_schema": {"schema": True}},
                        {"type": "json_object", "schema": {"$ref": "#/nowhere"}}, {"type": "xml"},
                        {"type": None}],
    "grammar": ["", 'root ::= "a"', "root ::= missing", "root ::= " + "(" * 200, "x" * 200_000],
    "json_schema": [{}, True, False, {"type": "array", "items": {"type": "integer"}},
                    {"enum": []}, [1]],
    "tools": [[], [{}], [1], [{"type": "function", "function": {"name": "f"}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "strange"}}}]],
    "tool_choice": ["required", "none", "x", {"type": "function", "function": []},
                    {"function": {"name": "f"}}, 5],
}

# The same for the Messages and Responses routes (over SHAPE_EDGES for a key both have).
ROUTE_SHAPES: dict[str, dict[str, list[Any]]] = {
    MESSAGES: {
        "messages": [[], [{}], [{"role": "user"}], [{"role": "system", "content": "hi"}],
                     [{"role": "user", "content": []}], [{"role": "user", "content": [{}]}],
                     [{"role": "user", "content": [{"type": "image"}]}],
                     [{"role": "user", "content": [{"type": "tool_result"}]}],
                     [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                    "content": [{"type": "text", "text": "a"}]}]}],
                     [{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                         "name": "f", "input": {"a": 2**64}}]}],
                     [{"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]}],
                     [{"role": "assistant", "content": "hi"}],
                     [{"role": "user", "content": [{"type": "redacted_thinking"}]}],
                     [{"role": "user", "content": "hi"}] * 500,
                     [{"role": "user", "content": "a" * 100_000}]],
        "system": ["", [], [{"type": "text"}], [{"type": "image", "text": "a"}], "x" * 100_000,
                   [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]],
        "stop_sequences": [[], [""], ["s"] * 16, ["s"] * 17, ["s"] * 1000, ["x" * 513], [None],
                           "s"],
        "thinking": [{"type": "enabled"}, {"type": "enabled", "budget_tokens": -1},
                     {"type": "enabled", "budget_tokens": 2**24 + 1},
                     {"type": "enabled", "budget_tokens": 0}, {"type": "adaptive"},
                     {"type": "disabled", "budget_tokens": 5}, {"type": "x"}, {}, "enabled"],
        "tools": [[], [{}], [{"name": "f"}], [{"name": "f", "input_schema": {"type": "strange"}}],
                  [{"name": "f", "input_schema": True}],
                  [{"name": "", "input_schema": {"type": "object"}}],
                  [{"name": "f", "input_schema": {"type": "object"}, "type": "bash_20250124"}],
                  [{"name": "f", "input_schema": {"type": "object"}}] * 2],
        "tool_choice": [{"type": "tool"}, {"type": "tool", "name": "nowhere"}, {"type": "any"},
                        {"type": "none"}, {"type": "x"}, "auto", {}],
        "metadata": [{}, {"user_id": None}, {"user_id": "x" * 10_000}, {"other": 1}, []],
    },
    RESPONSES: {
        "input": [[], [{}], "", [{"role": "user"}], [{"role": "system", "content": "hi"}],
                  [{"type": "message", "role": "user", "content": [{"type": "input_text"}]}],
                  [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
                  [{"type": "function_call_output", "call_id": "x", "output": "1"}],
                  [{"type": "function_call", "call_id": "x", "name": "f", "arguments": "{"}],
                  [{"type": "reasoning", "summary": []}], [{"type": "item_reference", "id": "x"}],
                  [{"role": "user", "content": "hi"}] * 500, "a" * 100_000, {"role": "user"}],
        "tools": [[], [{}], [{"type": "function"}], [{"type": "web_search"}],
                  [{"type": "function", "name": "f", "parameters": {"type": "strange"}}],
                  [{"type": "function", "name": "f", "parameters": {"type": "object"}}] * 2],
        "tool_choice": ["required", "none", "x", {"type": "function"},
                        {"type": "function", "name": "nowhere"}, 5],
        "text": [{}, {"format": {"type": "json_schema"}}, {"format": {"type": "xml"}},
                 {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strange"}}},
                 {"format": {"type": "json_schema", "name": "x", "schema": True}},
                 {"verbosity": "low"}, "json"],
        "reasoning": [{}, {"effort": "x"}, {"effort": None}, {"summary": "auto"}, "high"],
        "previous_response_id": ["", "resp_nowhere", "x" * 10_000],
        "truncation": ["auto", "disabled", None, 1],
        "metadata": [{}, {"k": 1}, {"x" * 100: "v"}, {str(i): "v" for i in range(17)}, []],
        "include": [[], ["reasoning.encrypted_content"], ["x"]],
    },
}

# ---- valid bodies --------------------------------------------------------------------------------

part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
    "content": text | st.lists(part, min_size=1, max_size=3)})
stop = text.filter(bool) | st.lists(text.filter(bool), max_size=4)
sampling = {
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0.0, 2.0) | st.sampled_from([0.0, 1e-6, 1e-5, 1.0]),
    "top_p": st.floats(0.0, 1.0) | st.sampled_from([1e-9, 1.0]),
    "top_k": st.integers(-1, VOCAB + 10),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.integers(-1, 2**63 - 1),
    "stop": stop,
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "model": st.sampled_from([MODEL, "model.gguf", "model"]),
    "user": text,
    "logprobs": st.booleans(),
    "response_format": st.just({"type": "text"}),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB).map(str), st.integers(-100, 100),
                                  max_size=3),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repeat_penalty": st.floats(0.5, 2.0),
    "repeat_last_n": st.integers(-1, 64),
    "tools": st.just([{"type": "function",
                       "function": {"name": "f", "parameters": {"type": "object"}}}]),
}
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3)},
    optional={**sampling, "max_completion_tokens": st.integers(1, 4),
              "chat_template_kwargs": st.dictionaries(
                  st.sampled_from(["enable_thinking", "x", "date", "chat_template", "messages",
                                   "add_generation_prompt", "tools", "eos_token"]),
                  st.booleans() | text, max_size=2),
              "reasoning_format": st.sampled_from(["auto", "deepseek", "none"])})
prompt = st.one_of(text.filter(bool), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
                   st.lists(text.filter(bool), min_size=1, max_size=1))
text_body = st.fixed_dictionaries({"prompt": prompt}, optional={**sampling, "echo": st.booleans()})


def _coherent(body: dict[str, Any], tools: str) -> dict[str, Any]:
    """A valid body's fields that must agree: a tool_choice has its tools; a thinking budget is
    under max_tokens, and thinking forces no tool."""
    if "tool_choice" in body and tools not in body:
        body = {k: v for k, v in body.items() if k != "tool_choice"}
    thinking = body.get("thinking") or {}
    if thinking.get("type") == "enabled":
        body["thinking"] = {**thinking,
                            "budget_tokens": min(thinking["budget_tokens"], body["max_tokens"] - 1)}
        if (body.get("tool_choice") or {}).get("type") in ("any", "tool"):
            body["tool_choice"] = {"type": "auto"}
    return body


anthropic_content = text | st.lists(part, min_size=1, max_size=3)
messages_body = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 16),
     "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                 "content": anthropic_content}),
                          min_size=1, max_size=2)},
    optional={"system": text | st.lists(part, min_size=1, max_size=2),
              "stop_sequences": st.lists(text.filter(bool), max_size=4),
              "temperature": st.floats(0.0, 1.0),
              "top_p": st.floats(0.0, 1.0) | st.sampled_from([1e-9, 1.0]),
              "top_k": st.integers(1, VOCAB + 10),
              "stream": st.booleans(),
              "thinking": st.fixed_dictionaries({"type": st.just("enabled"),
                                                 "budget_tokens": st.integers(0, 8)})
              | st.just({"type": "disabled"}),
              "tools": st.just([{"name": "f", "description": "a function",
                                 "input_schema": {"type": "object",
                                                  "properties": {"a": {"type": "string"}}}}]),
              "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                              {"type": "tool", "name": "f"}]),
              "metadata": st.fixed_dictionaries({}, optional={"user_id": text})}
).map(lambda body: _coherent(body, "tools"))
responses_body = st.fixed_dictionaries(
    {"model": st.just(MODEL),
     "input": text | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": text}),
                              min_size=1, max_size=2)},
    optional={"instructions": text,
              "max_output_tokens": st.integers(1, 16),
              "temperature": st.floats(0.0, 2.0),
              "top_p": st.floats(0.0, 1.0) | st.sampled_from([1e-9, 1.0]),
              "stream": st.booleans(),
              "store": st.booleans(),
              "tools": st.just([{"type": "function", "name": "f",
                                 "parameters": {"type": "object",
                                                "properties": {"a": {"type": "string"}}}}]),
              "tool_choice": st.sampled_from(["auto", "none", "required"]),
              "text": st.just({"format": {"type": "json_object"}}),
              "reasoning": st.fixed_dictionaries(
                  {"effort": st.sampled_from(["none", "minimal", "low", "medium", "high"])})}
).map(lambda body: _coherent(body, "tools"))
VALID = {CHAT: chat_body, TEXT: text_body, MESSAGES: messages_body, RESPONSES: responses_body}


def _valid(route: str) -> st.SearchStrategy[dict[str, Any]]:
    return VALID[route]


def _pairs_text(pairs: list[tuple[str, str]]) -> str:
    """An object's JSON text from (key, raw value text) pairs: keys may repeat, values are written
    as given."""
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in pairs) + "}"


def _dump(value: Any, ascii: bool = False) -> str:
    # NaN/Infinity come out as such: not JSON, as clients send
    return json.dumps(value, ensure_ascii=ascii)


# ---- cases: (route, body bytes or a lazy huge body, content type) --------------------------------


@st.composite
def cases(draw) -> tuple[str, str, Any, str]:
    kind = draw(st.sampled_from(KINDS))
    route = draw(st.sampled_from(ROUTES))
    fields = FIELDS[route]
    body = draw(_valid(route))
    ascii = draw(st.booleans())                      # non-ASCII as \u escapes, or as UTF-8 bytes
    pairs = [(k, _dump(v, ascii)) for k, v in body.items()]
    # one or more fields (known or ignored) get a wild value
    if kind == "mutate":
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(fields + IGNORED_FIELDS))
            pairs = [p for p in pairs if p[0] != key] + [(key, _dump(draw(wild)))]
    elif kind == "edge":                              # a known field at an edge value
        key = draw(st.sampled_from(fields))
        value = draw(st.sampled_from(INT_EDGES + FLOAT_EDGES) | st.integers(-(2**70), 2**70))
        pairs = [p for p in pairs if p[0] != key] + [(key, _dump(value))]
    elif kind == "shape":
        edges = {**SHAPE_EDGES, **ROUTE_SHAPES.get(route, {})}
        key = draw(st.sampled_from(sorted(set(edges) & set(fields + IGNORED_FIELDS))))
        pairs = ([p for p in pairs if p[0] != key]
                 + [(key, _dump(draw(st.sampled_from(edges[key])), ascii))])
    elif kind == "raw":                               # raw JSON text in place of a value
        key = draw(st.sampled_from(fields + IGNORED_FIELDS))
        pairs = [p for p in pairs if p[0] != key] + [(key, draw(st.sampled_from(RAW_VALUES)))]
    # inside messages (input) / content parts / an option object (NESTED)
    elif kind == "nested":
        raw = draw(st.sampled_from(RAW_VALUES) | wild.map(_dump))
        holder, part_type, keys = NESTED[route]
        key = draw(st.sampled_from(keys))
        if holder is not None and key in ("type", "text"):
            inner = ('[{"role": "user", "content": '
                     f'[{_pairs_text([("type", _dump(part_type)), (key, raw)])}]}}]')
            pairs = [p for p in pairs if p[0] != holder] + [(holder, inner)]
        elif holder is not None and key not in OPTION_KEYS:
            inner = (
                f'[{_pairs_text([("role", _dump("user")), ("content", _dump("hi")), (key, raw)])}]')
            pairs = [p for p in pairs if p[0] != holder] + [(holder, inner)]
        else:
            option, first = OPTION_KEYS.get(key, ("stream_options", {}))
            inner = _pairs_text([(k, _dump(v)) for k, v in first.items()] + [(key, raw)])
            pairs = [p for p in pairs if p[0] != option] + [(option, inner)]
    # the same key twice, the second a wild or raw value
    elif kind == "duplicate":
        key = draw(st.sampled_from(fields))
        pairs = pairs + [(key, draw(st.sampled_from(RAW_VALUES) | wild.map(_dump)))]
    elif kind == "drop":
        if pairs:
            del pairs[draw(st.integers(0, len(pairs) - 1))]
    elif kind == "non_object":
        return (route, draw(st.sampled_from(NOT_OBJECTS)).encode("utf-8", "surrogatepass"),
                "application/json", kind)
    data = _pairs_text(pairs).encode("utf-8", "surrogatepass")
    # bytes that are not UTF-8, inside a string or anywhere
    if kind == "bad_utf8":
        at = draw(st.integers(0, len(data)))
        quote = data.rfind(b'"', 0, at)
        at = quote + 1 if quote >= 0 and draw(st.booleans()) else at
        data = data[:at] + draw(st.sampled_from(BAD_BYTES)) + data[at:]
    elif kind == "truncated":
        data = data[:draw(st.integers(0, max(len(data) - 1, 0)))]
    elif kind == "huge":
        return route, ("huge", draw(st.sampled_from(HUGE_SHAPES))), "application/json", kind
    content_type = "application/json"
    if kind == "content_type":
        content_type = draw(st.sampled_from(["text/plain", "", "application/x-www-form-urlencoded",
                                             "application/json; charset=utf-8",
                                             "multipart/form-data",
                                             "application/json; charset=latin-1"]))
    return route, data, content_type, kind


# kind "nested": the list of messages (None: none), its content parts' type, the keys to put a wild
# value in; a key of OPTION_KEYS goes in one of its option objects instead.
MESSAGE_KEYS = ["role", "content", "type", "text", "name"]
NESTED = {CHAT: ("messages", "text", MESSAGE_KEYS + ["tool_calls", "include_usage"]),
          TEXT: (None, "text", ["role", "content", "type", "text", "name", "tool_calls",
                                "include_usage"]),
          MESSAGES: ("messages", "text", MESSAGE_KEYS + ["budget_tokens", "user_id"]),
          RESPONSES: ("input", "input_text", MESSAGE_KEYS + ["effort", "format"])}
OPTION_KEYS = {"include_usage": ("stream_options", {}),
               "budget_tokens": ("thinking", {"type": "enabled"}), "user_id": ("metadata", {}),
               "effort": ("reasoning", {}), "format": ("text", {})}

# Weights by repetition: valid bodies (an engine run each) are a modest share; parse-time rejections
# are cheap. Hypothesis leans to the first entry (its simplest): a cheap one.
KINDS = (["raw"] * 5 + ["mutate"] * 6 + ["edge"] * 5 + ["shape"] * 3 + ["nested"] * 3
         + ["duplicate"] * 2 + ["drop"]
         + ["non_object"] * 3 + ["bad_utf8"] * 3 + ["truncated"] * 3 + ["content_type"] + ["huge"]
         + ["valid"] * 3)
# (where, size): a string value, or the body itself, of about the limit's size (the last one over
# it).
HUGE_SHAPES = [("value", MAX_BODY - 200), ("value", MAX_BODY - 64), ("stop", MAX_BODY - 200),
               ("bytes", MAX_BODY), ("value", MAX_BODY + 1), ("nested", MAX_BODY - 200)]


# per route: (head, tail) of a body with a long string value, and with a long stop string
HUGE_HEADS = {
    CHAT: (('{"max_tokens": 1, "messages": [{"role": "user", "content": "', '"}]}'),
           ('{"max_tokens": 1, "prompt": "a", "stop": ["', '"]}')),
    TEXT: (('{"max_tokens": 1, "prompt": "', '"}'),
           ('{"max_tokens": 1, "prompt": "a", "stop": ["', '"]}')),
    MESSAGES: (('{"model": "fuzz", "max_tokens": 1, "messages": [{"role": "user", "content": "',
                '"}]}'),
               ('{"model": "fuzz", "max_tokens": 1, "stop_sequences": ["',
                '"], "messages": [{"role": "user", "content": "a"}]}')),
    RESPONSES: (('{"model": "fuzz", "max_output_tokens": 1, "input": "', '"}'),
                ('{"model": "fuzz", "max_output_tokens": 1, "input": "a", "instructions": "',
                 '"}')),
}


def _huge(route: str, shape: tuple[str, int]) -> bytes:
    where, size = shape
    if where == "bytes":
        return b"[" * (size // 2) + b"]" * (size // 2)
    if where == "nested":                             # a deep array just under the limit
        head = b'{"prompt": "a", "max_tokens": 1, "x": '
        n = (size - len(head) - 1) // 2
        return head + b"[" * n + b"]" * n + b"}"
    head, tail = HUGE_HEADS[route][where == "stop"]
    room = size - len(head) - len(tail)
    filler = ("word é😀 " * (room // 8)).encode()[:room].decode("utf-8", "ignore")
    data = (head + filler + tail).encode()
    # exactly `size` bytes: JSON allows trailing whitespace
    return data + b" " * (size - len(data))


# Bodies that once gave a 500, sent first every run (kind "found").
FOUND = [
    # RecursionError in msgspec
    (ROUTES[1], b'{"prompt": "a", "logit_bias": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    (ROUTES[0], b'{"messages": [{"role": "user", "content": "hi"}], "user": ' + b'{"a":' * DEEP
                + b"1" + b"}" * DEEP
     + b"}"),
    # beyond msgpack's integers
    (ROUTES[1], b'{"model": "model.gguf", "prompt": [18446744073709551616]}'),
    (ROUTES[0], json.dumps({"messages": [{"role": "user", "content": "hi"}],
                            "chat_template_kwargs": {"x": 2**64}}).encode()),
    (ROUTES[0], json.dumps({"messages": [{"role": "assistant", "content": "hi",
                                          "tool_calls": [{"id": -(2**63) - 1}]}]}).encode()),
    # a top_p that float32 rounds to 0 kept no candidate: token 0 was drawn, which the grammar
    # forbids (a 500)
    (ROUTES[0], json.dumps({"messages": [{"role": "system", "content": ""}], "max_tokens": 1,
                            "top_p": 5e-324, "json_schema": {}}).encode()),
]


# ---- checking an answer --------------------------------------------------------------------------


def _error_shape(obj: Any, route: str, status: int | None = None) -> str | None:
    """What is wrong with an error body (of a `status` answer, if given), or None if it is the
    route's shape: Anthropic's for /v1/messages, OpenAI's for the others."""
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return f"no error object: {str(obj)[:200]}"
    if not (isinstance(err.get("message"), str) and isinstance(err.get("type"), str)):
        return f"error fields wrong: {str(err)[:200]}"
    if route == MESSAGES:
        if obj.get("type") != "error" or "code" in err:
            return f"not Anthropic's error shape: {str(obj)[:200]}"
        if status is not None and err["type"] != ERROR_TYPES.get(status, "invalid_request_error"):
            return f"error type {err['type']} in a {status} answer"
        return None
    if route == RESPONSES and isinstance(err.get("code"), str) and err["code"]:
        return None                 # a named code, as OpenAI's Responses API has one (a 404)
    if not isinstance(err.get("code"), int):
        return f"error fields wrong: {str(err)[:200]}"
    if status is not None and err["code"] != status:
        return f"error code {err['code']} in a {status} answer"
    return None


def _sse(raw: bytes) -> list[tuple[str | None, str]]:
    """A stream's events: (the event line's name or None, the data line's text)."""
    out = []
    for e in raw.decode("utf-8").split("\n\n"):
        if not e.strip():
            continue
        name, data = None, None
        for line in e.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
            else:
                raise ValueError(f"not an SSE line: {line[:200]!r}")
        if data is None:
            raise ValueError(f"an SSE event without data: {e[:200]!r}")
        out.append((name, data))
    return out


RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


def _check_stream(route: str, raw: bytes, streams: collections.Counter) -> str | None:
    try:
        events = _sse(raw)
    except ValueError as e:
        return str(e)
    streams[f"{route} streams"] += 1
    if route == MESSAGES:
        if not events or events[-1][0] not in ("message_stop", "error"):
            return f"stream did not end with message_stop or error: {raw[-400:]!r}"
        for name, data in events:
            obj = json.loads(data)
            if not isinstance(obj, dict) or obj.get("type") != name:
                return f"event {name} with data {data[:200]}"
            if name == "error":
                problem = _error_shape(obj, route)
                if problem:
                    return problem
                streams[f"{route} error {obj['error']['type']}"] += 1
                if obj["error"]["type"] == "api_error":
                    return f"stream error event: {data[:400]}"
        return None
    if route == RESPONSES:
        if not events or events[-1][0] not in RESPONSE_ENDS:
            return f"stream did not end with {'/'.join(RESPONSE_ENDS)}: {raw[-400:]!r}"
        for name, data in events:
            obj = json.loads(data)
            if not isinstance(obj, dict) or obj.get("type") != name:
                return f"event {name} with data {data[:200]}"
        streams[f"{route} {events[-1][0]}"] += 1
        return None
    if not events or events[-1] != (None, "[DONE]"):
        return f"stream did not end with [DONE]: {raw[-400:]!r}"
    for name, data in events[:-1]:
        if name is not None:
            return f"not an SSE data event: {name[:200]!r}"
        obj = json.loads(data)
        if "error" in obj:
            problem = _error_shape(obj, route)
            if problem:
                return problem
            streams[f"error {obj['error']['code']}"] += 1
            if obj["error"]["code"] >= 500:
                return f"stream error event: {data[:400]}"
        elif not isinstance(obj.get("choices"), list):
            return f"chunk without choices: {data[:200]}"
    return None


def _check_whole(route: str, raw: bytes) -> str | None:
    obj = _json_or(raw)
    if route == MESSAGES:
        if not (isinstance(obj, dict) and obj.get("type") == "message"
                and isinstance(obj.get("content"), list) and "stop_reason" in obj):
            return f"200 not a message: {raw[:400]!r}"
    elif route == RESPONSES:
        if not (isinstance(obj, dict) and obj.get("object") == "response"):
            return f"200 not a response: {raw[:400]!r}"
    elif not (isinstance(obj, dict) and isinstance(obj.get("choices"), list) and obj["choices"]):
        return f"200 without choices: {raw[:400]!r}"
    return None


def _check(route: str, r: httpx.Response, raw: bytes, streams: collections.Counter) -> str | None:
    """None if the answer is acceptable, else what is wrong with it."""
    status = r.status_code
    if status == 503 and r.headers.get("retry-after"):
        return _error_shape(_json_or(raw), route)
    if status >= 500:
        return f"status {status}: {raw[:400]!r}"
    if 400 <= status < 500:
        return _error_shape(_json_or(raw), route, status)
    if status != 200:
        return f"status {status}: {raw[:400]!r}"
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return _check_stream(route, raw, streams)
    return _check_whole(route, raw)


def _json_or(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _shown(data: bytes) -> str:
    return repr(data[:300]) + (f" ... ({len(data)} bytes)" if len(data) > 300 else "")


# ---- the test ------------------------------------------------------------------------------------


def _found_examples(test):
    for route, data in reversed(FOUND):
        test = example((route, data, "application/json", "found"))(test)
    return test


def test_fuzz_completion_routes(server):
    by_status: collections.Counter = collections.Counter()
    by_route: collections.Counter = collections.Counter()
    by_route_status: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_kind: collections.Counter = collections.Counter()
    seconds_by_kind: collections.Counter = collections.Counter()
    streams: collections.Counter = collections.Counter()
    failures: list[str] = []
    huge_sent = [0]
    started = time.monotonic()
    client = httpx.Client(base_url=server.url, timeout=httpx.Timeout(60.0, connect=5.0))
    # closed in the finally below
    corpus = open(CORPUS, "w") if CORPUS else None  # noqa: SIM115

    def send(route: str, data: bytes, content_type: str) -> None:
        headers = {"Content-Type": content_type} if content_type else {}
        try:
            with client.stream("POST", route, content=data, headers=headers) as r:
                raw = r.read()
        except httpx.HTTPError as e:
            problem, status = f"{type(e).__name__}: {e}", "no answer"
        else:
            problem, status = _check(route, r, raw, streams), r.status_code
        by_status[status] += 1
        by_route[route] += 1
        by_route_status[route][status] += 1
        if corpus is not None:
            corpus.write(json.dumps({"route": route, "content_type": content_type, "status": status,
                                     "body": base64.b64encode(data).decode()}) + "\n")
        if problem:
            failures.append(f"{route} {_shown(data)} (Content-Type {content_type!r}) -> {problem}")
            assert KEEP_GOING, failures[-1]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              print_blob=True, suppress_health_check=list(HealthCheck))
    @given(cases())
    @_found_examples
    def fuzz(case):
        route, data, content_type, kind = case
        if isinstance(data, tuple):                   # ("huge", shape): made here, only a few times
            if huge_sent[0] >= HUGE_BODIES:
                return
            huge_sent[0] += 1
            data = _huge(route, data[1])
        by_kind[kind] += 1
        t0 = time.monotonic()
        send(route, data, content_type)
        seconds_by_kind[kind] += time.monotonic() - t0

    try:
        fuzz()
    finally:
        if corpus is not None:
            corpus.close()
        tried = sum(by_status.values())
        seconds = time.monotonic() - started
        summary = {"bodies_tried": tried,
                   "by_status": {str(k): v for k, v in sorted(by_status.items(), key=str)},
                   "by_route": dict(by_route),
                   "by_route_status": {route: {str(k): v for k, v in sorted(c.items(), key=str)}
                                       for route, c in by_route_status.items()},
                   "by_kind": dict(by_kind),
                   "seconds_by_kind": {k: round(v, 1) for k, v in seconds_by_kind.items()},
                   "streams": dict(streams),
                   "huge_bodies": huge_sent[0], "status_500": by_status.get(500, 0),
                   "seconds": round(seconds, 1), "failures": failures[:50]}
        SUMMARY.write_text(json.dumps(summary, indent=1))
        print(f"\nfuzz: {tried} bodies tried in {seconds:.0f} s, by status {summary['by_status']}, "
              f"by route and status {summary['by_route_status']}, streams (and error events in "
              f"them) {summary['streams']}, 500s {summary['status_500']} (summary in {SUMMARY})")
        for f in failures[:50]:
            print("FAIL", f)
    assert not failures, "\n".join(failures[:20])
    assert tried >= MIN_TRIED and 500 not in by_status
    assert by_status[200] > 0 and any(400 <= s < 500 for s in by_status if isinstance(s, int))

    # After all that: an ordinary request is served, the engine is healthy and never restarted.
    r = client.post(ROUTES[0],
                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    answer = r.json()
    message = answer["choices"][0]["message"]
    assert answer["usage"]["completion_tokens"] == 8
    assert (message.get("content") or "") + (message.get("reasoning_content") or ""), answer
    assert client.get("/health").status_code == 200
    faults = client.get("/faults").json()
    assert faults["restarts"] == 0, faults
    client.close()
