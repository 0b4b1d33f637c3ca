"""Tool-call formats of the families we serve (issue 16, item 1): Llama 3, Mistral's two, GLM-4.5,
Qwen3.5's Qwen3-Coder XML (issue 34), beside Hermes and generic (serve/tool_formats/).

Parsers on literal model texts, fed whole and split at every character boundary (a streamed answer
is the same calls as a whole one); the forced-call grammars walked at random over a vocabulary where
the marks are special tokens; and, against the real server with the official openai client, a made
model whose chat template is each family's own (written into its metadata, with the marks as control
tokens): forced calls validate, stream as OpenAI streams them (a first piece with id, type, name and
arguments "", then argument pieces), several calls have their own indexes, `parallel_tool_calls:
false` gives one, and a round trip (call, result, answer) renders in the family's template."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import openai
import pytest
from tool_data import TIME, WEATHER, grammar_walk

from strata_jax.serve.launch import ServerProcess
from strata_jax.serve.tool_formats import CallStream, detect
from strata_jax.serve.tools import call_grammar, deltas, parse_calls, special_marks
from strata_jax.testing.templates import QWEN35_TEMPLATE

TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

PARIS = '{"city": "Zürich", "unit": "c"}'
ZONE = '{"zone": -3}'
TWO = [("get_weather", PARIS), ("get_time", ZONE)]
# (format, the model's text, content left, calls)
TEXTS = [
    ("hermes",
     (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "get_time", "arguments": {ZONE}}}\n</tool_call>'),
     "Let me look.", TWO),
    ("llama3", f'{{"name": "get_weather", "parameters": {PARIS}}}', None, TWO[:1]),
    ("llama3", (f'<|python_tag|>{{"name": "get_weather", "parameters": {PARIS}}}; '
               f'{{"name": "get_time", "parameters": {ZONE}}}'), None, TWO),
    ("llama3", f'{{"type": "function", "name": "get_time", "parameters": {ZONE}}}', None, TWO[1:]),
    ("mistral",
     (f'Sure.[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}, "id": "a1b2c3d4e"}}, '
                f'{{"name": "get_time", "arguments": {ZONE}, "id": "Zz9Yy8Xx7"}}]'), "Sure.", TWO),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_time", "arguments": {ZONE}}}]', None, TWO[1:]),
    ("mistral_args", f'[TOOL_CALLS]get_weather[ARGS]{PARIS}[TOOL_CALLS]get_time[ARGS]{ZONE}',
     None, TWO),
    ("mistral_args", f'Checking.[TOOL_CALLS]get_time[CALL_ID]abcDEF123[ARGS]{ZONE}',
     "Checking.", TWO[1:]),
    ("glm45", ('\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n'
              '<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>\n'
              '<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>-3</arg_value>\n'
              '</tool_call>'), None, TWO),
    ("glm45", ('I will check.\n<tool_call>get_time\n<arg_key>zone</arg_key>\n'
               '<arg_value>-3</arg_value>\n</tool_call>'),
     "I will check.", TWO[1:]),
    ("qwen3_coder", ('<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n'
                    '<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
                    '<function=get_time>\n<parameter=zone>\n-3\n</parameter>\n</function>\n'
                    '</tool_call>'), None, TWO),
    ("qwen3_coder", ('I will check.\n\n<tool_call>\n<function=get_time>\n<parameter=zone>\n-3\n'
                    '</parameter>\n</function>\n</tool_call>'), "I will check.", TWO[1:]),
    ("generic", f'{{"name": "get_weather", "arguments": {PARIS}}}', None, TWO[:1]),
    ("generic", (f'[{{"name": "get_weather", "arguments": {PARIS}}}, {{"name": "get_time", '
                 f'"arguments": {ZONE}}}]'),
     None, TWO),
]


def streamed(fmt: str, pieces: list[str],
             parallel: bool = True) -> tuple[str, list[dict], list[tuple]]:
    s = CallStream(fmt, TOOLS, parallel)
    events = [e for p in pieces for e in s.feed(p)] + s.end()
    return "".join(e[1] for e in events if e[0] == "content"), s.calls, events


def names_args(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) if "function" in c
            else (c["name"], c["arguments"])
            for c in calls]


@pytest.mark.parametrize("fmt, text, content, calls", TEXTS)
def test_each_format_parses_its_calls(fmt, text, content, calls):
    got_content, got = parse_calls(text, fmt, TOOLS)
    assert (got_content, names_args(got)) == (content, calls)
    assert len({c["id"] for c in got}) == len(got)
    if fmt.startswith("mistral"):      # Mistral's templates take 9 letters or digits
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)
    else:
        assert all(c["id"].startswith("call_") for c in got)
    one_content, one = parse_calls(text, fmt, TOOLS, parallel=False)
    assert names_args(one) == calls[:1] and one_content == content


@pytest.mark.parametrize("fmt, text, content, calls", TEXTS)
def test_split_at_every_boundary_the_same_calls(fmt, text, content, calls):
    for cut in range(len(text) + 1):
        got_content, got, _ = streamed(fmt, [text[:cut], text[cut:]])
        assert names_args(got) == calls, (cut, got)
        assert (got_content.strip() or None) == content, cut
    got_content, got, events = streamed(fmt, list(text))          # a character a piece
    assert names_args(got) == calls and (got_content.strip() or None) == content
    # OpenAI's pieces: the first of a call with index, id, type, name and arguments ""; then
    # arguments
    pieces = [d["tool_calls"][0] for d in deltas(events) if "tool_calls" in d]
    for i, (name, args) in enumerate(calls):
        mine = [p for p in pieces if p["index"] == i]
        assert mine[0] == {"index": i, "id": got[i]["id"], "type": "function",
                           "function": {"name": name, "arguments": ""}}
        assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"}
                   for p in mine[1:])
        assert "".join(p["function"]["arguments"] for p in mine[1:]) == args
        # arguments made a pair at a time there: the others as written
        if fmt not in ("glm45", "qwen3_coder"):
            assert len(mine) > 3


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "mistral_args", "glm45",
                                 "qwen3_coder", "generic"])
@pytest.mark.parametrize("text", ["Paris is sunny.", '{"answer": 42}',
                                  "<tool_call>\nnot json\n</tool_call> ok",
                                  '{"name": "nope", "arguments": {}}',
                                  "[TOOL_CALLS]nope[ARGS]{} ok", "<tool_call>nope\n</tool_call>",
                                  "[1, 2]", "<|python_tag|>print(1)",
                                  "<tool_call>\n<function=nope>\n</function>\n</tool_call>"])
def test_text_that_is_no_call_is_content(fmt, text):
    content, calls = parse_calls(text, fmt, TOOLS)
    assert (content, calls) == (text, [])
    for cut in range(len(text) + 1):
        got_content, got, _ = streamed(fmt, [text[:cut], text[cut:]])
        assert not got and got_content == text.lstrip(), cut


def test_a_call_cut_short_is_no_call_whole_and_a_started_one_streamed():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert parse_calls(text, "hermes", TOOLS) == (text, [])
    _, calls, _ = streamed("hermes", [text])
    assert [(c["name"], c["complete"]) for c in calls] == [("get_weather", False)]


@pytest.mark.parametrize("fmt, source", [
    ("llama3", "{{- '<|start_header_id|>ipython<|end_header_id|>' }}"),
    ("mistral", "[TOOL_CALLS]["),
    ("mistral_args", "[TOOL_CALLS]{{ name }}[ARGS]"), ("glm45", "<tool_call>{{ n }}<arg_key>"),
    ("hermes", "<tool_call>\n{{ c | tojson }}"), ("hermes", "anything else"),
    ("qwen3_coder",
     "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + args_name }}"),
])
def test_formats_are_told_by_the_template_marks(fmt, source):
    assert detect(source) == fmt


# ---- the families' templates (their real shapes, as the models' GGUFs carry them) ----------------

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501

MISTRAL_NEMO = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

MISTRAL_SMALL_32 = """{%- set default_system_message = "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI." %}
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = default_system_message %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}
{%- if tools is defined and tools is not none and tools|length > 0 %}
    {{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'system' %}
        {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if message['content'] %}
            {{- message['content'] }}
        {%- endif %}
        {%- if message['tool_calls'] %}
            {%- for tool in message['tool_calls'] %}
                {%- set arguments = tool['function']['arguments'] %}
                {%- if arguments is not string %}
                    {%- set arguments = arguments|tojson %}
                {%- endif %}
                {{- "[TOOL_CALLS]" + tool['function']['name'] + "[ARGS]" + arguments }}
            {%- endfor %}
        {%- endif %}
        {{- eos_token }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]' + message['content']|string + '[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user, system, assistant and tool roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

GLM45 = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text }}
            {%- elif item is string -%}
                {{- item }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
    {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ visible_text(m.content) }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not visible_text(m.content).endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\\n<tool_response>\\n' }}
{{- m.content }}
{{- '\\n</tool_response>' }}
{%- else -%}
<|observation|>{% for tr in m.content %}

<tool_response>
{{ tr.output if tr.output is defined else tr }}
</tool_response>{% endfor -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}
"""  # noqa: E501

# family: (template, its marks that are control tokens in the family's vocabulary)
FAMILIES = {
    "llama3": (LLAMA31,
               ["<|python_tag|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]),
    "mistral": (MISTRAL_NEMO,
                ["[TOOL_CALLS]", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]),
    "mistral_args": (MISTRAL_SMALL_32,
                     ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[INST]", "[/INST]"]),
    "glm45": (GLM45, ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                      "</arg_value>", "<|user|>", "<|assistant|>", "<|observation|>"]),
    # (<think> is in the vocabulary)
    "qwen3_coder": (QWEN35_TEMPLATE, ["<tool_call>", "</tool_call>"]),
    "generic": (None, []),          # the made model's own ChatML, which knows no tools
}


def with_marks(metadata: dict, marks: list[str]) -> dict:
    """The vocabulary with its last merged tokens (and their merges) given to the marks, as control
    tokens."""
    tokens, types = (list(metadata["tokenizer.ggml.tokens"]),
                     list(metadata["tokenizer.ggml.token_type"]))
    first_special = tokens.index("<|endoftext|>")
    for j, mark in enumerate(marks):
        tokens[first_special - 1 - j], types[first_special - 1 - j] = mark, 3       # CONTROL
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": list(metadata["tokenizer.ggml.merges"])[:-len(marks)]}


def family_tokenizer(family: str):
    from strata_jax.gguf import load_tokenizer
    from strata_jax.makers.tiny_tokenizer import tiny_tokenizer

    md = {k: v for k, (v, _) in tiny_tokenizer(512).metadata("qwen2").items()}
    md |= with_marks(md, FAMILIES[family][1])
    md["tokenizer.chat_template"] = FAMILIES[family][0]
    return load_tokenizer(md)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "mistral_args", "glm45",
                                 "qwen3_coder", "generic"])
def test_forced_grammars_walked_at_random_give_valid_calls(fmt, parallel):
    """Random tokens among those each grammar allows: every walk that ends is calls that validate,
    written with the marks' special tokens; parallel false: one call."""
    from strata_jax.engine.grammar.constrain import Grammars

    tk = family_tokenizer(fmt if FAMILIES.get(fmt, (None,))[0] else "glm45")
    marks = special_marks(tk)
    grammars = Grammars(tk, tk.vocab_size)
    rng = np.random.default_rng(0)
    ended = 0
    for _ in range(12):
        c = grammars.constraint(call_grammar(TOOLS, "required", fmt, parallel, marks))
        out, walked_to_end = grammar_walk(c, tk, rng)
        if not walked_to_end:
            continue                    # a long parallel walk: not ended, not checked
        ended += 1
        text = tk.decode(out)
        content, calls = parse_calls(text, fmt, TOOLS, parallel)
        assert calls and not (content or "").replace("<think></think>", "").strip(), text
        assert len(calls) == 1 or parallel
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                SCHEMAS[call["function"]["name"]])
        for mark in ("[TOOL_CALLS]", "<tool_call>", "[ARGS]"):
            if mark in marks and mark in text and fmt != "hermes":
                assert marks[mark] in out, (mark, text)
    assert ended >= 6


def test_forced_grammar_of_a_named_function():
    tk = family_tokenizer("mistral_args")
    grammar = call_grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}},
                           "mistral_args", True, special_marks(tk))
    assert "get_time" in grammar[1] and "get_weather" not in grammar[1]


# ---- against the real server ---------------------------------------------------------------------

N_CTX = 2048


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="qwen3", layers=2, hidden=64)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, model, tmp_path_factory):
    from strata_jax.gguf import GGUFModel
    from strata_jax.testing.edit_gguf import rewrite_gguf

    template, marks = FAMILIES[request.param]
    path = model
    if template is not None:
        metadata = GGUFModel.open(model).metadata
        path = rewrite_gguf(model, tmp_path_factory.mktemp(request.param) / "model.gguf",
                            set_metadata={"tokenizer.chat_template": template,
                                          **with_marks(metadata, marks)})
    with ServerProcess([str(path), "--parallel", "4", "--max-context", str(N_CTX), "--model-name",
                        "tiny"]) as srv:
        srv.wait_up().wait_ready()
        yield request.param, openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                           timeout=300)


def ask(client, seed: int, **kw):
    return client.chat.completions.create(**{"model": "tiny", "messages": ASK, "tools": TOOLS,
                                             "max_tokens": 120, "tool_choice": "required",
                                             "temperature": 1.0, "seed": seed, **kw})


def stream_calls(client, seed: int, **kw) -> tuple[list, str | None, str]:
    chunks = list(ask(client, seed, stream=True, **kw))
    pieces = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return pieces, reason, content


def test_forced_calls_in_the_family_format_whole_and_streamed(family):
    fmt, client = family
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: ask(client, i, parallel_tool_calls=False), range(8)))
    for r in answers:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (fmt, choice)
        (call,) = choice.message.tool_calls
        assert call.type == "function" and (len(call.id) == 9 if fmt.startswith("mistral") else
                                             call.id.startswith("call_"))
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    pieces, reason, content = stream_calls(client, 0, parallel_tool_calls=False)
    assert reason == "tool_calls" and not content.strip()
    first = pieces[0]
    assert (first.index, first.type, first.function.arguments) == (0, "function", "") and first.id
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 2                  # the arguments came in pieces, not as one
    whole = answers[0].choices[0].message.tool_calls[0]
    assert first.function.name == whole.function.name
    assert "".join(p.function.arguments for p in pieces) == whole.function.arguments


def test_several_calls_each_with_its_index(family):
    fmt, client = family
    seen = 0
    for seed in range(6):
        r = ask(client, seed, max_tokens=300,
                tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = r.choices[0]
        if choice.finish_reason == "length":
            continue
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and calls
        assert all(c.function.name == "get_time" for c in calls)
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS["get_time"])
        assert len({c.id for c in calls}) == len(calls)
        seen = max(seen, len(calls))
        pieces, _, _ = stream_calls(client, seed, max_tokens=300,
                                    tool_choice={"type": "function",
                                                 "function": {"name": "get_time"}})
        heads = [p for p in pieces if p.id is not None]
        assert [p.index for p in heads] == list(range(len(calls)))
        assert ["".join(p.function.arguments for p in pieces if p.index == i)
                for i in range(len(calls))] == \
               [c.function.arguments for c in calls]
    # Llama 3.1's template renders one call a message: its grammar writes one
    if fmt != "llama3":
        assert seen >= 2, "no answer made several calls"


def test_a_round_trip_renders_in_the_family_template(family):
    _fmt, client = family
    call = ask(client, 3, parallel_tool_calls=False).choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    for stream in (False, True):
        r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                           tool_choice="none", max_tokens=12, temperature=0,
                                           stream=stream)
        if stream:
            chunks = list(r)
            assert ([c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop",
                                                                                      "length"))
            assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        else:
            assert (r.choices[0].finish_reason in ("stop", "length")
                    and not r.choices[0].message.tool_calls)
    # auto: the model may or may not call; whatever it writes is an answer (no error)
    r = ask(client, 1, tool_choice="auto", max_tokens=24)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
