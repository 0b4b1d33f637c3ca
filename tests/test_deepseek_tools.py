"""DeepSeek's tool calls (issue 37): V3's and R1's `function<｜tool▁sep｜>NAME` with fenced JSON,
and V3.1's `NAME<｜tool▁sep｜>` with bare JSON (tool_formats/deepseek_calls.py, grammar.py), told by
DeepSeek's own templates (gguf/templates/deepseek-*.jinja), which render calls and results but not
the tools (the server describes them in a system message, as llama.cpp does); R1's `<think>`
reasoning ends at the calls' mark.

Parsers on literal model texts, whole and split at every character; the forced grammars walked at
random over a vocabulary with DeepSeek's marks as control tokens; and the real server, with the
official openai client, serving a made deepseek2 model with V3.1's template and marks as make-model
writes it (makers/family_chat.py): forced calls whole and streamed, several calls with their
indexes, a tool-result turn."""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from embedding_checks import check_embeddings
from tool_data import TIME, WEATHER, grammar_walk

from strata_jax.gguf.family_templates import family_template
from strata_jax.makers.family_chat import family_chat_metadata
from strata_jax.serve.http.reasoning import split_reasoning
from strata_jax.serve.launch import ServerProcess
from strata_jax.serve.tool_formats import DS_CALLS, CallStream, call_mark, detect
from strata_jax.serve.tools import call_grammar, deltas, parse_calls, special_marks, tool_prompt

TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PARIS, ZONE = '{"city": "Zürich", "unit": "c"}', '{"zone": -3}'
TWO = [("get_weather", PARIS), ("get_time", ZONE)]
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3(name: str, args: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


def v31(name: str, args: str) -> str:
    return f"{CB}{name}{SEP}{args}{CE}"


# (format, the model's text, content left, calls)
TEXTS = [
    ("deepseek_v3", f"{B}{v3(*TWO[0])}\n{v3(*TWO[1])}{E}", None, TWO),
    ("deepseek_v3", f"Let me check.{B}{v3(*TWO[1])}{E}", "Let me check.", TWO[1:]),
    ("deepseek_v31", f"{B}{v31(*TWO[0])}{v31(*TWO[1])}{E}", None, TWO),
    # each format reads the other's form too (llama.cpp's R1 and V3.1 parsers overlap the same way)
    ("deepseek_v31", f"{B}{v3(*TWO[0])}{E}", None, TWO[:1]),
    ("deepseek_v3", f"I will look.\n\n{B}{v31(*TWO[1])}{E}", "I will look.", TWO[1:]),
]


def names_args(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) if "function" in c
            else (c["name"], c["arguments"]) for c in calls]


def streamed(fmt: str, pieces: list[str], parallel: bool = True):
    s = CallStream(fmt, TOOLS, parallel)
    events = [e for p in pieces for e in s.feed(p)] + s.end()
    return "".join(e[1] for e in events if e[0] == "content"), s.calls, events


@pytest.mark.parametrize("fmt, text, content, calls", TEXTS)
def test_calls_whole_streamed_and_one_when_not_parallel(fmt, text, content, calls):
    got_content, got = parse_calls(text, fmt, TOOLS)
    assert (got_content, names_args(got)) == (content, calls)
    assert all(c["id"].startswith("call_") for c in got) and len({c["id"] for c in got}) == len(got)
    one_content, one = parse_calls(text, fmt, TOOLS, parallel=False)
    assert (one_content, names_args(one)) == (content, calls[:1])
    for cut in range(len(text) + 1):
        got_content, got, _ = streamed(fmt, [text[:cut], text[cut:]])
        assert names_args(got) == calls and (got_content.strip() or None) == content, cut
    _, got, events = streamed(fmt, list(text))          # a character a piece
    pieces = [d["tool_calls"][0] for d in deltas(events) if "tool_calls" in d]
    for i, (name, args) in enumerate(calls):
        mine = [p for p in pieces if p["index"] == i]
        assert mine[0] == {"index": i, "id": got[i]["id"], "type": "function",
                           "function": {"name": name, "arguments": ""}}
        assert len(mine) > 3 and "".join(p["function"]["arguments"] for p in mine[1:]) == args


@pytest.mark.parametrize("fmt", ["deepseek_v3", "deepseek_v31"])
@pytest.mark.parametrize("text", ["Paris is sunny.", f"{B}{v3('nope', '{}')}{E} ok",
                                  f"{B}not a call{E}", f"{B}{CB}get_time{SEP}not json{CE}{E}"])
def test_text_that_is_no_call_is_content(fmt, text):
    content, calls = parse_calls(text, fmt, TOOLS)
    assert (content, calls) == (text, [])


def test_r1_reasoning_ends_at_the_calls_mark():
    """R1's generation prompt opens <think>: a call written while thinking ends the reasoning (its
    mark, as llama.cpp's thinking end tags for DeepSeek), as does </think>."""
    text = f"I should look it up.\n{B}{v3(*TWO[0])}{E}"
    mark = call_mark("deepseek_v3")
    reasoning, content = split_reasoning(text, in_reasoning=True, call_mark=mark)
    assert reasoning == "I should look it up." and content.startswith(DS_CALLS)
    assert names_args(parse_calls(content, "deepseek_v3", TOOLS)[1]) == TWO[:1]
    reasoning, content = split_reasoning(f"<think>\nHmm.\n</think>\n\n{B}{v3(*TWO[1])}{E}",
                                         call_mark=call_mark("deepseek_v3"))
    assert reasoning == "Hmm." and names_args(parse_calls(content, "deepseek_v3", TOOLS)[1]) \
        == TWO[1:]


def deepseek_tokenizer(family: str):
    from strata_jax.gguf import load_tokenizer
    from strata_jax.makers.tiny_tokenizer import tiny_tokenizer

    md = {k: v for k, (v, _) in tiny_tokenizer(512).metadata("qwen2").items()}
    return load_tokenizer(md | family_chat_metadata(md, family))


@pytest.mark.parametrize("family, fmt", [("deepseek-r1", "deepseek_v3"),
                                         ("deepseek-v3.1", "deepseek_v31")])
def test_the_templates_tell_their_format_and_render_a_round_trip(family, fmt):
    assert detect(family_template(family)) == fmt
    tk = deepseek_tokenizer(family)
    messages = [{"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": PARIS}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    msgs, kwargs, tooling = tool_prompt(tk, messages, {}, TOOLS, "required")
    assert tooling["tool_format"] == fmt and tooling["grammar"][0] == "lark"
    text = tk.apply_chat_template(msgs, add_generation_prompt=True, **kwargs)
    # the tools, described with the call's syntax, in the system prompt before the first turn
    assert text.index('"name": "get_time"') < text.index("<｜User｜>")
    assert f"{B}{CB}" in text.split("<｜User｜>")[0]
    # the earlier call as the family writes it, then its result
    call = v3("get_weather", PARIS) if fmt == "deepseek_v3" else v31("get_weather", PARIS)
    assert call in text
    assert '<｜tool▁output▁begin｜>{"temperature": 21}<｜tool▁output▁end｜>' in text


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("family, fmt", [("deepseek-r1", "deepseek_v3"),
                                         ("deepseek-v3.1", "deepseek_v31")])
def test_forced_grammars_walked_at_random_give_valid_calls(family, fmt, parallel):
    from strata_jax.engine.grammar.constrain import Grammars

    tk = deepseek_tokenizer(family)
    marks = special_marks(tk)
    assert {B, E, CB, CE, SEP} <= set(marks)
    grammars = Grammars(tk, tk.vocab_size)
    rng = np.random.default_rng(0)
    ended = 0
    for _ in range(10):
        c = grammars.constraint(call_grammar(TOOLS, "required", fmt, parallel, marks))
        out, walked_to_end = grammar_walk(c, tk, rng)
        if not walked_to_end:
            continue                    # a long parallel walk: not ended, not checked
        ended += 1
        text = tk.decode(out)
        content, calls = parse_calls(text, fmt, TOOLS, parallel)
        assert calls and not content and (len(calls) == 1 or parallel), text
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                SCHEMAS[call["function"]["name"]])
        assert marks[B] in out and marks[SEP] in out
    assert ended >= 5


# ---- against the real server ---------------------------------------------------------------------

DEEPSEEK2 = {"arch": "deepseek2", "layers": 2, "hidden": 64}


@pytest.fixture(scope="module")
def server(tiny_model):
    """A made deepseek2 model (MLA, the sigmoid router, a leading dense layer) as make-model writes
    it: V3.1's template and DeepSeek's marks as control tokens (makers/family_chat.py). One server
    for the family's end-to-end run and the tool format's."""
    path = tiny_model(**DEEPSEEK2)
    with ServerProcess([str(path), "--parallel", "2", "--max-context", "2048",
                        "--model-name", "tiny"]) as srv:
        srv.wait_up().wait_ready()
        yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                 timeout=300)


ASK = [{"role": "user", "content": "What is the weather in Zürich?"}]


def ask(client, seed: int, **kw):
    return client.chat.completions.create(**{"model": "tiny", "messages": ASK, "tools": TOOLS,
                                             "max_tokens": 160, "tool_choice": "required",
                                             "temperature": 1.0, "seed": seed, **kw})


@pytest.mark.parametrize("thinking", [False, True])
def test_a_forced_call_whole_and_streamed(server, thinking):
    """With V3.1's thinking on (its prompt ends inside <think>) the forced call is a call, not
    reasoning."""
    _srv, client = server
    kw = {"parallel_tool_calls": False,
          "extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}}}
    whole = ask(client, 5, logprobs=True, **kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    # written in DeepSeek's own form (the tokens, as logprobs shows them)
    raw = "".join(t.token for t in whole.logprobs.content)
    (call,) = whole.message.tool_calls
    assert raw.startswith(B + CB + call.function.name + SEP) and raw.endswith(CE + E), raw
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert not (whole.message.content or "").strip()
    assert not (whole.message.model_extra or {}).get("reasoning_content")
    chunks = list(ask(client, 5, stream=True, **kw))
    pieces = [p for c in chunks if c.choices for p in (c.choices[0].delta.tool_calls or [])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    first = pieces[0]
    assert (first.index, first.type, first.function.name, first.function.arguments) == \
        (0, "function", call.function.name, "")
    assert len(pieces) > 2 and all(p.id is None for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments


def test_several_calls_each_with_its_index(server):
    _srv, client = server
    seen = 0
    for seed in range(4):
        choice = ask(client, seed, max_tokens=300).choices[0]
        if choice.finish_reason == "length":
            continue
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and calls
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        chunks = list(ask(client, seed, max_tokens=300, stream=True))
        pieces = [p for c in chunks if c.choices for p in (c.choices[0].delta.tool_calls or [])]
        assert [p.index for p in pieces if p.id is not None] == list(range(len(calls)))
        seen = max(seen, len(calls))
    assert seen >= 2, "no answer made several calls"


def test_a_tool_result_turn_renders_and_is_answered(server):
    srv, client = server
    call = ask(client, 3, parallel_tool_calls=False).choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = httpx.post(srv.url + "/apply-template", json={"messages": messages, "tools": TOOLS},
                   timeout=60)
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    # the tools described, with DeepSeek's syntax, before the first turn
    assert '"name": "get_time"' in prompt.split("<｜User｜>")[0]
    assert v31(call.function.name, call.function.arguments) in prompt
    # V3.1's template writes each result with no outputs_begin / outputs_end around them (R1's does)
    assert prompt.endswith('<｜end▁of▁sentence｜><｜tool▁output▁begin｜>{"temperature": 21}'
                           "<｜tool▁output▁end｜>")
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                       tool_choice="none", max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls


def test_embeddings_are_the_last_hidden_state(server, tiny_model):
    """/v1/embeddings serves deepseek2 (tests/embedding_checks.py: against transformers)."""
    from strata_jax.testing.hf_deepseek import load_deepseek

    _srv, client = server
    check_embeddings(client, load_deepseek(tiny_model(**DEEPSEEK2)), DEEPSEEK2["hidden"])


def test_a_turn_ends_on_deepseeks_eos(server):
    """The made file's BOS and EOS are DeepSeek's, as a real file's (makers/family_chat.py): the
    template opens the chat with the BOS and writes the EOS after each answer, and an answer ends on
    it (a bias makes it the first token; with ignore_eos the answer runs on to max_tokens)."""
    srv, client = server
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    props = httpx.get(srv.url + "/props", timeout=60).json()
    assert (props["bos_token"], props["eos_token"]) == (bos, eos)
    turns = ASK + [{"role": "assistant", "content": "Sunny."},
                   {"role": "user", "content": "And tomorrow?"}]
    prompt = httpx.post(srv.url + "/apply-template", json={"messages": turns},
                        timeout=60).json()["prompt"]
    assert prompt.startswith(bos + "<｜User｜>")
    assert f"Sunny.{eos}<｜User｜>And tomorrow?" in prompt
    (eos_id,) = httpx.post(srv.url + "/tokenize", json={"content": eos},
                           timeout=60).json()["tokens"]
    kw = {"model": "tiny", "messages": turns, "max_tokens": 8, "temperature": 0,
          "logit_bias": {str(eos_id): 100}}
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert not r.choices[0].message.content
    r = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
