"""Chat templates that tests put into tiny models."""

# Qwen3's way: the generation prompt opens the reasoning (<think>), unless enable_thinking is false.
THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)

# Hermes / Qwen's way with tools: the tools in a system turn, calls as <tool_call>{json}</tool_call>, tool results
# as <tool_response> in a user turn.
_HERMES_TURNS = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}</tools>\nAnswer a call as <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{%- for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
)
HERMES_TEMPLATE = _HERMES_TURNS + "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"

# Qwen3-Next's way: Hermes' tools, and a generation prompt that opens the reasoning (<think>).
QWEN3_TOOLS_TEMPLATE = _HERMES_TURNS + (
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
