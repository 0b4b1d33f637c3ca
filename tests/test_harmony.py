"""gpt-oss's harmony chat format (issue 37): the channels split into reasoning, answer and calls
(serve/http/harmony.py), the calls read (tool_formats/harmony_calls.py) and forced (grammar.py),
and gpt-oss's own template (gguf/templates/gpt-oss.jinja) in the sandbox.

Parsers on literal model texts, whole and split at every character; the forced grammar walked at
random over a vocabulary with the harmony marks as control tokens; and the real server, with the
official openai client, serving a made gpt-oss that speaks harmony as make-model writes it
(makers/family_chat.py: the marks in its vocabulary, gpt-oss's template in its metadata). Its
random weights write no harmony of their own, so the reasoning split is checked on answers a
request grammar lays out as gpt-oss writes them, and calls are forced."""

from __future__ import annotations

import itertools
import json
import re

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from embedding_checks import check_embeddings
from tool_data import TIME, WEATHER, grammar_walk

from strata_jax.gguf.family_templates import family_template
from strata_jax.gguf.named_templates import chat_template_source
from strata_jax.makers.family_chat import HARMONY_TOKENS, family_chat_metadata
from strata_jax.serve.http.harmony import HarmonySplit, HarmonyTokens, split_harmony
from strata_jax.serve.launch import ServerProcess
from strata_jax.serve.tool_formats import CallStream, detect
from strata_jax.serve.tools import call_grammar, deltas, parse_calls, special_marks, tool_prompt

TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ARGS = '{"city": "Paris", "unit": "c"}'

# (the model's text, reasoning, content the split gives with tools in play, calls)
TEXTS = [
    (("<|channel|>analysis<|message|>The user wants a city.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Paris is sunny."),
     "The user wants a city.", "Paris is sunny.", []),
    ("<|channel|>final<|message|>Only an answer.", None, "Only an answer.", []),
    # the recipient in the channel's header, with its content type
    (("<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>"
     f"commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"),
     "I need the weather.", None, [("get_weather", ARGS)]),
    # ... or in the role's (as the template renders past calls)
    (' to=functions.get_time<|channel|>commentary json<|message|>{"zone": -3}', None, None,
     [("get_time", '{"zone": -3}')]),
    # a preamble the user may see, then the call
    (("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_weather<|message|>{ARGS}"), None, "Let me look.",
     [("get_weather", ARGS)]),
]


def pieces_of(text: str, cuts: list[int], calls: bool = True) -> list[tuple[str, str]]:
    p = HarmonySplit(True, calls)
    bounds = [0, *cuts, len(text)]
    return [x for a, b in itertools.pairwise(bounds) for x in p.feed(text[a:b])] + p.flush()


@pytest.mark.parametrize("text, reasoning, content, calls", TEXTS)
def test_the_channels_split_into_reasoning_answer_and_calls(text, reasoning, content, calls):
    got_reasoning, rest = split_harmony(text, calls=True)
    assert got_reasoning == reasoning
    got_content, got_calls = parse_calls(rest, "harmony", TOOLS)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    # streamed, cut anywhere: the same parts
    whole = pieces_of(text, [])
    for cut in range(len(text) + 1):
        parts = pieces_of(text, [cut])
        for kind in ("reasoning", "content"):
            assert ("".join(t for k, t in parts if k == kind)
                    == "".join(t for k, t in whole if k == kind)), (cut, kind)


def test_a_call_streams_as_openai_pieces():
    text = TEXTS[2][0]
    p = HarmonySplit(True, True)
    stream = CallStream("harmony", TOOLS)
    events = []
    for ch in text:                                 # a character a piece
        for kind, t in p.feed(ch):
            if kind == "content":
                events += stream.feed(t)
    events += stream.end()
    pieces = [d["tool_calls"][0] for d in deltas(events) if "tool_calls" in d]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""} and pieces[0]["id"]
    assert len(pieces) > 3 and "".join(x["function"]["arguments"] for x in pieces[1:]) == ARGS
    assert not [e for e in events if e[0] == "content"]


def test_reasoning_format_none_keeps_the_analysis_as_written():
    text = TEXTS[0][0]
    assert split_harmony(text, enabled=False) == (
        None, "<|channel|>analysis<|message|>The user wants a city.<|end|>Paris is sunny.")


@pytest.mark.parametrize("text", [
    # no tools in play: a call is left out (llama.cpp's "unsolicited" calls)
    f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}",
    # gpt-oss's built-in tools are no function of the request
    '<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|end|>',
])
def test_calls_no_tool_asked_for_are_left_out(text):
    assert split_harmony(text + "<|start|>assistant<|channel|>final<|message|>Done.") == (
        None, "Done.")


@pytest.mark.parametrize("text", ["Plain text, no harmony.", "<|channel|>final and no message",
                                  "a < b and to= nothing"])
def test_text_that_is_no_harmony_is_content(text):
    reasoning, content = split_harmony(text)
    assert reasoning is None
    # a header cut short (the answer ended inside it) is no text; the rest is content as written
    assert content == ("" if text.startswith("<|channel|>") else text)


def test_edge_bodies_an_empty_one_and_a_long_text_that_opens_like_a_header():
    # an analysis with no text before the next message: the next message is read
    assert split_harmony("<|channel|>analysis<|message|><|start|>assistant<|channel|>final"
                         "<|message|>Hi") == ("", "Hi")
    # past MAX_HEADER characters with no <|message|>: text (once, not read as a header again)
    long = "<|start|>" + "x" * 300
    assert split_harmony(long + "<|end|>more") == (None, long + "more")


def test_the_template_is_detected_and_renders_tools_calls_and_results():
    source = family_template("gpt-oss")
    assert detect(source) == "harmony" and chat_template_source("gpt-oss") == source
    tk = harmony_tokenizer()
    # <|return|> (after the final answer) and <|call|> (after a call) end generation; <|end|>, which
    # ends every other message, does not
    ids = {m: tk.token_to_id(m) for m in ("<|return|>", "<|call|>", "<|end|>")}
    assert tk.is_eos(ids["<|return|>"]) and tk.is_eos(ids["<|call|>"])
    assert not tk.is_eos(ids["<|end|>"])
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "reasoning_content": "Need the weather.",
                 "content": "Checking.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": ARGS}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    msgs, kwargs, tooling = tool_prompt(tk, messages, {"reasoning_effort": "low"}, TOOLS, "auto")
    assert tooling == {"tool_format": "harmony", "grammar": None}
    text = tk.apply_chat_template(msgs, add_generation_prompt=True, **kwargs)
    assert "Reasoning: low" in text and "type get_weather = (_: {" in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            f"{ARGS}<|call|>"
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '"{\\"temperature\\": 21}"<|end|><|start|>assistant') in text


def test_several_calls_of_one_message_render_each_with_its_result():
    """The template renders one call a message and names a result by the call before it."""
    tk = harmony_tokenizer()
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": n, "arguments": a}}
             for i, (n, a) in enumerate([("get_weather", ARGS), ("get_time", '{"zone": 2}')])]
    messages = [{"role": "user", "content": "Weather and time?"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    msgs, kwargs, _ = tool_prompt(tk, messages, {}, TOOLS, "auto")
    text = tk.apply_chat_template(msgs, add_generation_prompt=True, **kwargs)
    turns = re.findall(r"<\|start\|>(assistant to=functions\.\w+|functions\.\w+ to=assistant)"
                       r"<\|channel\|>commentary(?: json)?<\|message\|>([^<]*)", text)
    assert turns == [("assistant to=functions.get_weather", ARGS),
                     ("functions.get_weather to=assistant", '"sunny"'),
                     ("assistant to=functions.get_time", '{"zone": 2}'),
                     ("functions.get_time to=assistant", '"noon"')]


def harmony_tokenizer():
    from strata_jax.gguf import load_tokenizer
    from strata_jax.makers.tiny_tokenizer import tiny_tokenizer

    md = {k: v for k, (v, _) in tiny_tokenizer(512).metadata("qwen2").items()}
    return load_tokenizer(md | family_chat_metadata(md, "gpt-oss"))


@pytest.mark.parametrize("text, reasoning", [(t[0], t[1]) for t in TEXTS] + [
    # an analysis message to a built-in tool is a call, not reasoning; a second analysis counts
    (('<|channel|>analysis to=browser.search<|message|>{"q": 1}<|end|><|start|>assistant'
      "<|channel|>analysis<|message|>More thought.<|end|>"), "More thought."),
    ("<|start|>" + "x " * 300 + "<|end|>", None)])        # no harmony: none
def test_reasoning_tokens_are_the_analysis_bodies(text, reasoning):
    """HarmonyTokens, fed a text's tokens one at a time, counts its analysis bodies' tokens."""
    tk = harmony_tokenizer()
    count = HarmonyTokens(tk)
    for t in tk.encode(text, add_special=False):
        count.add(t)
    assert count.tokens == len(tk.encode(reasoning or "", add_special=False))
    assert (count.tokens > 0) == bool(reasoning)


def test_the_forced_grammar_walked_at_random_gives_one_valid_call():
    """Random tokens among those the grammar allows (the analysis kept short by a bias toward
    <|end|>): every walk is one call that validates, written with the marks' control tokens."""
    from strata_jax.engine.grammar.constrain import Grammars

    tk = harmony_tokenizer()
    marks = special_marks(tk)
    assert set(HARMONY_TOKENS) - {"<|return|>", "<|call|>"} <= set(marks)
    grammars = Grammars(tk, tk.vocab_size)
    rng = np.random.default_rng(0)
    end = tk.token_to_id("<|end|>")
    kinds = set()
    for _ in range(16):
        c = grammars.constraint(call_grammar(TOOLS, "required", "harmony", True, marks))
        out, _ = grammar_walk(c, tk, rng, prefer=(end, 0.3))
        text = tk.decode(out)
        reasoning, rest = split_harmony(text, calls=True)
        content, calls = parse_calls(rest, "harmony", TOOLS)
        assert len(calls) == 1 and not content, text
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]),
                            SCHEMAS[calls[0]["function"]["name"]])
        assert marks["<|message|>"] in out and marks["<|channel|>"] in out
        kinds.add((reasoning is not None, text.startswith(" to=")))
    assert len(kinds) >= 3, kinds           # with and without reasoning, both headers


# ---- against the real server ---------------------------------------------------------------------

N_CTX = 2048


# a made gpt-oss as make-model writes it (MXFP4 experts; harmony's marks and template): the options
# of tests/test_gpt_oss.py's F32 file, so a session that runs both makes it once
GPT_OSS = {"arch": "gpt-oss", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
           "experts_used": 2, "expert_ffn": 32, "quant": "F32"}


@pytest.fixture(scope="module")
def server(tiny_model):
    from strata_jax.gguf import GGUFModel, load_tokenizer

    path = tiny_model(**GPT_OSS)
    md = GGUFModel.open(path).metadata
    assert md["general.architecture"] == "gpt-oss"
    assert md["tokenizer.chat_template"] == family_template("gpt-oss")
    tk = load_tokenizer(path)
    with ServerProcess([str(path), "--parallel", "2", "--max-context", str(N_CTX),
                        "--model-name", "tiny"]) as srv:
        srv.wait_up().wait_ready()
        yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                 timeout=300), tk


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WORDS = r"[a-z]{2,6}( [a-z]{2,6}){1,4}"


def laid_out(tk) -> str:
    """A request grammar (Lark) that lays the answer out as gpt-oss writes one: an analysis message,
    then the final one."""
    sp = {m: f"<[{tk.token_to_id(m)}]>" for m in HARMONY_TOKENS}
    return (f'start: {sp["<|channel|>"]} "analysis" {sp["<|message|>"]} /{WORDS}/ '
            f'{sp["<|end|>"]} {sp["<|start|>"]} "assistant" {sp["<|channel|>"]} "final" '
            f'{sp["<|message|>"]} /{WORDS}/\n')


def analysis_tokens(tokens: list[str]) -> int:
    """The tokens of an answer's leading analysis message's body (0 without one), from its tokens
    as logprobs shows them: between its header's <|message|> and its <|end|>."""
    text = "".join(tokens)
    if not text.startswith("<|channel|>analysis<|message|>"):
        assert "<|channel|>analysis" not in text, text
        return 0
    at = tokens.index("<|message|>")
    assert "".join(tokens[:at]) == "<|channel|>analysis", tokens
    return tokens.index("<|end|>") - at - 1


def test_reasoning_and_answer_whole_and_streamed(server):
    """... and usage's reasoning_tokens counts the analysis message's tokens (whole, streamed with
    include_usage, and with reasoning_format none: tokens the model reasoned either way)."""
    _srv, client, tk = server
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 80, "temperature": 1.0, "seed": 7,
          "extra_body": {"grammar": laid_out(tk)}}
    whole = client.chat.completions.create(**kw, logprobs=True)
    msg = whole.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert re.fullmatch(WORDS, reasoning) and re.fullmatch(WORDS, msg.content), msg
    n = analysis_tokens([t.token for t in whole.choices[0].logprobs.content])
    assert whole.usage.completion_tokens_details.reasoning_tokens == n
    assert 0 < n < whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas_ = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas_) \
        == reasoning
    assert "".join(d.content or "" for d in deltas_) == msg.content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == n
    # reasoning_format none: the analysis message stays in the content, as written
    raw = client.chat.completions.create(**{**kw, "extra_body": {
        "grammar": laid_out(tk), "reasoning_format": "none"}})
    assert raw.choices[0].message.content == \
        f"<|channel|>analysis<|message|>{reasoning}<|end|>{msg.content}"
    assert "reasoning_content" not in (raw.choices[0].message.model_extra or {})
    assert raw.usage.completion_tokens_details.reasoning_tokens == n


def test_a_forced_call_streamed_and_whole(server):
    _srv, client, tk = server
    end = tk.token_to_id("<|end|>")
    kw = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
          "max_tokens": 160, "temperature": 1.0, "logit_bias": {str(end): 6}}
    seen = 0
    for seed in range(4):
        chunks = list(client.chat.completions.create(**kw, seed=seed, stream=True))
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        if reason == "length":
            continue
        assert reason == "tool_calls"
        pieces = [p for c in chunks if c.choices for p in (c.choices[0].delta.tool_calls or [])]
        first = pieces[0]
        assert (first.index, first.type, first.function.arguments) == (0, "function", "")
        assert first.id.startswith("call_") and first.function.name in SCHEMAS
        assert all(p.index == 0 and p.id is None for p in pieces[1:]) and len(pieces) > 2
        args = "".join(p.function.arguments for p in pieces)
        jsonschema.validate(json.loads(args), SCHEMAS[first.function.name])
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        whole = client.chat.completions.create(**kw, seed=seed).choices[0]
        assert whole.finish_reason == "tool_calls"
        (call,) = whole.message.tool_calls
        assert (call.function.name, call.function.arguments) == (first.function.name, args)
        seen += 1
    assert seen >= 2


def test_structured_output_is_the_final_message(server):
    """A JSON schema asked for: the model may reason first, then its final message is the JSON
    (llama.cpp's response format for gpt-oss); its reasoning tokens are counted, or none."""
    _srv, client, tk = server
    schema = WEATHER["function"]["parameters"]
    for seed in range(3):
        res = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=120, temperature=1.0, seed=seed,
            logit_bias={str(tk.token_to_id("<|end|>")): 6}, logprobs=True,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
        r = res.choices[0]
        assert r.finish_reason == "stop", r
        jsonschema.validate(json.loads(r.message.content), schema)
        # (the tokens as logprobs shows them: a character cut between two is not whole)
        raw = "".join(t.token for t in r.logprobs.content)
        n = analysis_tokens([t.token for t in r.logprobs.content])
        assert res.usage.completion_tokens_details.reasoning_tokens == n
        laid_out_so = re.compile(
            r"(<\|channel\|>analysis<\|message\|>.*<\|end\|><\|start\|>assistant)?"
            r"<\|channel\|>final( (<\|constrain\|>)?json)?<\|message\|>\{", re.DOTALL)
        assert laid_out_so.match(raw), raw


def test_a_tool_result_turn_renders_back(server):
    srv, client, _tk = server
    messages = ASK + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = httpx.post(srv.url + "/apply-template", json={"messages": messages, "tools": TOOLS,
                                                       "reasoning_effort": "high"}, timeout=60)
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "Reasoning: high" in prompt
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}"
        "<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"{\\"temperature\\": 21}"<|end|><|start|>assistant')
    # and the model answers it (its random words are content, or a call, never an error)
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                       max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_embeddings_are_the_last_hidden_state(server, tiny_model):
    """/v1/embeddings serves gpt-oss (tests/embedding_checks.py: against transformers)."""
    from strata_jax.testing.hf_gpt_oss import load_gpt_oss

    _srv, client, _tk = server
    check_embeddings(client, load_gpt_oss(tiny_model(**GPT_OSS)), GPT_OSS["hidden"])
