"""Untrusted templates (issue 13, item 4): a request's chat_template_kwargs set template variables
only, unless the server trusts request templates; every render (the model file's template too) is
bounded in output, value sizes and time; a chat request is rendered once.

Unit tests first (no server), then two real `strata-jax serve` processes on one tiny qwen3 model:
one as shipped, one started with --trust-request-chat-template.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack

import httpx
import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizer_data import smollm2_tokenizer

from strata_jax.engine.prompt import chat_text_ids
from strata_jax.gguf import template_sandbox
from strata_jax.gguf.chat_template import RESERVED_TEMPLATE_KWARGS, ChatTemplate
from strata_jax.gguf.template_bounds import RENDER_TIMEOUT_S, ChatTemplateError
from strata_jax.gguf.template_sandbox import render_bounded
from strata_jax.gguf.tokenizer import load_tokenizer
from strata_jax.serve.errors import ApiError
from strata_jax.serve.http.generate import ModelNames, parse_chat
from strata_jax.serve.launch import ServerProcess
from strata_jax.serve.params import RequestParams
from strata_jax.serve.prompts import Prompts
from strata_jax.testing.edit_gguf import rewrite_gguf

HI = [{"role": "user", "content": "Hi"}]
N_CTX = 256


# A template that uses what real ones use (Qwen3's, Llama 3's): namespace, reversed loops,
# loop.index, string methods, tojson with indent, `~`, `%`, `+`, macros, filters. It must render as
# plain jinja does.
RICH_TEMPLATE = """\
{%- macro render_tool(t) -%}{{ t.function.name ~ ': ' ~ (t | tojson(indent=2)) }}{%- endmacro -%}
{%- set ns = namespace(last_user=0, n=0) -%}
{%- for m in messages[::-1] -%}
    {%- if m.role == 'user' and ns.last_user == 0 -%}
        {%- set ns.last_user = messages | length - loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- if tools -%}<tools>{% for t in tools %}
{{ render_tool(t) | indent(2) }}{% endfor %}
</tools>{%- endif -%}
{%- for m in messages -%}
    {%- set ns.n = ns.n + 1 -%}
    {%- set content = m.content | trim -%}
    {%- if content.startswith('/') %}[cmd {{ content.split(' ')[0] | upper }}]{% endif -%}
    {{ '<|%s|>' % m.role }}{{ content | replace('\\n', ' ') }}{{ ' (%d of %d)' % (loop.index, messages | length) }}
    {%- if loop.index == ns.last_user %} <- last user{% endif %}
{% endfor -%}
{{ '{} messages, {:>4}'.format(ns.n, 'end') }}|{{ '-' * 8 }}|{{ ', '.join(['a', 'b']) }}|{{ 2 ** 10 }}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}
"""  # noqa: E501

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Météo, 日本語 👍",
                                            "parameters": {"type": "object",
                                                           "properties": {"q": {"type": "string"}},
                                                           "required": ["q"]}}} for i in range(3)]
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "/help me\nplease"},
        {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Again, 日本語 👍"}]


def _plain_jinja(source: str) -> jinja2.Template:
    """The template as transformers renders it: jinja's sandbox with none of our bounds."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = template_sandbox._raise_exception
    return env.from_string(source)


# ---- the render bounds (no server) ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "rich"])
def test_a_normal_template_renders_the_same_text(name):
    source = smollm2_tokenizer().chat_template if name == "smollm2" else RICH_TEMPLATE
    variables = {"messages": CHAT, "add_generation_prompt": True, "tools": TOOLS, "documents": None}
    ours = ChatTemplate(source).render(CHAT, tools=TOOLS)
    assert ours == _plain_jinja(source).render(**variables)
    assert "Again, 日本語 👍" in ours


# Each hostile template, and words its error must hold. Each would take gigabytes or minutes
# unbounded.
HOSTILE = {
    "string multiplication": ("{{ 'x' * 10**9 }}",
                              "repeated str of about 1,000,000,000 characters"),
    "list multiplication": ("{{ ([1] * 10**9) | length }}", "repeated list"),
    "huge output": (("{% for i in range(100000) %}{% for j in range(1000) %}{{ 'y' * 100 }}"
                     "{% endfor %}{% endfor %}"),
                    "characters of output"),
    "a power": ("{{ 7 ** 1000000 }}", "MAX_INT_BITS"),
    "squaring in a loop": (("{% set ns = namespace(x=2**60) %}{% for i in range(40) %}"
                           "{% set ns.x = ns.x * ns.x %}{% endfor %}"), "MAX_INT_BITS"),
    "doubling with +": (("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                        "{% set ns.s = ns.s + ns.s %}{% endfor %}"), "MAX_RENDER_CHARS"),
    "doubling with ~": (("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"), "MAX_RENDER_CHARS"),
    "doubling with %": (("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                        "{% set ns.s = '%s%s' % (ns.s, ns.s) %}{% endfor %}"), "MAX_RENDER_CHARS"),
    "doubling a block set": (("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set t %}"
                             "{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = t %}{% endfor %}"),
                             "MAX_RENDER_CHARS"),
    "a list that holds itself twice": (("{% set ns = namespace(x=[1]) %}{% for i in range(60) %}"
                                       "{% set ns.x = [ns.x, ns.x] %}{% endfor %}"
                                       "{{ ns.x | tojson }}"),
                                       "MAX_PRINTED_ITEMS"),
    "a width": ("{{ 'x' | center(10**9) }}", "MAX_COUNT"),
    "a method's width": ("{{ 'x'.ljust(10**9) }}", "MAX_COUNT"),
    "a % width": ("{{ '%999999999d' % 1 }}", "MAX_COUNT"),
    "a * width": ("{{ '%*d' % (999999999, 1) }}", "MAX_COUNT"),
    "a format width": ("{{ '{:>999999999}'.format(1) }}", "MAX_COUNT"),
    "replace by itself": ("{% set s = 'x' * 100000 %}{{ s.replace('', s) | length }}",
                          "replace's text"),
    "join with itself": ("{% set s = 'x' * 100000 %}{{ s.join([s] * 1000) | length }}",
                         "join's text"),
    "indent every line": ("{% set s = '\\n' * 100000 %}{{ s | indent(99999) | length }}",
                          "indent's text"),
    "tojson "
    "indent": ("{% set s = [[[[[[[[1]]]]]]]] * 10000 %}{{ s | tojson(indent=99999) | length }}",
                      "tojson text"),
    "batch padding": ("{{ [1] | batch(10**9, 'x') | list | length }}", "MAX_COUNT"),
    "endless recursion": ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
                          "RecursionError"),
    "division by zero": ("{{ 1 / 0 }}", "ZeroDivisionError"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_fails_fast_naming_the_bound(name):
    source, words = HOSTILE[name]
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=words):
        ChatTemplate(source).render(HI)
    assert time.monotonic() - t0 < 10   # none runs into the time bound (that is the next test)


@pytest.mark.parametrize("source", [
    # no output, no calls
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # 2**50 calls
    "{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(50) }}",
])
def test_a_slow_template_stops_at_the_time_bound(source):
    template = ChatTemplate(source)._template
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="ran for more than 0.3 s"):
        render_bounded(template, {"messages": HI}, timeout_s=0.3)
    assert time.monotonic() - t0 < 3
    t0 = time.monotonic()
    # the default bound, through render
    with pytest.raises(ChatTemplateError, match="RENDER_TIMEOUT_S"):
        ChatTemplate(source).render(HI)
    assert RENDER_TIMEOUT_S <= time.monotonic() - t0 < RENDER_TIMEOUT_S + 3


def test_the_model_files_template_is_bounded_too(tiny_model, tmp_path):
    model = rewrite_gguf(tiny_model(arch="qwen3", layers=2, hidden=64), tmp_path / "hostile.gguf",
                         set_metadata={"tokenizer.chat_template": HOSTILE["huge output"][0]})
    with pytest.raises(ChatTemplateError, match="characters of output"):
        load_tokenizer(model).apply_chat_template(HI)


def test_kwargs_may_use_any_name_as_a_variable():
    # `self` is the name of the methods' own first argument: it must not collide with it (a
    # TypeError, once). (In jinja `self` is the template itself, so the template cannot read it: no
    # matter.)
    tok = smollm2_tokenizer()
    out = tok.apply_chat_template(HI, chat_template="{{ x }}|{{ eos_token }}", self="me", x=1,
                                  eos_token="E")
    assert out == "1|E"


# ---- the reserved keys and rendering once (no server) --------------------------------------------


def test_reserved_keys_are_refused_unless_trusted():
    names = ModelNames("tiny")
    for key in sorted(RESERVED_TEMPLATE_KWARGS):
        body = json.dumps({"messages": HI,
                           "chat_template_kwargs": {"enable_thinking": False, key: "x"}}).encode()
        with pytest.raises(ApiError) as e:
            parse_chat(body, names)
        assert (e.value.status == 400
                and e.value.param == f"chat_template_kwargs.{key}"), e.value.body()
        assert (e.value.type == "invalid_request_error"
                and "--trust-request-chat-template" in e.value.message)
        assert parse_chat(body, names, trust_template=True).chat_template_kwargs[key] == "x"
    body = json.dumps({"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}).encode()
    assert parse_chat(body, names).chat_template_kwargs == {"enable_thinking": False}


def test_a_chat_is_rendered_once_per_request(think_model, monkeypatch):
    """The server's prompt maker (serve/prompts.py) as a server runs it, loaded from the model's
    file: ChatTemplate.render is where every render goes through, once a request."""
    prompts = Prompts.load(str(think_model), N_CTX)
    tok = prompts.tokenizer
    # an attention family: no second render for a hybrid family's turn end (engine/prompt.py)
    assert not prompts.hybrid
    renders = []
    real_render = ChatTemplate.render
    monkeypatch.setattr(ChatTemplate, "render",
                        lambda self, *a, **k: renders.append(1) or real_render(self, *a, **k))
    params = RequestParams(max_tokens=4, temperature=0.0, top_k=40, top_p=0.95, min_p=0.05)
    for kwargs, think in (({}, True), ({"enable_thinking": False}, False)):
        renders.clear()
        prepared = prompts.prepare(HI, params, kwargs)
        assert len(renders) == 1
        text = tok.apply_chat_template(HI, **kwargs)
        assert prepared.ids == chat_text_ids(tok, text) and prepared.think is think
        assert prepared.sampling.top_k == 40 and prepared.max_tokens == 4
    renders.clear()
    prepared = prompts.prepare("plain text", params)
    assert renders == [] and prepared.ids == tok.encode("plain text", add_special=True)


# ---- against the real server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(think_model):
    """(as shipped, trusting request templates): started together, so their starts overlap."""
    args = [str(think_model), "--parallel", "1", "--max-context", str(N_CTX), "--model-name",
            "tiny"]
    with ExitStack() as stack:
        plain = stack.enter_context(ServerProcess(args))
        trusted = stack.enter_context(ServerProcess([*args, "--trust-request-chat-template"]))
        # the background compiles done first: a hostile template's render times race its limits
        yield plain.wait_ready().wait_built(), trusted.wait_ready().wait_built()


@pytest.fixture(scope="module")
def tok(think_model):
    return load_tokenizer(think_model)


def _chat(server, kwargs, messages=HI, timeout=60):
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, "chat_template_kwargs": kwargs}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=timeout)


def _prompt_tokens(tok, text: str) -> int:
    return len(chat_text_ids(tok, text))


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_server_refuses_each_reserved_key(servers, key):
    r = _chat(servers[0], {"enable_thinking": False, key: "{{ 'x' }}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == f"chat_template_kwargs.{key}"
    assert key in err["message"] and "--trust-request-chat-template" in err["message"]


def test_server_takes_template_variables(servers, tok):
    for thinking in (True, False):
        r = _chat(servers[0], {"enable_thinking": thinking})
        assert r.status_code == 200, r.text
        text = tok.apply_chat_template(HI, enable_thinking=thinking)
        assert r.json()["usage"]["prompt_tokens"] == _prompt_tokens(tok, text)


def test_trusted_server_uses_the_requests_template_and_inputs(servers, tok):
    trusted = servers[1]
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
                "{{ add_generation_prompt }} OURS")
    cases = [({"chat_template": template}, f"{tok.bos_token}[Hi]True OURS"),
             ({"chat_template": template,
               "messages": [{"role": "user", "content": "other words here"}],
               "add_generation_prompt": False, "bos_token": ""}, "[other words here]False OURS")]
    for kwargs, text in cases:
        r = _chat(trusted, kwargs)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == _prompt_tokens(tok, text), text
    assert _chat(servers[0], cases[0][0]).status_code == 400


@pytest.mark.parametrize("name",
                         ["string multiplication", "huge output", "a list that holds itself twice"])
def test_trusted_server_refuses_a_hostile_template_at_once(servers, name):
    source, words = HOSTILE[name]
    t0 = time.monotonic()
    r = _chat(servers[1], {"chat_template": source})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 10


def test_trusted_server_stops_a_long_loop_and_serves_on(servers):
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    t0 = time.monotonic()
    r = _chat(servers[1], {"chat_template": loop})
    assert r.status_code == 400 and "RENDER_TIMEOUT_S" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < RENDER_TIMEOUT_S + 10
    for server in servers:
        r = _chat(server, {})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
