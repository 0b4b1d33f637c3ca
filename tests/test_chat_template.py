"""Chat templates render what transformers' apply_chat_template renders; bad chats get clear
errors."""

from __future__ import annotations

import json

import pytest
from tokenizer_data import made_vocab, smollm2_tokenizer, smollm2_transformers

from strata_jax.gguf.chat_template import (
    ChatMessageError,
    ChatTemplate,
    NoChatTemplateError,
    validate_messages,
)
from strata_jax.gguf.named_templates import NAMED_TEMPLATES, chat_template_source
from strata_jax.gguf.template_bounds import ChatTemplateError
from strata_jax.gguf.tokenizer import load_tokenizer

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi! 日本語で? 👍"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again,\nwith a newline."},
    ],
    [{"role": "user", "content": ""}],
]

# A Qwen3-style template: thinking can be switched off with enable_thinking=False.
THINKING_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Whitespace control as HF sets it (trim_blocks, lstrip_blocks), loop controls, tojson, tools,
# strftime_now.
FEATURES_TEMPLATE = """\
{% if tools %}
    <tools>{{ tools | tojson(indent=2) }}</tools>
{% endif %}
{% for message in messages %}
    {% if message.role == 'tool' %}{% continue %}{% endif %}
    [{{ message.role }}] {{ message.content | tojson }}
    {% if loop.index >= 3 %}{% break %}{% endif %}
{% endfor %}
{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}
"""

TOOLS = [{"type": "function",
          "function": {"name": "météo", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_renders_like_transformers(chat, add_generation_prompt):
    ours = smollm2_tokenizer().apply_chat_template(chat,
                                                   add_generation_prompt=add_generation_prompt)
    hf = smollm2_transformers()
    theirs = hf.apply_chat_template(chat, tokenize=False,
                                    add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_smollm2_prompt_text():
    prompt = smollm2_tokenizer().apply_chat_template(CHATS[0])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of "
        "France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm2_tokenizer().encode(prompt)
    assert ids[0] == smollm2_tokenizer().token_to_id("<|im_start|>")


@pytest.mark.parametrize("template", [THINKING_TEMPLATE, FEATURES_TEMPLATE])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False},
                                    {"enable_thinking": True, "tools": TOOLS}])
def test_custom_templates_render_like_transformers(template, kwargs):
    chat = CHATS[1][:2] + [{"role": "tool", "content": "ignored"}] + CHATS[1][2:]
    ours = smollm2_tokenizer().apply_chat_template(chat, chat_template=template, **kwargs)
    theirs = smollm2_transformers().apply_chat_template(
        chat, chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert ours == theirs


REASONING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.thinking %}[{{ m.thinking }}]{% endif %}{{ m.content }}\n{% endfor %}"
)


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_fields_render_like_transformers(field):
    chat = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", field: "add them"}]
    ours = smollm2_tokenizer().apply_chat_template(chat, add_generation_prompt=False,
                                                   chat_template=REASONING_TEMPLATE)
    theirs = smollm2_transformers().apply_chat_template(chat, chat_template=REASONING_TEMPLATE,
                                                        tokenize=False)
    assert ours == theirs == "user:2+2?\nassistant:<think>add them</think>[add them]4\n"


def test_enable_thinking_reaches_the_template():
    tok = smollm2_tokenizer()
    chat = CHATS[0]
    off = tok.apply_chat_template(chat, chat_template=THINKING_TEMPLATE, enable_thinking=False)
    on = tok.apply_chat_template(chat, chat_template=THINKING_TEMPLATE, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    assert tok.apply_chat_template(chat, chat_template=THINKING_TEMPLATE) == on


def test_template_helpers():
    out = ChatTemplate(FEATURES_TEMPLATE).render(CHATS[1], tools=TOOLS, bos_token="<s>",
                                                 eos_token="</s>")
    # not ASCII-escaped, not HTML-escaped
    assert json.dumps(TOOLS, ensure_ascii=False, indent=2) in out
    assert '"Hi! 日本語で? 👍"' in out
    assert "[assistant]" in out and "Again" not in out  # {% break %} after the third message
    assert out.rstrip().endswith("<s>|</s>|4")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(CHATS[0])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_template_is_sandboxed():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}"
                     "{{ ''.__class__.__subclasses__() }}").render(CHATS[0])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set _ = messages.append(1) %}").render(CHATS[0])  # immutable


def test_no_template_error_and_plain_encode_still_works():
    _, md = made_vocab("qwen2")
    tok = load_tokenizer({k: v for k, v in md.items() if k != "tokenizer.chat_template"})
    assert tok.chat_template is None
    with pytest.raises(NoChatTemplateError) as err:
        tok.apply_chat_template(CHATS[0])
    assert "no chat template" in str(err.value) and "completions" in str(err.value)
    assert "chat_template" in str(err.value)
    assert tok.decode(tok.encode("plain completion text")) == "plain completion text"
    # a template can be passed instead, per call or when loading
    assert tok.apply_chat_template(CHATS[0],
                                   chat_template=THINKING_TEMPLATE).startswith("<|im_start|>user\n")
    assert load_tokenizer(md, chat_template=THINKING_TEMPLATE).chat_template == THINKING_TEMPLATE


def test_text_parts_and_none_fields():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"},
                                     {"type": "text", "text": "two"}], "name": None},
        {"role": "assistant", "content": None,
         "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    ]
    checked = validate_messages(messages)
    assert checked[0] == {"role": "user", "content": "one\ntwo"}
    assert "content" not in checked[1] and checked[1]["tool_calls"]
    # the caller's messages are not changed
    assert messages[0]["content"][0] == {"type": "text", "text": "one"}


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "must be a list"),
        ([], "empty"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "a"}, {"role": "bot", "content": "hi"}],
         r"messages\[1\]\.role is 'bot'"),
        ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
        ([{"role": "user", "content": 42}],
         r"messages\[0\]\.content must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
         r"content\[0\]\.type is 'image_url'"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text must be a string"),
        ([{"role": "assistant", "content": None}], r"messages\[0\] \(assistant\) has no 'content'"),
    ],
)
def test_bad_messages_name_the_field(messages, match):
    with pytest.raises(ChatMessageError, match=match):
        smollm2_tokenizer().apply_chat_template(messages)


# llama.cpp's built-in names (its src/llama-chat.cpp formats them in C++): the text it makes for
# this chat.
NAMED_CHAT = [{"role": "system", "content": "You are a test."},
              {"role": "user", "content": "Hi there"},
              {"role": "assistant", "content": " Hello "}, {"role": "user", "content": "Again"}]
LLAMA_CPP_TEXT = {
    "chatml": "<|im_start|>system\nYou are a test.<|im_end|>\n<|im_start|>user\nHi "
              "there<|im_end|>\n<|im_start|>assistant\n Hello "
              "<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a "
              "test.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi "
              "there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
              "Hello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
              "Again<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a "
                 "test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi "
                 "there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello<|"
                 "END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Again<|END_OF_TURN_TOKEN|"
                 "><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "llama2-sys": "[INST] <<SYS>>\nYou are a test.\n<</SYS>>\n\nHi there [/INST] Hello </s>[INST] "
                  "Again [/INST]",
    "mistral-v1": " [INST] You are a test.\n\nHi there [/INST]  Hello </s> [INST] Again [/INST]",
    "mistral-v3": "[INST] You are a test.\n\nHi there[/INST] Hello</s>[INST] Again[/INST]",
    "mistral-v7": "[SYSTEM_PROMPT] You are a test.[/SYSTEM_PROMPT][INST] Hi there[/INST]  Hello "
                  "</s>[INST] Again[/INST]",
    "gemma": "<start_of_turn>user\nYou are a test.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
             "Hello<end_of_turn>\n<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n",
    "vicuna": "You are a test.\n\nUSER: Hi there\nASSISTANT:  Hello </s>\nUSER: Again\nASSISTANT:",
    "openchat": "You are a test.<|end_of_turn|>GPT4 Correct User: Hi there<|end_of_turn|>GPT4 "
                "Correct Assistant:  Hello <|end_of_turn|>GPT4 Correct User: "
                "Again<|end_of_turn|>GPT4 Correct Assistant:",
    "deepseek3": "You are a test.\n\n<｜User｜>Hi there<｜Assistant｜> Hello "
                 "<｜end▁of▁sentence｜><｜User｜>Again<｜Assistant｜>",
}


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_TEXT))
def test_named_templates_render_as_llama_cpp(name):
    assert ChatTemplate(chat_template_source(name)).render(NAMED_CHAT) == LLAMA_CPP_TEXT[name]


def test_named_templates_all_render_and_other_values_are_jinja():
    for name, source in NAMED_TEMPLATES.items():
        assert "Again" in ChatTemplate(source).render(NAMED_CHAT), name
    assert chat_template_source("{{ messages[0].content }}") == "{{ messages[0].content }}"
