"""The replay's tool-calling agents: a small tool set in OpenAI's `tools` shape, run here (made-up
answers, deterministic from the arguments), so a turn whose answer has `tool_calls` is followed by
one `role: tool` message a call and the conversation goes on, as an agent framework would. Works
with any OpenAI-compatible server; a server that ignores `tools` (or a model that calls none) gets
plain turns.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
from collections.abc import Callable
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "the city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_command",
        "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)

# tasks that give a model a reason to call the tools
TOOL_TASKS = ("What is the weather in {city} right now, in celsius?",
              "Compute {a} * {b} + {c} with the calculator.", "Read {f} and tell me what it does.",
              "Run the tests with `pytest -x -q` and summarize the failures.",
              "Is it warmer in {city} or in {city2}? Check the weather in both.",
              "How much is ({a} + {b}) / {c}? Use the calculator, then explain the result.")
_CITIES = ("Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Hanoi", "Denver", "Cairo", "Perth", "Quito")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos, ast.Mod: operator.mod}


def tool_task(rng: random.Random, files: tuple[str, ...]) -> str:
    return rng.choice(TOOL_TASKS).format(city=rng.choice(_CITIES), city2=rng.choice(_CITIES),
                                         a=rng.randint(2, 999),
                                         b=rng.randint(2, 999), c=rng.randint(2, 99),
                                         f=rng.choice(files))


def calculate(expression: str) -> float:
    """Arithmetic only (a parse tree of numbers and operators: no names, no calls), bounded."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (isinstance(node, ast.Constant) and isinstance(node.value, (int, float))
                and not isinstance(node.value, bool)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    return ev(ast.parse(expression, mode="eval"))


def run_tool(call: dict[str, Any],
             long_output: Callable[[str, dict[str, Any]], str]) -> tuple[str, bool]:
    """The `role: tool` content for one call -> (content, whether the call was well formed). A call
    to an unknown tool, or whose arguments are not a JSON object, gets an error message back, as
    agents send."""
    fn = call.get("function") or {}
    name = fn.get("name")
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError as e:
        return json.dumps({"error": f"the arguments are not valid JSON: {e}"}), False
    if not isinstance(args, dict):
        return json.dumps({"error": "the arguments must be a JSON object"}), False
    if name not in TOOL_NAMES:
        return (json.dumps({"error": f"no tool named {name!r}; the tools are "
                                     f"{', '.join(TOOL_NAMES)}"}), False)
    if name == "get_weather":
        city = str(args.get("city") or "?")
        h = int(hashlib.sha256(city.lower().encode()).hexdigest(), 16)
        temp = h % 40 - 5
        if args.get("unit") == "fahrenheit":
            temp = round(temp * 9 / 5 + 32)
        return json.dumps({"city": city, "temperature": temp, "unit": args.get("unit") or "celsius",
                           "conditions": ("sunny", "cloudy", "rain", "snow", "windy")[h % 5]}), True
    if name == "calculator":
        try:
            return json.dumps({"result": calculate(str(args.get("expression") or ""))}), True
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError) as e:
            return json.dumps({"error": f"cannot evaluate: {e}"}), True
    return long_output(name, args), True
