"""The formats, the marks that tell them apart, call ids, a tool's schema: what grammar and parser
share."""

from __future__ import annotations

import re
import secrets
import string
import uuid
from typing import Any

FORMATS = ("hermes", "llama3", "mistral", "mistral_args", "glm45", "qwen3_coder", "harmony",
           "deepseek_v3", "deepseek_v31", "generic")
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = ("<arg_key>", "</arg_key>", "<arg_value>",
                                                  "</arg_value>")
FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END = ("<function=", "</function>", "<parameter=",
                                                    "</parameter>")
# gpt-oss's harmony: messages `<|start|>ROLE<|channel|>CHANNEL<|message|>...<|end|>`; a call is a
# message to `functions.NAME`. HARMONY_CALL opens a call as http/harmony.py hands it on (its
# normal form, whatever header the model wrote: `<|start|>assistant to=functions.NAME<|message|>`).
H_START, H_CHANNEL, H_MESSAGE, H_END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
H_CONSTRAIN, H_RETURN, H_CALL = "<|constrain|>", "<|return|>", "<|call|>"
HARMONY_CALL = H_START + "assistant to=functions."
# DeepSeek V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
# \n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
# V3.1: `...<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...`
DS_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL = "<\uff5ctool\u2581call\u2581begin\uff5c>"
DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
DS_FENCE = "```json"


def detect(template: str | None) -> str:
    """The format of a template that renders the tools, told by the marks in its source (llama.cpp's
    way); "hermes" when it has none of them."""
    t = template or ""
    if H_CHANNEL in t:                  # llama.cpp's test for gpt-oss
        return "harmony"
    if DS_CALLS in t:
        return "deepseek_v3" if DS_FENCE in t else "deepseek_v31"
    # before hermes: the same <tool_call> mark
    if HERMES_OPEN in t and FUNCTION in t and PARAMETER in t:
        return "qwen3_coder"
    if ARG_KEY in t:
        return "glm45"
    if TOOL_CALLS in t:
        return "mistral_args" if ARGS in t else "mistral"
    if "ipython" in t or PYTHON_TAG in t:
        return "llama3"
    return "hermes"


def call_mark(fmt: str) -> str | None:
    """The text that opens a call in `fmt` where one may follow other text (None: a call is the
    whole answer)."""
    if fmt in ("llama3", "generic"):
        return None
    if fmt == "harmony":
        return HARMONY_CALL
    if fmt.startswith("deepseek"):
        return DS_CALLS
    return TOOL_CALLS if fmt.startswith("mistral") else HERMES_OPEN


def call_id(fmt: str) -> str:
    """A new call's id: Mistral's templates take exactly 9 letters or digits, the others OpenAI's
    call_..."""
    if fmt.startswith("mistral"):
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_id(cid: Any) -> Any:
    """An id a Mistral template accepts (9 letters or digits), the same for the same id: ids from
    other servers (call_...) are mapped, so a conversation carried over still renders."""
    if not isinstance(cid, str) or re.fullmatch(r"[A-Za-z0-9]{9}", cid):
        return cid
    return uuid.uuid5(uuid.NAMESPACE_URL, cid).hex[:9]


def parameters(fn: dict) -> dict:
    """A tool's arguments schema; one that gives none takes any object."""
    return fn.get("parameters") or {"type": "object"}


def is_string(prop: Any) -> bool:
    """Whether a property's value is a string (GLM writes those raw, everything else as JSON)."""
    if not isinstance(prop, dict):
        return False
    if prop.get("type") == "string":
        return True
    options = prop.get("enum") or ([prop["const"]] if "const" in prop else None)
    return bool(options) and all(isinstance(o, str) for o in options)
