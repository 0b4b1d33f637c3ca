"""The tool-call formats of the model families we serve: which one a chat template speaks, the
grammar that forces a call in it, and the parser that turns the model's text into calls as it
arrives.

| format         | a call, as the model writes it                                                  | template says  |
| -------------- | ------------------------------------------------------------------------------- | -------------- |
| "hermes"       | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` (Qwen, Hermes) | `<tool_call>`  |
| "llama3"       | `{"name": "f", "parameters": {...}}`, maybe after `<|python_tag|>`; `; ` between | `ipython`      |
| "mistral"      | `[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "a1b2c3d4e"}, ...]` (Nemo)  | `[TOOL_CALLS]` |
| "mistral_args" | `[TOOL_CALLS]f[ARGS]{...}`, once a call (Mistral Small 3.2, Devstral, Magistral) | `[ARGS]`       |
| "glm45"        | `<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`  | `<arg_key>`    |
| "qwen3_coder"  | `<tool_call>\\n<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>` | `<function=`, `<parameter=` (Qwen3.5, Qwen3-Coder) |
| "harmony"      | `<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>` (gpt-oss; http/harmony.py splits the channels first) | `<|channel|>` |
| "deepseek_v3"  | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>` (V3, R1) | `<｜tool▁calls▁begin｜>`, ```` ```json ```` |
| "deepseek_v31" | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>` (V3.1) | `<｜tool▁calls▁begin｜>` |
| "generic"      | `{"name": "f", "arguments": {...}}` or an array of them: the whole answer       | (no tools)     |

(llama.cpp's common/chat.cpp tells them apart by the same marks; vLLM has a parser for each.) A mark
that is one special token of the vocabulary (`[TOOL_CALLS]` in Mistral's) is that token in the
grammar (`<[id]>`), so a forced call is written with it, as the model was trained to.

`CallStream` reads one answer's content as it comes, piece by piece, and says what it holds: content
text, the start of a call (its index, id, name), and pieces of its arguments (JSON text) as the
model writes them. The whole answer is parsed by the same object, so a streamed answer and a whole
one are the same calls.

Modules: marks.py (the formats, their marks, call ids), grammar.py (the forced call), stream.py
(CallStream) with its states for JSON-object calls (json_calls.py), name-first ones
(named_calls.py), Qwen3-Coder's XML (xml_calls.py), harmony's (harmony_calls.py) and DeepSeek's
(deepseek_calls.py), json_scan.py.
"""  # noqa: E501

from .grammar import call_grammar, harmony_structured
from .marks import (
    ARG_KEY,
    ARG_KEY_END,
    ARG_VALUE,
    ARG_VALUE_END,
    ARGS,
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_FENCE,
    DS_SEP,
    FORMATS,
    FUNCTION,
    FUNCTION_END,
    H_CHANNEL,
    H_CONSTRAIN,
    H_END,
    H_MESSAGE,
    H_START,
    HARMONY_CALL,
    HERMES_CLOSE,
    HERMES_OPEN,
    PARAMETER,
    PARAMETER_END,
    TOOL_CALLS,
    call_mark,
    detect,
    mistral_id,
)
from .stream import CallStream

__all__ = [
    "ARGS",
    "ARG_KEY",
    "ARG_KEY_END",
    "ARG_VALUE",
    "ARG_VALUE_END",
    "DS_CALL",
    "DS_CALLS",
    "DS_CALLS_END",
    "DS_CALL_END",
    "DS_FENCE",
    "DS_SEP",
    "FORMATS",
    "FUNCTION",
    "FUNCTION_END",
    "HARMONY_CALL",
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "H_CHANNEL",
    "H_CONSTRAIN",
    "H_END",
    "H_MESSAGE",
    "H_START",
    "PARAMETER",
    "PARAMETER_END",
    "TOOL_CALLS",
    "CallStream",
    "call_grammar",
    "call_mark",
    "detect",
    "harmony_structured",
    "mistral_id",
]
