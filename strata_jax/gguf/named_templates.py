"""llama.cpp's built-in chat template names (`--chat-template chatml`, ...), as Jinja.

llama.cpp formats these in C++ (src/llama-chat.cpp, llm_chat_apply_template); here each is a Jinja
template that renders the same text, so a name goes through the same sandboxed renderer as a model's
own template. `--chat-template VALUE` that is none of these names is the template itself (as
llama.cpp takes it). Newlines are written as '\\n' inside expressions: chat templates render with
trim_blocks, which would eat a newline written after a block tag.
"""

from __future__ import annotations

# For each name: the messages, then the assistant's turn opened when add_generation_prompt.
_LOOP = "{%- for m in messages -%}"
_SP = "{{ ' ' }}"        # a space beside a {%- -%} tag, which would strip a literal one
_END = "{%- endfor -%}"


def _each(body: str, open_turn: str = "") -> str:
    gen = f"{{%- if add_generation_prompt -%}}{open_turn}{{%- endif -%}}" if open_turn else ""
    return _LOOP + body + _END + gen


def _llama2(system: str) -> str:
    return ("{%- set ns = namespace(inside=true) -%}[INST]" + _SP + _LOOP +
            "{%- if not ns.inside -%}{%- set ns.inside = true -%}[INST]" + _SP + "{%- endif -%}"
            "{%- if m.role == 'system' -%}" + system +
            "{%- elif m.role == 'user' -%}{{ m.content }} [/INST]"
            "{%- else -%}{{ m.content }}</s>{%- set ns.inside = false -%}{%- endif -%}" + _END)


def _mistral(lead: str, trail: str, trim: bool) -> str:
    lead, trail = lead.replace(" ", _SP), trail.replace(" ", _SP)
    content = "{{ m.content | trim }}" if trim else "{{ m.content }}"
    return ("{%- set ns = namespace(inside=false) -%}" + _LOOP +
            "{%- if not ns.inside -%}{%- set ns.inside = true -%}" + lead + "[INST]" + trail
            + "{%- endif -%}"
            "{%- if m.role == 'system' -%}{{ m.content }}{{ '\\n\\n' }}"
            "{%- elif m.role == 'user' -%}{{ m.content }}" + lead + "[/INST]"
            "{%- else -%}" + trail + content + "</s>{%- set ns.inside = false -%}{%- endif -%}"
            + _END)


_GEMMA = ("{%- set ns = namespace(system='') -%}" + _LOOP +
          "{%- if m.role == 'system' -%}{%- set ns.system = ns.system + (m.content | trim) -%}"
          "{%- else -%}{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
          "<start_of_turn>{{ role }}{{ '\\n' }}"
          "{%- if ns.system and role != 'model' -%}{{ ns.system }}{{ '\\n\\n' }}"
          "{%- set ns.system = '' -%}{%- endif -%}{{ m.content | trim }}<end_of_turn>{{ '\\n' }}"
          "{%- endif -%}" + _END
          + "{%- if add_generation_prompt -%}<start_of_turn>model{{ '\\n' }}{%- endif -%}")


def _vicuna(system: str) -> str:
    return _each("{%- if m.role == 'system' -%}" + system +
                 "{%- elif m.role == 'user' -%}USER: {{ m.content }}{{ '\\n' }}"
                 "{%- elif m.role == 'assistant' -%}ASSISTANT: "
                 "{{ m.content }}</s>{{ '\\n' }}{%- endif -%}", "ASSISTANT:")


def _roles(system: str, user: str, assistant: str, open_turn: str) -> str:
    return _each("{%- if m.role == 'system' -%}" + system + "{%- elif m.role == 'user' -%}" + user +
                 "{%- elif m.role == 'assistant' -%}" + assistant + "{%- endif -%}", open_turn)


_CMD = "<|START_OF_TURN_TOKEN|>"

NAMED_TEMPLATES: dict[str, str] = {
    "chatml": _each("<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}",
                    "<|im_start|>assistant{{ '\\n' }}"),
    "llama2": _llama2("{{ m.content }}{{ '\\n' }}"),
    "llama2-sys": _llama2("<<SYS>>{{ '\\n' }}{{ m.content }}{{ '\\n' }}<</SYS>>{{ '\\n\\n' }}"),
    "mistral-v1": _mistral(" ", " ", False),
    "mistral-v3": _mistral("", " ", True),
    "mistral-v3-tekken": _mistral("", "", False),
    "mistral-v7": _roles("[SYSTEM_PROMPT] {{ m.content }}[/SYSTEM_PROMPT]",
                         "[INST] {{ m.content }}[/INST]",
                         _SP + "{{ m.content }}</s>",
                         "").replace("{%- elif m.role == 'assistant' -%}", "{%- else -%}"),
    "phi3": _each("<|{{ m.role }}|>{{ '\\n' }}{{ m.content }}<|end|>{{ '\\n' }}",
                  "<|assistant|>{{ '\\n' }}"),
    "phi4": _each("<|im_start|>{{ m.role }}<|im_sep|>{{ m.content }}<|im_end|>",
                  "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _each("<|{{ m.role }}|>{{ '\\n' }}{{ m.content }}{{ '\\n' }}",
                     "<|assistant|>{{ '\\n' }}"),
    "zephyr": _each("<|{{ m.role }}|>{{ '\\n' }}{{ m.content }}<|endoftext|>{{ '\\n' }}",
                    "<|assistant|>{{ '\\n' }}"),
    "gemma": _GEMMA,
    "vicuna": _vicuna("{{ m.content }}{{ '\\n\\n' }}"),
    "vicuna-orca": _vicuna("SYSTEM: {{ m.content }}{{ '\\n' }}"),
    "deepseek": _roles("{{ m.content }}", "### Instruction:{{ '\\n' }}{{ m.content }}{{ '\\n' }}",
                       "### Response:{{ '\\n' }}{{ m.content }}{{ '\\n' }}<|EOT|>{{ '\\n' }}",
                       "### Response:{{ '\\n' }}"),
    "deepseek3": _roles("{{ m.content }}{{ '\\n\\n' }}", "<｜User｜>{{ m.content }}",
                        "<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>", "<｜Assistant｜>"),
    "command-r": _roles(_CMD + "<|SYSTEM_TOKEN|>{{ m.content | trim }}<|END_OF_TURN_TOKEN|>",
                        _CMD + "<|USER_TOKEN|>{{ m.content | trim }}<|END_OF_TURN_TOKEN|>",
                        _CMD + "<|CHATBOT_TOKEN|>{{ m.content | trim }}<|END_OF_TURN_TOKEN|>",
                        _CMD + "<|CHATBOT_TOKEN|>"),
    "llama3": _each("<|start_header_id|>{{ m.role }}<|end_header_id|>{{ '\\n\\n' }}"
                    "{{ m.content | trim }}<|eot_id|>",
                    "<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}"),
    "openchat": _each("{%- if m.role == 'system' -%}{{ m.content }}<|end_of_turn|>{%- else -%}"
                      "GPT4 Correct {{ m.role[:1] | upper }}{{ m.role[1:] }}: "
                      "{{ m.content }}<|end_of_turn|>{%- endif -%}", "GPT4 Correct Assistant:"),
}


def chat_template_source(value: str) -> str:
    """--chat-template's value -> a Jinja template: one of llama.cpp's names, a family's own
    template by its name (gguf/family_templates.py: gpt-oss, deepseek-r1, deepseek-v3.1), else the
    value is the template."""
    from .family_templates import FAMILY_TEMPLATES, family_template

    name = value.strip()
    if name in FAMILY_TEMPLATES:
        return family_template(name)
    return NAMED_TEMPLATES.get(name, value)
